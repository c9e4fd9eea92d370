"""int4 (asymmetric GPTQ-style and symmetric groups, nibble packing): native codec == numpy
reference, bit for bit; the round-trip bound; pack/unpack; the exact int4 x int4 GEMM; the
weight-only GEMM against float64; bad input.

Round-trip bound (per element of a group with stored scale s; eps = 2^-24):
  Asymmetric. The zero point z is an integer, so unless clamped the decode is
  (q - z) s = rint(fl(x / s)) s: |x - x'| <= s/2 + |x| eps <= s (1/2 + 16 eps), as |x| <= 15 s
  up to rounding. Clamping: the window [-z s, (15 - z) s] differs from [lo, hi] by at most
  |lo + z s| = s |z - (-lo / s)| <= s (1/2 + 15 eps) at the low end and, since 15 s = hi - lo
  up to 45 eps s (+ 15 * 2^-150 for a subnormal s), by s (1/2 + 60 eps) + 15 * 2^-150 at the
  high end; a clamped x lies between the window end and lo (or hi), so it moves by no more.
  Symmetric. Unclamped the same s (1/2 + 8 eps); the clamp to [-8, 7] acts only when |x / s|
  rounds beyond the range, which for a normal s needs |x| > 7 s (1 + 2 eps) - impossible
  beyond rounding noise - and for a subnormal s costs at most 7 * 2^-150 (|s - max|x|/7| <=
  2^-150).
  Both: |x - x'| <= s (1/2 + 2^-14) + 2^-140 for the exact decode; when s underflows to 0
  the decode is 0 and |x| < 15 * 2^-150 < 2^-140. The float32 decode adds one rounding
  (relative eps), or +-inf when the exact decode is beyond 2^128 - 2^103.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from strategies import float_inputs, assert_bytes_equal, to_dtype

import qformats.int4 as I
import qformats.int8 as I8
from qformats import QuantizedTensor
from qformats.int4 import reference as R

SETTINGS = settings(max_examples=150, deadline=None)
F32 = np.float32
F32_OVERFLOW = 2.0**128 - 2.0**103  # smallest exact value float32 rounds to inf


def _np(x):
    """numpy view of an array/tensor; bfloat16 tensors as their raw int16 bits."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


def ref_quantize(x32, gs, symmetric):
    if symmetric:
        qw, s = R.quantize_sym(x32, gs)
        return {"qweight": qw, "scales": s}
    qw, s, z = R.quantize_asym(x32, gs)
    return {"qweight": qw, "scales": s, "zeros": z}


def exact_decode(bufs, gs, shape):
    """(q - zero) * s or q * s in float64 (exact: a 5-bit integer times a float32)."""
    sym = "zeros" not in bufs
    q = R.unpack(_np(bufs["qweight"]), signed=sym).astype(np.float64).reshape(-1, gs)
    if not sym:
        q = q - _np(bufs["zeros"]).astype(np.float64).reshape(-1, 1)
    return (q * _np(bufs["scales"]).astype(np.float64).reshape(-1, 1)).reshape(shape)


def check_round_trip(x32, bufs, gs):
    """The documented bound (module docstring) on the exact decode, and where it overflows."""
    exact = exact_decode(bufs, gs, x32.shape)
    s = np.repeat(_np(bufs["scales"]).astype(np.float64).reshape(-1, 1), gs, axis=1).reshape(x32.shape)
    err = np.abs(x32.astype(np.float64) - exact)
    bound = s * (0.5 + 2.0**-14) + 2.0**-140
    assert (err <= bound).all(), (err - bound).max()
    return exact


