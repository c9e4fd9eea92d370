"""int4 on the GPU: bytes equal the CPU and the reference in both modes for every input
dtype; dequantize equal for every output dtype; every team size and the long-group (segment)
path; pack/unpack; misaligned pointers; the caller's stream; poisoned outputs; device mixes."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from conftest import requires_cuda
import qformats.int4 as I
from qformats import QuantizedTensor
from qformats.int4 import reference as R
from strategies import assert_bytes_equal, float_inputs, misaligned_copy, on_cuda

pytestmark = requires_cuda
torch = pytest.importorskip("torch")

FLOATS = ("float32", "float16", "bfloat16")


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _ref(x32, gs, sym):
    if sym:
        qw, s = R.quantize_sym(x32, gs)
        return {"qweight": qw, "scales": s}
    qw, s, z = R.quantize_asym(x32, gs)
    return {"qweight": qw, "scales": s, "zeros": z}


def _assert_decodes_equal(gq: QuantizedTensor) -> None:
    """GPU dequantize == CPU dequantize of the same buffers, bytes, for every output dtype."""
    cq = gq.to("cpu")
    for dtype in FLOATS:
        gd = gq.dequantize(dtype)
        assert gd.is_cuda and gd.dtype == getattr(torch, dtype) and tuple(gd.shape) == gq.shape
        assert_bytes_equal(gd, cq.dequantize(dtype))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_gpu_quantize_equals_cpu_and_reference(data):
    gs = data.draw(st.sampled_from([8, 16, 32, 64, 128]), label="group_size")
    sym = data.draw(st.booleans(), label="symmetric")
    inp = data.draw(float_inputs(block=gs, max_rows=4, max_blocks=6), label="x")
    ref = _ref(inp.x32, gs, sym)
    gq = I.quantize(on_cuda(inp.x), gs, symmetric=sym)
    cq = I.quantize(inp.x, gs, symmetric=sym)
    assert sorted(gq.buffers) == sorted(ref) and gq.dtype == inp.dtype
    for k in ref:
        assert gq.buffers[k].is_cuda
        assert_bytes_equal(gq.buffers[k], ref[k])
        assert_bytes_equal(gq.buffers[k], cq.buffers[k])
    _assert_decodes_equal(gq)


def _spiky(shape, dtype, seed):
    """Gaussian rows at scales 1e-3..1e3, shifted off-centre (so lo and hi differ), with one
    large value of either sign planted per row at a random place."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) + np.float32(0.7)
    x *= np.logspace(-3, 3, shape[0], dtype=np.float32)[:, None]
    cols = rng.integers(0, shape[1], shape[0])
    x[np.arange(shape[0]), cols] = np.where(rng.random(shape[0]) < 0.5, -1, 1) * 8 * np.abs(x).max(axis=1)
    return torch.from_numpy(x).to(getattr(torch, dtype))


def _check_everywhere(x, gs, sym):
    """CPU result == GPU result for aligned and misaligned input, the decodes, and the decode
    from misaligned buffers into a misaligned output."""
    cpu = I.quantize(x, gs, symmetric=sym)
    for xx in (x.cuda(), misaligned_copy(x)):
        gq = I.quantize(xx, gs, symmetric=sym)
        for k in cpu.buffers:
            assert_bytes_equal(gq.buffers[k], cpu.buffers[k])
    _assert_decodes_equal(gq)
    qw = misaligned_copy(cpu.buffers["qweight"])
    sc = cpu.buffers["scales"].cuda()
    zp = None if sym else cpu.buffers["zeros"].cuda()
    for dtype in FLOATS:
        out = misaligned_copy(torch.zeros(x.shape, dtype=getattr(torch, dtype)))
        I._native.dequantize(qw, sc, zp, out, gs, _stream())
        assert_bytes_equal(out, cpu.dequantize(dtype))
    # aligned input, misaligned qweight out (the vector path needs both)
    qw_out = misaligned_copy(torch.zeros(cpu.buffers["qweight"].shape, dtype=torch.uint8))
    sc_out = torch.empty_like(sc)
    zp_out = None if sym else torch.empty_like(zp)
    I._native.quantize(x.cuda(), qw_out, sc_out, zp_out, gs, _stream())
    assert_bytes_equal(qw_out, cpu.buffers["qweight"])
    assert_bytes_equal(sc_out, cpu.buffers["scales"])
    if not sym:
        assert_bytes_equal(zp_out, cpu.buffers["zeros"])


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 128), (3, 4096), (1000, 4096), (257, 8192)])
@pytest.mark.parametrize("gs", [32, 128])
def test_gpu_large_and_misaligned(gs, shape, dtype, sym):
    _check_everywhere(_spiky(shape, dtype, 0), gs, sym)


