"""Every public codec entry point against inputs whose memory is not what it looks like:
read-only arrays and memory maps, masked arrays, big-endian arrays, torch tensors with the
negative bit, sparse tensors, list/None buffers, float and negative shapes."""
from __future__ import annotations

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
    "readonly": (lambda a: _readonly(a), "read-only"),
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


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_on_write_memmap_is_accepted_without_a_copy(fmt, tmp_path):
    w = _weight(2, 2, 0)
    f = tmp_path / "w.npy"
    np.save(f, w)
    ro = np.load(f, mmap_mode="r")
    with pytest.raises(TypeError, match="mode='c'"):
        getattr(qformats, fmt).quantize(ro)
    cow = np.load(f, mmap_mode="c")
    q = getattr(qformats, fmt).quantize(cow)
    ref = getattr(qformats, fmt).quantize(w)
    assert all(np.array_equal(q.buffers[k], ref.buffers[k]) for k in ref.buffers)


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
