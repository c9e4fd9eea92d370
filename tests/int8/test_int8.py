"""int8 (symmetric absmax, bitsandbytes rounding): native codec == numpy reference, bit for
bit; the round-trip bound; the exact integer GEMM; bad input.

Round-trip bound (per element of a unit with stored scale s = fl(absmax / 127) and
multiplier m = fl(127 / absmax); eps = 2^-24):
  t = 127 x / absmax is the exact code, v = fl(x * m) = t (1 + d1)(1 + d2), |d| <= eps, so
  |v - t| <= 127 * 2.0001 eps. q = clamp(rint(v)): |rint(v) - v| <= 1/2, and the clamp only
  acts when v > 127 >= |t| (it moves q towards t). So |q - t| <= 1/2 + 255 eps.
  |x - q s| <= |x - t s| + |t - q| s, with |x - t s| = |x| |1 - s / s_exact| <= 127 s eps for
  a normal s (s_exact = absmax / 127), or <= 127 * 2^-150 when s is subnormal (its absolute
  rounding error is <= 2^-150).
  Total: |x - q s| <= s (1/2 + 382 eps) + 127 * 2^-150  <=  s (1/2 + 2^-14) + 2^-140.
  When s underflows to 0 (absmax < 63.5 * 2^-149) the decode is 0 and the error <= absmax,
  which is below 2^-140 as well.
  Exception: 0 < absmax < 127 / FLT_MAX makes m = +inf; every nonzero code saturates to
  +-127 and the error is bounded by absmax * (1 + eps) + 2^-140 instead.
The decode q * s is one more float32 rounding of that exact product (relative eps, or +-inf
when |q s| >= 2^128 - 2^103, which needs absmax within a rounding of FLT_MAX).
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from strategies import float_inputs, assert_bytes_equal, to_dtype

import qformats.int8 as I
from qformats import QuantizedTensor
from qformats.int8 import reference as R

SETTINGS = settings(max_examples=150, deadline=None)
GRANULARITIES = [("tensor", 128), ("row", 128), ("group", 16), ("group", 32), ("group", 64)]
F32_OVERFLOW = 2.0**128 - 2.0**103  # smallest exact value float32 rounds to inf


def _np(x):
    """numpy view of an array/tensor; bfloat16 tensors as their raw int16 bits."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


def _unit_view(a, granularity, gs):
    """[n_units, unit_len] view of a float array quantized with this granularity."""
    n = R.unit_len(a.shape, granularity, gs)
    n_units = int(np.prod(R.scale_shape(a.shape, granularity, gs), dtype=np.int64))
    return a.reshape(n_units, n)


def exact_decode(q, scale, granularity, gs):
    """q * s in float64 (exact: an 8-bit integer times a float32), shaped like q."""
    qq = _unit_view(_np(q).astype(np.float64), granularity, gs)
    return (qq * _np(scale).astype(np.float64).reshape(-1, 1)).reshape(_np(q).shape)


def check_round_trip(x32, q, scale, granularity, gs):
    """The documented bound (see the module docstring) on the exact float64 decode q * s."""
    x = _unit_view(x32.astype(np.float64), granularity, gs)
    qq = _unit_view(_np(q).astype(np.float64), granularity, gs)
    s = _np(scale).astype(np.float64).reshape(-1, 1)
    absmax = np.abs(x).max(axis=-1, keepdims=True) if x.shape[1] else np.zeros((x.shape[0], 1))
    with np.errstate(divide="ignore", over="ignore"):
        m_inf = np.isinf(np.float32(127) / absmax.astype(np.float32))
    err = np.abs(x - _unit_view(exact_decode(q, scale, granularity, gs), granularity, gs))
    bound = np.where(m_inf, absmax * (1 + 2.0**-23), s * (0.5 + 2.0**-14)) + 2.0**-140
    assert (err <= bound).all(), (err - bound).max()
    assert (np.abs(qq) <= 127).all()


def _params(data):
    g, gs = data.draw(st.sampled_from(GRANULARITIES), label="granularity")
    block = gs if g == "group" else 8
    return g, gs, block