@SETTINGS
@given(data=st.data())
def test_native_matches_reference(data):
    gs = data.draw(st.sampled_from([8, 16, 32, 64]), label="group_size")
    sym = data.draw(st.booleans(), label="symmetric")
    inp = data.draw(float_inputs(block=gs, max_blocks=4), label="x")
    before = _np(inp.x).copy()
    qt = I.quantize(inp.x, group_size=gs, symmetric=sym)
    assert_bytes_equal(_np(inp.x), before)  # input untouched
    ref = ref_quantize(inp.x32, gs, sym)
    assert sorted(qt.buffers) == sorted(ref)
    for k in ref:
        assert_bytes_equal(qt.buffers[k], ref[k])
        assert type(qt.buffers[k]) is type(inp.x)
    assert qt.params == {"group_size": gs, "symmetric": sym} and qt.dtype == inp.dtype
    d = qt.dequantize("float32")
    assert_bytes_equal(d, R.dequantize(ref["qweight"], ref["scales"], ref.get("zeros"), gs))
    exact = check_round_trip(inp.x32, ref, gs)
    assert (np.isfinite(_np(d)) | (np.abs(exact) >= F32_OVERFLOW)).all()
    if not sym:
        assert (_np(qt.buffers["zeros"]) <= 15).all()


def test_exact_ties_round_half_to_even():
    # Asymmetric, lo = 0, hi = 15: scale = 1, zero = 0, so x / scale lands on k + 1/2.
    x = np.array([[0.5, 1.5, 2.5, 3.5, 13.5, 14.5, 15.0, 0.0]], F32)
    qt = I.quantize(x, 8)
    assert_bytes_equal(qt.buffers["scales"], np.ones((1, 1), F32))
    assert qt.buffers["zeros"].tolist() == [[0]]
    expected = [round(float(v)) for v in x[0]]  # Python's round() is half to even
    assert I.unpack_int4(qt.buffers["qweight"]).tolist() == [expected] == [[0, 2, 2, 4, 14, 14, 15, 0]]
    # The zero point's own tie: lo = -7.5, hi = 7.5 -> scale 1, -lo / scale = 7.5 -> zero 8.
    x = np.array([[-7.5, 7.5, 0.5, -0.5, 1.5, -1.5, 6.5, -6.5]], F32)
    qt = I.quantize(x, 8)
    assert qt.buffers["zeros"].tolist() == [[8]]
    q = I.unpack_int4(qt.buffers["qweight"])[0].astype(int)
    assert q.tolist() == [0, 15, 8, 8, 10, 6, 14, 2]
    # -7.5 and 7.5 decode to -8 and 7: each half a step away (the window moved by s/2).
    assert I.dequantize(qt)[0].tolist() == [-8, 7, 0, 0, 2, -2, 6, -6]
    # Symmetric, absmax 7: scale = 1.
    x = np.array([[2.5, -3.5, 6.5, 7.0, -7.0, 0.5, -0.5, 1.5]], F32)
    qt = I.quantize(x, 8, symmetric=True)
    expected = [round(float(v)) for v in x[0]]
    assert I.unpack_int4(qt.buffers["qweight"], signed=True).tolist() == [expected] == [[2, -4, 6, 7, -7, 0, 0, 2]]
    for dt in ("float16", "bfloat16"):
        inp = to_dtype(x, dt)
        assert_bytes_equal(I.quantize(inp.x, 8, symmetric=True).buffers["qweight"], qt.buffers["qweight"])


