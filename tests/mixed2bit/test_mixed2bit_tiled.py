"""mixed2bit layout "tiled" (mixed2bit_tiled.h): native codec == numpy reference byte for byte;
the per-tile 4-bit count and order; the layout's invariants; GEMM and QuantizedLinear; bad
input; save / load; the global layout's params and bytes unchanged."""
import numpy as np
import pytest
from hypothesis import event, given, settings

from qformats import QuantizedTensor, mixed2bit as M
from qformats.mixed2bit import reference as R
from mixed2bit_cases import tiled_cases as cases
from strategies import assert_bytes_equal

SETTINGS = settings(max_examples=100, deadline=None)
def _quantize_both(inp, params, sens):
    try:
        ref = R.quantize_tiled(inp.x32, sensitivity=sens, **params)
    except ValueError as e:
        assert "too large" in str(e)
        event("too large for fp16: both raise")
        with pytest.raises(ValueError, match="too large"):
            M.quantize(inp.x, sensitivity=sens, layout="tiled", **params)
        return None, None
    return M.quantize(inp.x, sensitivity=sens, layout="tiled", **params), ref


@SETTINGS
@given(cases())
def test_quantize_and_dequantize_match_reference(case):
    inp, params, sens = case
    before = np.copy(inp.x32)
    qt, ref = _quantize_both(inp, params, sens)
    if qt is None:
        return
    event(f"tiles per row: {-(-inp.x32.shape[1] // params['group_size'] // R.TILE_GROUPS)}")
    assert set(qt.buffers) == set(M.TILED_BUFFER_NAMES)
    for name in M.TILED_BUFFER_NAMES:
        assert_bytes_equal(qt.buffers[name], ref[name])
    rows, K = inp.x32.shape
    got = qt.dequantize("float32")
    assert_bytes_equal(got, R.dequantize_tiled(ref, rows, K, params["group_size"], params["scale_block"]))
    x = inp.x if isinstance(inp.x, np.ndarray) else inp.x.float().numpy()
    np.testing.assert_array_equal(np.asarray(x, np.float32), before)  # input untouched


@SETTINGS
@given(cases(dtypes=("float32",)))
def test_tile_counts_order_and_codes(case):
    """Each tile holds n4_count(ratio, tile size) 4-bit groups, the largest scores (ties: the
    smaller position); lo / mc4 follow the map's order; 2-bit groups' codes are <= 3."""
    inp, params, sens = case
    qt, ref = _quantize_both(inp, params, sens)
    if qt is None:
        return
    rows, K = inp.x32.shape
    gs = params["group_size"]
    G = K // gs
    is4 = R.tiled_is4(ref, rows, K, gs)
    scores = R.group_scores(inp.x32, gs, sens).reshape(rows, G)
    for t0 in range(0, G, R.TILE_GROUPS):
        tile4, tile_s = is4[:, t0:t0 + R.TILE_GROUPS], scores[:, t0:t0 + R.TILE_GROUPS]
        n = R.n4_count(params["ratio_4bit"], tile4.shape[1])
        assert (tile4.sum(axis=1) == n).all()
        for r in range(rows):
            chosen, rest = tile_s[r][tile4[r]], tile_s[r][~tile4[r]]
            if chosen.size and rest.size:
                assert chosen.min() >= rest.max()
                # among equal scores at the boundary, the chosen ones come first
                tie = chosen.min()
                at_tie = tile_s[r] == tie
                pos4, pos2 = np.flatnonzero(tile4[r] & at_tie), np.flatnonzero(~tile4[r] & at_tie)
                if pos4.size and pos2.size:
                    assert pos4.max() < pos2.min()
    assert qt.params["n4"] == rows * R.tiled_counts(K, gs, params["ratio_4bit"])[2]


def test_bits_per_weight_at_defaults():
    w = np.random.default_rng(0).standard_normal((64, 4096)).astype(np.float32)
    qt = M.quantize(w, layout="tiled")
    # codes 2 + scales 0.5 + so 1/8 + map 1/16 + 26 of 256 groups * 40 bits / 16 + so4 32 / 4096
    assert qt.avg_bits == pytest.approx(2 + 0.5 + 0.125 + 0.0625 + 26 * 40 / 4096 + 32 / 4096, abs=1e-9)
    assert qt.avg_bits <= 3.0


def test_global_layout_params_and_bytes_unchanged():
    """quantize without layout (or layout="global") writes the params and buffers of before:
    files written earlier load as they did."""
    w = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    a, b = M.quantize(w), M.quantize(w, layout="global")
    assert "layout" not in a.params and a.params == b.params and set(a.buffers) == set(M.BUFFER_NAMES)
    ref = R.quantize(w)
    for name in M.BUFFER_NAMES:
        assert_bytes_equal(b.buffers[name], ref[name])


