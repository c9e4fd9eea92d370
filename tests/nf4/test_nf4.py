"""nf4: native codec == numpy reference byte for byte (plain and double-quantized absmax);
round-trip bound; GEMM vs a float64 reference; bad input; numpy/torch I/O; serialization."""
import io

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from qformats import QuantizedTensor, nf4
from qformats.nf4 import _native
from qformats.nf4 import reference as R
from strategies import assert_bytes_equal, float_inputs, to_dtype

SETTINGS = settings(max_examples=150, deadline=None)
SMALL_BLOCKSIZES = st.sampled_from([32, 64, 128])
TINY = float(R.TINY)


def _flat(x32):
    return np.ascontiguousarray(x32).reshape(-1)


def _quantize_ref(x32, blocksize, cs):
    """The reference buffers of quantize(x, blocksize, cs), and the float32 absmax before compression."""
    packed, absmax = R.quantize(x32, blocksize)
    if not cs:
        return {"packed": packed, "absmax": absmax}, absmax
    q, absmax2, offset = R.double_quant(absmax)
    return {"packed": packed, "absmax": q, "absmax2": absmax2, "offset": offset}, absmax


def _stats_overflow(ref):
    """Compressed statistics that the quantize API refuses (R.stats_overflow)."""
    return "offset" in ref and R.stats_overflow(ref["absmax"], ref["absmax2"], ref["offset"])


def _np(x):
    return x.detach().cpu().numpy() if type(x).__module__.startswith("torch") else np.asarray(x)


def _bits(x):
    """A copy of x's raw bits as a numpy integer array (bfloat16 tensors included)."""
    if type(x).__module__.startswith("torch"):
        import torch

        return x.detach().view({2: torch.int16, 4: torch.int32}[x.element_size()]).numpy().copy()
    return x.view({2: np.uint16, 4: np.uint32}[x.itemsize]).copy()


# --- native == reference ---------------------------------------------------------------------------

@SETTINGS
@given(float_inputs(block=64, k_multiple=1, max_blocks=3), SMALL_BLOCKSIZES, st.booleans())
def test_quantize_matches_reference(inp, blocksize, cs):
    before = _bits(inp.x)
    ref, _ = _quantize_ref(inp.x32, blocksize, cs)
    if _stats_overflow(ref):
        with pytest.raises(ValueError, match="overflows"):
            nf4.quantize(inp.x, blocksize=blocksize, compress_statistics=cs)
        return
    qt = nf4.quantize(inp.x, blocksize=blocksize, compress_statistics=cs)
    assert set(qt.buffers) == set(ref)
    for name in ref:
        assert_bytes_equal(qt.buffers[name], ref[name])
    assert qt.params == {"blocksize": blocksize, "quant_type": "nf4", "compress_statistics": cs}
    assert qt.shape == tuple(inp.x32.shape) and qt.dtype == inp.dtype
    assert_bytes_equal(_bits(inp.x), before)  # input untouched


@settings(max_examples=60, deadline=None)
@given(float_inputs(block=64, k_multiple=1, max_blocks=3, dtypes=("float32",)),
       st.sampled_from([256, 512, 1024, 2048, 4096]), st.booleans())
def test_quantize_matches_reference_large_blocks(inp, blocksize, cs):
    ref, _ = _quantize_ref(inp.x32, blocksize, cs)
    if _stats_overflow(ref):
        return
    qt = nf4.quantize(inp.x, blocksize=blocksize, compress_statistics=cs)
    for name in ref:
        assert_bytes_equal(qt.buffers[name], ref[name])


@pytest.mark.parametrize("blocksize", [32, 64, 4096])
def test_large_input_threaded_matches_reference(blocksize):
    # Enough blocks for several threads; odd length so the last block is partial and padded.
    rng = np.random.default_rng(blocksize)
    x = (rng.standard_normal(300_001) * 0.02).astype(np.float32)
    x[1000:1000 + blocksize] = 0  # a zero block (when aligned) among normal ones
    for cs in (False, True):
        qt = nf4.quantize(x, blocksize=blocksize, compress_statistics=cs)
        ref, _ = _quantize_ref(x, blocksize, cs)
        for name in ref:
            assert_bytes_equal(qt.buffers[name], ref[name])
        out = nf4.dequantize(qt)
        absmax = R.dequantize_absmax(ref["absmax"], ref["absmax2"], ref["offset"]) if cs else ref["absmax"]
        assert_bytes_equal(out, R.dequantize(ref["packed"], absmax, x.size, blocksize))