def test_corner_cases():
    fmax = np.finfo(F32).max
    sub = np.float32(2.0**-149)  # smallest subnormal
    x = np.array([
        [0.0, -0.0, 0.0, -0.0, 0.0, 0.0, -0.0, 0.0],        # all zero: scale +0, zero 0, codes 0
        [5.0] * 8,                                          # constant positive
        [-5.0] * 8,                                         # constant negative
        [sub, -sub, 0.0, sub, 3 * sub, -45 * sub, 0.0, 0.0],  # subnormal scale
        [fmax, -fmax, 0.0, 1.0, -1.0, fmax, 0.0, 0.0],      # hi - lo overflows
        [fmax, 3e38, 0.0, 1.0, 2.0, 1e38, 0.0, 0.0],        # huge, one-sided
    ], F32)
    for sym in (False, True):
        qt = I.quantize(x, 8, symmetric=sym)
        ref = ref_quantize(x, 8, sym)
        for k in ref:
            assert_bytes_equal(qt.buffers[k], ref[k])
        s = qt.buffers["scales"][:, 0]
        assert s[0].view(np.uint32) == 0 and qt.buffers["qweight"][0].tolist() == [0] * 4
        assert np.isfinite(s).all() and (s > 0)[1:].all()
        d = I.dequantize(qt)
        assert_bytes_equal(d, R.dequantize(ref["qweight"], ref["scales"], ref.get("zeros"), 8))
        exact = check_round_trip(x, ref, 8)
        assert (np.isfinite(d) | (np.abs(exact) >= F32_OVERFLOW)).all()
        assert not np.isnan(d).any()
    # asymmetric specifics
    qt = I.quantize(x, 8)
    q = I.unpack_int4(qt.buffers["qweight"]).astype(int)
    z = qt.buffers["zeros"][:, 0].astype(int)
    assert z[0] == 0 and q[1].tolist() == [15] * 8 and z[2] == 15 and q[2].tolist() == [0] * 8
    # hi - lo = inf: scale falls back to hi/15 - lo/15 (finite), zero near the middle
    assert qt.buffers["scales"][4, 0] == F32(fmax) / F32(15) - F32(-fmax) / F32(15)
    assert z[4] in (7, 8)
    # symmetric: -45 ulp with scale fl(45/7 ulp) = 6 ulp is exactly -7.5 steps -> code -8,
    # the one way the symmetric quantizer reaches -8 (rounding of a subnormal scale)
    qs = I.quantize(x, 8, symmetric=True)
    assert qs.buffers["scales"][3, 0] == 6 * sub
    assert I.unpack_int4(qs.buffers["qweight"], signed=True)[3].tolist() == [0, 0, 0, 0, 0, -8, 0, 0]


@pytest.mark.parametrize("shape", [(0, 32), (3, 0), (0,), (64,), (2, 3, 32), (1, 1, 1, 64)])
@pytest.mark.parametrize("sym", [False, True])
def test_shapes_and_empty(shape, sym):
    x = np.random.default_rng(0).standard_normal(shape).astype(F32)
    qt = I.quantize(x, 32, symmetric=sym)
    ref = ref_quantize(x, 32, sym)
    for k in ref:
        assert_bytes_equal(qt.buffers[k], ref[k])
    assert I.expected_buffers(x.shape, qt.params) == {k: (str(v.dtype), v.shape) for k, v in ref.items()}
    assert_bytes_equal(qt.dequantize(), R.dequantize(ref["qweight"], ref["scales"], ref.get("zeros"), 32))


def test_large_threaded_paths():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 150_016)) * 3).astype(F32)
    for sym in (False, True):
        qt = I.quantize(x, 128, symmetric=sym)
        ref = ref_quantize(x, 128, sym)
        for k in ref:
            assert_bytes_equal(qt.buffers[k], ref[k])
        assert_bytes_equal(qt.dequantize(), R.dequantize(ref["qweight"], ref["scales"], ref.get("zeros"), 128))