@SETTINGS
@given(data=st.data())
def test_native_matches_reference(data):
    g, gs, block = _params(data)
    inp = data.draw(float_inputs(block=block, max_blocks=5), label="x")
    before = _np(inp.x).copy()
    qt = I.quantize(inp.x, granularity=g, group_size=gs)
    assert_bytes_equal(_np(inp.x), before)  # input untouched
    rq, rs = R.quantize(inp.x32, g, gs)
    assert_bytes_equal(qt.buffers["q"], rq)
    assert_bytes_equal(qt.buffers["scale"], rs)
    assert type(qt.buffers["q"]) is type(inp.x) and qt.dtype == inp.dtype
    assert qt.params == ({"granularity": g, "group_size": gs} if g == "group" else {"granularity": g})
    # decode: native == reference, bit for bit
    d = qt.dequantize("float32")
    assert_bytes_equal(d, R.dequantize(rq, rs, g, gs))
    check_round_trip(inp.x32, rq, rs, g, gs)
    # overflow of the float32 decode happens only where the exact decode is out of range
    exact = exact_decode(rq, rs, g, gs)
    assert (np.isfinite(_np(d)) | (np.abs(exact) >= F32_OVERFLOW)).all()


@SETTINGS
@given(data=st.data())
def test_seed_calls_per_tensor(data):
    inp = data.draw(float_inputs(block=8, max_blocks=4), label="x")
    q, scale = I.quantize_tensor(inp.x)
    rq, rs = R.quantize(inp.x32, "tensor")
    assert_bytes_equal(q, rq)
    assert_bytes_equal(scale, rs)
    assert tuple(scale.shape) == (1,) * inp.x32.ndim
    assert_bytes_equal(I.dequantize_tensor(q, scale), R.dequantize(rq, rs, "tensor"))


def test_exact_ties_round_half_to_even():
    # absmax 127 -> m = 1 exactly, absmax 254 -> m = 0.5 exactly: x * m lands on k + 1/2.
    halves = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 125.5, -126.5, 127.0], np.float32)
    x = np.concatenate([halves, -halves[-1:]]).reshape(1, -1)  # absmax exactly 127
    q = I.quantize(x, "row").buffers["q"]
    expected = [round(float(v)) for v in x[0]]  # Python's round() is half to even
    assert q[0].tolist() == expected == [0, 2, 2, 4, 0, -2, -2, 126, -126, 127, -127]
    x2 = np.array([[1.0, 3.0, 5.0, -7.0, 254.0, 253.0]], np.float32)  # m = 0.5
    assert I.quantize(x2, "row").buffers["q"][0].tolist() == [0, 2, 2, -4, 127, 126]
    for dt in ("float16", "bfloat16"):  # the same ties through 16-bit inputs
        inp = to_dtype(x, dt)
        assert _np(I.quantize(inp.x, "row").buffers["q"])[0].tolist() == expected


def test_corner_cases():
    fmax = np.finfo(np.float32).max
    tiny = np.float32(1e-38)  # 127 / tiny overflows: m = +inf
    x = np.array([
        [0.0, -0.0, 0.0, -0.0],                 # all zero: q 0, scale +0
        [tiny, -tiny / 2, 0.0, -0.0],           # m = inf: saturate, 0 stays 0
        [1e-45, -1e-45, 0.0, 1e-45],            # smallest subnormal
        [fmax, -fmax, 1.0, 0.0],                # huge: q*scale of the max overflows
        [5.0, 5.0, 5.0, 5.0],                   # constant
    ], np.float32)
    qt = I.quantize(x, "row")
    q, s = qt.buffers["q"], qt.buffers["scale"]
    rq, rs = R.quantize(x, "row")
    assert_bytes_equal(q, rq)
    assert_bytes_equal(s, rs)
    assert q[0].tolist() == [0, 0, 0, 0] and s[0, 0].view(np.uint32) == 0  # +0.0 bits
    assert q[1].tolist() == [127, -127, 0, 0]
    assert q[2].tolist() == [127, -127, 0, 127]
    assert q[3].tolist() == [127, -127, 0, 0]
    assert q[4].tolist() == [127] * 4
    d = I.dequantize(qt)
    assert_bytes_equal(d, R.dequantize(rq, rs, "row"))
    assert d[3, 0] == np.inf and d[3, 1] == -np.inf  # documented decode overflow at FLT_MAX
    assert (d[4] == np.float32(127) * (np.float32(5) / np.float32(127))).all()
    check_round_trip(x, q, s, "row", 0)