@SETTINGS
@given(float_inputs(block=64, k_multiple=1, max_blocks=3), SMALL_BLOCKSIZES, st.booleans())
def test_dequantize_matches_reference_and_bound(inp, blocksize, cs):
    x32 = _flat(inp.x32)
    n = x32.size
    ref, absmax = _quantize_ref(x32, blocksize, cs)
    if _stats_overflow(ref):
        return  # the quantize API refuses these (test above); they would decode to NaN
    qt = QuantizedTensor("nf4", inp.x32.shape, "float32",
                         {"blocksize": blocksize, "quant_type": "nf4", "compress_statistics": cs}, ref)
    got = nf4.dequantize(qt)
    dec_absmax = R.dequantize_absmax(ref["absmax"], ref["absmax2"], ref["offset"]) if cs else absmax
    want = R.dequantize(ref["packed"], dec_absmax, n, blocksize)
    assert_bytes_equal(got, want.reshape(inp.x32.shape))
    assert_bytes_equal(nf4.decoded_absmax(qt), dec_absmax)
    if n == 0:
        return
    # Round-trip bound (derivation in qformats.nf4's docstring): the code is the nearest NF4 level
    # to s = x / A up to float32 rounding, so |x - c A| <= A (G + 2^-22); the decoder's product
    # adds 2^-24 |c A| (+ half a subnormal). In a full block with A < 1e-38 bitsandbytes scales by
    # 1/1e-38 instead and only |x - x'| <= A holds (c has the sign of x and |c| <= 1).
    blk = np.arange(n) // blocksize
    a = absmax.astype(np.float64)[blk]
    full = (blk + 1) * blocksize <= n
    base = np.where(full & (a < TINY), a, a * (R.MAX_HALF_GAP + 2.0**-21))
    x64, got64 = x32.astype(np.float64), _flat(got).astype(np.float64)
    if cs:
        # Double quantization moves the decoded absmax A' by at most
        # absmax2 * (DYNAMIC_MAX_ERROR + 2^-20) + 2^-22 (|A'| + |offset|) (2 absmax2 more when
        # 1/absmax2 overflows: a NaN scaled value gets code 0).
        a2 = ref["absmax2"].astype(np.float64)[np.arange(absmax.size) // 256]
        dec = dec_absmax.astype(np.float64)
        off = abs(float(ref["offset"][0]))
        da = np.abs(absmax.astype(np.float64) - dec)
        da_bound = (a2 * (R.DYNAMIC_MAX_ERROR + 2.0**-20) + 2.0**-22 * (np.abs(dec) + off)
                    + np.where(a2 < 2.0**-126, 2 * a2, 0) + 2.0**-149)
        assert (da <= da_bound).all(), np.max(da - da_bound)
        bound = base + da[blk] + 2.0**-23 * np.abs(dec[blk]) + 2.0**-149
    else:
        bound = base + 2.0**-149
    err = np.abs(x64 - got64)
    assert (err <= bound).all(), (np.max(err - bound), np.argmax(err - bound))


def test_round_trip_bound_is_tight_for_the_widest_gap():
    # s = -0.848 (the midpoint of -1 and -0.696) is as far as any value gets from its code.
    x = np.zeros(64, np.float32)
    x[0] = 1.0
    x[1] = R.MIDPOINTS[0]
    qt = nf4.quantize(x)
    err = abs(float(nf4.dequantize(qt)[1]) - float(x[1]))
    assert err == pytest.approx(R.MAX_HALF_GAP, rel=1e-6)


# --- hand-made corner cases -----------------------------------------------------------------------

@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("amax", [1.0, 4.0, 0.125])
def test_ties_on_midpoints_go_to_the_lower_code(partial, amax):
    # A power-of-two absmax makes s = x / absmax exact (for the reciprocal and the division
    # alike), so x = midpoint * absmax lands exactly on the midpoint: strict '>' gives the lower
    # code; the next float up gives the upper one.
    bs = 64
    mids = R.MIDPOINTS
    above = np.nextafter(mids, np.float32(2))
    block = np.concatenate([[amax], mids * np.float32(amax), above * np.float32(amax)]).astype(np.float32)
    n = bs if not partial else block.size  # 31 values: one partial block
    x = np.zeros(n, np.float32)
    x[: block.size] = block
    packed, absmax = nf4.quantize_nf4(x, bs)
    assert absmax[0] == np.float32(amax)
    codes = np.stack([packed >> 4, packed & 15], -1).reshape(-1)
    assert codes[0] == 15
    np.testing.assert_array_equal(codes[1:16], np.arange(15))       # tie -> lower code j
    np.testing.assert_array_equal(codes[16:31], np.arange(1, 16))   # just above -> j + 1
    ref_p, ref_a = R.quantize(x, bs)
    assert_bytes_equal(packed, ref_p)
    assert_bytes_equal(absmax, ref_a)


def test_zero_blocks_and_padding():
    # Full all-zero block: absmax 0. Partial all-zero block: absmax clamped to 1e-38. Code 7.
    x = np.zeros(64 + 5, np.float32)
    x[1] = -0.0
    packed, absmax = nf4.quantize_nf4(x, 64)
    assert absmax.view(np.uint32).tolist() == [0, 0x006CE3EE]
    assert packed.tolist() == [0x77] * 35  # 69 codes of 7 + the padding nibble 7
    x = np.array([1.0, -1.0, 0.5], np.float32)  # odd length: the last low nibble is the pad code
    packed, _ = nf4.quantize_nf4(x, 32)
    assert packed.tolist() == [0xF0, 0xC7]  # 0.5 -> code 12 (0.4407; the midpoint is 0.5017)


def test_partial_block_uses_division_and_clamped_absmax():
    # A partial block of subnormals: stored absmax 1e-38 and codes of x / 1e-38.
    x = np.concatenate([np.ones(32, np.float32), np.array([1e-40, -5e-39, 3e-39], np.float32)])
    packed, absmax = nf4.quantize_nf4(x, 32)
    assert absmax[1] == R.TINY
    assert_bytes_equal(packed, R.quantize(x, 32)[0])
    # A full block of subnormals keeps its true absmax but is scaled by 1 / 1e-38.
    x = np.full(32, 1e-40, np.float32)
    packed, absmax = nf4.quantize_nf4(x, 32)
    # s = 1e-40 * (1 / 1e-38) = 0.01 < 0.0398 (the first positive midpoint): code 7, not 15.
    assert absmax[0] == np.float32(1e-40) and (packed == 0x77).all()
    assert_bytes_equal(packed, R.quantize(x, 32)[0])


@pytest.mark.parametrize("value", [0.0, -0.0, 1e-45, -3e-39, 1.0, -7.5, 65504.0, 3.4028235e38, -3.4028235e38])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_constant_and_extreme_blocks(value, dtype):
    inp = to_dtype(np.full(100, value, np.float32), dtype)
    for cs in (False, True):
        ref, _ = _quantize_ref(inp.x32, 32, cs)
        if _stats_overflow(ref):  # 4 blocks of absmax ~3.4e38: their float32 sum is inf
            assert abs(value) > 1e38
            with pytest.raises(ValueError, match="overflows"):
                nf4.quantize(inp.x, blocksize=32, compress_statistics=cs)
            continue
        qt = nf4.quantize(inp.x, blocksize=32, compress_statistics=cs)
        for name in ref:
            assert_bytes_equal(qt.buffers[name], ref[name])
        assert np.isfinite(_np(nf4.dequantize(qt, "float32"))).all()


def test_empty_input():
    for cs in (False, True):
        qt = nf4.quantize(np.zeros((0, 3), np.float32), compress_statistics=cs)
        assert qt.buffers["packed"].shape == (0,) and qt.buffers["absmax"].shape == (0,)
        assert nf4.dequantize(qt).shape == (0, 3)
    assert qt.buffers["absmax2"].shape == (0,)
    assert qt.buffers["offset"].view(np.uint32)[0] == 0xFFC00000  # torch's mean of nothing: NaN
    packed, absmax = nf4.quantize_nf4(np.zeros(0, np.float32))
    assert packed.shape == (0,) and absmax.shape == (0,)
    assert nf4.dequantize_nf4(packed, absmax, 0).shape == (0,)


def test_constants_match_reference():
    c = _native.constants()
    assert_bytes_equal(np.array(c["code"], np.float32), R.CODE)
    assert_bytes_equal(np.array(c["midpoints"], np.float32), R.MIDPOINTS)
    assert_bytes_equal(np.array(c["dynamic_map"], np.float32), R.DYNAMIC_MAP)
    assert np.float32(c["tiny"]) == R.TINY
    assert (np.diff(R.CODE) > 0).all() and (np.diff(R.DYNAMIC_MAP) > 0).all()


# --- double quantization pieces -------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(0, 140_000), st.integers(0, 2**32 - 1), st.sampled_from([1e-40, 1e-3, 1.0, 1e30]))
def test_mean_torch_order_matches_reference(n, seed, scale):
    x = np.abs(np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    got, want = np.float32(_native.mean_torch_order(x)), R.mean_torch_order(x)
    assert got.view(np.uint32) == want.view(np.uint32)


def test_mean_torch_order_deep_cascade():
    # 600 K values: 18 K groups of 32, enough for the level-3 carry (every 4096 groups).
    x = np.abs(np.random.default_rng(7).standard_normal(600_001)).astype(np.float32)
    assert np.float32(_native.mean_torch_order(x)).view(np.uint32) == R.mean_torch_order(x).view(np.uint32)


absmax_arrays = st.one_of(
    st.lists(st.floats(0, 1e4, width=32), max_size=700),
    st.lists(st.sampled_from([0.0, 1e-45, 3e-39, 1e-38, 0.5, 1.0, 1.0000001, 3e38]), max_size=700),
    st.integers(0, 700).map(lambda k: [0.25] * k),  # all equal: d = 0 exactly -> codes 0
)


@settings(max_examples=150, deadline=None)
@given(absmax_arrays)
def test_double_quant_matches_reference(values):
    absmax = np.array(values, np.float32)
    nb = absmax.size
    q, a2, off = np.empty(nb, np.uint8), np.empty(-(-nb // 256), np.float32), np.empty(1, np.float32)
    _native.double_quant(absmax, q, a2, off)
    rq, ra2, roff = R.double_quant(absmax)
    assert_bytes_equal(q, rq)
    assert_bytes_equal(a2, ra2)
    assert_bytes_equal(off, roff)
    dec = np.empty(nb, np.float32)
    _native.dequantize_absmax(q, a2, off, dec)
    assert_bytes_equal(dec, R.dequantize_absmax(rq, ra2, roff))


def test_dynamic_code_table_corners():
    # v = +-1, 0, NaN (0 * inf), and the midpoints of the map are decided as bitsandbytes' table.
    # v = 0 falls in table cell 32768, whose value is +1/65535: the nearest map entry to that is
    # 2.125e-5 (code 131), not the map's exact 0 (code 127). bitsandbytes stores 131 too.
    v = np.array([-1.0, 1.0, 0.0, np.nan, -np.inf, np.inf], np.float32)
    assert R.dynamic_codes_of(v).tolist() == [0, 255, 131, 0, 0, 255]
    assert R.DYNAMIC_MAP[127] == 0 and R.DYNAMIC_MAP[131] == pytest.approx(2.125e-5, rel=1e-6)
    d = np.array([0.5, -0.5, 0.0, 0.25], np.float32)  # a2 = 0.5: v = 1, -1, 0, 0.5
    q, a2 = np.empty(4, np.uint8), np.empty(1, np.float32)
    _native.double_quant(d + np.float32(1), q, a2, np.empty(1, np.float32))  # offset = mean = 1.0625
    assert_bytes_equal(q, R.double_quant(d + np.float32(1))[0])


# --- GEMM -------------------------------------------------------------------------------------------

@SETTINGS
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 200), SMALL_BLOCKSIZES, st.booleans(),
       st.integers(0, 2**32 - 1))
def test_gemm_matches_float64_reference(m, n, k, blocksize, cs, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((m, k)).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    wq = nf4.quantize(w, blocksize=blocksize, compress_statistics=cs)
    got = nf4.gemm(x, wq)
    ref_buf, absmax = _quantize_ref(w, blocksize, cs)
    if cs:
        absmax = R.dequantize_absmax(ref_buf["absmax"], ref_buf["absmax2"], ref_buf["offset"])
    w_hat = R.dequantize(ref_buf["packed"], absmax, m * k, blocksize).reshape(m, k).astype(np.float64)
    ref = x.astype(np.float64) @ w_hat.T
    assert got.shape == (n, m) and got.dtype == np.float32
    # Relative Frobenius error, relative to |X| |W'|^T: a float32 dot product is accurate to
    # ~K 2^-24 of sum |x w|, not of the (possibly cancelling) sum itself (m = n = 1, k = 4 finds it).
    scale = np.abs(x).astype(np.float64) @ np.abs(w_hat).T
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(scale) + 1e-30


@pytest.mark.parametrize("cs", [False, True])
def test_gemm_relative_frobenius_error(cs):
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((48, 300)) * 0.02).astype(np.float32)  # K % 64 != 0: blocks straddle rows
    x = rng.standard_normal((64, 300)).astype(np.float32)
    wq = nf4.quantize(w, compress_statistics=cs)
    w_hat = nf4.dequantize(wq, "float32").astype(np.float64)
    ref = x.astype(np.float64) @ w_hat.T
    got = nf4.gemm(x, wq)
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref)


def test_gemm_blocks_straddle_rows_and_torch_io():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    w = rng.standard_normal((37, 40)).astype(np.float32)  # K = 40: 32-blocks straddle rows
    x = rng.standard_normal((5, 40)).astype(np.float32)
    wq = nf4.quantize(torch.from_numpy(w), blocksize=32)
    got = nf4.gemm(torch.from_numpy(x), wq)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (5, 37)
    ref = x.astype(np.float64) @ nf4.dequantize(wq).numpy().astype(np.float64).T
    assert np.linalg.norm(got.numpy() - ref) <= 1e-5 * np.linalg.norm(ref)
    got_np = nf4.gemm(x, wq)  # numpy activations, torch weights: numpy out
    assert isinstance(got_np, np.ndarray)
    np.testing.assert_array_equal(got_np, got.numpy())


# --- bad input --------------------------------------------------------------------------------------

def test_bad_input_raises():
    torch = pytest.importorskip("torch")
    good = np.ones(64, np.float32)
    for bad in (np.array([1.0, np.nan], np.float32), np.array([np.inf, 1.0], np.float32),
                np.array([-np.inf], np.float16)):
        with pytest.raises(ValueError, match="NaN or Inf"):
            nf4.quantize(bad)
    with pytest.raises(ValueError, match="NaN or Inf"):
        nf4.quantize(torch.tensor([1.0, float("nan")], dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        nf4.quantize(np.ones(8, np.int32))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        nf4.quantize(np.ones(8, np.float64))
    with pytest.raises(TypeError, match="numpy array or a torch tensor"):
        nf4.quantize([1.0, 2.0])
    for bs in (16, 33, 48, 8192, 0, -64):
        with pytest.raises(ValueError, match="blocksize"):
            nf4.quantize(good, blocksize=bs)
    for bs in (64.0, True, "64"):
        with pytest.raises(TypeError, match="blocksize"):
            nf4.quantize(good, blocksize=bs)
    with pytest.raises(TypeError, match="compress_statistics"):
        nf4.quantize(good, compress_statistics=1)
    with pytest.raises(ValueError, match="contiguous"):
        nf4.quantize(np.ones((8, 8), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="contiguous"):
        nf4.quantize(torch.ones(8, 8).t())
    with pytest.raises(ValueError, match="scalar"):
        nf4.quantize(np.ones((), np.float32))
    with pytest.raises(ValueError, match="1-D"):
        nf4.quantize_nf4(np.ones((2, 64), np.float32))
    packed, absmax = nf4.quantize_nf4(good)
    with pytest.raises(ValueError, match="shape"):
        nf4.dequantize_nf4(packed, absmax, 66)
    with pytest.raises(TypeError, match="uint8"):
        nf4.dequantize_nf4(absmax, absmax, 64)
    # GEMM shapes and dtypes
    wq = nf4.quantize(np.ones((4, 64), np.float32))
    with pytest.raises(ValueError, match="to match w"):
        nf4.gemm(np.ones((2, 32), np.float32), wq)
    with pytest.raises(TypeError, match="float32"):  # float16 / bfloat16 activations are accepted
        nf4.gemm(np.ones((2, 64), np.int32), wq)
    with pytest.raises(ValueError, match="2-D"):
        nf4.gemm(np.ones((2, 64), np.float32), nf4.quantize(np.ones(64, np.float32)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        nf4.gemm(np.full((2, 64), np.nan, np.float32), wq)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        nf4.gemm(np.ones((2, 64), np.float32), np.ones((4, 64), np.float32))
    # A tensor whose buffers do not match its params is refused before native code runs.
    broken = QuantizedTensor("nf4", (4, 64), "float32", dict(wq.params, blocksize=32), dict(wq.buffers))
    with pytest.raises(ValueError, match="absmax"):
        nf4.dequantize(broken)
    with pytest.raises(ValueError, match="quant_type"):
        nf4.expected_buffers((64,), {"blocksize": 64, "quant_type": "fp4"})
    with pytest.raises(ValueError, match="unknown"):
        nf4.expected_buffers((64,), {"block_size": 64})


def test_native_adapters_check_sizes():
    x = np.ones(100, np.float32)
    with pytest.raises(ValueError, match="packed"):
        _native.quantize(x, 64, np.empty(49, np.uint8), np.empty(2, np.float32))
    with pytest.raises(ValueError, match="absmax"):
        _native.quantize(x, 64, np.empty(50, np.uint8), np.empty(1, np.float32))
    with pytest.raises(ValueError, match="blocksize"):
        _native.quantize(x, 48, np.empty(50, np.uint8), np.empty(3, np.float32))
    with pytest.raises(TypeError):
        _native.quantize(x, 64, np.empty(50, np.int8), np.empty(2, np.float32))
    with pytest.raises(ValueError, match="out"):
        _native.gemm(np.ones((2, 10), np.float32), np.empty(15, np.uint8), np.empty(1, np.float32),
                     np.empty(5, np.float32), 3, 10, 32)


# --- API: library in = library out, dtypes, serialization ---------------------------------------

def test_numpy_in_numpy_out_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal((3, 50)).astype(np.float32)
    for cs in (False, True):
        qn = nf4.quantize(x.astype(np.float16), compress_statistics=cs)
        assert all(isinstance(b, np.ndarray) for b in qn.buffers.values())
        out = nf4.dequantize(qn)
        assert isinstance(out, np.ndarray) and out.dtype == np.float16 and out.shape == (3, 50)
        qt = nf4.quantize(torch.from_numpy(x).to(torch.bfloat16), compress_statistics=cs)
        assert all(isinstance(b, torch.Tensor) for b in qt.buffers.values())
        out = nf4.dequantize(qt)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (3, 50)
        assert nf4.dequantize(qt, "float32").dtype == torch.float32
        # Same values, same bytes, whichever library carried them.
        x32 = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
        qn2 = nf4.quantize(x32, compress_statistics=cs)
        for name in qn2.buffers:
            assert_bytes_equal(qt.buffers[name], qn2.buffers[name])
    packed, absmax = nf4.quantize_nf4(torch.from_numpy(x.reshape(-1)))
    assert isinstance(packed, torch.Tensor) and isinstance(absmax, torch.Tensor)
    assert isinstance(nf4.dequantize_nf4(packed, absmax, x.size), torch.Tensor)


@pytest.mark.parametrize("cs", [False, True])
def test_state_dict_round_trip(cs):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal((7, 33)).astype(np.float32)
    qt = nf4.quantize(x, blocksize=32, compress_statistics=cs)
    buf = io.BytesIO()
    torch.save(qt.state_dict(), buf)
    buf.seek(0)
    back = QuantizedTensor.from_state_dict(torch.load(buf, weights_only=True))
    assert back.format == "nf4" and back.shape == (7, 33) and back.params == qt.params
    np.testing.assert_array_equal(back.dequantize().numpy(), nf4.dequantize(qt))


def test_expected_buffers():
    assert nf4.expected_buffers((3, 5), {"blocksize": 64, "quant_type": "nf4", "compress_statistics": False}) == {
        "packed": ("uint8", (8,)), "absmax": ("float32", (1,))}
    assert nf4.expected_buffers((1000, 64), {"blocksize": 32, "compress_statistics": True}) == {
        "packed": ("uint8", (32000,)), "absmax": ("uint8", (2000,)), "absmax2": ("float32", (8,)),
        "offset": ("float32", (1,))}


@pytest.mark.parametrize("cs", [False, True])
def test_safetensors_round_trip(cs, tmp_path):
    pytest.importorskip("safetensors")
    import qformats

    x = np.random.default_rng(4).standard_normal((10, 70)).astype(np.float32)
    qt = nf4.quantize(x, compress_statistics=cs)
    qformats.save(tmp_path / "w.safetensors", {"w": qt})
    back = qformats.load(tmp_path / "w.safetensors")["w"]
    assert back.params == qt.params
    for name in qt.buffers:
        assert_bytes_equal(back.buffers[name], qt.buffers[name])
