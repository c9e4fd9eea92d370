"""mixed2bit: native codec == numpy reference byte for byte; 4-bit group count and selection
order; outliers; round-trip bound; pack_2bit/unpack_2bit; GEMM; bad input; serialization."""
import io
import math

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from qformats import QuantizedTensor, mixed2bit as M
from qformats.mixed2bit import reference as R
from strategies import assert_bytes_equal, float_inputs, to_dtype

SETTINGS = settings(max_examples=100, deadline=None)
EPS32 = 2.0 ** -23
SENS_VALUES = [0.0, -0.0, 1e-40, 1e-3, 0.5, 1.0, 3.0, 1e10, 3e38]


@st.composite
def cases(draw, dtypes=("float32", "float16", "bfloat16")):
    """(input, params dict, sensitivity float32 [K] or None)."""
    gs = draw(st.sampled_from([16, 32]))
    # Non-empty here (empty shapes: test_empty_inputs); up to 6 x 5 = 30 groups.
    inp = draw(float_inputs(block=gs, min_rows=1, max_rows=6, min_blocks=1, max_blocks=5, dtypes=dtypes))
    K = inp.x32.shape[1]
    params = {
        "group_size": gs,
        "ratio_4bit": draw(st.sampled_from([0.0, 0.1, 1.0]) | st.floats(0, 1)),
        "outlier_ratio": draw(st.sampled_from([0.0, 0.0, 0.05, 0.3, 1.0])),
        "scale_block": draw(st.sampled_from([1, 2, 3, 16])),
    }
    sens = None
    if draw(st.booleans()):
        sens = draw(hnp.arrays(np.float32, (K,), elements=st.sampled_from(SENS_VALUES)
                               | st.floats(0, 100, width=32)))
    return inp, params, sens