@pytest.mark.parametrize("shape", [(0, 32), (3, 0), (0,), (64,), (2, 3, 32), (1, 1, 1, 64)])
@pytest.mark.parametrize("g", ["tensor", "row", "group"])
def test_shapes_and_empty(shape, g):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    qt = I.quantize(x, g, 32) if g == "group" and shape[-1] % 32 == 0 else I.quantize(x, g if g != "group" else "row")
    p = qt.params
    rq, rs = R.quantize(x, p["granularity"], p.get("group_size", 0))
    assert_bytes_equal(qt.buffers["q"], rq)
    assert_bytes_equal(qt.buffers["scale"], rs)
    assert I.expected_buffers(x.shape, p) == {"q": ("int8", x.shape), "scale": ("float32", rs.shape)}
    assert_bytes_equal(qt.dequantize(), R.dequantize(rq, rs, p["granularity"], p.get("group_size", 0)))


def test_large_threaded_paths():
    # Long units are split into segments across threads; results must not depend on that.
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 150_016)) * 3).astype(np.float32)
    x[1, 123_456] = 40.0
    for g, gs in [("tensor", 0), ("row", 0), ("group", 128)]:
        qt = I.quantize(x, g, gs or 128)
        rq, rs = R.quantize(x, g, gs)
        assert_bytes_equal(qt.buffers["q"], rq)
        assert_bytes_equal(qt.buffers["scale"], rs)
        assert_bytes_equal(qt.dequantize(), R.dequantize(rq, rs, g, gs))


def test_bulk_random_discriminates_rounding_variants():
    # Many random units at many scales: native == reference, and the data is rich enough to
    # tell the spec (x * fl(127/absmax)) from near-miss variants (x / fl(absmax/127), or
    # round half away from zero), so a kernel with either slip would fail here.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 256)) * 10.0 ** rng.integers(-30, 30, (512, 1))
    x = x.astype(np.float32)
    # Half the rows are near-ties: x = fl((k + 1/2) * fl(absmax / 127)) lands within a few
    # ulps of a rounding boundary, where the exact order of the float32 operations shows.
    am = rng.uniform(0.1, 100, (256, 1)).astype(np.float32)
    k = rng.integers(-127, 127, (256, 255)).astype(np.float32) + np.float32(0.5)
    x[::2] = np.concatenate([am, (k * (am / np.float32(127))).astype(np.float32)], axis=1)
    for g, gs in [("row", 0), ("group", 32)]:
        qt = I.quantize(x, g, gs or 32)
        rq, rs = R.quantize(x, g, gs)
        assert_bytes_equal(qt.buffers["q"], rq)
        assert_bytes_equal(qt.buffers["scale"], rs)
        u = _unit_view(x, g, gs)
        absmax = np.abs(u).max(axis=-1, keepdims=True)
        by_div = np.clip(np.rint(u / (absmax / np.float32(127))), -127, 127)
        half_away = np.clip(np.trunc(u * (np.float32(127) / absmax) + np.copysign(0.5, u).astype(np.float32)),
                            -127, 127)
        assert (by_div.astype(np.int8) != _unit_view(rq, g, gs)).any()
        assert (half_away.astype(np.int8) != _unit_view(rq, g, gs)).any()


def test_torch_in_torch_out():
    x = torch.randn(4, 64, dtype=torch.float16)
    x0 = x.clone()
    qt = I.quantize(x, "group", 32)
    assert all(isinstance(b, torch.Tensor) for b in qt.buffers.values())
    assert torch.equal(x, x0)
    d = I.dequantize(qt)
    assert isinstance(d, torch.Tensor) and d.dtype == torch.float16
    assert I.dequantize(qt, "float32").dtype == torch.float32
    assert I.dequantize(qt, torch.bfloat16).dtype == torch.bfloat16


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_int8_matmul_exact(data):
    n, m, k = (data.draw(st.integers(0, s)) for s in (5, 40, 80))
    a = data.draw(hnp.arrays(np.int8, (n, k)))
    b = data.draw(hnp.arrays(np.int8, (m, k)))
    out = I.int8_matmul(a, b)
    assert out.dtype == np.int32 and out.shape == (n, m)
    assert np.array_equal(out.astype(np.int64), R.matmul(a, b))