def test_bulk_random_discriminates_rounding_variants():
    # Near-ties: x = fl((k + 1/2) * s) for the group's own scale s sits within a few ulps of
    # a rounding boundary (or on it), where the order of the float32 operations shows: the
    # data must tell the spec (true division x / s, half to even) from x * fl(1 / s) and from
    # round half away from zero, so a kernel with either slip fails here.
    rng = np.random.default_rng(4)
    n, gs = 512, 32
    lo = -rng.uniform(0.1, 10, (n, 1)).astype(F32)
    hi = rng.uniform(0.1, 10, (n, 1)).astype(F32)
    s = ((hi - lo) / F32(15)).astype(F32)
    z = np.rint(-lo / s)
    k = rng.integers(1, 13, (n, gs - 2)).astype(F32) - z + F32(0.5)
    xa = np.concatenate([lo, hi, (k * s).astype(F32)], axis=1).astype(F32)
    a = rng.uniform(0.1, 10, (n, 1)).astype(F32)
    k = rng.integers(-7, 6, (n, gs - 1)).astype(F32) + F32(0.5)
    xs = np.concatenate([a, (k * (a / F32(7))).astype(F32)], axis=1).astype(F32)
    for x, sym in ((xa, False), (xs, True)):
        qt = I.quantize(x, gs, symmetric=sym)
        ref = ref_quantize(x, gs, sym)
        for key in ref:
            assert_bytes_equal(qt.buffers[key], ref[key])
        q = R.unpack(ref["qweight"], signed=sym).astype(F32)
        sc = ref["scales"]
        zf = F32(0) if sym else ref["zeros"].astype(F32)
        lo_, hi_ = (-8, 7) if sym else (0, 15)
        with np.errstate(all="ignore"):
            by_recip = np.clip(np.rint(x * (F32(1) / sc)) + zf, lo_, hi_)
            half_away = np.clip(np.trunc(x / sc + np.copysign(F32(0.5), x)) + zf, lo_, hi_)
        assert (by_recip != q).any() and (half_away != q).any()


def test_torch_in_torch_out():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x0 = x.clone()
    for sym in (False, True):
        qt = I.quantize(x, 32, symmetric=sym)
        assert all(isinstance(b, torch.Tensor) for b in qt.buffers.values())
        assert torch.equal(x, x0)
        d = I.dequantize(qt)
        assert isinstance(d, torch.Tensor) and d.dtype == torch.bfloat16
        assert I.dequantize(qt, "float32").dtype == torch.float32
        ref = ref_quantize(x.float().numpy(), 32, sym)
        for k in ref:
            assert_bytes_equal(qt.buffers[k], ref[k])


# -- packing ---------------------------------------------------------------------------------

