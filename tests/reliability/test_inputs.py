"""Every public codec entry point against inputs whose memory is not what it looks like:
read-only arrays and memory maps (read in place), masked arrays, big-endian arrays, torch
tensors with the negative bit, sparse tensors, list/None buffers, float and negative shapes."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qformats
from qformats import QuantizedTensor
from qformats._core import validate

torch = pytest.importorskip("torch")

FORMATS = list(qformats.FORMATS)
BAD_NUMPY = {  # variant -> (make, what the message says)
    "masked": (lambda a: np.ma.masked_array(a, mask=np.zeros(a.shape, bool)), "masked"),
    "bigendian": (lambda a: a.astype(a.dtype.newbyteorder(">")), "byte order"),
}
BAD_TORCH = {
    "negbit": (lambda a: torch._neg_view(torch.from_numpy(np.ascontiguousarray(-a))), "negation"),
    "sparse": (lambda a: torch.from_numpy(a).to_sparse(), "sparse"),
}


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _weight(rows, blocks, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 128 * blocks)).astype(np.float32)


@settings(max_examples=40)
@given(fmt=st.sampled_from(FORMATS), variant=st.sampled_from(sorted(BAD_NUMPY) + sorted(BAD_TORCH)),
       rows=st.integers(1, 4), blocks=st.integers(1, 3), seed=st.integers(0, 2**16),
       where=st.sampled_from(["quantize", "gemm_x", "dequantize_buffer"]))
def test_bad_memory_refused_everywhere(fmt, variant, rows, blocks, seed, where):
    mod = getattr(qformats, fmt)
    w = _weight(rows, blocks, seed)
    make, says = {**BAD_NUMPY, **BAD_TORCH}[variant]
    if where == "quantize":
        with pytest.raises(TypeError, match=says):
            mod.quantize(make(w))
        return
    q = mod.quantize(w)
    if where == "gemm_x":
        if not hasattr(mod, "gemm"):
            return
        with pytest.raises(TypeError, match=says):
            mod.gemm(make(w[:, : q.shape[-1]].copy()), q)
        return
    names = sorted(q.buffers)
    if variant == "bigendian":  # one-byte dtypes have no byte order
        names = [k for k in names if q.buffers[k].dtype.itemsize > 1]
        if not names:
            return
    name = names[0]
    bufs = dict(q.buffers)
    if variant in BAD_TORCH:
        bufs = {k: torch.from_numpy(v) for k, v in bufs.items()}
        if variant == "negbit" and not bufs[name].dtype.is_floating_point:
            return  # the negative bit exists for float / signed tensors read as values only
        b = bufs[name]
        bufs[name] = torch._neg_view(-b) if variant == "negbit" else b.to_sparse()
    else:
        bufs[name] = make(bufs[name])
    bad = QuantizedTensor(q.format, q.shape, q.dtype, dict(q.params), bufs)
    with pytest.raises(TypeError, match=says):
        bad.dequantize()


def _torch_readonly(a):
    """A CPU tensor on the memory of a read-only numpy array (torch warns that it cannot mark
    it read-only; the code under test only reads it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(_readonly(a))


def _torch_writable(a):
    return torch.from_numpy(a.copy())


def _qt(q, make):
    """q with every buffer passed through make."""
    return QuantizedTensor(q.format, q.shape, q.dtype, dict(q.params), {k: make(v) for k, v in q.buffers.items()})


def _bytes(r):
    """Everything a result holds, as bytes: arrays, tensors, QuantizedTensors, tuples, floats."""
    if isinstance(r, QuantizedTensor):
        return (r.format, tuple(r.shape), r.dtype, sorted(r.params.items()),
                [(k, _bytes(v)) for k, v in sorted(r.buffers.items())])
    if isinstance(r, tuple):
        return tuple(_bytes(v) for v in r)
    if isinstance(r, torch.Tensor):
        r = r.view(torch.int16) if r.dtype == torch.bfloat16 else r
        return (str(r.dtype), tuple(r.shape), r.numpy().tobytes())
    if isinstance(r, np.ndarray):
        return (r.dtype.str, r.shape, r.tobytes())
    return np.float64(r).tobytes()


def _entry_points(fmt, w, seed):
    """{name: call(make)} for every public entry point of format ``fmt`` that takes arrays, each
    call passing every array argument through ``make`` (made from the float weight ``w``)."""
    rng = np.random.default_rng(seed)
    mod = getattr(qformats, fmt)
    M, K = w.shape
    x = rng.standard_normal((3, K)).astype(np.float32)
    q = mod.quantize(w)
    calls = {
        "quantize": lambda m: mod.quantize(m(w)),
        "dequantize": lambda m: mod.dequantize(_qt(q, m)),
        "QuantizedTensor.dequantize(float16)": lambda m: _qt(q, m).dequantize("float16"),
    }
    if hasattr(mod, "gemm"):
        calls["gemm"] = lambda m: mod.gemm(m(x), _qt(q, m))
    if fmt == "q4_0":
        aq = qformats.q8_1.quantize_q8_1(x)
        blocks = q.buffers["blocks"]
        calls.update({
            "quantize_q4_0": lambda m: mod.quantize_q4_0(m(w)),
            "dequantize_q4_0": lambda m: mod.dequantize_q4_0(m(blocks), K),
            "gemm_q4_0_q8_1": lambda m: mod.gemm_q4_0_q8_1(m(blocks), m(aq), M, x.shape[0], K),
            "linear": lambda m: mod.linear(m(x), _qt(q, m)),
        })
    elif fmt in ("q8_0", "q8_1"):
        enc, dec = getattr(mod, f"quantize_{fmt}"), getattr(mod, f"dequantize_{fmt}")
        xq = enc(w)
        calls.update({
            f"quantize_{fmt}": lambda m: enc(m(w)),
            f"dequantize_{fmt}": lambda m: dec(m(xq), K),
        })
    elif fmt == "int8":
        tq, ts = mod.quantize_tensor(w)
        a = rng.integers(-127, 128, (3, K), dtype=np.int8)
        sa, sw = rng.random(3, dtype=np.float32), rng.random(M, dtype=np.float32)
        bias = rng.standard_normal(M).astype(np.float32)
        wq = q.buffers["q"]
        calls.update({
            "quantize(group)": lambda m: mod.quantize(m(w), "group", 64),
            "quantize_tensor": lambda m: mod.quantize_tensor(m(w)),
            "dequantize_tensor": lambda m: mod.dequantize_tensor(m(tq), m(ts)),
            "int8_matmul": lambda m: mod.int8_matmul(m(a), m(wq)),
            "int8_linear": lambda m: mod.int8_linear(m(a), m(sa), m(wq), m(sw), bias=m(bias), relu=True),
        })
    elif fmt == "int4":
        qs = mod.quantize(w, symmetric=True)
        codes = rng.integers(-8, 8, (M, K), dtype=np.int8)
        packed = mod.pack_int4(codes)
        calls.update({
            "quantize(symmetric)": lambda m: mod.quantize(m(w), symmetric=True),
            "dequantize(symmetric)": lambda m: mod.dequantize(_qt(qs, m)),
            "gemm(symmetric)": lambda m: mod.gemm(m(x), _qt(qs, m)),
            "pack_int4": lambda m: mod.pack_int4(m(codes)),
            "unpack_int4": lambda m: mod.unpack_int4(m(packed), signed=True),
            "int4_matmul": lambda m: mod.int4_matmul(m(packed[:2].copy()), m(packed)),
        })
    elif fmt == "nf4":
        qc = mod.quantize(w, compress_statistics=True)
        flat = w.reshape(-1)
        pk, am = mod.quantize_nf4(flat)
        calls.update({
            "quantize(compress_statistics)": lambda m: mod.quantize(m(w), compress_statistics=True),
            "dequantize(compress_statistics)": lambda m: mod.dequantize(_qt(qc, m)),
            "gemm(compress_statistics)": lambda m: mod.gemm(m(x), _qt(qc, m)),
            "quantize_nf4": lambda m: mod.quantize_nf4(m(flat)),
            "dequantize_nf4": lambda m: mod.dequantize_nf4(m(pk), m(am), flat.size),
        })
    elif fmt == "mixed2bit":
        sens = rng.random(K, dtype=np.float32)
        values = rng.integers(0, 4, (M, K), dtype=np.uint8)
        packed = mod.pack_2bit(values)
        calls.update({
            "quantize(sensitivity, outliers)": lambda m: mod.quantize(m(w), sensitivity=m(sens),
                                                                      outlier_ratio=0.01),
            "pack_2bit": lambda m: mod.pack_2bit(m(values)),
            "unpack_2bit": lambda m: mod.unpack_2bit(m(packed), values.size - 5),
            "nmse": lambda m: mod.nmse(m(w), _qt(q, m)),
        })
    return calls


READONLY = {  # variant -> (read-only inputs, the writable inputs they must match)
    "numpy": (_readonly, lambda a: a.copy()),
    "torch": (_torch_readonly, _torch_writable),
}


@pytest.mark.parametrize("variant", sorted(READONLY))
@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=3, deadline=None)
@given(rows=st.integers(1, 4), blocks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_readonly_inputs_give_the_writable_result(fmt, variant, rows, blocks, seed):
    """Read-only arrays (and torch tensors on a read-only array's memory) are inputs like any
    other: every public entry point gives the writable array's result, bit for bit."""
    ro, rw = READONLY[variant]
    for name, call in _entry_points(fmt, _weight(rows, blocks, seed), seed).items():
        want = call(rw)
        assert _bytes(call(ro)) == _bytes(want), f"{fmt}.{name} ({variant})"


def test_readonly_inputs_through_torch_ops():
    """qformats.ops wraps numpy buffers as tensors without a copy; read-only ones (a loaded
    memory map) give the same result, and no warning about tensors the caller never sees."""
    w = _weight(4, 2, 1)
    x = torch.from_numpy(_weight(3, 2, 2))
    for fmt in FORMATS:
        q = getattr(qformats, fmt).quantize(w)
        want = (qformats.ops.linear(x, q), qformats.ops.dequantize(q))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = (qformats.ops.linear(x, _qt(q, _readonly)), qformats.ops.dequantize(_qt(q, _readonly)))
        assert _bytes(got) == _bytes(want), fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_memmap_read_only_is_read_in_place(fmt, tmp_path):
    """np.load(mmap_mode="r") is taken as it is (mode="c", copy-on-write, too), with the
    writable array's result."""
    w = _weight(2, 2, 0)
    f = tmp_path / "w.npy"
    np.save(f, w)
    ref = getattr(qformats, fmt).quantize(w)
    for mode in ("r", "c"):
        m = np.load(f, mmap_mode=mode)
        assert isinstance(m, np.memmap) and m.flags.writeable == (mode == "c")
        assert _bytes(getattr(qformats, fmt).quantize(m)) == _bytes(ref), mode


def test_native_linear_reads_a_read_only_map_in_place(tmp_path):
    """No copy is made of a read-only input: a bound weight (q4_0's native Linear, which keeps
    its buffers) made from a mode="r" map sees a change written to the file through another
    mapping of it, which a copy taken at binding time would not."""
    from qformats.q4_0 import _native

    w1, w2 = _weight(8, 2, 3), _weight(8, 2, 4)
    b1, b2 = (qformats.q4_0.quantize(v).buffers["blocks"] for v in (w1, w2))
    f = tmp_path / "blocks.npy"
    np.save(f, b1)
    ro = np.load(f, mmap_mode="r")
    assert not ro.flags.writeable
    M, K = w1.shape
    lin = _native.make_linear(ro, M, K, False)
    x = _weight(3, 2, 5)

    def run():
        out = np.empty((3, M), np.float32)
        lin(x, out)
        return out

    first = run()
    assert np.array_equal(first, qformats.q4_0.gemm(x, qformats.q4_0.quantize(w1)))
    rw = np.load(f, mmap_mode="r+")  # the same file pages, shared with `ro`
    rw[...] = b2
    rw.flush()
    second = run()
    assert np.array_equal(second, qformats.q4_0.gemm(x, qformats.q4_0.quantize(w2)))
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("fmt", ["int4", "nf4", "q4_0", "int8", "mixed2bit"])
def test_native_linear_workspace_checked(fmt):
    """A bound weight's workspace (the CUDA product's scratch, unused on the CPU) is checked on
    every device: uint8 only (TypeError), never overlapping x or out (ValueError, out untouched);
    a valid one leaves the product as without it, and the CPU asks for none."""
    from qformats import format_spec

    q = getattr(qformats, fmt).quantize(_weight(64, 8, 1))
    run = format_spec(fmt).make_linear(q).run
    x = _weight(3, 8, 2)
    ref = np.empty((3, 64), np.float32)
    run(x, ref, None, 0)
    assert run.gemm_workspace(512) == 0
    out = np.empty((3, 64), np.float32)
    run(x, out, None, 0, np.zeros(64, np.uint8))
    assert np.array_equal(out, ref)
    with pytest.raises(TypeError, match="workspace"):
        run(x, out, None, 0, np.zeros(16, np.float32))
    buf = np.full(out.nbytes + 64, 7, np.uint8)
    inside = buf[: out.nbytes].view(np.float32).reshape(out.shape)
    with pytest.raises(ValueError, match="overlap"):
        run(x, inside, None, 0, buf[16:])
    assert (buf == 7).all()
    with pytest.raises(ValueError, match="overlap"):
        run(x, out, None, 0, x.view(np.uint8))


def test_read_only_outputs_are_still_refused():
    """An output must be writable: a direct native call given a read-only one raises (nanobind's
    TypeError) instead of writing through it."""
    from qformats.q8_1 import _native

    x = _weight(1, 1, 0)
    out = np.zeros(x.size // 32 * 36, np.uint8)
    out.flags.writeable = False
    with pytest.raises(TypeError, match="incompatible function arguments"):
        _native.quantize(x, out)
    assert not out.any()


@pytest.mark.parametrize("bad, err", [([1, 2, 3], TypeError), (None, TypeError)])
def test_list_or_none_buffer(bad, err):
    q = qformats.q4_0.quantize(_weight(2, 1, 0))
    bufs = dict(q.buffers, blocks=bad)
    with pytest.raises(err, match="blocks"):
        QuantizedTensor(q.format, q.shape, q.dtype, q.params, bufs).dequantize()


def test_buffers_not_a_dict():
    q = qformats.q4_0.quantize(_weight(2, 1, 0))
    with pytest.raises(TypeError, match="buffers"):
        validate(QuantizedTensor(q.format, q.shape, q.dtype, q.params, [q.buffers["blocks"]]))


@given(shape=st.lists(st.one_of(st.integers(-3, 64), st.floats(0.5, 64.5)), min_size=1, max_size=3))
def test_shapes_ints_and_non_negative(shape):
    ok = all(isinstance(s, int) and s >= 0 for s in shape)
    if ok:
        assert QuantizedTensor("q4_0", shape, "float32").shape == tuple(shape)
        return
    first_bad = next(s for s in shape if not (isinstance(s, int) and s >= 0))
    err = TypeError if isinstance(first_bad, float) else ValueError
    with pytest.raises(err, match="shape"):
        QuantizedTensor("q4_0", shape, "float32")


def test_validate_refuses_reassigned_negative_or_float_shape():
    q = qformats.int8.quantize(_weight(2, 1, 0))
    q.shape = (-2, 64)
    with pytest.raises(ValueError, match="shape"):
        validate(q)
    q.shape = (2.0, 64)
    with pytest.raises(TypeError, match="shape"):
        validate(q)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_empty_dims_everywhere(fmt, lib):
    """Zero rows, zero columns and zero-sized leading dims: a result of the right (empty) shape,
    or, for shapes a format does not take at all (mixed2bit is 2-D only), a ValueError."""
    mod = getattr(qformats, fmt)
    conv = (lambda a: a) if lib == "numpy" else torch.from_numpy
    for shape in [(0, 256), (3, 0), (0,), (2, 0, 256)]:
        try:
            q = mod.quantize(conv(np.zeros(shape, np.float32)))
        except ValueError as e:
            assert fmt == "mixed2bit" and "2-D" in str(e), (fmt, shape, e)
            continue
        assert tuple(q.shape) == shape and tuple(q.dequantize().shape) == shape
    if not hasattr(mod, "gemm") or fmt == "q8_1":
        return
    w = mod.quantize(conv(_weight(8, 2, 0)))
    assert tuple(mod.gemm(conv(np.zeros((0, 256), np.float32)), w).shape) == (0, 8)
    empty_w = mod.quantize(conv(np.zeros((0, 256), np.float32)))
    y = mod.gemm(conv(np.ones((2, 256), np.float32)), empty_w)
    assert tuple(y.shape) == (2, 0)