@pytest.mark.parametrize("M_, N, K, ratio", [(5, 3, 4096 + 48, 0.1), (300, 7, 256, 0.5), (9, 1, 16 * 600, 0.0)])
def test_gemm_and_linear_match_float64(M_, N, K, ratio):
    torch = pytest.importorskip("torch")
    from qformats.nn import QuantizedLinear

    rng = np.random.default_rng(2)
    w = rng.standard_normal((M_, K)).astype(np.float32)
    x = rng.standard_normal((N, K)).astype(np.float32)
    qt = M.quantize(w, ratio_4bit=ratio, layout="tiled")
    wd = R.dequantize_tiled(R.quantize_tiled(w, ratio_4bit=ratio), M_, K, 16, 16).astype(np.float64)
    ref = x.astype(np.float64) @ wd.T
    scale = np.abs(x).astype(np.float64) @ np.abs(wd).T
    got = M.gemm(x, qt)
    assert got.shape == (N, M_) and got.dtype == np.float32
    assert (np.abs(got - ref) <= K * 2.0 ** -24 * scale * 1.01 + 1e-37).all()
    lin = torch.nn.Linear(K, M_)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    ql = QuantizedLinear.from_linear(lin, "mixed2bit", ratio_4bit=ratio, layout="tiled")
    y = ql(torch.from_numpy(x)).detach().numpy().astype(np.float64)
    want = ref + lin.bias.detach().numpy().astype(np.float64)
    assert (np.abs(y - want) <= K * 2.0 ** -24 * scale * 1.01 + 1e-6 * np.abs(want) + 1e-6).all()


@pytest.mark.parametrize("sb", [1, 4, 16, 256])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 1.0])
def test_fused_few_rows_gemm_matches_float64(ratio, sb):
    """N = 1..4 with groups of 16 takes the fused row kernel where the CPU has one (AVX2: groups
    across the lanes, s * sum q x - m * sum x per group): within float32 rounding of the decoded
    product at every scale_block (below 8 its pairs are gathered), with 4-bit groups in the steps
    and a short last tile; N = 5 (the decoding path) agrees as well."""
    rng = np.random.default_rng(int(ratio * 8) + sb)
    M_, K = 13, 16 * 300
    w = rng.standard_normal((M_, K)).astype(np.float32)
    qt = M.quantize(w, ratio_4bit=ratio, scale_block=sb, layout="tiled")
    wd = M.dequantize(qt).astype(np.float64)
    for N in (1, 2, 3, 4, 5):
        x = rng.standard_normal((N, K)).astype(np.float32)
        ref = x.astype(np.float64) @ wd.T
        scale = np.abs(x).astype(np.float64) @ np.abs(wd).T
        got = M.gemm(x, qt)
        assert (np.abs(got - ref) <= K * 2.0 ** -24 * scale * 1.01 + 1e-37).all(), N


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"layout": "blocked"}, ValueError, "layout"),
    ({"layout": "tiled", "outlier_ratio": 0.01}, ValueError, "no outliers"),
    ({"layout": "tiled", "scale_block": 3}, ValueError, "power of two"),
    ({"layout": "tiled", "scale_block": 512}, ValueError, "power of two"),
])
def test_bad_params_raise(kwargs, exc, match):
    w = np.zeros((2, 64), np.float32)
    with pytest.raises(exc, match=match):
        M.quantize(w, **kwargs)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="NaN|finite"):
        M.quantize(np.full((2, 32), np.nan, np.float32), layout="tiled")
    with pytest.raises(ValueError):
        M.quantize(np.zeros((2, 24), np.float32), layout="tiled")  # K not a multiple of 16
    with pytest.raises(ValueError, match="too large"):
        M.quantize(np.array([[-3e6] + [0.0] * 15] * 2, np.float32), layout="tiled", ratio_4bit=0.0)


def test_inconsistent_buffers_rejected():
    """A map that does not mark n4_row groups per row would send slots past lo / mc4: rejected,
    as are buffers of the wrong size or dtype."""
    w = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    qt = M.quantize(w, layout="tiled")
    bad = {k: np.copy(v) for k, v in qt.buffers.items()}
    bad["map"][1, 0] ^= np.uint32(1)
    q2 = QuantizedTensor("mixed2bit", qt.shape, qt.dtype, qt.params, bad)
    with pytest.raises(ValueError, match="map"):
        M.dequantize(q2)
    with pytest.raises(ValueError, match="map"):
        M.gemm(np.zeros((1, 512), np.float32), q2)
    short = {k: np.copy(v) for k, v in qt.buffers.items()}
    short["lo"] = short["lo"][:, :-1]
    with pytest.raises(ValueError):
        QuantizedTensor("mixed2bit", qt.shape, qt.dtype, qt.params, short).dequantize()
    wrong = {k: np.copy(v) for k, v in qt.buffers.items()}
    wrong["map"] = wrong["map"].view(np.int32)
    with pytest.raises((TypeError, ValueError)):
        QuantizedTensor("mixed2bit", qt.shape, qt.dtype, qt.params, wrong).dequantize()
    params = dict(qt.params, n4=qt.params["n4"] + 1)
    with pytest.raises(ValueError, match="n4"):
        M.expected_buffers(qt.shape, params)


def test_empty_shapes():
    for shape in [(0, 64), (3, 0)]:
        qt = M.quantize(np.zeros(shape, np.float32), layout="tiled")
        assert qt.dequantize().shape == shape


def test_save_load_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    from qformats import load_quantized, quantize_model, save_quantized

    def build():
        return torch.nn.Sequential(torch.nn.Linear(512, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))

    model = build()
    quantize_model(model, format="mixed2bit", layout="tiled", progress=False)
    x = torch.randn(3, 512)
    y = model(x)
    save_quantized(model, tmp_path / "m")
    back = load_quantized(tmp_path / "m", model=build)
    assert torch.equal(back(x), y)
    assert back[0].quantized_weight.params["layout"] == "tiled"
