"""mixed2bit layout "tiled" on the GPU: quantize writes the numpy reference's bytes (Hypothesis,
every input dtype, sensitivity on either device); dequantize equals the CPU's bytes in every
output dtype, also into a misaligned output; a tile with a bad map decodes to NaN and only that
tile; the "too large" error as on the CPU; the caller's stream; QuantizedLinear on CUDA. (The
CUDA GEMM's numerics: tests/gemm/test_gemm_cuda.py.)"""
import numpy as np
import pytest
from hypothesis import given, settings

from conftest import requires_cuda
from mixed2bit_cases import tiled_cases as cases
from qformats import QuantizedTensor, mixed2bit as M
from qformats.mixed2bit import reference as R
from strategies import assert_bytes_equal, misaligned_copy, on_cuda

pytestmark = requires_cuda
torch = pytest.importorskip("torch")

GPU_SETTINGS = settings(max_examples=60, deadline=None)
DTYPES = ("float32", "float16", "bfloat16")


def _cpu_torch(qt):
    """qt with its buffers as torch CPU tensors (so that dequantize returns torch, bfloat16 too)."""
    bufs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v.cpu() for k, v in qt.buffers.items()}
    return type(qt)(qt.format, qt.shape, qt.dtype, dict(qt.params), bufs)


@GPU_SETTINGS
@given(cases())
def test_gpu_quantize_equals_reference(case):
    inp, params, sens = case
    x = on_cuda(inp.x)
    before = x.clone()
    try:
        ref = R.quantize_tiled(inp.x32, sensitivity=sens, **params)
    except ValueError as e:
        assert "too large" in str(e)
        with pytest.raises(ValueError, match="too large"):
            M.quantize(x, sensitivity=sens, layout="tiled", **params)
        return
    for s in (sens, None if sens is None else on_cuda(sens)):
        qt = M.quantize(x, sensitivity=s, layout="tiled", **params)
        for name in M.TILED_BUFFER_NAMES:
            assert qt.buffers[name].is_cuda, name
            assert_bytes_equal(qt.buffers[name], ref[name])
    assert torch.equal(x, before)


@GPU_SETTINGS
@given(cases())
def test_gpu_dequantize_equals_cpu(case):
    inp, params, sens = case
    try:
        q = _cpu_torch(M.quantize(inp.x32, sensitivity=sens, layout="tiled", **params))
    except ValueError:
        return  # too large for fp16: covered above
    qc = q.to("cuda")
    for dtype in DTYPES:
        got = M.dequantize(qc, dtype=dtype)
        assert got.is_cuda and got.dtype == getattr(torch, dtype)
        assert_bytes_equal(got, M.dequantize(q, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_quantize_of_misaligned_16bit_input(dtype):
    """A 16-bit weight whose pointer is not 16-byte aligned takes the quantizer's unstaged path
    (the staged one copies 16-byte chunks): the same bytes as the CPU."""
    w = torch.from_numpy(np.random.default_rng(2).standard_normal((7, 16 * 300)).astype(np.float32)).to(dtype)
    x = misaligned_copy(w)
    assert x.data_ptr() % 16
    want = M.quantize(w, layout="tiled", ratio_4bit=0.2)
    got = M.quantize(x, layout="tiled", ratio_4bit=0.2)
    for name in M.TILED_BUFFER_NAMES:
        assert_bytes_equal(got.buffers[name], want.buffers[name])


def test_gpu_dequantize_into_misaligned_output():
    """The Linear's dequantize into an output whose pointer is not 16-byte aligned (its
    element-wise store path) equals the aligned one."""
    w = np.random.default_rng(1).standard_normal((5, 16 * 300)).astype(np.float32)
    qc = M.quantize(w, layout="tiled").to("cuda")
    lin = M._native.make_tiled_linear(*M._tiled_args(qc))
    want = M.dequantize(qc, dtype="float16")
    out = misaligned_copy(torch.full(want.shape, float("nan"), dtype=torch.float16))
    assert out.data_ptr() % 16
    lin.dequantize(out, None, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_gpu_bad_tile_decodes_to_nan_only_there():
    """One more 4-bit group in tile 1 of row 2 (of 3 tiles per row): that tile's values are NaN,
    every other value is the CPU's."""
    w = np.random.default_rng(2).standard_normal((4, 16 * 600)).astype(np.float32)
    q = M.quantize(w, layout="tiled")
    want = M.dequantize(q)
    bad = {k: np.copy(v) for k, v in q.buffers.items()}
    word = 256 // 32 + 1  # tile 1's second map word
    v = int(bad["map"][2, word])
    bad["map"][2, word] = np.uint32(v | (~v & (v + 1)))  # its lowest clear bit set
    qc = QuantizedTensor("mixed2bit", q.shape, q.dtype, q.params, bad).to("cuda")
    got = M.dequantize(qc).cpu().numpy()
    tile = np.zeros(want.shape, bool)
    tile[2, 256 * 16:512 * 16] = True
    assert np.isnan(got[tile]).all()
    assert_bytes_equal(got[~tile], want[~tile])


def test_gpu_runs_on_the_callers_stream():
    w = torch.randn(64, 16 * 520, device="cuda")
    ref = M.quantize(w.cpu(), layout="tiled")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        qt = M.quantize(w, layout="tiled")
        y = M.dequantize(qt)
    s.synchronize()
    for name in M.TILED_BUFFER_NAMES:
        assert_bytes_equal(qt.buffers[name].cpu().numpy(), np.asarray(ref.buffers[name]))
    assert torch.equal(y.cpu(), torch.from_numpy(np.asarray(M.dequantize(ref))))


def test_gpu_empty_and_bad_inputs():
    for shape in [(0, 64), (3, 0)]:
        qt = M.quantize(torch.zeros(shape, device="cuda"), layout="tiled")
        assert qt.dequantize().shape == shape
    with pytest.raises(ValueError, match="NaN|finite"):
        M.quantize(torch.full((2, 32), float("nan"), device="cuda"), layout="tiled")
    with pytest.raises(ValueError, match="too large"):
        M.quantize(torch.tensor([[-3e6] + [0.0] * 15] * 2, device="cuda"), layout="tiled", ratio_4bit=0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 5, 40])
def test_gpu_quantized_linear(dtype, n):
    """QuantizedLinear with the tiled layout on CUDA: its forward (kernel rows and above) against
    x @ dequantize(W)^T + bias in float64, at the tolerance of tests/gemm/test_gemm_cuda.py."""
    from qformats.nn import QuantizedLinear

    torch.manual_seed(n)
    lin = torch.nn.Linear(16 * 300, 70).to("cuda", dtype)
    ql = QuantizedLinear.from_linear(lin, "mixed2bit", layout="tiled")
    assert ql.quantized_weight.buffers["codes"].is_cuda
    x = torch.randn(n, 16 * 300, device="cuda", dtype=dtype)
    y = ql(x)
    w = M.dequantize(ql.quantized_weight, dtype="float32").double()
    ref = x.double() @ w.T + lin.bias.double()
    scale = x.double().abs() @ w.abs().T + lin.bias.double().abs()
    tol = {torch.float16: 1e-3, torch.bfloat16: 4e-3, torch.float32: 1e-5}[dtype]
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert (y.double() - ref).norm() <= tol * scale.norm()