@SETTINGS
@given(data=st.data())
def test_pack_unpack_inverse(data):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6))
    shape = (*shape[:-1], 2 * shape[-1])
    signed = data.draw(st.booleans())
    lo, hi = (-8, 7) if signed else (0, 15)
    v = data.draw(hnp.arrays(np.int8 if signed else np.uint8, shape, elements=st.integers(lo, hi)))
    use_torch = data.draw(st.booleans())
    vv = torch.from_numpy(v) if use_torch else v
    p = I.pack_int4(vv)
    assert type(p) is type(vv)
    assert_bytes_equal(p, R.pack(v))
    assert_bytes_equal(I.unpack_int4(p, signed=signed), v)
    # and every byte is a valid packing: unpack then pack is the identity
    b = data.draw(hnp.arrays(np.uint8, (*shape[:-1], shape[-1] // 2)))
    assert_bytes_equal(I.pack_int4(I.unpack_int4(b, signed=signed)), b)
    assert_bytes_equal(I.unpack_int4(b, signed=signed), R.unpack(b, signed=signed))


def test_pack_layout_and_bad_input():
    assert I.pack_int4(np.array([1, 2, -8, 7, -1, 0], np.int8)).tolist() == [0x21, 0x78, 0x0F]
    assert I.pack_int4(np.array([15, 0], np.uint8)).tolist() == [0x0F]
    assert I.unpack_int4(np.array([0x8F], np.uint8), signed=True).tolist() == [-1, -8]
    with pytest.raises(ValueError, match="must lie in"):
        I.pack_int4(np.array([8, 0], np.int8))
    with pytest.raises(ValueError, match="must lie in"):
        I.pack_int4(np.array([16, 0], np.uint8))
    with pytest.raises(ValueError, match="even"):
        I.pack_int4(np.zeros(3, np.uint8))
    with pytest.raises(TypeError):
        I.pack_int4(np.zeros(4, np.int16))
    with pytest.raises(TypeError):
        I.pack_int4([1, 2])
    with pytest.raises(ValueError, match="contiguous"):
        I.pack_int4(np.zeros((4, 2), np.uint8).T)
    with pytest.raises(TypeError):
        I.unpack_int4(np.zeros(4, np.int8))
    with pytest.raises(TypeError):
        I.unpack_int4(np.zeros(4, np.uint8), signed=1)


# -- int4 x int4 -----------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_int4_matmul_exact(data):
    n, m, kb = (data.draw(st.integers(0, s)) for s in (5, 40, 50))
    a = data.draw(hnp.arrays(np.uint8, (n, kb)))
    b = data.draw(hnp.arrays(np.uint8, (m, kb)))
    out = I.int4_matmul(a, b)
    assert out.dtype == np.int32 and out.shape == (n, m)
    assert np.array_equal(out.astype(np.int64), R.matmul(a, b))


def test_int4_matmul_tiles_torch_and_quantized():
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (130, 160), dtype=np.uint8)
    b = rng.integers(0, 256, (37, 160), dtype=np.uint8)
    out = I.int4_matmul(torch.from_numpy(a), torch.from_numpy(b))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int32
    assert np.array_equal(out.numpy().astype(np.int64), R.matmul(a, b))
    # every product at its maximum (-8 * -8), K = 4096
    full = np.full((2, 2048), 0x88, np.uint8)
    assert I.int4_matmul(full, full).tolist() == [[64 * 4096] * 2] * 2
    # symmetric quantized operands: per-group integer sums times scales == float GEMM of
    # the decoded values (one group spanning K keeps it a single scale product)
    xa = rng.standard_normal((3, 64)).astype(F32)
    xb = rng.standard_normal((5, 64)).astype(F32)
    qa, qb = I.quantize(xa, 64, symmetric=True), I.quantize(xb, 64, symmetric=True)
    ints = I.int4_matmul(qa.buffers["qweight"], qb.buffers["qweight"]).astype(np.float64)
    scaled = ints * qa.buffers["scales"].astype(np.float64) * qb.buffers["scales"].astype(np.float64).T
    assert np.allclose(scaled, R.gemm(qa.dequantize(), qb.dequantize()), rtol=1e-6, atol=1e-6)
    kb = (I.MAX_MATMUL_K + 1) // 2 + 1  # K = 2 * kb > MAX_MATMUL_K
    with pytest.raises(ValueError, match="overflow"):
        I.int4_matmul(np.zeros((1, kb), np.uint8), np.zeros((1, kb), np.uint8))
    z = np.zeros((2, 8), np.uint8)
    with pytest.raises(ValueError, match="2-D"):
        I.int4_matmul(z.reshape(-1), z)
    with pytest.raises(ValueError, match="K mismatch"):
        I.int4_matmul(z, np.zeros((2, 9), np.uint8))
    with pytest.raises(TypeError):
        I.int4_matmul(z.astype(np.int8), z)
    with pytest.raises(TypeError):
        I.int4_matmul(z.tolist(), z)
    with pytest.raises(ValueError, match="contiguous"):
        I.int4_matmul(np.zeros((8, 2), np.uint8).T, z)


# -- weight-only GEMM ------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 6), m=st.integers(0, 40), groups=st.integers(0, 4), gs=st.sampled_from([8, 32, 64]),
       sym=st.booleans(), seed=st.integers(0, 2**32 - 1), xdtype=st.sampled_from(["float32", "float16", "bfloat16"]))
def test_weight_only_gemm(n, m, groups, gs, sym, seed, xdtype):
    k = groups * gs
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10)).astype(F32)
    x = to_dtype(rng.standard_normal((n, k)).astype(F32), xdtype)
    qt = I.quantize(w, gs, symmetric=sym)
    ref = ref_quantize(w, gs, sym)
    w_deq = R.dequantize(ref["qweight"], ref["scales"], ref.get("zeros"), gs)
    y = I.gemm(x.x, qt)
    assert type(y) is type(x.x) and tuple(y.shape) == (n, m) and I.A.dtype_name(y) == "float32"
    yr = R.gemm(x.x32, w_deq)
    y = _np(y).astype(np.float64)
    den = np.linalg.norm(yr)
    if den == 0:
        assert (y == 0).all()
    else:
        assert np.linalg.norm(y - yr) / den <= 1e-5