# Group sizes around every team size (1..512 threads of 4 chunks) and past a CTA (the
# segment path): the vector path takes 8 values a chunk (a CTA holds 16384), the misaligned
# path 2 (a CTA holds 4096).
GROUP_SIZES = [8, 40, 264, 1032, 4096, 4104, 8200, 16376, 16384, 16392, 40000, 65544]


@pytest.mark.parametrize("gs", GROUP_SIZES)
@pytest.mark.parametrize("sym", [False, True])
def test_gpu_large_group_sizes(gs, sym):
    rows = 5 if gs < 20000 else 3
    x = _spiky((rows, 2 * gs), "float16" if gs % 16 else "float32", gs)
    _check_everywhere(x, gs, sym)


@pytest.mark.parametrize("shape", [(0, 32), (3, 0), (0,), (2, 3, 32)])
@pytest.mark.parametrize("sym", [False, True])
def test_gpu_shapes_and_empty(shape, sym):
    x = torch.randn(shape)
    cpu = I.quantize(x, 32 if shape[-1] else 8, symmetric=sym)
    gq = I.quantize(x.cuda(), 32 if shape[-1] else 8, symmetric=sym)
    for k in cpu.buffers:
        assert_bytes_equal(gq.buffers[k], cpu.buffers[k])
    _assert_decodes_equal(gq)


