"""nf4 vs bitsandbytes: byte-for-byte equality with ``bitsandbytes.functional.quantize_4bit(...,
quant_type="nf4")`` (packed codes, absmax; with compress_statistics the uint8 absmax, offset,
state2.absmax and the maps), and equality of ``dequantize_4bit`` with ours.

Scope of the claim, as found in bitsandbytes 0.50 on the CPU (see src/formats/nf4/nf4.h):
* the offset is torch's float32 mean; torch splits sums of >= 32768 values across its threads,
  so beyond 32767 blocks bitsandbytes' offset depends on torch.get_num_threads(); ours is the
  one-thread value (tested below with torch.set_num_threads(1)).
* bitsandbytes' AVX-512 dequantize_4bit indexes absmax per row, which is wrong for 2-D shapes
  whose rows are not a whole number of blocks; its decode is compared on the flattened tensor.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as F  # noqa: E402

from qformats import nf4  # noqa: E402
from qformats.nf4 import reference as R  # noqa: E402
from strategies import assert_bytes_equal, float_inputs, to_dtype  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True, scope="module")
def _eager_bitsandbytes():
    # bitsandbytes wraps its fallback dequantize in torch.compile; compiling it costs seconds per
    # shape/dtype on this CPU. Eager mode runs the same float32 ops.
    with torch._dynamo.config.patch(disable=True):
        yield


def _same(a, b):
    """Bit-exact equality of two arrays/tensors (bfloat16 tensors compared as int16 bits)."""
    a, b = (torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in (a, b))
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    assert_bytes_equal(a, b)


def _torch(inp):
    return inp.x if isinstance(inp.x, torch.Tensor) else torch.from_numpy(inp.x)


def _same_decode(qt, packed, state, flat=False):
    """Our decode equals bitsandbytes' ``dequantize_4bit`` computed in float32, and our decode in
    the original dtype is that float32 result rounded once. (bitsandbytes' own 16-bit decode
    depends on the host CPU: its AVX-512 kernel rounds the float32 product once, its torch
    fallback on CPUs without AVX-512 multiplies in the 16-bit type, a few ulps apart; seen on
    the GPU machine's CPU. Decoding in float32 takes both paths out of the comparison.)"""
    import copy

    s32 = copy.copy(state)
    s32.dtype = torch.float32
    want32 = F.dequantize_4bit(packed, s32)
    got32 = nf4.dequantize(qt, dtype="float32")
    if flat:
        want32, got32 = want32.reshape(-1), got32.reshape(-1)
    _same(got32, want32.reshape(got32.shape))
    got = nf4.dequantize(qt)
    want = torch.from_numpy(np.asarray(got32)) if isinstance(got32, np.ndarray) else got32
    _same(got.reshape(want.shape), want.to(TORCH_DTYPES[qt.dtype]))


def _bnb(x, blocksize, cs):
    return F.quantize_4bit(x, blocksize=blocksize, compress_statistics=cs, quant_type="nf4")


def _assert_same_as_bnb(qt, packed, state, cs):
    assert_bytes_equal(qt.buffers["packed"], packed.reshape(-1))
    assert state.quant_type == "nf4" and state.blocksize == qt.params["blocksize"]
    assert_bytes_equal(state.code, R.CODE)
    if not cs:
        assert_bytes_equal(qt.buffers["absmax"], state.absmax)
        return
    assert_bytes_equal(qt.buffers["absmax"], state.absmax)           # uint8 codes
    assert_bytes_equal(qt.buffers["offset"], state.offset.reshape(1))  # float32 mean
    assert_bytes_equal(qt.buffers["absmax2"], state.state2.absmax)   # float32 per 256 blocks
    assert state.state2.blocksize == R.DOUBLE_QUANT_BLOCK
    assert_bytes_equal(state.state2.code, R.DYNAMIC_MAP)


@settings(max_examples=100, deadline=None)
@given(float_inputs(block=64, k_multiple=1, max_blocks=3), st.sampled_from(R.BLOCKSIZES), st.booleans())
def test_quantize_matches_bitsandbytes(inp, blocksize, cs):
    packed, state = _bnb(_torch(inp), blocksize, cs)
    if cs and inp.x32.size and not (torch.isfinite(state.offset) and torch.isfinite(state.state2.absmax).all()):
        # The float32 sum of absmax overflowed: bitsandbytes stores offset = inf and decodes NaN;
        # we refuse the input (the native kernel still reproduces those bytes, checked here).
        with pytest.raises(ValueError, match="overflows"):
            nf4.quantize(inp.x, blocksize=blocksize, compress_statistics=cs)
        rq, ra2, roff = R.double_quant(R.quantize(inp.x32, blocksize)[1])
        assert_bytes_equal(rq, state.absmax)
        assert_bytes_equal(roff, state.offset.reshape(1))
        assert_bytes_equal(ra2, state.state2.absmax)
        return
    qt = nf4.quantize(inp.x, blocksize=blocksize, compress_statistics=cs)
    _assert_same_as_bnb(qt, packed, state, cs)
    # dequantize_4bit on the flattened tensor (see the module docstring), in the input dtype.
    flat = _torch(inp).reshape(-1)
    if flat.numel():
        p1, s1 = _bnb(flat, blocksize, cs)
        _same_decode(qt, p1, s1, flat=True)  # (n, 1) for n <= 2: bitsandbytes' transpose shim


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("blocksize,cs", [(64, False), (64, True), (32, True), (128, False), (256, True),
                                          (1024, False), (4096, True)])
def test_real_weights_like_matrix(dtype, blocksize, cs):
    # A weight-like 512 x 1024 matrix: normal, std 0.02, with a few outliers.
    rng = np.random.default_rng(blocksize + cs)
    w = (rng.standard_normal((512, 1024)) * 0.02).astype(np.float32)
    w[rng.integers(0, 512, 20), rng.integers(0, 1024, 20)] *= 30
    inp = to_dtype(w, dtype)
    x = _torch(inp)
    packed, state = _bnb(x, blocksize, cs)
    qt = nf4.quantize(x, blocksize=blocksize, compress_statistics=cs)
    _assert_same_as_bnb(qt, packed, state, cs)
    # Rows are whole blocks here (1024 % blocksize == 0 up to 1024), so bitsandbytes' 2-D decode
    # is right; 4096-blocks span rows, decode those flattened.
    if blocksize <= 1024:
        _same_decode(qt, packed, state)
    else:
        p1, s1 = _bnb(x.reshape(-1), blocksize, cs)
        _same_decode(qt, p1, s1, flat=True)
    got = nf4.dequantize(qt)
    assert got.dtype == TORCH_DTYPES[dtype] and got.shape == (512, 1024)
    # Same bytes from numpy input (float32 / float16), too.
    if dtype != "bfloat16":
        qn = nf4.quantize(inp.x, blocksize=blocksize, compress_statistics=cs)
        for name in qt.buffers:
            assert_bytes_equal(qn.buffers[name], qt.buffers[name])


def test_many_blocks_offset_single_thread():
    # 40000 blocks: torch sums >= 32768 values in parallel; on one thread the offset is ours.
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.from_numpy((np.random.default_rng(5).standard_normal(40_000 * 32 - 7) * 0.05).astype(np.float32))
        packed, state = _bnb(x, 32, True)
    finally:
        torch.set_num_threads(n_threads)
    qt = nf4.quantize(x, blocksize=32, compress_statistics=True)
    _assert_same_as_bnb(qt, packed, state, True)


def test_corner_cases_match_bitsandbytes():
    cases = [
        np.zeros(64 + 5, np.float32),                                  # full and partial zero blocks
        np.array([1.0, -1.0, 0.5], np.float32),                        # odd length: pad code 7
        np.concatenate([[1.0], R.MIDPOINTS, np.nextafter(R.MIDPOINTS, np.float32(2))]).astype(np.float32),
        np.concatenate([np.ones(64), [1e-40, -5e-39, 3e-39]]).astype(np.float32),  # subnormal partial
        np.full(64, 1e-40, np.float32),                                # subnormal full block
        np.full(640, 0.25, np.float32),                                # equal absmax: d = 0 exactly
        np.full(33, -0.0, np.float32),
    ]
    for x in cases:
        for blocksize in (32, 64):
            for cs in (False, True):
                packed, state = _bnb(torch.from_numpy(x), blocksize, cs)
                qt = nf4.quantize(x, blocksize=blocksize, compress_statistics=cs)
                _assert_same_as_bnb(qt, packed, state, cs)
                _same_decode(qt, packed, state, flat=True)


def test_empty_input_matches_bitsandbytes():
    for cs in (False, True):
        packed, state = _bnb(torch.zeros(0), 64, cs)
        qt = nf4.quantize(np.zeros(0, np.float32), compress_statistics=cs)
        assert qt.buffers["packed"].size == 0 and packed.numel() == 0
        if cs:  # torch's mean of nothing: NaN 0xFFC00000
            assert_bytes_equal(qt.buffers["offset"], state.offset.reshape(1))
        assert_bytes_equal(qt.buffers["absmax"], state.absmax)


def test_maps_match_bitsandbytes():
    assert_bytes_equal(F.get_4bit_type("nf4", device="cpu"), R.CODE)
    assert_bytes_equal(F.create_dynamic_map(), R.DYNAMIC_MAP)