def test_weight_only_gemm_threads_and_torch_weights():
    rng = np.random.default_rng(5)
    w = torch.from_numpy(rng.standard_normal((70, 256)).astype(F32))
    x = rng.standard_normal((9, 256)).astype(F32)
    for sym in (False, True):
        qt = I.quantize(w, 128, symmetric=sym)  # torch buffers, numpy activations
        y = I.gemm(x, qt)
        assert isinstance(y, np.ndarray)
        yr = R.gemm(x, I.dequantize(qt).numpy())
        assert np.linalg.norm(y - yr) / np.linalg.norm(yr) <= 1e-5
    qt = I.quantize(w.numpy(), 128)
    with pytest.raises(ValueError, match="2-D"):
        I.gemm(x[0], qt)
    with pytest.raises(ValueError, match="K mismatch"):
        I.gemm(x[:, :128].copy(), qt)
    with pytest.raises(ValueError, match="2-D"):
        I.gemm(x, I.quantize(w.numpy().reshape(2, 35, 256), 128))
    with pytest.raises(TypeError):
        I.gemm(x, w)
    with pytest.raises(ValueError, match="int4"):
        I.gemm(x, I8.quantize(w.numpy()))
    with pytest.raises(TypeError):
        I.gemm(x.astype(np.int32), qt)
    with pytest.raises(ValueError, match="NaN or Inf"):
        I.gemm(np.full((2, 256), np.nan, F32), qt)


# -- errors, metadata, serialization ---------------------------------------------------------

def test_bad_input():
    x = np.ones((2, 64), F32)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[0, 5] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            I.quantize(y, 32)
    with pytest.raises(TypeError):
        I.quantize(x.astype(np.int8), 32)
    with pytest.raises(TypeError):
        I.quantize(x.tolist(), 32)
    with pytest.raises(ValueError, match="contiguous"):
        I.quantize(np.ones((64, 4), F32).T, 32)
    with pytest.raises(ValueError, match="contiguous"):
        I.quantize(torch.ones(64, 4).T, 32)
    with pytest.raises(ValueError, match="multiple"):
        I.quantize(x)  # K = 64 < default group_size 128
    with pytest.raises(ValueError, match="multiple"):
        I.quantize(np.ones((2, 96), F32), 64)
    for gs in (0, 12, -8):
        with pytest.raises(ValueError):
            I.quantize(x, gs)
    with pytest.raises(TypeError):
        I.quantize(x, 32.0)
    with pytest.raises(TypeError):
        I.quantize(x, 32, symmetric=1)
    with pytest.raises(ValueError, match="scalar"):
        I.quantize(np.array(1.0, F32), 8)
    # the native adapters check on their own too
    with pytest.raises(ValueError):
        I._native.quantize(x, np.empty(64, np.uint8), np.empty(2, F32), None, 12)
    with pytest.raises(ValueError):
        I._native.dequantize(np.empty(64, np.uint8), np.empty(3, F32), None, np.empty(128, F32), 64)