def _np(x):
    """numpy view of a numpy array / torch tensor (bfloat16 tensors as exact float32)."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu()
        return (x.float() if str(x.dtype) == "torch.bfloat16" else x).numpy()
    return np.asarray(x)


def _check_against_reference(inp, params, sens):
    before = np.copy(inp.x32)
    sens_before = None if sens is None else np.copy(sens)
    try:
        ref = R.quantize(inp.x32, sensitivity=sens, **params)
    except ValueError as e:
        assert "too large" in str(e)
        event("too large for fp16: both raise")
        with pytest.raises(ValueError, match="too large"):
            M.quantize(inp.x, sensitivity=sens, **params)
        return None
    qt = M.quantize(inp.x, sensitivity=sens, **params)
    event("quantized" + (" (empty)" if inp.x32.size == 0 else ""))
    for name in M.BUFFER_NAMES:
        assert_bytes_equal(qt.buffers[name], ref[name])
    rows, K = inp.x32.shape
    assert qt.params["n4"] == R.n4_count(params["ratio_4bit"], rows * (K // params["group_size"]))
    got = qt.dequantize("float32")
    want = R.dequantize(ref, rows, K, params["group_size"], params["scale_block"])
    assert_bytes_equal(got, want)
    # inputs untouched
    np.testing.assert_array_equal(_np(inp.x).astype(np.float32), before)
    if sens is not None:
        np.testing.assert_array_equal(sens, sens_before)
    return qt, ref


@SETTINGS
@given(cases())
def test_quantize_matches_reference(case):
    # Any finite input: byte-equal buffers and decode, or both raise "too large".
    _check_against_reference(*case)


@SETTINGS
@given(cases(dtypes=("float16",)))
def test_fp16_inputs_never_too_large(case):
    # |w| <= 65504: every second-order field and outlier fits fp16, so nothing may raise.
    assert _check_against_reference(*case) is not None


@SETTINGS
@given(cases())
def test_selection_count_order_and_outliers(case):
    inp, params, sens = case
    try:
        a = R.analyze(inp.x32, sensitivity=sens, **params)
    except ValueError:
        return
    try:
        qt = M.quantize(inp.x, sensitivity=sens, **params)
    except ValueError:
        return  # too large (checked in the test above)
    rows, K = inp.x32.shape
    gs = params["group_size"]
    n_groups = rows * (K // gs)
    is4 = np.unpackbits(_np(qt.buffers["group_map"]), bitorder="little")
    assert not is4[n_groups:].any()  # padding bits 0
    is4 = is4[:n_groups].astype(bool)
    n4 = int(math.floor(params["ratio_4bit"] * n_groups + 0.5))
    assert is4.sum() == n4 == qt.params["n4"] == qt.buffers["codes4"].shape[0]
    # (-score, id) order: every 4-bit group beats every 2-bit group.
    s = a.scores
    if 0 < n4 < n_groups:
        ids = np.arange(n_groups)
        worst4 = min(zip(s[is4], -ids[is4]))   # the last 4-bit group in (-score, id) order
        best2 = max(zip(s[~is4], -ids[~is4]))  # the first 2-bit group
        assert worst4 > best2
    # Outliers: in 2-bit groups, sorted, the n_out largest |w| (ties to the smaller index).
    oidx = _np(qt.buffers["outlier_idx"]).astype(np.int64)
    n_out = R.n_out_count(params["outlier_ratio"], n_groups - n4, gs)
    assert oidx.shape == (n_out,) and (np.diff(oidx) > 0).all()
    assert (~is4[oidx // gs]).all()
    if 0 < n_out < (n_groups - n4) * gs:
        flat = np.abs(inp.x32.reshape(-1))
        cand = np.flatnonzero(np.repeat(~is4, gs))
        rest = np.setdiff1d(cand, oidx)
        assert min(zip(flat[oidx], -oidx)) > max(zip(flat[rest], -rest))
    assert_bytes_equal(qt.buffers["outlier_val"], inp.x32.reshape(-1)[oidx].astype(np.float16))


def test_tied_scores_go_to_smaller_group_ids():
    # Every group has the same range (and the same sensitivity score): the first n4 win.
    g = np.array([-1.0, 2.0] + [0.5] * 14, np.float32)
    w = np.tile(g, (6, 4))  # 6 rows x 4 groups = 24 groups
    for sens in (None, np.ones(64, np.float32)):
        qt = M.quantize(w, ratio_4bit=0.25, sensitivity=sens)  # n4 = 6
        is4 = np.unpackbits(qt.buffers["group_map"], bitorder="little")[:24]
        np.testing.assert_array_equal(is4, [1] * 6 + [0] * 18)
        for name, b in R.quantize(w, ratio_4bit=0.25, sensitivity=sens).items():
            assert_bytes_equal(qt.buffers[name], b)


def test_partial_ties_and_outlier_ties():
    # Ranges 1 or 2 in a fixed pattern; equal |w| (+-3) for the outliers: ties by index.
    rng = np.random.default_rng(7)
    w = np.zeros((5, 64), np.float32)
    pattern = rng.integers(1, 3, size=(5, 4)).astype(np.float32)
    for r in range(5):
        for c in range(4):
            w[r, c * 16] = pattern[r, c]
            w[r, c * 16 + 3] = rng.choice([3.0, -3.0]) * (pattern[r, c] == 1)
    for ratio in (0.1, 0.3, 0.5):
        for orat in (0.0, 0.01, 0.02):
            qt = M.quantize(w, ratio_4bit=ratio, outlier_ratio=orat)
            ref = R.quantize(w, ratio_4bit=ratio, outlier_ratio=orat)
            for name in M.BUFFER_NAMES:
                assert_bytes_equal(qt.buffers[name], ref[name])
            is4 = np.unpackbits(qt.buffers["group_map"], bitorder="little")[:20].astype(bool)
            scores = R.group_scores(w, 16)
            assert len(set(scores.tolist())) < 20  # there are ties
            order = sorted(range(20), key=lambda i: (-scores[i], i))
            assert set(np.flatnonzero(is4)) == set(order[: qt.params["n4"]])


def test_negative_zero_does_not_change_bytes():
    w = np.zeros((2, 32), np.float32)
    w[0, ::3] = -0.0
    w[1, 5] = -0.0
    w[1, 7] = -1.0
    qt = M.quantize(w, ratio_4bit=0.5)
    qt2 = M.quantize(w + np.float32(0), ratio_4bit=0.5)  # the same values, +0 only
    for name in M.BUFFER_NAMES:
        assert_bytes_equal(qt.buffers[name], qt2.buffers[name])
        assert_bytes_equal(qt.buffers[name], R.quantize(w, ratio_4bit=0.5)[name])
    assert not (qt.buffers["so2"].view(np.uint16) & 0x8000).any()  # never fp16 -0


def test_outlier_groups_emptied():
    # outlier_ratio=1: every element of a 2-bit group is an outlier; lo = hi = 0 there.
    w = np.random.default_rng(3).standard_normal((3, 32)).astype(np.float32)
    qt = M.quantize(w, ratio_4bit=0.5, outlier_ratio=1.0)
    ref = R.quantize(w, ratio_4bit=0.5, outlier_ratio=1.0)
    for name in M.BUFFER_NAMES:
        assert_bytes_equal(qt.buffers[name], ref[name])
    assert qt.params["n_out"] == 3 * 16
    y = M.dequantize(qt)
    is4 = np.unpackbits(qt.buffers["group_map"], bitorder="little")[:6].astype(bool)
    w2 = w.reshape(6, 16)[~is4]
    np.testing.assert_array_equal(y.reshape(6, 16)[~is4], w2.astype(np.float16).astype(np.float32))
    assert (qt.buffers["so2"] == 0).all()


@SETTINGS
@given(cases(dtypes=("float32", "float16")))
def test_round_trip_bound_and_nearest_code(case):
    """Per element (not an outlier) with first-order scale, m, decoded s_eff, m_eff, qmax:
    x lies in [-m, -m + qmax * scale] and the grid {q * s_eff - m_eff} spans
    [-m_eff, qmax * s_eff - m_eff], so the nearest grid point is within
    max(s_eff / 2, |m - m_eff| + qmax * |scale - s_eff|); plus float32 rounding of the code
    division and of the decode (a few ulps of the magnitudes involved)."""
    inp, params, sens = case
    try:
        a = R.analyze(inp.x32, sensitivity=sens, **params)
        qt = M.quantize(inp.x, sensitivity=sens, **params)
    except ValueError:
        return
    rows, K = inp.x32.shape
    gs, sb = params["group_size"], params["scale_block"]
    n_groups = rows * (K // gs)
    bufs = {k: _np(v) for k, v in qt.buffers.items()}
    is4, s_eff, m_eff = R.effective_params(bufs, rows, K, gs, sb)
    x = inp.x32.astype(np.float64).reshape(n_groups, gs)
    y = _np(qt.dequantize("float32")).astype(np.float64).reshape(n_groups, gs)
    qmax = np.where(is4, 15.0, 3.0)[:, None]
    se, me = s_eff.astype(np.float64)[:, None], m_eff.astype(np.float64)[:, None]
    sc, mm = a.scale.astype(np.float64)[:, None], a.m.astype(np.float64)[:, None]
    keep = np.ones(x.size, bool)
    keep[a.outlier_idx] = False
    keep = keep.reshape(x.shape)
    err = np.abs(x - y)
    mag = np.abs(x) + mm + me + qmax * (sc + se)
    slack = 8 * EPS32 * mag + 1e-44
    bound = np.maximum(se / 2, np.abs(mm - me) + qmax * np.abs(sc - se)) + slack
    assert (err[keep] <= bound[keep]).all()
    # The code is the nearest point of the decoded grid (up to the same rounding).
    grid = np.arange(16, dtype=np.float64)[None, None, :]
    pts = np.where(grid <= qmax[..., None], (grid * se[..., None]).astype(np.float32).astype(np.float64)
                   - me[..., None], np.inf)
    best = np.min(np.abs(x[..., None] - pts), axis=-1)
    assert (err[keep] <= best[keep] + 4 * EPS32 * mag[keep] + 1e-44).all()
    # Outliers decode to their fp16 value.
    np.testing.assert_array_equal(y.reshape(-1)[a.outlier_idx],
                                  inp.x32.reshape(-1)[a.outlier_idx].astype(np.float16).astype(np.float64))


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 4), st.sampled_from([0.0, 0.1, 0.5, 1.0]),
       st.sampled_from([0.0, 0.02]), st.booleans(), st.integers(0, 2**32 - 1))
def test_gemm_matches_float64_reference(m, n, kb, ratio, orat, use_sens, seed):
    rng = np.random.default_rng(seed)
    K = 16 * kb
    w = rng.standard_normal((m, K)).astype(np.float32)
    x = rng.standard_normal((n, K)).astype(np.float32)
    sens = rng.random(K).astype(np.float32) if use_sens else None
    qt = M.quantize(w, ratio_4bit=ratio, outlier_ratio=orat, sensitivity=sens)
    got = M.gemm(x, qt)
    wd = R.dequantize(R.quantize(w, ratio_4bit=ratio, outlier_ratio=orat, sensitivity=sens), m, K, 16, 16)
    ref = x.astype(np.float64) @ wd.astype(np.float64).T
    assert got.shape == (n, m) and got.dtype == np.float32
    # Relative Frobenius error <= 1e-5, measured against |X| . |W'|^T: a single short dot
    # product can cancel to far below its terms, and float32 summation error scales with the
    # terms (per element it is below K * 2^-24 * sum |x w|). test_gemm_large_threaded_and_torch
    # checks the plain ||Y - Y_ref|| / ||Y_ref|| on a full-size product.
    scale = np.abs(x).astype(np.float64) @ np.abs(wd).astype(np.float64).T
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(scale) + 1e-30
    assert (np.abs(got - ref) <= K * 2.0 ** -24 * scale * 1.01 + 1e-37).all()


def test_gemm_large_threaded_and_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    w = rng.standard_normal((300, 256)).astype(np.float32)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    qt = M.quantize(w, outlier_ratio=0.01)
    ref = x.astype(np.float64) @ M.dequantize(qt).astype(np.float64).T
    got = M.gemm(x, qt)
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref)
    got_t = M.gemm(torch.from_numpy(x).to(torch.bfloat16), qt)  # converted to float32 first
    assert isinstance(got_t, torch.Tensor) and got_t.dtype == torch.float32
    x_bf = torch.from_numpy(x).to(torch.bfloat16).float().numpy().astype(np.float64)
    ref_bf = x_bf @ M.dequantize(qt).astype(np.float64).T
    assert np.linalg.norm(got_t.numpy() - ref_bf) <= 1e-5 * np.linalg.norm(ref_bf)


# -- pack_2bit / unpack_2bit -------------------------------------------------------------------

@SETTINGS
@given(hnp.array_shapes(min_dims=1, max_dims=3, max_side=4).map(lambda s: (*s[:-1], 16 * s[-1])),
       st.sampled_from([np.uint8, np.int8, np.int32, np.int64, np.uint16]), st.data())
def test_pack_unpack_inverse(shape, dtype, data):
    v = data.draw(hnp.arrays(dtype, shape, elements=st.integers(0, 3)))
    before = v.copy()
    p = M.pack_2bit(v)
    assert p.dtype == np.int32 and p.shape == (*shape[:-1], shape[-1] // 16)
    assert_bytes_equal(p, R.pack_2bit(v))
    u = M.unpack_2bit(p, v.size)
    assert u.dtype == np.uint8 and u.shape == (v.size,)
    np.testing.assert_array_equal(u, v.reshape(-1))
    np.testing.assert_array_equal(v, before)
    k = data.draw(st.integers(0, v.size))
    np.testing.assert_array_equal(M.unpack_2bit(p, k), v.reshape(-1)[:k])
    np.testing.assert_array_equal(R.unpack_2bit(p, k), v.reshape(-1)[:k])


def test_pack_2bit_bit_positions():
    for i in range(16):
        for val in (1, 2, 3):
            v = np.zeros(16, np.uint8)
            v[i] = val
            assert M.pack_2bit(v).view(np.uint32)[0] == val << (2 * i)
    assert M.pack_2bit(np.full(16, 3, np.uint8))[0] == -1
    assert M.unpack_2bit(np.array([0b11100100], np.int32), 4).tolist() == [0, 1, 2, 3]


def test_pack_2bit_torch():
    torch = pytest.importorskip("torch")
    v = torch.tensor([[0, 1, 2, 3] * 8], dtype=torch.int64)
    p = M.pack_2bit(v)
    assert isinstance(p, torch.Tensor) and p.dtype == torch.int32 and tuple(p.shape) == (1, 2)
    u = M.unpack_2bit(p, 32)
    assert isinstance(u, torch.Tensor) and u.dtype == torch.uint8
    assert u.tolist() == v.reshape(-1).tolist()


@pytest.mark.parametrize("bad, exc, match", [
    (np.full(16, 4, np.uint8), ValueError, "0..3"),
    (np.full(16, -1, np.int32), ValueError, "0..3"),
    (np.zeros(15, np.uint8), ValueError, "multiple of 16"),
    (np.zeros(16, np.float32), TypeError, "integer"),
    (np.zeros(16, bool), TypeError, "integer"),
    ([0] * 16, TypeError, "numpy array"),
    (np.zeros((4, 32), np.uint8)[:, ::2], ValueError, "contiguous"),
    (np.uint8(1), TypeError, "numpy array"),
])
def test_pack_2bit_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        M.pack_2bit(bad)


def test_unpack_2bit_bad_input():
    with pytest.raises(ValueError, match="exceeds"):
        M.unpack_2bit(np.zeros(2, np.int32), 33)
    with pytest.raises(ValueError):
        M.unpack_2bit(np.zeros(2, np.int32), -1)
    with pytest.raises(TypeError, match="int32"):
        M.unpack_2bit(np.zeros(2, np.uint32), 4)
    with pytest.raises(TypeError):
        M.unpack_2bit(np.zeros(2, np.int32), 4.0)


# -- sizes, params, errors ---------------------------------------------------------------------

def test_avg_bits_at_defaults():
    w = np.random.default_rng(0).standard_normal((384, 384)).astype(np.float32)
    qt = M.quantize(w)
    nbytes = (1152 + 8294 * 4 + 922 * 2 * 4 + 8294 + 922 * 2 + 519 * 2 * 2 + 58 * 2 * 2)
    assert qt.params["n4"] == 922 and qt.nbytes == nbytes
    assert abs(qt.avg_bits - 2.9378) < 1e-4
    q0 = M.quantize(w, ratio_4bit=0)
    assert q0.params["n4"] == 0 and q0.buffers["codes4"].shape == (0, 2)
    assert M.nmse(w, qt) < M.nmse(w, q0)
    assert M.quantize(w, outlier_ratio=0.001).params["n_out"] == math.floor(0.001 * 8294 * 16 + 0.5)


def test_empty_inputs():
    for shape in ((0, 32), (3, 0), (0, 0)):
        w = np.zeros(shape, np.float32)
        qt = M.quantize(w, outlier_ratio=0.5)
        assert qt.nbytes == 0 and qt.avg_bits == 0.0
        for name, b in R.quantize(w, outlier_ratio=0.5).items():
            assert_bytes_equal(qt.buffers[name], b)
        assert M.dequantize(qt).shape == shape
        assert M.gemm(np.zeros((2, shape[1]), np.float32), qt).shape == (2, shape[0])


def test_numpy_torch_io_and_state_dict():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    sens = rng.random(64).astype(np.float32)
    qn = M.quantize(w, sensitivity=sens, outlier_ratio=0.02)
    qt = M.quantize(torch.from_numpy(w), sensitivity=torch.from_numpy(sens), outlier_ratio=0.02)
    assert all(isinstance(b, torch.Tensor) for b in qt.buffers.values())
    for name in M.BUFFER_NAMES:
        assert_bytes_equal(qt.buffers[name], qn.buffers[name])
    y = qt.dequantize()
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    qh = M.quantize(torch.from_numpy(w).half())
    assert qh.dequantize().dtype == torch.float16 and qh.dequantize("bfloat16").dtype == torch.bfloat16
    buf = io.BytesIO()
    torch.save(qn.state_dict(), buf)
    buf.seek(0)
    back = QuantizedTensor.from_state_dict(torch.load(buf, weights_only=True))
    assert back.params == qn.params and back.avg_bits == qn.avg_bits
    assert_bytes_equal(back.dequantize(), qn.dequantize())
    assert_bytes_equal(M.gemm(w[:3], back), M.gemm(w[:3], qn))


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"ratio_4bit": 1.5}, ValueError, "ratio_4bit"),
    ({"ratio_4bit": -0.1}, ValueError, "ratio_4bit"),
    ({"ratio_4bit": float("nan")}, ValueError, "ratio_4bit"),
    ({"ratio_4bit": "0.1"}, TypeError, "ratio_4bit"),
    ({"ratio_4bit": True}, TypeError, "ratio_4bit"),
    ({"outlier_ratio": 2.0}, ValueError, "outlier_ratio"),
    ({"group_size": 24}, ValueError, "multiple of 16"),
    ({"group_size": 8}, ValueError, "group_size"),
    ({"group_size": 48}, ValueError, "multiple of the block size 48"),
    ({"group_size": 16.0}, TypeError, "group_size"),
    ({"scale_block": 0}, ValueError, "scale_block"),
    ({"sensitivity": np.ones(32, np.float32)}, ValueError, "shape"),
    ({"sensitivity": np.ones((1, 64), np.float32)}, ValueError, "shape"),
    ({"sensitivity": -np.ones(64, np.float32)}, ValueError, ">= 0"),
    ({"sensitivity": np.full(64, np.nan, np.float32)}, ValueError, "NaN"),
    ({"sensitivity": np.full(64, np.inf, np.float32)}, ValueError, "NaN or Inf"),
    ({"sensitivity": np.ones(64, np.int32)}, TypeError, "float"),
    ({"sensitivity": [1.0] * 64}, TypeError, "numpy array"),
])
def test_bad_params_raise(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        M.quantize(np.ones((2, 64), np.float32), **kwargs)


@pytest.mark.parametrize("bad, exc, match", [
    (np.ones(64, np.float32), ValueError, "2-D"),
    (np.ones((2, 2, 64), np.float32), ValueError, "2-D"),
    (np.ones((2, 40), np.float32), ValueError, "multiple of the block size 16"),
    (np.ones((2, 64), np.int32), TypeError, "float32, float16 or bfloat16"),
    (np.ones((4, 128), np.float32)[:, ::2], ValueError, "contiguous"),
    (np.array([[np.nan] + [0.0] * 15], np.float32), ValueError, "NaN or Inf"),
    (np.array([[np.inf] + [0.0] * 15], np.float32), ValueError, "NaN or Inf"),
    (np.array([[3e6] + [0.0] * 15], np.float32), ValueError, "too large"),
    ([[1.0] * 16], TypeError, "numpy array"),
])
def test_bad_input_raises(bad, exc, match):
    with pytest.raises(exc, match=match):
        M.quantize(bad)


def test_too_large_boundary():
    # A 2-bit group [0, x]: d = x / 3 / 15 must stay below 65520 (fp16 inf from there).
    ok = np.array([[2.9e6] + [0.0] * 15], np.float32)
    bad = np.array([[3.0e6] + [0.0] * 15], np.float32)
    M.quantize(ok, ratio_4bit=0)
    with pytest.raises(ValueError, match="too large"):
        M.quantize(bad, ratio_4bit=0)
    with pytest.raises(ValueError, match="too large"):
        R.quantize(bad, ratio_4bit=0)
    M.quantize(bad, ratio_4bit=1)  # a 4-bit group: d = x / 15 / 255 fits
    with pytest.raises(ValueError, match="too large"):  # an fp16 outlier of 1e5 is inf
        M.quantize(np.array([[1e5] + [0.0] * 15], np.float32), ratio_4bit=0, outlier_ratio=0.1)
    with pytest.raises(ValueError, match="too large"):  # 0 * inf score
        M.quantize(np.array([[1e20] + [0.0] * 15], np.float32), sensitivity=np.zeros(16, np.float32))


def test_expected_buffers_and_validate():
    w = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    qt = M.quantize(w, outlier_ratio=0.05, scale_block=3)
    exp = M.expected_buffers(qt.shape, qt.params)
    assert {k: (M.A.dtype_name(v), tuple(v.shape)) for k, v in qt.buffers.items()} == exp
    for bad in ({**qt.params, "n4": qt.params["n4"] + 1}, {**qt.params, "n_out": 0},
                {**qt.params, "selection": "magic"}, {**qt.params, "group_size": 24},
                {k: v for k, v in qt.params.items() if k != "n4"}, {**qt.params, "extra": 1}):
        with pytest.raises((ValueError, TypeError)):
            M.expected_buffers(qt.shape, bad)
    with pytest.raises(ValueError):
        M.expected_buffers((4, 64, 1), qt.params)
    with pytest.raises(ValueError):
        QuantizedTensor("mixed2bit", qt.shape, "float32", qt.params,
                        {**qt.buffers, "codes2": qt.buffers["codes2"][1:]}).dequantize()
    with pytest.raises(TypeError):
        M.dequantize(w)


def test_dequantize_writes_the_requested_dtype():
    # Decoded in float32 and rounded once to the output dtype: the bytes of a cast of the
    # float32 result (float16 overflow -> inf included).
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    w = rng.standard_normal((33, 96)).astype(np.float32)
    big = (w * 3e4).astype(np.float32)  # decodes beyond float16's range
    for qt in (M.quantize(w, outlier_ratio=0.01, ratio_4bit=0.2), M.quantize(big, ratio_4bit=0.2)):
        y32 = M.dequantize(qt, "float32")
        assert y32.dtype == np.float32
        y16 = M.dequantize(qt, "float16")
        assert y16.dtype == np.float16
        with np.errstate(over="ignore"):
            assert_bytes_equal(y16, y32.astype(np.float16))
        with pytest.raises(TypeError, match="bfloat16"):
            M.dequantize(qt, "bfloat16")  # numpy buffers: numpy has no bfloat16
        qtt = QuantizedTensor(qt.format, qt.shape, qt.dtype, qt.params,
                              {k: torch.from_numpy(v) for k, v in qt.buffers.items()})
        for dtype in ("float32", "float16", "bfloat16"):
            got = M.dequantize(qtt, dtype)
            assert got.dtype == getattr(torch, dtype)
            assert_bytes_equal(got, torch.from_numpy(y32).to(getattr(torch, dtype)))
    assert np.isinf(M.dequantize(M.quantize(big, ratio_4bit=0.2), "float16")).any()


def test_native_rejects_inconsistent_buffers():
    w = np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32)
    qt = M.quantize(w, outlier_ratio=0.05)
    args = M._native_args(qt)
    out = np.empty(qt.shape, np.float32)
    M._native.dequantize(*args, out)
    assert_bytes_equal(out, M.dequantize(qt))
    names = list(M.BUFFER_NAMES)
    # a group map whose popcount is not n4
    bufs = dict(zip(names, args[6:]))
    bad_map = bufs["group_map"].copy()
    bad_map[0] ^= 1
    with pytest.raises(ValueError, match="n4"):
        M._native.dequantize(*args[:6], *[bad_map if n == "group_map" else bufs[n] for n in names], out)
    # unsorted / out-of-range outlier indices
    for idx in (bufs["outlier_idx"][::-1].copy(), np.full_like(bufs["outlier_idx"], 4 * 64)):
        with pytest.raises(ValueError, match="outlier_idx"):
            M._native.dequantize(*args[:6], *[idx if n == "outlier_idx" else bufs[n] for n in names], out)
    # a short output / wrong dtypes
    with pytest.raises(ValueError):
        M._native.dequantize(*args, np.empty(10, np.float32))
    with pytest.raises(TypeError):
        M._native.dequantize(*args[:6], *[bufs[n].view(np.uint8) if n == "codes2" else bufs[n]
                                          for n in names], out)
    with pytest.raises(ValueError):
        M._native.quantize(w, None, 16, 16, qt.params["n4"] + 1, qt.params["n_out"], *args[6:])
    with pytest.raises(ValueError):
        M._native.quantize(w, np.ones(10, np.float32), 16, 16, qt.params["n4"], qt.params["n_out"],
                           *args[6:])


def test_threaded_large_input_matches_reference():
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((192, 1024)) * rng.random((192, 1)) * 0.1).astype(np.float32)
    sens = rng.random(1024).astype(np.float32) ** 4
    for kw in ({}, {"sensitivity": sens, "outlier_ratio": 0.003, "group_size": 32}):
        qt = M.quantize(w, **kw)
        ref = R.quantize(w, **kw)
        for name in M.BUFFER_NAMES:
            assert_bytes_equal(qt.buffers[name], ref[name])
        gs = kw.get("group_size", 16)
        assert_bytes_equal(M.dequantize(qt), R.dequantize(ref, 192, 1024, gs, 16))


def test_bfloat16_and_float16_inputs_match_reference():
    torch = pytest.importorskip("torch")
    x32 = np.random.default_rng(8).standard_normal((6, 96)).astype(np.float32)
    for dtype in ("float16", "bfloat16"):
        inp = to_dtype(x32, dtype)
        qt = M.quantize(inp.x, outlier_ratio=0.01)
        ref = R.quantize(inp.x32, outlier_ratio=0.01)
        for name in M.BUFFER_NAMES:
            assert_bytes_equal(qt.buffers[name], ref[name])
        assert qt.dtype == dtype
    assert torch is not None