def _ties(rows, gs, sym, dtype, seed):
    """Groups whose x / scale fall exactly on, or a few ulps beside, the rounding ties k + 1/2:
    the extremes pin scale to c (asymmetric: -8c and 7c, range 15c, zero 8; symmetric: +-7c),
    the other values are (k + 1/2) c nudged by -2..2 ulps (in the input dtype), for c a power of
    two or a small odd multiple of one at scales 2^-20 .. 2^20. The CUDA fast path sends exactly
    these values (r within 2^-17 of a half-integer) to the exact division; far more of them than
    random data has."""
    rng = np.random.default_rng(seed)
    tdt = getattr(torch, dtype)
    x = torch.empty(rows, gs, dtype=torch.float32)
    for r in range(rows):
        c = float(rng.choice([1.0, 3.0, 5.0, 0.75])) * 2.0 ** int(rng.integers(-10, 11))
        k = rng.integers(-7 if sym else -8, 7, gs)
        v = torch.from_numpy((k + 0.5).astype(np.float32) * np.float32(c)).to(tdt)
        for _ in range(2):  # +-1 or 2 ulps in the input dtype, on half of the values
            step = torch.from_numpy(rng.integers(-1, 2, gs).astype(np.float32)).to(tdt)
            v = torch.where(step > 0, torch.nextafter(v, torch.full_like(v, float("inf"))),
                            torch.where(step < 0, torch.nextafter(v, torch.full_like(v, -float("inf"))), v))
        v[0] = -7 * c if sym else -8 * c
        v[1] = 7 * c
        x[r] = v.float()
    return x.reshape(rows // 4, 4 * gs).to(tdt)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("gs", [32, 128, 1024])
def test_gpu_rounding_ties(gs, dtype, sym):
    x = _ties(512, gs, sym, dtype, gs + 7 * sym)
    ref = _ref(x.float().numpy(), gs, sym)
    cpu = I.quantize(x, gs, symmetric=sym)
    for xx in (x.cuda(), misaligned_copy(x)):
        gq = I.quantize(xx, gs, symmetric=sym)
        for k in ref:
            assert_bytes_equal(gq.buffers[k], ref[k])
            assert_bytes_equal(gq.buffers[k], cpu.buffers[k])


# -- pack / unpack ---------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_gpu_pack_unpack_equal_cpu(data):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9))
    shape = (*shape[:-1], 2 * shape[-1])
    signed = data.draw(st.booleans())
    lo, hi = (-8, 7) if signed else (0, 15)
    v = data.draw(hnp.arrays(np.int8 if signed else np.uint8, shape, elements=st.integers(lo, hi)))
    p = I.pack_int4(on_cuda(v))
    assert p.is_cuda
    assert_bytes_equal(p, R.pack(v))
    u = I.unpack_int4(p, signed=signed)
    assert u.is_cuda
    assert_bytes_equal(u, v)
    b = data.draw(hnp.arrays(np.uint8, (*shape[:-1], shape[-1] // 2)))
    assert_bytes_equal(I.unpack_int4(on_cuda(b), signed=signed), R.unpack(b, signed=signed))
    assert_bytes_equal(I.pack_int4(I.unpack_int4(on_cuda(b), signed=signed)), b)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 4096, 1_000_003])
@pytest.mark.parametrize("signed", [False, True])
def test_gpu_pack_unpack_large_and_misaligned(n, signed):
    rng = np.random.default_rng(n)
    b = rng.integers(0, 256, n, dtype=np.uint8)
    codes = R.unpack(b, signed=signed)
    for packed_in in (on_cuda(b), misaligned_copy(b)):
        assert_bytes_equal(I.unpack_int4(packed_in, signed=signed), codes)
        out = misaligned_copy(torch.zeros(2 * n, dtype=torch.int8 if signed else torch.uint8))
        I._native.unpack(packed_in, out, _stream())
        assert_bytes_equal(out, codes)
    for codes_in in (on_cuda(codes), misaligned_copy(codes)):
        assert_bytes_equal(I.pack_int4(codes_in), b)
        out = misaligned_copy(torch.zeros(n, dtype=torch.uint8))
        I._native.pack(codes_in, out, _stream())
        assert_bytes_equal(out, b)


# -- streams, poisoned outputs, devices --------------------------------------------------------

def test_gpu_runs_on_the_callers_stream():
    x = torch.randn(512, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
    with torch.cuda.stream(s):
        y = x * 2  # queued on s: quantize must come after it
        q128 = I.quantize(y, 128)
        q_long = I.quantize(y.reshape(64, 32768), 32768, symmetric=True)  # the segment path
        d = q128.dequantize("float16")
        p = I.pack_int4(I.unpack_int4(q128.buffers["qweight"]))
    s.synchronize()
    xc = (x * 2).cpu()
    for qt, cpu in ((q128, I.quantize(xc, 128)), (q_long, I.quantize(xc.reshape(64, 32768), 32768, symmetric=True))):
        for k in cpu.buffers:
            assert_bytes_equal(qt.buffers[k], cpu.buffers[k])
    assert_bytes_equal(d, I.quantize(xc, 128).dequantize("float16"))
    assert_bytes_equal(p, q128.buffers["qweight"])


@pytest.mark.parametrize("gs", [8, 128, 20000])
@pytest.mark.parametrize("sym", [False, True])
def test_gpu_output_poisoned_then_fully_written(gs, sym):
    shape = (30, 40000) if gs == 20000 else (300, 1024)
    x = torch.randn(shape, device="cuda")
    cpu = I.quantize(x.cpu(), gs, symmetric=sym)
    qw = torch.full(cpu.buffers["qweight"].shape, 0xAB, dtype=torch.uint8, device="cuda")
    sc = torch.full(cpu.buffers["scales"].shape, float("nan"), device="cuda")
    zp = None if sym else torch.full(cpu.buffers["zeros"].shape, 0xAB, dtype=torch.uint8, device="cuda")
    I._native.quantize(x, qw, sc, zp, gs, _stream())
    assert_bytes_equal(qw, cpu.buffers["qweight"])
    assert_bytes_equal(sc, cpu.buffers["scales"])
    if not sym:
        assert_bytes_equal(zp, cpu.buffers["zeros"])
    for dtype in FLOATS:
        out = torch.full(shape, float("nan"), dtype=getattr(torch, dtype), device="cuda")
        I._native.dequantize(qw, sc, zp, out, gs, _stream())
        assert_bytes_equal(out, cpu.dequantize(dtype))
    packed = torch.full((shape[0], shape[1] // 2), 0xAB, dtype=torch.uint8, device="cuda")
    codes = I.unpack_int4(qw, signed=sym)
    I._native.pack(codes, packed, _stream())
    assert_bytes_equal(packed, qw)
    unpacked = torch.full(shape, 0x55, dtype=codes.dtype, device="cuda")
    I._native.unpack(qw, unpacked, _stream())
    assert_bytes_equal(unpacked, codes)


def test_gpu_mixed_devices_raise():
    x = torch.randn(4, 64)
    qt = I.quantize(x, 32)
    mixed = QuantizedTensor("int4", qt.shape, qt.dtype, qt.params,
                            {"qweight": qt.buffers["qweight"].cuda(), "scales": qt.buffers["scales"],
                             "zeros": qt.buffers["zeros"].cuda()})
    with pytest.raises(ValueError, match="device"):
        I.dequantize(mixed)
    with pytest.raises(ValueError, match="same device"):
        I._native.dequantize(qt.buffers["qweight"].cuda(), qt.buffers["scales"].cuda(), qt.buffers["zeros"],
                             torch.empty(4, 64, device="cuda"), 32, 0)
    with pytest.raises(ValueError, match="same device"):
        I._native.quantize(x.cuda(), torch.empty(4, 32, dtype=torch.uint8, device="cuda"), torch.empty(4, 2),
                           None, 32, 0)
    with pytest.raises(ValueError, match="same device"):
        I._native.pack(torch.zeros(8, dtype=torch.uint8, device="cuda"), torch.empty(4, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="same device"):
        I._native.unpack(torch.zeros(4, dtype=torch.uint8, device="cuda"), torch.empty(8, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="contiguous"):
        I.quantize(torch.randn(64, 64, device="cuda").t(), 32)


def test_gpu_gemms_check_devices():
    """The GEMMs run on CUDA (tests/gemm/test_gemm_cuda.py checks the values); operands on two
    devices raise, from the Python layer and from the native adapter on its own."""
    w = I.quantize(torch.randn(8, 64, device="cuda"), 32)
    assert I.gemm(torch.randn(2, 64, device="cuda"), w).is_cuda
    with pytest.raises(ValueError, match="device"):
        I.gemm(torch.randn(2, 64), w)  # CPU activations, CUDA weights
    a = torch.zeros(2, 8, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="device"):
        I.int4_matmul(a, a.cpu())
    with pytest.raises(ValueError, match="same device"):
        I._native.int4_matmul(a, a, torch.empty(2, 2, dtype=torch.int32), 2, 2, 16, 0)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,gs", [((16, 128), 128), ((48, 4096), 128), ((32, 2048), 256), ((64, 96), 32),
                                      ((4096, 14336), 128)])
def test_gpu_tiles_layout(shape, gs, dtype, sym):
    """The tiles layout on the GPU: quantize's bytes equal the CPU's and the reference's
    permutation of the rows layout; relayout both ways on the device; dequantize (every output
    dtype) equal to the CPU's, in row order."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])).to(getattr(torch, dtype))
    gq = I.quantize(x.cuda(), gs, sym, layout="tiles")
    cq = I.quantize(x, gs, sym, layout="tiles")
    rows = I.quantize(x, gs, sym)
    ref = R.to_tiles(rows.buffers["qweight"].numpy(), rows.buffers["scales"].numpy(),
                     None if sym else rows.buffers["zeros"].numpy(), gs)
    for name, want in zip(("qweight", "scales", "zeros"), ref):
        if want is not None:
            assert gq.buffers[name].is_cuda
            assert_bytes_equal(gq.buffers[name], cq.buffers[name])
            assert_bytes_equal(gq.buffers[name], want)
    back = I.relayout(gq, "rows")
    for name in rows.buffers:
        assert_bytes_equal(back.buffers[name], rows.buffers[name])
    _assert_decodes_equal(gq)
    assert_bytes_equal(gq.dequantize("float32"), rows.dequantize("float32"))
