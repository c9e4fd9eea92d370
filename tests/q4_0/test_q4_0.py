"""q4_0: native codec == numpy reference byte for byte; round trip; GEMM; bad input."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from qformats import q4_0, q8_1
from qformats import _arrays as A
from strategies import assert_bytes_equal, float_inputs

SETTINGS = settings(max_examples=200, deadline=None)


@SETTINGS
@given(float_inputs(block=32))
def test_quantize_matches_reference(inp):
    before = np.copy(inp.x32)
    ref = q4_0.reference.quantize(inp.x32)
    if A.fp16_field_overflowed(ref, 0):  # scale beyond fp16: the API refuses
        with pytest.raises(ValueError, match="overflows fp16"):
            q4_0.quantize_q4_0(inp.x)
        return
    assert_bytes_equal(q4_0.quantize_q4_0(inp.x), ref)
    np.testing.assert_array_equal(inp.x32, before)  # input untouched


@SETTINGS
@given(float_inputs(block=32))
def test_dequantize_matches_reference_and_bound(inp):
    blocks = q4_0.reference.quantize(inp.x32)
    with np.errstate(invalid="ignore"):  # blocks with an inf scale decode to inf/NaN in both
        got = q4_0.dequantize_q4_0(blocks, inp.x32.shape[-1])
        ref = q4_0.reference.dequantize(blocks)
    assert_bytes_equal(got, ref)
    if A.fp16_field_overflowed(blocks, 0):
        return  # the quantize API refuses such inputs (test above); no bound to check
    # Bound: half a step of the stored scale, plus what the fp16 rounding of d moves the grid
    # (|d - fp16(d)| * 8 at the ends), plus the clamp of +8 to 7 (one more step at +max).
    x = inp.x32.astype(np.float64).reshape(-1, 32)
    d = np.abs(blocks.reshape(-1, 18)[:, :2].copy().view("<f2").astype(np.float64))
    amax = np.abs(x).max(axis=1, keepdims=True) if x.size else np.zeros((0, 1))
    err = np.abs(x - ref.reshape(-1, 32).astype(np.float64))
    bound = d * 1.0 + np.abs(amax / 8 - d) * 8 + 1e-45  # one step covers the clamp at +max
    assert (err <= bound * (1 + 1e-6)).all()


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_gemm_matches_reference(m, n, kb, seed):
    rng = np.random.default_rng(seed)
    k = 32 * kb
    w = rng.standard_normal((m, k)).astype(np.float32)
    a = rng.standard_normal((n, k)).astype(np.float32)
    wq, aq = q4_0.quantize_q4_0(w), q8_1.quantize_q8_1(a)
    got = q4_0.gemm_q4_0_q8_1(wq, aq, m, n, k)
    wd = q4_0.reference.dequantize(wq).astype(np.float64)
    ad = q8_1.reference.dequantize(aq).astype(np.float64)
    ref = wd @ ad.T
    assert got.shape == (m, n) and got.dtype == np.float32
    # float32 rounding is relative to the summed magnitudes, not to the result: a block whose
    # integer sum cancels to -1 still has float32 partial sums of hundreds (AVX-512 scales 8
    # lane sums per block; seed 804, m = n = kb = 1 found that with a bound relative to |ref|)
    mag = np.abs(wd) @ np.abs(ad).T
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(mag) + 1e-30


def test_exact_tie_first_element_wins():
    # |x| ties: +3 then -3. The first (+3) is max, so d = -3/8 and x=+3 maps to q = 0.
    x = np.zeros(32, np.float32)
    x[5], x[9] = 3.0, -3.0
    blk = q4_0.quantize_q4_0(x)
    d = blk[0, :2].copy().view("<f2")[0]
    assert d == np.float16(-0.375)
    assert blk[0, 2 + 5] & 0x0F == 0 and blk[0, 2 + 9] & 0x0F == 15


def test_all_zero_block_with_negative_zero_first():
    x = np.zeros(32, np.float32)
    x[0] = -0.0
    assert_bytes_equal(q4_0.quantize_q4_0(x), q4_0.reference.quantize(x))
    assert q4_0.quantize_q4_0(x)[0, :2].tobytes() == b"\x00\x00"  # d = -0 / -8 = +0 (gguf)


def test_numpy_and_torch_io():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    out_np = q4_0.quantize_q4_0(x)
    out_t = q4_0.quantize_q4_0(torch.from_numpy(x))
    assert isinstance(out_np, np.ndarray) and isinstance(out_t, torch.Tensor)
    assert_bytes_equal(out_t, out_np)
    qt = q4_0.quantize(torch.from_numpy(x).half())
    y = qt.dequantize()
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float16 and tuple(y.shape) == (3, 64)
    assert qt.avg_bits == 4.5 and qt.nbytes == 3 * 2 * 18


@pytest.mark.parametrize("bad, exc, match", [
    (np.ones((2, 33), np.float32), ValueError, "multiple of the block size 32"),
    (np.ones((2, 32), np.int32), TypeError, "float32, float16 or bfloat16"),
    (np.float32(1.0), TypeError, "numpy array or a torch tensor"),
    ([1.0] * 32, TypeError, "numpy array or a torch tensor"),
    (np.ones((4, 64), np.float32)[:, ::2], ValueError, "contiguous"),
    (np.array([np.nan] + [0.0] * 31, np.float32), ValueError, "NaN or Inf"),
    (np.array([np.inf] + [0.0] * 31, np.float32), ValueError, "NaN or Inf"),
    (np.full(32, 65520 * 8, np.float32), ValueError, "overflows fp16"),
])
def test_bad_input_raises(bad, exc, match):
    with pytest.raises(exc, match=match):
        q4_0.quantize_q4_0(bad)


def test_bad_torch_input_raises():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="contiguous"):
        q4_0.quantize_q4_0(torch.ones(64, 64).t()[:, :32])
    with pytest.raises(ValueError, match="NaN"):
        q4_0.quantize_q4_0(torch.full((32,), float("nan"), dtype=torch.bfloat16))


def test_dequantize_and_gemm_shape_errors():
    blocks = q4_0.quantize_q4_0(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="expected shape"):
        q4_0.dequantize_q4_0(blocks, 96)
    with pytest.raises(TypeError, match="uint8"):
        q4_0.dequantize_q4_0(blocks.astype(np.int8), 64)
    aq = q8_1.quantize_q8_1(np.ones((3, 64), np.float32))
    with pytest.raises(ValueError, match="expected shape"):
        q4_0.gemm_q4_0_q8_1(blocks, aq, 2, 2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_0.gemm_q4_0_q8_1(blocks, aq, 2, 3, 48)


def test_native_adapter_rejects_bad_sizes_directly():
    # The adapters check on their own: a direct call with a short output cannot write past it.
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ValueError):
        q4_0._native.quantize(x, np.empty(18, np.uint8))
    with pytest.raises(TypeError):
        q4_0._native.quantize(x, np.empty(36, np.int8))


def test_threaded_result_equals_single_block_results():
    # Large enough to be split across threads; every block must equal the one-block encode.
    x = np.random.default_rng(2).standard_normal((64, 4096)).astype(np.float32)
    big = q4_0.quantize_q4_0(x)
    small = np.stack([q4_0.reference.quantize(r) for r in x[:4]])
    assert_bytes_equal(big[:4], small)
    assert_bytes_equal(big, q4_0.reference.quantize(x))
