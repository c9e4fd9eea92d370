"""q8_1: native codec == numpy reference byte for byte; round trip; bad input."""
import numpy as np
import pytest
from hypothesis import given, settings

from qformats import q8_1
from qformats import _arrays as A
from strategies import assert_bytes_equal, float_inputs

SETTINGS = settings(max_examples=200, deadline=None)


@SETTINGS
@given(float_inputs(block=32))
def test_quantize_matches_reference(inp):
    before = np.copy(inp.x32)
    ref = q8_1.reference.quantize(inp.x32)
    if A.fp16_field_overflowed(ref, 0):  # scale beyond fp16: the API refuses
        with pytest.raises(ValueError, match="overflows fp16"):
            q8_1.quantize_q8_1(inp.x)
        return
    assert_bytes_equal(q8_1.quantize_q8_1(inp.x), ref)
    np.testing.assert_array_equal(inp.x32, before)


@SETTINGS
@given(float_inputs(block=32))
def test_dequantize_matches_reference_and_bound(inp):
    blocks = q8_1.reference.quantize(inp.x32)
    with np.errstate(invalid="ignore", over="ignore"):
        got = q8_1.dequantize_q8_1(blocks, inp.x32.shape[-1])
        assert_bytes_equal(got, q8_1.reference.dequantize(blocks))
    if A.fp16_field_overflowed(blocks, 0):
        return  # the quantize API refuses such inputs; no bound to check
    b = blocks.reshape(-1, 36)
    d = b[:, 0:2].copy().view("<f2").astype(np.float64)
    x = inp.x32.astype(np.float64).reshape(-1, 32)
    amax = np.abs(x).max(axis=1, keepdims=True) if x.size else np.zeros((0, 1))
    err = np.abs(x - np.asarray(got, np.float64).reshape(-1, 32))
    # Half a step, plus the fp16 rounding of d stretched over at most 127 steps.
    bound = d / 2 + np.abs(amax / 127 - d) * 127 + 1e-45
    assert (err <= bound * (1 + 1e-6)).all()
    # s = fp16(d * sum(q)) with the unrounded d: consistent with the codes within fp16 rounding.
    q = b[:, 4:].copy().view(np.int8).astype(np.float64)
    s = b[:, 2:4].copy().view("<f2").astype(np.float64)[:, 0]
    want = (amax[:, 0] / 127) * q.sum(axis=1)
    ok = np.abs(want) < 65504  # beyond that s saturates to inf, as in llama.cpp
    # fp16 keeps 11 significant bits; below 2^-14 its absolute step is 2^-24.
    assert (np.abs(s[ok] - want[ok]) <= np.abs(want[ok]) * 2 ** -10 + 2 ** -24).all()


def test_round_half_away_from_zero():
    # amax 127 gives d = 1, id = 1: x = +-2.5 must round away from zero to +-3 (roundf).
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2] = 127.0, 2.5, -2.5
    qs = q8_1.quantize_q8_1(x)[0, 4:].view(np.int8)
    assert (qs[0], qs[1], qs[2]) == (127, 3, -3)


@pytest.mark.parametrize("bad, exc", [
    (np.ones((2, 31), np.float32), ValueError),
    (np.ones(32, np.float64), TypeError),
    (np.array([np.nan] * 32, np.float32), ValueError),
    (np.full(32, 65520 * 127, np.float32), ValueError),
])
def test_bad_input_raises(bad, exc):
    with pytest.raises(exc):
        q8_1.quantize_q8_1(bad)