def test_int8_matmul_tiles_torch_and_extremes():
    rng = np.random.default_rng(2)
    a = rng.integers(-128, 128, (130, 333), dtype=np.int8)
    b = rng.integers(-128, 128, (37, 333), dtype=np.int8)
    out = I.int8_matmul(torch.from_numpy(a), torch.from_numpy(b))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int32
    assert np.array_equal(out.numpy().astype(np.int64), R.matmul(a, b))
    # The largest K allowed, every product at its maximum 2^14: 2^14 * 131071 < 2^31.
    k = I.MAX_MATMUL_K
    a = np.full((2, k), -128, np.int8)
    b = np.stack([np.full(k, -128, np.int8), np.full(k, 127, np.int8)])
    out = I.int8_matmul(a, b)
    assert out.tolist() == [[128 * 128 * k, -128 * 127 * k]] * 2
    with pytest.raises(ValueError, match="overflow"):
        I.int8_matmul(np.zeros((1, k + 1), np.int8), np.zeros((1, k + 1), np.int8))


def test_bad_input():
    x = np.ones((2, 64), np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[1, 3] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            I.quantize(y)
    with pytest.raises(TypeError):
        I.quantize(x.astype(np.int32))
    with pytest.raises(TypeError):
        I.quantize(x.tolist())
    with pytest.raises(ValueError, match="contiguous"):
        I.quantize(np.ones((64, 4), np.float32).T)
    with pytest.raises(ValueError, match="contiguous"):
        I.quantize(torch.ones(64, 4).T)
    with pytest.raises(ValueError, match="multiple"):
        I.quantize(x, "group", 48)
    with pytest.raises(ValueError):
        I.quantize(x, "group", 0)
    with pytest.raises(TypeError):
        I.quantize(x, "group", 32.0)
    with pytest.raises(ValueError, match="granularity"):
        I.quantize(x, "column")
    with pytest.raises(ValueError, match="scalar"):
        I.quantize(np.array(1.0, np.float32))
    a = np.zeros((2, 8), np.int8)
    with pytest.raises(ValueError, match="2-D"):
        I.int8_matmul(a.reshape(-1), a)
    with pytest.raises(ValueError, match="2-D"):
        I.int8_matmul(a, a.reshape(1, 2, 8))
    with pytest.raises(ValueError, match="K mismatch"):
        I.int8_matmul(a, np.zeros((2, 9), np.int8))
    with pytest.raises(TypeError):
        I.int8_matmul(a.astype(np.uint8), a)
    with pytest.raises(TypeError):
        I.int8_matmul(a.tolist(), a)
    with pytest.raises(ValueError, match="contiguous"):
        I.int8_matmul(np.zeros((8, 2), np.int8).T, a)
    with pytest.raises(ValueError, match="single element"):
        I.dequantize_tensor(a, np.ones((2, 1), np.float32))
    # the native adapters check on their own too
    with pytest.raises(ValueError):
        I._native.quantize(x, np.empty((2, 64), np.int8), np.empty((3,), np.float32), 64)
    with pytest.raises(TypeError):
        I._native.dequantize(a, np.ones(2, np.float64), np.empty((2, 8), np.float32), 8)


def test_expected_buffers_and_validation():
    assert I.expected_buffers((4, 64), {}) == {"q": ("int8", (4, 64)), "scale": ("float32", (4, 1))}
    assert I.expected_buffers((4, 64), {"granularity": "tensor"})["scale"] == ("float32", (1, 1))
    assert I.expected_buffers((2, 4, 64), {"granularity": "group", "group_size": 16})["scale"] == (
        "float32", (2, 4, 4))
    for bad in ({"granularity": "group", "group_size": 48}, {"granularity": "x"}, {"foo": 1},
                {"granularity": "group", "group_size": "16"}):
        with pytest.raises(ValueError):
            I.expected_buffers((4, 64), bad)
    with pytest.raises(ValueError):
        I.expected_buffers((), {})
    qt = I.quantize(np.ones((4, 64), np.float32))
    broken = QuantizedTensor("int8", qt.shape, qt.dtype, qt.params,
                             {"q": qt.buffers["q"], "scale": np.ones((4, 2), np.float32)})
    with pytest.raises(ValueError):
        I.dequantize(broken)


@pytest.mark.parametrize("g", ["tensor", "row", "group"])
def test_state_dict_round_trip(g):
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    qt = I.quantize(x, g, 32)
    buf = io.BytesIO()
    torch.save(qt.state_dict(), buf)
    buf.seek(0)
    qt2 = QuantizedTensor.from_state_dict(torch.load(buf, weights_only=True))
    assert qt2.format == "int8" and qt2.params == qt.params and qt2.dtype == "bfloat16"
    for k in qt.buffers:
        assert_bytes_equal(qt2.buffers[k], qt.buffers[k])
    assert torch.equal(qt2.dequantize(), qt.dequantize())
