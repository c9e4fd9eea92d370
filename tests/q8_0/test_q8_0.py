"""q8_0: native codec == numpy reference byte for byte; q8_1's scale and codes; round trip and
bound; bad input; the QuantizedTensor and QuantizedLinear faces."""
import numpy as np
import pytest
from hypothesis import given, settings

from qformats import _arrays as A
from qformats import q8_0, q8_1
from qformats._core import format_spec
from strategies import assert_bytes_equal, float_inputs

SETTINGS = settings(max_examples=200, deadline=None)


@SETTINGS
@given(float_inputs(block=32))
def test_quantize_matches_reference(inp):
    before = np.copy(inp.x32)
    ref = q8_0.reference.quantize(inp.x32)
    assert ref.shape == (*inp.x32.shape[:-1], inp.x32.shape[-1] // 32, 34)
    if A.fp16_field_overflowed(ref, 0):  # scale beyond fp16: the API refuses
        with pytest.raises(ValueError, match="overflows fp16"):
            q8_0.quantize_q8_0(inp.x)
        return
    assert_bytes_equal(q8_0.quantize_q8_0(inp.x), ref)
    np.testing.assert_array_equal(inp.x32, before)


@SETTINGS
@given(float_inputs(block=32))
def test_same_scale_and_codes_as_q8_1(inp):
    """q8_0 is q8_1 without s: byte for byte the same d and codes (one rule, common/int8_block.h),
    natively and in the references."""
    ours, theirs = q8_0.reference.quantize(inp.x32), q8_1.reference.quantize(inp.x32)
    assert_bytes_equal(ours[..., 0:2], theirs[..., 0:2])
    assert_bytes_equal(ours[..., 2:], theirs[..., 4:])
    if A.fp16_field_overflowed(ours, 0):
        return
    ours, theirs = q8_0.quantize_q8_0(inp.x), q8_1.quantize_q8_1(inp.x)
    assert_bytes_equal(ours[..., 0:2], theirs[..., 0:2])
    assert_bytes_equal(ours[..., 2:], theirs[..., 4:])


@SETTINGS
@given(float_inputs(block=32))
def test_dequantize_matches_reference_and_bound(inp):
    blocks = q8_0.reference.quantize(inp.x32)
    k = inp.x32.shape[-1]
    with np.errstate(invalid="ignore", over="ignore"):
        got = q8_0.dequantize_q8_0(blocks, k)
        assert_bytes_equal(got, q8_0.reference.dequantize(blocks))
    if A.fp16_field_overflowed(blocks, 0):
        return  # the quantize API refuses such inputs; no bound to check
    b = blocks.reshape(-1, 34)
    d = b[:, 0:2].copy().view("<f2").astype(np.float64)
    q = b[:, 2:].copy().view(np.int8).astype(np.float64)
    # the decoded value is exactly q * d (one float32 product of exact operands, |q| <= 127)
    assert (np.abs(q) <= 127).all()
    np.testing.assert_array_equal(np.asarray(got, np.float64).reshape(-1, 32), (q * d).astype(np.float32))
    x = inp.x32.astype(np.float64).reshape(-1, 32)
    amax = np.abs(x).max(axis=1, keepdims=True) if x.size else np.zeros((0, 1))
    err = np.abs(x - np.asarray(got, np.float64).reshape(-1, 32))
    # Half a step, plus the fp16 rounding of d stretched over at most 127 steps.
    bound = d / 2 + np.abs(amax / 127 - d) * 127 + 1e-45
    assert (err <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dequantize_16_bit_is_float32_rounded_once(dtype):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(4).standard_normal((3, 128)).astype(np.float32)
    blocks = q8_0.quantize_q8_0(x)
    want = torch.from_numpy(q8_0.reference.dequantize(blocks)).to(getattr(torch, dtype))
    got = q8_0.dequantize_q8_0(torch.from_numpy(blocks), 128, dtype)
    assert_bytes_equal(got, want)
    np_half = q8_0.dequantize_q8_0(blocks, 128, "float16")
    assert_bytes_equal(np_half, q8_0.reference.dequantize(blocks).astype(np.float16))


def test_round_half_away_from_zero_and_layout():
    # amax 127 gives d = 1, id = 1: x = +-2.5 must round away from zero to +-3 (roundf).
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2], x[31] = 127.0, 2.5, -2.5, -0.5
    blk = q8_0.quantize_q8_0(x)
    assert blk.shape == (1, 34) and blk.dtype == np.uint8
    assert blk[0, 0:2].view("<f2")[0] == 1.0
    qs = blk[0, 2:].view(np.int8)
    assert (qs[0], qs[1], qs[2], qs[31]) == (127, 3, -3, -1)


def test_torch_input_and_readonly_input_give_numpy_bytes():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(5).standard_normal((2, 3, 64)).astype(np.float32)
    want = q8_0.quantize_q8_0(x)
    assert want.shape == (2, 3, 2, 34)
    got = q8_0.quantize_q8_0(torch.from_numpy(x))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8
    assert_bytes_equal(got, want)
    ro = x.copy()
    ro.flags.writeable = False
    assert_bytes_equal(q8_0.quantize_q8_0(ro), want)
    want.flags.writeable = False
    assert_bytes_equal(q8_0.dequantize_q8_0(want, 64), q8_0.reference.dequantize(want))


def test_quantized_tensor_and_spec():
    x = np.random.default_rng(6).standard_normal((5, 96)).astype(np.float16)
    qt = q8_0.quantize(x)
    assert qt.format == "q8_0" and qt.shape == (5, 96) and qt.dtype == "float16" and qt.params == {}
    assert list(qt.buffers) == ["blocks"] and qt.buffers["blocks"].shape == (5, 3, 34)
    assert qt.avg_bits == 8.5
    back = qt.dequantize()
    assert back.dtype == np.float16
    assert_bytes_equal(back, q8_0.reference.dequantize(qt.buffers["blocks"]).astype(np.float16))
    assert_bytes_equal(qt.dequantize("float32"), q8_0.reference.dequantize(qt.buffers["blocks"]))
    spec = format_spec("q8_0")
    assert spec is q8_0.SPEC and spec.name == "q8_0" and spec.block({}) == 32
    assert spec.with_group_size({}, 32) == {}
    with pytest.raises(ValueError, match="fixed blocks"):
        spec.with_group_size({}, 64)
    assert q8_0.expected_buffers((5, 96), {}) == {"blocks": ("uint8", (5, 3, 34))}
    with pytest.raises(ValueError, match="no parameters"):
        q8_0.expected_buffers((5, 96), {"group_size": 32})
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0.expected_buffers((5, 95), {})
    with pytest.raises(ValueError, match="expected a q8_0"):
        q8_0.dequantize(q8_1.quantize(x))


@pytest.mark.parametrize("bad, exc, says", [
    (np.ones((2, 31), np.float32), ValueError, "multiple"),
    (np.ones(32, np.float64), TypeError, "float32"),
    (np.ones(32, np.int32), TypeError, "float32"),
    (np.float32(1.0), TypeError, "numpy array"),
    (np.array([np.nan] * 32, np.float32), ValueError, "NaN"),
    (np.array([1.0] * 31 + [np.inf], np.float32), ValueError, "NaN or Inf"),
    (np.full(32, 65520 * 127, np.float32), ValueError, "overflows fp16"),
    (np.ones((64, 64), np.float32)[:, ::2], ValueError, "contiguous"),
    ([1.0] * 32, TypeError, "got list"),
])
def test_bad_input_raises(bad, exc, says):
    with pytest.raises(exc, match=says):
        q8_0.quantize_q8_0(bad)


def test_largest_scale_that_fits_fp16_is_accepted():
    # d = amax / 127 rounds to fp16 65504 (finite) just below 65520 * 127.
    x = np.full(32, 65504 * 127, np.float32)
    blk = q8_0.quantize_q8_0(x)
    assert blk[0, 0:2].view("<f2")[0] == 65504 and (blk[0, 2:].view(np.int8) == 127).all()


def test_bad_blocks_raise():
    blocks = q8_0.quantize_q8_0(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0.dequantize_q8_0(blocks, 48)
    with pytest.raises(ValueError, match="expected shape"):
        q8_0.dequantize_q8_0(blocks, 96)
    with pytest.raises(ValueError, match="expected shape"):
        q8_0.dequantize_q8_0(blocks[..., :33].copy(), 64)
    with pytest.raises(TypeError, match="uint8"):
        q8_0.dequantize_q8_0(blocks.view(np.int8), 64)
    with pytest.raises(TypeError, match="int"):
        q8_0.dequantize_q8_0(blocks, 64.0)
    with pytest.raises(ValueError, match=">= 0"):
        q8_0.dequantize_q8_0(blocks, -32)
    with pytest.raises(TypeError, match="bfloat16"):
        q8_0.dequantize_q8_0(blocks, 64, "bfloat16")  # numpy has no bfloat16
    with pytest.raises(ValueError, match="contiguous"):
        q8_0.dequantize_q8_0(np.concatenate([blocks, blocks], axis=0)[::2], 64)
    # the native adapter checks sizes on its own (a direct call cannot write out of bounds)
    with pytest.raises(ValueError, match="34 bytes"):
        q8_0._native.dequantize(np.zeros(35, np.uint8), np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="out"):
        q8_0._native.quantize(np.ones(64, np.float32), np.zeros(67, np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_quantized_linear_forward_equals_dequantized_f_linear(dtype):
    """QuantizedLinear.from_linear(lin, format="q8_0"): the forward is F.linear on the
    dequantized weight (q8_0 binds no native kernel: the qformats::linear operator path)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from qformats.nn import QuantizedLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96)
    q = QuantizedLinear.from_linear(lin, format="q8_0")
    assert q.quantized_weight.format == "q8_0"
    assert_bytes_equal(q.quantized_weight.buffers["blocks"], q8_0.quantize_q8_0(lin.weight.detach()))
    tdt = getattr(torch, dtype)
    for lead in ((1,), (2, 5), (40,)):
        x = torch.randn(*lead, 256).to(tdt)
        y = q(x)
        w = q8_0.dequantize_q8_0(q.quantized_weight.buffers["blocks"], 256, dtype)
        assert y.dtype == tdt and y.shape == (*lead, 96)
        assert torch.equal(y, F.linear(x, w, q.bias.to(tdt)))
    ref = lin(x.float())
    assert ((y.float() - ref).norm() / ref.norm()) < (0.01 if dtype == "float32" else 0.05)