def test_expected_buffers_and_validation():
    assert I.expected_buffers((4, 256), {}) == {
        "qweight": ("uint8", (4, 128)), "scales": ("float32", (4, 2)), "zeros": ("uint8", (4, 2))}
    assert I.expected_buffers((2, 3, 64), {"group_size": 32, "symmetric": True}) == {
        "qweight": ("uint8", (2, 3, 32)), "scales": ("float32", (2, 3, 2))}
    for bad in ({"group_size": 12}, {"group_size": 0}, {"symmetric": "yes"}, {"foo": 1}, {"group_size": 64}):
        with pytest.raises(ValueError):
            I.expected_buffers((4, 96), bad)
    with pytest.raises(ValueError):
        I.expected_buffers((), {})
    qt = I.quantize(np.ones((4, 64), F32), 32)
    broken = QuantizedTensor("int4", qt.shape, qt.dtype, qt.params,
                             {"qweight": qt.buffers["qweight"], "scales": qt.buffers["scales"]})
    with pytest.raises(ValueError):
        I.dequantize(broken)  # asymmetric without zeros


@pytest.mark.parametrize("sym", [False, True])
def test_state_dict_round_trip(sym):
    x = torch.randn(6, 64, dtype=torch.float16)
    qt = I.quantize(x, 32, symmetric=sym)
    buf = io.BytesIO()
    torch.save(qt.state_dict(), buf)
    buf.seek(0)
    qt2 = QuantizedTensor.from_state_dict(torch.load(buf, weights_only=True))
    assert qt2.format == "int4" and qt2.params == qt.params and qt2.dtype == "float16"
    assert sorted(qt2.buffers) == sorted(qt.buffers)
    for k in qt.buffers:
        assert_bytes_equal(qt2.buffers[k], qt.buffers[k])
    assert torch.equal(qt2.dequantize(), qt.dequantize())


# -- the "tiles" layout ------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(tiles=st.integers(1, 3), groups=st.integers(1, 4), gs=st.sampled_from([8, 32, 128, 256]),
       sym=st.booleans(), seed=st.integers(0, 2**32 - 1), torch_in=st.booleans())
def test_tiles_layout_is_the_reference_permutation(tiles, groups, gs, sym, seed, torch_in):
    """quantize(layout="tiles") stores exactly the reference's permutation (reference.to_tiles, the
    spec's index formula) of the rows layout's bytes; relayout and reference.from_tiles undo it
    byte for byte; dequantize decodes to the same bits in row order."""
    m, k = 16 * tiles, gs * groups
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(F32)
    x = torch.from_numpy(x) if torch_in else x
    rows = I.quantize(x, gs, sym)
    t = I.quantize(x, gs, sym, layout="tiles")
    assert t.params == {"group_size": gs, "symmetric": sym, "layout": "tiles"}
    ref = R.to_tiles(_np(rows.buffers["qweight"]), _np(rows.buffers["scales"]),
                     None if sym else _np(rows.buffers["zeros"]), gs)
    for name, want in zip(("qweight", "scales", "zeros"), ref):
        if want is not None:
            assert type(t.buffers[name]) is type(x)
            assert tuple(t.buffers[name].shape) == want.shape == I.expected_buffers((m, k), t.params)[name][1]
            assert_bytes_equal(t.buffers[name], want)
    back = I.relayout(t, "rows")
    for name, want in zip(("qweight", "scales", "zeros"), R.from_tiles(*ref, gs)):
        if want is not None:
            assert_bytes_equal(back.buffers[name], want)
            assert_bytes_equal(back.buffers[name], rows.buffers[name])
    assert back.params == rows.params
    assert_bytes_equal(I.dequantize(t), I.dequantize(rows))
    assert_bytes_equal(I.relayout(rows, "tiles").buffers["qweight"], t.buffers["qweight"])
    assert I.relayout(t, "tiles") is t


