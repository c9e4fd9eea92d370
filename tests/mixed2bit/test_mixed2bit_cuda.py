"""mixed2bit on the GPU: every buffer equals the CPU's and the reference's (selection ties,
outliers, second order, codes); dequantize equal in float32/float16/bfloat16; large inputs over
many CTAs; misaligned pointers; the caller's stream; poisoned outputs fully written; device
mixes; the "too large" error as on the CPU; pack_2bit/unpack_2bit."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from conftest import requires_cuda
from qformats import mixed2bit as M
from qformats.mixed2bit import reference as R
from strategies import assert_bytes_equal, float_inputs, misaligned_copy, on_cuda

pytestmark = requires_cuda
torch = pytest.importorskip("torch")

GPU_SETTINGS = settings(max_examples=80, deadline=None)
DTYPES = ("float32", "float16", "bfloat16")
SENS_VALUES = [0.0, -0.0, 1e-40, 1e-3, 0.5, 1.0, 3.0, 1e10, 3e38]


@st.composite
def cases(draw):
    """(input, params, sensitivity float32 [K] or None); group sizes 16 (the registers path of
    the kernels), 32 and 48 (the generic path)."""
    gs = draw(st.sampled_from([16, 16, 32, 48]))
    inp = draw(float_inputs(block=gs, min_rows=1, max_rows=8, min_blocks=1, max_blocks=6))
    K = inp.x32.shape[1]
    params = {
        "group_size": gs,
        "ratio_4bit": draw(st.sampled_from([0.0, 0.1, 1.0]) | st.floats(0, 1)),
        "outlier_ratio": draw(st.sampled_from([0.0, 0.0, 0.02, 0.3, 1.0])),
        "scale_block": draw(st.sampled_from([1, 2, 3, 16])),
    }
    sens = None
    if draw(st.booleans()):
        sens = draw(hnp.arrays(np.float32, (K,), elements=st.sampled_from(SENS_VALUES)
                               | st.floats(0, 100, width=32)))
    return inp, params, sens


def _cpu_torch(qt):
    """The QuantizedTensor with torch CPU buffers (numpy has no bfloat16 output; note that
    QuantizedTensor.to("cpu") keeps numpy buffers as they are)."""
    bufs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v.cpu() for k, v in qt.buffers.items()}
    return type(qt)(qt.format, qt.shape, qt.dtype, dict(qt.params), bufs)


def _assert_same_buffers(gpu, want: dict):
    for name in M.BUFFER_NAMES:
        b = gpu.buffers[name]
        assert isinstance(b, torch.Tensor) and b.is_cuda, name
        assert_bytes_equal(b, want[name])


def _assert_same_dequantize(gpu, cpu, dtypes=DTYPES):
    cpu = _cpu_torch(cpu)
    for dtype in dtypes:
        gd = gpu.dequantize(dtype)
        assert gd.is_cuda and gd.dtype == getattr(torch, dtype)
        assert_bytes_equal(gd, cpu.dequantize(dtype))


def _check_gpu(x_cpu, params, sens, sens_gpu=None):
    """GPU == CPU == reference on every buffer and on dequantize, or all three raise 'too large'."""
    x32 = x_cpu.float().numpy() if isinstance(x_cpu, torch.Tensor) else np.asarray(x_cpu, np.float32)
    try:
        ref = R.quantize(x32, sensitivity=sens, **params)
    except ValueError as e:
        assert "too large" in str(e)
        with pytest.raises(ValueError, match="too large"):
            M.quantize(on_cuda(x_cpu), sensitivity=sens, **params)
        return None
    g = M.quantize(on_cuda(x_cpu), sensitivity=sens if sens_gpu is None else sens_gpu, **params)
    c = M.quantize(x_cpu, sensitivity=sens, **params)
    assert g.params == c.params and g.dtype == c.dtype and g.shape == c.shape
    _assert_same_buffers(g, ref)
    _assert_same_buffers(g, c.buffers)
    _assert_same_dequantize(g, c)
    return g, c


@GPU_SETTINGS
@given(cases())
def test_gpu_quantize_equals_cpu_and_reference(case):
    inp, params, sens = case
    _check_gpu(inp.x, params, sens)


@GPU_SETTINGS
@given(cases(), st.booleans())
def test_gpu_sensitivity_as_cuda_tensor(case, sens_on_gpu):
    inp, params, sens = case
    if sens is None:
        sens = np.ones(inp.x32.shape[1], np.float32)
    _check_gpu(inp.x, params, sens, torch.from_numpy(sens).cuda() if sens_on_gpu else None)


def test_gpu_tied_scores_go_to_smaller_group_ids():
    # Every group has the same range and sensitivity score: the first n4 ids win, also across
    # many CTAs (256 x 64 = 16384 groups).
    g = np.array([-1.0, 2.0] + [0.5] * 14, np.float32)
    for rows, cols in ((6, 4), (256, 64)):
        w = np.tile(g, (rows, cols))
        K = w.shape[1]
        for sens in (None, np.ones(K, np.float32)):
            for ratio in (0.25, 0.1, 0.999):
                out = _check_gpu(w, {"ratio_4bit": ratio}, sens)
                gq = out[0]
                n4 = gq.params["n4"]
                is4 = np.unpackbits(gq.buffers["group_map"].cpu().numpy(), bitorder="little")[: rows * cols]
                np.testing.assert_array_equal(is4, [1] * n4 + [0] * (rows * cols - n4))


def test_gpu_partial_ties_and_outlier_ties():
    # Ranges 1 or 2 in a fixed pattern; equal |w| (+-3) for the outliers: ties by index.
    rng = np.random.default_rng(7)
    for rows, cols in ((5, 4), (300, 32)):
        w = np.zeros((rows, 16 * cols), np.float32)
        pattern = rng.integers(1, 3, size=(rows, cols)).astype(np.float32)
        for c in range(cols):
            w[:, c * 16] = pattern[:, c]
            w[:, c * 16 + 3] = rng.choice([3.0, -3.0], size=rows) * (pattern[:, c] == 1)
            w[:, c * 16 + 5] = -0.0
        for ratio in (0.1, 0.3, 0.5):
            for orat in (0.0, 0.01, 0.02, 0.2):
                for sens in (None, np.ones(16 * cols, np.float32)):
                    assert _check_gpu(w, {"ratio_4bit": ratio, "outlier_ratio": orat}, sens) is not None


def test_gpu_constant_and_zero_inputs():
    for v in (0.0, -0.0, 1.0, -2.5):
        w = np.full((37, 96), v, np.float32)
        for ratio in (0.0, 0.1, 0.5, 1.0):
            assert _check_gpu(w, {"ratio_4bit": ratio, "outlier_ratio": 0.05}, None) is not None


def _large(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    rows = torch.randint(0, shape[0], (4,), generator=g)
    x[rows] *= 50.0  # a few large rows: their groups win the 4-bit selection
    return x.to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 1024)])
def test_gpu_large_equals_cpu(shape, dtype):
    x = _large(shape, dtype, 1)
    K = shape[1]
    sens = (torch.rand(K, generator=torch.Generator().manual_seed(2)) ** 4).numpy()
    for kw in ({}, {"sensitivity": sens, "outlier_ratio": 0.001, "group_size": 32},
               {"ratio_4bit": 0.3, "scale_block": 7, "outlier_ratio": 0.0005}):
        g = M.quantize(x.cuda(), **kw)
        c = M.quantize(x, **kw)
        _assert_same_buffers(g, c.buffers)
        _assert_same_dequantize(g, c, (dtype, "float32"))


def test_gpu_large_matches_reference():
    x = _large((512, 2048), "float32", 3)
    kw = {"outlier_ratio": 0.002, "scale_block": 5}
    g = M.quantize(x.cuda(), **kw)
    _assert_same_buffers(g, R.quantize(x.numpy(), **kw))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_misaligned_inputs_and_outputs(dtype):
    x = _large((300, 512), dtype, 4)
    for kw in ({}, {"group_size": 32, "outlier_ratio": 0.01}):
        c = M.quantize(x, **kw)
        g = M.quantize(misaligned_copy(x), **kw)
        _assert_same_buffers(g, c.buffers)
        # misaligned buffers in, misaligned output written by the native call
        mis = type(c)(c.format, c.shape, c.dtype, dict(c.params),
                      {k: misaligned_copy(v) for k, v in c.buffers.items()})
        want = _cpu_torch(c).dequantize(dtype)
        assert_bytes_equal(mis.dequantize(dtype), want)
        args = M._native_args(mis)
        out = misaligned_copy(torch.zeros(c.shape, dtype=getattr(torch, dtype)))
        ws = torch.empty(M._native.dequantize_workspace_bytes(*args[:6]), dtype=torch.uint8, device="cuda")
        M._native.dequantize(*args, out, ws, torch.cuda.current_stream().cuda_stream)
        assert_bytes_equal(out, want)
        # a workspace that is not 256-byte aligned
        ws2 = torch.empty(ws.numel() + 1, dtype=torch.uint8, device="cuda")[1:]
        out2 = torch.empty(c.shape, dtype=getattr(torch, dtype), device="cuda")
        M._native.dequantize(*args, out2, ws2, torch.cuda.current_stream().cuda_stream)
        assert_bytes_equal(out2, want)


def test_gpu_runs_on_the_callers_stream():
    x = torch.randn(512, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
    with torch.cuda.stream(s):
        y = x * 2  # queued on s: quantize must come after it
        q = M.quantize(y, outlier_ratio=0.001)
        d = q.dequantize("float16")  # asynchronous, on s too
    s.synchronize()
    c = M.quantize((x * 2).cpu(), outlier_ratio=0.001)
    _assert_same_buffers(q, c.buffers)
    assert_bytes_equal(d, _cpu_torch(c).dequantize("float16"))


def _poisoned(shapes: dict) -> dict:
    bufs = {}
    for name, (dt, shape) in shapes.items():
        t = torch.empty(shape, dtype=getattr(torch, dt), device="cuda")
        t.view(torch.uint8).fill_(0xAB)  # never a valid byte pattern to leave behind
        bufs[name] = t
    return bufs


@pytest.mark.parametrize("kw", [{}, {"outlier_ratio": 0.01, "group_size": 32, "scale_block": 3},
                                {"ratio_4bit": 1.0}, {"ratio_4bit": 0.0, "outlier_ratio": 1.0}])
def test_gpu_outputs_poisoned_then_fully_written(kw):
    x = torch.randn(300, 1024, device="cuda")
    sens = np.random.default_rng(5).random(1024).astype(np.float32)
    c = M.quantize(x.cpu(), sensitivity=sens, **kw)
    p = c.params
    bufs = _poisoned(M.expected_buffers(c.shape, p))
    M._quantize_into(x, sens, p["group_size"], p["scale_block"], p["n4"], p["n_out"], bufs)
    for name in M.BUFFER_NAMES:
        assert_bytes_equal(bufs[name], c.buffers[name])
    g = type(c)(c.format, c.shape, c.dtype, dict(p), bufs)
    args = M._native_args(g)
    ws = torch.empty(M._native.dequantize_workspace_bytes(*args[:6]), dtype=torch.uint8, device="cuda")
    for dtype in DTYPES:
        out = torch.full(c.shape, float("nan"), dtype=getattr(torch, dtype), device="cuda")
        M._native.dequantize(*args, out, ws.fill_(0xAB), torch.cuda.current_stream().cuda_stream)
        assert_bytes_equal(out, _cpu_torch(c).dequantize(dtype))


def test_gpu_empty_inputs():
    for shape in ((0, 32), (3, 0), (0, 0)):
        w = torch.zeros(shape, device="cuda")
        qt = M.quantize(w, outlier_ratio=0.5, sensitivity=np.ones(shape[1], np.float32))
        assert qt.nbytes == 0 and all(b.is_cuda for b in qt.buffers.values())
        y = M.dequantize(qt, "bfloat16")
        assert y.is_cuda and tuple(y.shape) == shape


def test_gpu_too_large_raises_like_the_cpu():
    bad = [
        (np.array([[3.0e6] + [0.0] * 15], np.float32), {"ratio_4bit": 0}, None),       # so2 d inf
        (np.array([[1e5] + [0.0] * 15], np.float32), {"ratio_4bit": 0, "outlier_ratio": 0.1}, None),
        (np.array([[1e20] + [0.0] * 15], np.float32), {}, np.zeros(16, np.float32)),     # 0 * inf
        (np.array([[3e38] * 8 + [-3e38] * 8] * 3, np.float32), {"ratio_4bit": 1}, None),  # so4 inf
    ]
    for w, kw, sens in bad:
        with pytest.raises(ValueError, match="too large"):
            M.quantize(w, sensitivity=sens, **kw)
        with pytest.raises(ValueError, match="too large"):
            M.quantize(torch.from_numpy(w).cuda(), sensitivity=sens, **kw)
    # the boundary that fits, and the stream still works after the errors
    ok = np.array([[2.9e6] + [0.0] * 15], np.float32)
    _check_gpu(ok, {"ratio_4bit": 0}, None)
    _check_gpu(np.array([[3.0e6] + [0.0] * 15], np.float32), {"ratio_4bit": 1}, None)
    big = torch.randn(2048, 1024)
    big[1000, 17] = 1e7
    with pytest.raises(ValueError, match="too large"):
        M.quantize(big.cuda(), ratio_4bit=0)
    torch.cuda.synchronize()


def test_gpu_mixed_devices_raise():
    x = torch.randn(8, 64)
    c = M.quantize(x, outlier_ratio=0.05)
    g = c.to("cuda")
    args = M._native_args(g)
    ws = torch.empty(M._native.dequantize_workspace_bytes(*args[:6]), dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="same device"):  # CPU output, CUDA buffers
        M._native.dequantize(*args, torch.empty(8, 64), ws, 0)
    with pytest.raises(ValueError, match="same device"):  # CPU workspace
        M._native.dequantize(*args, torch.empty(8, 64, device="cuda"),
                             torch.empty(ws.numel(), dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="workspace"):  # no workspace on CUDA
        M._native.dequantize(*args, torch.empty(8, 64, device="cuda"))
    with pytest.raises(ValueError, match="workspace"):  # too small
        M._native.dequantize(*args, torch.empty(8, 64, device="cuda"), ws[:1], 0)
    mixed = type(g)(g.format, g.shape, g.dtype, dict(g.params), {**g.buffers, "so2": c.buffers["so2"]})
    with pytest.raises(ValueError, match="so2"):
        mixed.dequantize()
    p = c.params
    bufs = {k: v.clone() for k, v in g.buffers.items()}
    bufs["codes2"] = bufs["codes2"].cpu()
    with pytest.raises(ValueError, match="same device"):  # CUDA input, one CPU output
        M._quantize_into(x.cuda(), None, 16, 16, p["n4"], p["n_out"], bufs)
    with pytest.raises(ValueError, match="contiguous"):
        M.quantize(torch.randn(64, 64, device="cuda").t())
    with pytest.raises(ValueError, match="device"):
        M.gemm(torch.randn(2, 64), g)
    with pytest.raises(ValueError, match="device"):
        M.gemm(torch.randn(2, 64, device="cuda"), c)


def test_gpu_inconsistent_buffers_decode_to_nan():
    # The CPU raises ValueError (tests/mixed2bit/test_mixed2bit.py); the GPU decoder detects
    # the same conditions without a synchronization and writes NaN everywhere, in bounds.
    x = torch.randn(4, 64)
    g = M.quantize(x, outlier_ratio=0.05).to("cuda")
    args = list(M._native_args(g))
    names = list(M.BUFFER_NAMES)
    ws = torch.empty(M._native.dequantize_workspace_bytes(*args[:6]), dtype=torch.uint8, device="cuda")
    bad_map = args[6 + names.index("group_map")].clone()
    bad_map[0] ^= 1
    idx = args[6 + names.index("outlier_idx")]
    for name, bad in (("group_map", bad_map), ("outlier_idx", idx.flip(0).contiguous()),
                      ("outlier_idx", torch.full_like(idx, 4 * 64)),
                      ("outlier_idx", torch.full_like(idx, -1))):
        a = list(args)
        a[6 + names.index(name)] = bad
        out = torch.zeros(4, 64, device="cuda")
        M._native.dequantize(*a, out, ws, torch.cuda.current_stream().cuda_stream)
        assert torch.isnan(out).all(), name
    out = torch.zeros(4, 64, device="cuda")  # and a consistent call afterwards is exact again
    M._native.dequantize(*args, out, ws, torch.cuda.current_stream().cuda_stream)
    assert_bytes_equal(out, M.dequantize(_cpu_torch(g), "float32"))


@GPU_SETTINGS
@given(hnp.array_shapes(min_dims=1, max_dims=3, max_side=5).map(lambda s: (*s[:-1], 16 * s[-1])),
       st.sampled_from([np.uint8, np.int8, np.int32, np.int64]), st.data())
def test_gpu_pack_unpack_equal_cpu(shape, dtype, data):
    v = data.draw(hnp.arrays(dtype, shape, elements=st.integers(0, 3)))
    vt = torch.from_numpy(v)
    p_cpu = M.pack_2bit(vt)
    p_gpu = M.pack_2bit(vt.cuda())
    assert p_gpu.is_cuda and p_gpu.dtype == torch.int32
    assert_bytes_equal(p_gpu, p_cpu)
    assert_bytes_equal(p_gpu, R.pack_2bit(v))
    k = data.draw(st.integers(0, v.size))
    u_gpu = M.unpack_2bit(p_gpu, k)
    assert u_gpu.is_cuda and u_gpu.dtype == torch.uint8
    assert_bytes_equal(u_gpu, M.unpack_2bit(p_cpu, k))
    np.testing.assert_array_equal(u_gpu.cpu().numpy(), v.reshape(-1)[:k])


def test_gpu_pack_unpack_large_misaligned_and_stream():
    v = torch.randint(0, 4, (3000, 4096), dtype=torch.uint8)
    want = M.pack_2bit(v)
    assert_bytes_equal(M.pack_2bit(misaligned_copy(v)), want)
    out = misaligned_copy(torch.zeros(want.shape, dtype=torch.int32))
    M._native.pack_2bit(v.cuda(), out, torch.cuda.current_stream().cuda_stream)
    assert_bytes_equal(out, want)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
    with torch.cuda.stream(s):
        pg = M.pack_2bit(v.cuda())
        u = M.unpack_2bit(misaligned_copy(pg), v.numel() - 5)
    s.synchronize()
    assert_bytes_equal(u, v.reshape(-1)[:-5])