def test_tiles_index_formula():
    """The first groups of a 32 x 3-group weight, by hand: row m's group c is stored group
    ((m // 16) * 3 + c) * 16 + m % 16."""
    assert R.tiles_group(0, 0, 3) == 0 and R.tiles_group(1, 0, 3) == 1 and R.tiles_group(15, 0, 3) == 15
    assert R.tiles_group(0, 1, 3) == 16 and R.tiles_group(0, 2, 3) == 32 and R.tiles_group(16, 0, 3) == 48
    x = np.arange(32 * 24, dtype=F32).reshape(32, 24) / 64  # group sizes 8: distinct groups
    t = I.quantize(x, 8, layout="tiles")
    rows = I.quantize(x, 8)
    flat_t, flat_r = t.buffers["qweight"].reshape(-1, 4), rows.buffers["qweight"].reshape(-1, 4)
    assert np.array_equal(flat_t[16 + 5], flat_r[5 * 3 + 1])    # row 5, group 1
    assert np.array_equal(flat_t[48 + 2], flat_r[18 * 3 + 0])   # row 18, group 0
    assert t.buffers["scales"].reshape(-1)[32 + 7] == rows.buffers["scales"][7, 2]


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("gs", [32, 128])
def test_tiles_gemm_and_linear(sym, n, gs):
    """The CPU product of a tiles weight: the exact values of dequantize times x (float64
    yardstick, float32 tolerance), through gemm and the bound kernel; above 4 rows, where both
    layouts take the tile decoder, bit for bit the rows layout's product."""
    from qformats import format_spec

    rng = np.random.default_rng(n + gs)
    w = rng.standard_normal((48, 4 * gs)).astype(F32)
    t = I.quantize(w, gs, sym, layout="tiles")
    x = rng.standard_normal((n, 4 * gs)).astype(F32)
    want = R.gemm(x, I.dequantize(t))
    got = I.gemm(x, t)
    assert got.dtype == F32 and got.shape == (n, 48)
    if n > 4:
        assert np.array_equal(got, I.gemm(x, I.quantize(w, gs, sym)))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(x).sum(1).max() * np.abs(_np(I.dequantize(t))).max()
    tt = I.quantize(torch.from_numpy(w), gs, sym, layout="tiles")
    run = format_spec("int4").make_linear(tt).run
    out = torch.full((n, 48), float("nan"))
    run(torch.from_numpy(x), out, None, 0)
    assert np.array_equal(out.numpy(), got)
    dense = torch.empty(48, 4 * gs)
    run.dequantize(dense)
    assert_bytes_equal(dense, I.dequantize(tt))


def test_tiles_bad_input_and_state_dict():
    x = np.ones((32, 64), F32)
    with pytest.raises(ValueError, match="layout"):
        I.quantize(x, 32, layout="columns")
    for shape in [(24, 64), (64,), (2, 16, 64)]:
        with pytest.raises(ValueError, match="M % 16"):
            I.quantize(np.ones(shape, F32), 32, layout="tiles")
        with pytest.raises(ValueError):
            I.expected_buffers(shape, {"group_size": 32, "layout": "tiles"})
    with pytest.raises(ValueError, match="M % 16"):
        I.relayout(I.quantize(np.ones((24, 64), F32), 32), "tiles")
    with pytest.raises(ValueError):  # a rows-shaped buffer under tiles params
        rows = I.quantize(x, 32)
        I.dequantize(QuantizedTensor("int4", rows.shape, rows.dtype, {**rows.params, "layout": "tiles"},
                                     rows.buffers))
    with pytest.raises(ValueError, match="tiles"):  # the native check
        I._native.dequantize(np.empty(768, np.uint8), np.empty(48, F32), None, np.empty((24, 64), F32), 32,
                             tiles_K=64)
    qt = I.quantize(torch.randn(32, 64, dtype=torch.float16), 32, layout="tiles")
    buf = io.BytesIO()
    torch.save(qt.state_dict(), buf)
    buf.seek(0)
    qt2 = QuantizedTensor.from_state_dict(torch.load(buf, weights_only=True))
    assert qt2.params == qt.params
    for k in qt.buffers:
        assert_bytes_equal(qt2.buffers[k], qt.buffers[k])
    assert torch.equal(qt2.dequantize(), qt.dequantize())
