"""CPU GEMMs of every format against float64 references, on every instruction-set path.

Float kernels: relative Frobenius error <= 1e-5 against the float64 product of the dequantized
operands, measured relative to ||X| . |W|^T| (a short dot product can cancel far below its terms;
float32 summation error scales with the terms). Integer kernels: exact. Each native call writes
into a poisoned output (NaN or 0x7F7F7F7F) so that unwritten elements show. Each case runs on
the scalar, AVX2 and AVX-512 paths that this CPU supports (QFORMATS_GEMM_ISA).
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from qformats import int4, int8, mixed2bit, nf4, q4_0, q8_1  # noqa: E402

F32 = np.float32
N_VALUES = (1, 2, 3, 8, 17, 64)
ISA_ORDER = ("scalar", "avx2", "avx512")
_env = os.environ.pop("QFORMATS_GEMM_ISA", None)
DETECTED = q4_0._native.gemm_isa()
if _env is not None:
    os.environ["QFORMATS_GEMM_ISA"] = _env
ISAS = ISA_ORDER[: ISA_ORDER.index(DETECTED) + 1]
SETTINGS = settings(max_examples=12, deadline=None)


@contextmanager
def use_isa(isa: str):
    old = os.environ.get("QFORMATS_GEMM_ISA")
    os.environ["QFORMATS_GEMM_ISA"] = isa
    try:
        for mod in (q4_0, int8, int4, nf4, mixed2bit):
            assert mod._native.gemm_isa() == isa
        yield
    finally:
        if old is None:
            del os.environ["QFORMATS_GEMM_ISA"]
        else:
            os.environ["QFORMATS_GEMM_ISA"] = old


def _np64(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.float().numpy()
    return np.asarray(a, dtype=np.float64)


def assert_close(got, x, w) -> None:
    """||got - x w^T|| <= 1e-5 ||(|x| |w|^T)|| with x [N, K], w [M, K] (float64 of the operands)."""
    x64, w64 = _np64(x), _np64(w)
    got = _np64(got)
    ref = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    assert got.shape == ref.shape
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref)
    assert err <= 1e-5 * np.linalg.norm(scale) + 1e-30, (err, np.linalg.norm(scale))


def activations(rng, n: int, k: int, dtype: str = "float32"):
    x = rng.standard_normal((n, k)).astype(F32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    return torch.from_numpy(x).to(torch.bfloat16)


def poisoned(shape, dtype=F32):
    if dtype == np.int32:
        return np.full(shape, 0x7F7F7F7F, np.int32)
    return np.full(shape, np.nan, dtype)


def snapshot(*arrays):
    return [a.clone() if isinstance(a, torch.Tensor) else a.copy() for a in arrays]


def assert_unchanged(before, after):
    for b, a in zip(before, after):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert np.array_equal(a, b, equal_nan=True)


# --- q4_0 x q8_1 (integer dot products) ------------------------------------------------------------

def _q4q8_case(isa, n, m, kb, seed):
    k = 32 * kb
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10)).astype(F32)
    x = rng.standard_normal((n, k)).astype(F32)
    wq, aq = q4_0.quantize_q4_0(w), q8_1.quantize_q8_1(x)
    before = snapshot(wq, aq)
    with use_isa(isa):
        out = poisoned((m, n))
        q4_0._native.gemm_q4_0_q8_1(wq, aq, out, m, n, k)
        got = q4_0.gemm_q4_0_q8_1(wq, aq, m, n, k)
    assert_unchanged(before, [wq, aq])
    np.testing.assert_array_equal(got, out)
    # W . A^T with W [m, k], A [n, k]: the "x" of assert_close is W here.
    assert_close(out, q4_0.dequantize_q4_0(wq, k), q8_1.dequantize_q8_1(aq, k))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", N_VALUES)
def test_q4_0_q8_1_all_n(isa, n):
    _q4q8_case(isa, n, 17, 7, n)  # 17 rows: two full panels of 8 and one row; 7 blocks: odd


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(n=st.sampled_from(N_VALUES), m=st.integers(1, 20), kb=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_q4_0_q8_1_shapes(isa, n, m, kb, seed):
    _q4q8_case(isa, n, m, kb, seed)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("xdtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_q4_0_linear_is_q8_1_then_integer_gemm(isa, xdtype, n):
    rng = np.random.default_rng(n)
    m, k = 13, 32 * 5
    w = rng.standard_normal((m, k)).astype(F32)
    x = activations(rng, n, k, xdtype)
    qt = q4_0.quantize(w)
    before = snapshot(x, qt.buffers["blocks"])
    with use_isa(isa):
        got = q4_0.linear(x, qt)
        out = poisoned((n, m))
        q4_0._native.linear(x, qt.buffers["blocks"], out, m, n, k)
        via_blocks = q4_0.gemm_q4_0_q8_1(qt.buffers["blocks"], q8_1.quantize_q8_1(x), m, n, k)
    assert_unchanged(before, [x, qt.buffers["blocks"]])
    assert type(got) is type(x) and tuple(got.shape) == (n, m) and str(got.dtype).endswith("float32")
    np.testing.assert_array_equal(_np64(got), out)
    np.testing.assert_array_equal(out, via_blocks.T)  # bitwise: the same q8_1 bytes, the same kernel
    assert_close(out, q8_1.dequantize_q8_1(q8_1.quantize_q8_1(x), k), q4_0.dequantize(qt, "float32"))


# --- weight-only GEMMs ------------------------------------------------------------------------------

def _weight_only(isa, fmt: str, x, w, **params):
    """(public result, poisoned native result, dequantized weight) of one format's weight-only GEMM."""
    n, k = x.shape
    m = w.shape[0]
    if fmt == "q4_0":
        qt = q4_0.quantize(w)
    elif fmt == "int8":
        qt = int8.quantize(w, **params)
    elif fmt == "nf4":
        qt = nf4.quantize(w, **params)
    elif fmt == "int4":
        qt = int4.quantize(w, **params)
    else:
        qt = mixed2bit.quantize(w, **params)
    mod = {"q4_0": q4_0, "nf4": nf4, "int4": int4, "int8": int8, "mixed2bit": mixed2bit}[fmt]
    before = snapshot(x, *qt.buffers.values())
    out = poisoned((n, m))
    with use_isa(isa):
        got = mod.gemm(x, qt)
        if fmt == "q4_0":
            q4_0._native.gemm(x, qt.buffers["blocks"], out, m, n, k)
        elif fmt == "nf4":
            nf4._native.gemm(x, qt.buffers["packed"], nf4.decoded_absmax(qt), out, m, k, qt.params["blocksize"])
        elif fmt == "int8":
            unit = {"row": k, "tensor": m * k, "group": params.get("group_size")}[params["granularity"]]
            int8._native.gemm(x, qt.buffers["q"], qt.buffers["scale"], out, n, k, m, unit)
        elif fmt == "int4":
            b = qt.buffers
            int4._native.gemm(x, b["qweight"], b["scales"], b.get("zeros"), out, n, k, m, qt.params["group_size"])
        else:
            mixed2bit._native.gemm(x, *mixed2bit._native_args(qt), out)
    assert_unchanged(before, [x, *qt.buffers.values()])
    assert type(got) is type(x) and tuple(got.shape) == (n, m) and str(got.dtype).endswith("float32")
    np.testing.assert_array_equal(_np64(got), out)
    return out, mod.dequantize(qt, "float32")


WEIGHT_CASES = [  # (format, params, K values)
    ("q4_0", {}, (32, 224, 1056)),
    ("nf4", {"blocksize": 64}, (64, 320, 1088)),
    ("nf4", {"blocksize": 32, "compress_statistics": True}, (32, 96)),
    ("nf4", {"blocksize": 128}, (40, 200)),                 # K % 32 != 0: blocks straddle rows
    ("int4", {"group_size": 128}, (128, 1152)),
    ("int4", {"group_size": 32, "symmetric": True}, (32, 160)),
    ("int4", {"group_size": 8}, (8, 40)),                   # groups not a multiple of 32
    ("int4", {"group_size": 64, "symmetric": True}, (64, 1088)),
    ("int8", {"granularity": "row"}, (16, 200, 1040)),       # K % 16 != 0: the tile path
    ("int8", {"granularity": "group", "group_size": 32}, (32, 96)),
    ("int8", {"granularity": "tensor"}, (24, 256)),
    ("int8", {"granularity": "group", "group_size": 8}, (8, 40)),  # units not a multiple of 16
    ("mixed2bit", {}, (16, 176, 1040)),
    ("mixed2bit", {"group_size": 32, "ratio_4bit": 0.5, "outlier_ratio": 0.02}, (32, 96, 1056)),
    ("mixed2bit", {"ratio_4bit": 1.0, "outlier_ratio": 0.05, "scale_block": 3}, (48,)),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt, params, ks", WEIGHT_CASES, ids=lambda v: str(v))
def test_weight_only_all_n(isa, fmt, params, ks):
    rng = np.random.default_rng(len(fmt) + len(params))
    for k in ks:
        w = (rng.standard_normal((11, k)) * 0.05).astype(F32)  # 11 rows: a full panel and 3 rows
        for n in N_VALUES:
            x = activations(rng, n, k)
            out, deq = _weight_only(isa, fmt, x, w, **params)
            assert_close(out, x, deq)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt, params", [(f, p) for f, p, _ in WEIGHT_CASES[::2]], ids=lambda v: str(v))
@SETTINGS
@given(n=st.sampled_from(N_VALUES), m=st.integers(1, 21).filter(lambda v: v % 2), units=st.integers(1, 9),
       xdtype=st.sampled_from(["float32", "float16", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
def test_weight_only_shapes_and_dtypes(isa, fmt, params, n, m, units, xdtype, seed):
    unit = {"q4_0": 32, "nf4": 32, "int4": params.get("group_size", 128), "int8": params.get("group_size", 16),
            "mixed2bit": params.get("group_size", 16)}[fmt]
    rng = np.random.default_rng(seed)
    k = unit * units
    w = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10)).astype(F32)
    x = activations(rng, n, k, xdtype)
    out, deq = _weight_only(isa, fmt, x, w, **params)
    assert_close(out, x, deq)


# --- int8 x int8 and the fused int8 linear ---------------------------------------------------------

def _int8_operands(rng, n, m, k):
    a = rng.integers(-128, 128, (n, k), dtype=np.int8)
    b = rng.integers(-128, 128, (m, k), dtype=np.int8)
    return a, b


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(n=st.sampled_from(N_VALUES), m=st.integers(1, 20), k=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_int8_matmul_exact(isa, n, m, k, seed):
    a, b = _int8_operands(np.random.default_rng(seed), n, m, k)
    before = snapshot(a, b)
    out = poisoned((n, m), np.int32)
    with use_isa(isa):
        int8._native.int8_matmul(a, b, out, n, m, k)
        got = int8.int8_matmul(a, b)
    assert_unchanged(before, [a, b])
    ref = a.astype(np.int64) @ b.astype(np.int64).T
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("isa", ISAS)
def test_int8_matmul_extremes_and_max_k(isa):
    k = int8.MAX_MATMUL_K
    for av, bv in ((-128, -128), (-128, 127), (127, 127)):
        a = np.full((3, k), av, np.int8)
        b = np.full((9, k), bv, np.int8)
        out = poisoned((3, 9), np.int32)
        with use_isa(isa):
            int8._native.int8_matmul(a, b, out, 3, 9, k)
        assert (out.astype(np.int64) == av * bv * k).all()


def _linear_ref(acc, xs, ws, bias, relu, scale_c, out_dtype):
    """The documented float32 formula, op by op in numpy float32 (no FMA), rounded once."""
    s = (xs.reshape(-1, 1).astype(F32) * ws.reshape(1, -1).astype(F32)) * F32(scale_c)
    v = acc.astype(F32) * s
    if bias is not None:
        v = v + _np64(bias).astype(F32).reshape(1, -1)
    if relu:
        v = np.where(v < 0, F32(0), v)
    if out_dtype == "float32":
        return v
    if out_dtype == "float16":
        return v.astype(np.float16)
    return torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", N_VALUES)
def test_int8_linear_fused(isa, out_dtype, n):
    rng = np.random.default_rng(n)
    m, k = 19, 200
    x = rng.standard_normal((n, k)).astype(F32)
    w = (rng.standard_normal((m, k)) * 0.1).astype(F32)
    xq, wq = int8.quantize(torch.from_numpy(x), "row"), int8.quantize(torch.from_numpy(w), "row")
    a, xs, b, ws = xq.buffers["q"], xq.buffers["scale"], wq.buffers["q"], wq.buffers["scale"]
    acc = a.numpy().astype(np.int64) @ b.numpy().astype(np.int64).T
    cases = [
        dict(),
        dict(bias=torch.from_numpy(rng.standard_normal(m).astype(F32)), relu=True),
        dict(bias=torch.from_numpy(rng.standard_normal(m).astype(F32)).half(), scale_c=0.5),
    ]
    for kw in cases:
        before = snapshot(a, xs, b, ws)
        with use_isa(isa):
            got = int8.int8_linear(a, xs, b, ws, out_dtype=out_dtype, **kw)
        assert_unchanged(before, [a, xs, b, ws])
        ref = _linear_ref(acc, xs.numpy(), ws.numpy(), kw.get("bias"), kw.get("relu", False),
                          kw.get("scale_c", 1.0), out_dtype)
        assert isinstance(got, torch.Tensor) and str(got.dtype) == f"torch.{out_dtype}"
        np.testing.assert_array_equal(_np64(got), _np64(ref))  # the same float32 operations
        if out_dtype == "float32" and not kw:  # and the layer it stands for: x . w^T
            assert_close(got, xq.dequantize("float32"), wq.dequantize("float32"))
    # numpy operands, per-tensor scales, poisoned native output
    xt, wt = int8.quantize_tensor(x), int8.quantize_tensor(w)
    out = poisoned((n, m))
    with use_isa(isa):
        int8._native.int8_linear(xt[0], xt[1].reshape(-1), wt[0], wt[1].reshape(-1), None, False, 1.0, out, n, m, k)
    acc_t = xt[0].astype(np.int64) @ wt[0].astype(np.int64).T
    np.testing.assert_array_equal(out, _linear_ref(acc_t, np.full(n, xt[1].item(), F32),
                                                   np.full(m, wt[1].item(), F32), None, False, 1.0, "float32"))


def test_int8_linear_bitsandbytes_convention():
    """bitsandbytes' int8_mm_dequant: acc * (row_stats * col_stats / 127^2) + bias."""
    rng = np.random.default_rng(1)
    a, b = _int8_operands(rng, 5, 7, 64)
    row_stats = rng.uniform(0.5, 3, 5).astype(F32)
    col_stats = rng.uniform(0.5, 3, 7).astype(F32)
    got = int8.int8_linear(a, row_stats, b, col_stats, scale_c=1 / 127**2)
    ref = (a.astype(np.float64) @ b.astype(np.float64).T) * np.outer(row_stats, col_stats) / 127**2
    np.testing.assert_allclose(got, ref, rtol=1e-6)


# --- int4 x int4 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(n=st.sampled_from(N_VALUES), m=st.integers(1, 20), kh=st.integers(0, 200), seed=st.integers(0, 2**32 - 1))
def test_int4_matmul_exact(isa, n, m, kh, seed):
    rng = np.random.default_rng(seed)
    k = 2 * kh
    ca = rng.integers(-8, 8, (n, k), dtype=np.int8)
    cb = rng.integers(-8, 8, (m, k), dtype=np.int8)
    a, b = int4.pack_int4(ca), int4.pack_int4(cb)
    before = snapshot(a, b)
    out = poisoned((n, m), np.int32)
    with use_isa(isa):
        int4._native.int4_matmul(a, b, out, n, m, k)
        got = int4.int4_matmul(a, b)
    assert_unchanged(before, [a, b])
    ref = ca.astype(np.int64) @ cb.astype(np.int64).T
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("isa", ISAS)
def test_int4_matmul_extremes(isa):
    k = 4096 + 66  # several 128-chunks and a partial one
    for av, bv in ((-8, -8), (-8, 7), (7, 7)):
        a = int4.pack_int4(np.full((3, k), av, np.int8))
        b = int4.pack_int4(np.full((9, k), bv, np.int8))
        with use_isa(isa):
            got = int4.int4_matmul(a, b)
        assert (got.astype(np.int64) == av * bv * k).all()


# --- empty shapes, threads, instruction sets ---------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
def test_empty_shapes(isa):
    with use_isa(isa):
        assert int8.int8_matmul(np.zeros((0, 8), np.int8), np.zeros((3, 8), np.int8)).shape == (0, 3)
        assert (int8.int8_matmul(np.zeros((2, 0), np.int8), np.zeros((3, 0), np.int8)) == 0).all()
        assert int8.int8_linear(np.zeros((2, 0), np.int8), np.ones(2, F32), np.zeros((3, 0), np.int8),
                                np.ones(3, F32)).tolist() == [[0.0] * 3] * 2
        assert (int4.int4_matmul(np.zeros((2, 0), np.uint8), np.zeros((3, 0), np.uint8)) == 0).all()
        w = q4_0.quantize(np.ones((3, 64), F32))
        assert q4_0.gemm(np.zeros((0, 64), F32), w).shape == (0, 3)
        assert q4_0.linear(np.zeros((0, 64), F32), w).shape == (0, 3)
        assert q4_0.gemm_q4_0_q8_1(w.buffers["blocks"], np.zeros((0, 2, 36), np.uint8), 3, 0, 64).shape == (3, 0)
        assert nf4.gemm(np.ones((2, 64), F32), nf4.quantize(np.zeros((0, 64), F32))).shape == (2, 0)


_THREAD_SCRIPT = """
import sys, numpy as np
from qformats import q4_0, q8_1, nf4, int4, int8, mixed2bit
rng = np.random.default_rng(0)
w = rng.standard_normal((520, 4096)).astype(np.float32)
x = rng.standard_normal((3, 4096)).astype(np.float32)
x8 = rng.standard_normal((40, 4096)).astype(np.float32)
wq = q4_0.quantize(w)
outs = [q4_0.gemm_q4_0_q8_1(wq.buffers["blocks"], q8_1.quantize_q8_1(x), 520, 3, 4096), q4_0.gemm(x, wq),
        q4_0.gemm(x8, wq), nf4.gemm(x, nf4.quantize(w)), nf4.gemm(x8, nf4.quantize(w)),
        int4.gemm(x8, int4.quantize(w, 128)), int4.gemm(x, int4.quantize(w, 128)), int8.gemm(x, int8.quantize(w)),
        int8.gemm(x8, int8.quantize(w, "group", 64)), mixed2bit.gemm(x, mixed2bit.quantize(w[:200])),
        mixed2bit.gemm(x, mixed2bit.quantize(w[:200], outlier_ratio=0.01)),
        mixed2bit.gemm(x8, mixed2bit.quantize(w[:200], outlier_ratio=0.01)),
        int8.int8_matmul(int8.quantize(x8).buffers["q"], int8.quantize(w).buffers["q"]).astype(np.float32)]
np.save(sys.argv[1], np.concatenate([o.reshape(-1) for o in outs]))
"""


def test_results_do_not_depend_on_thread_count(tmp_path):
    results = []
    for threads in ("1", "3"):
        # The child imports qformats from where this process did (source tree or installed).
        env = dict(os.environ, QFORMATS_NUM_THREADS=threads, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        path = tmp_path / f"t{threads}.npy"
        subprocess.run([sys.executable, "-c", _THREAD_SCRIPT, str(path)], env=env, check=True, timeout=120)
        results.append(np.load(path))
    np.testing.assert_array_equal(results[0], results[1])


def test_isa_paths_agree():
    """Integer results are the same on every path; float results differ by summation order only."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((37, 352)).astype(F32)
    x = rng.standard_normal((5, 352)).astype(F32)
    a, b = _int8_operands(rng, 5, 37, 352)
    res = {}
    for isa in ISAS:
        with use_isa(isa):
            res[isa] = (int8.int8_matmul(a, b), int4.int4_matmul(int4.pack_int4(a // 16), int4.pack_int4(b // 16)),
                        nf4.gemm(x, nf4.quantize(w)))
    for isa in ISAS:
        np.testing.assert_array_equal(res[isa][0], res["scalar"][0])
        np.testing.assert_array_equal(res[isa][1], res["scalar"][1])
        np.testing.assert_allclose(res[isa][2], res["scalar"][2], rtol=1e-4, atol=1e-4)


# --- bad input ----------------------------------------------------------------------------------------

def test_bad_input_raises_clear_errors():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(F32)
    x = rng.standard_normal((2, 64)).astype(F32)
    qt4, qnf, qi4, qm2 = q4_0.quantize(w), nf4.quantize(w), int4.quantize(w, 32), mixed2bit.quantize(w)
    for mod, qt in ((q4_0, qt4), (nf4, qnf), (int4, qi4), (mixed2bit, qm2)):
        fns = [mod.gemm] + ([q4_0.linear] if mod is q4_0 else [])
        for fn in fns:
            with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
                fn(x.astype(np.int32), qt)
            with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
                fn(x.astype(np.float64), qt)
            with pytest.raises(TypeError, match="numpy array or a torch tensor"):
                fn(x.tolist(), qt)
            with pytest.raises(TypeError, match="QuantizedTensor"):
                fn(x, w)
            with pytest.raises(ValueError, match="2-D"):
                fn(x[0], qt)
            with pytest.raises(ValueError, match="K|match"):
                fn(np.ones((2, 32), F32), qt)
            with pytest.raises(ValueError, match="contiguous"):
                fn(np.ones((64, 2), F32).T, qt)
            with pytest.raises(ValueError, match="NaN or Inf"):
                fn(np.full((2, 64), np.inf, F32), qt)
            other = qnf if mod is not nf4 else qt4
            with pytest.raises(ValueError, match="format"):
                fn(x, other)
    with pytest.raises(ValueError, match="overflow fp16"):
        q4_0.linear(np.full((1, 64), 1e7, F32), qt4)
    # q4_0 x q8_1 on raw blocks
    aq = q8_1.quantize_q8_1(x)
    with pytest.raises(ValueError, match="expected shape"):
        q4_0.gemm_q4_0_q8_1(qt4.buffers["blocks"], aq, 4, 3, 64)
    with pytest.raises(TypeError, match="uint8"):
        q4_0.gemm_q4_0_q8_1(qt4.buffers["blocks"].view(np.int8), aq, 4, 2, 64)
    with pytest.raises(TypeError, match="int"):
        q4_0.gemm_q4_0_q8_1(qt4.buffers["blocks"], aq, 4.0, 2, 64)
    # int8_linear
    a, b = _int8_operands(rng, 2, 3, 16)
    ones = lambda n: np.ones(n, F32)  # noqa: E731
    with pytest.raises(TypeError, match="int8"):
        int8.int8_linear(a.astype(np.int16), ones(2), b, ones(3))
    with pytest.raises(TypeError, match="float32"):
        int8.int8_linear(a, ones(2).astype(np.float16), b, ones(3))
    with pytest.raises(ValueError, match="x_scale: expected 2 elements"):
        int8.int8_linear(a, ones(3), b, ones(3))
    with pytest.raises(ValueError, match="w_scale: expected 3 elements"):
        int8.int8_linear(a, ones(2), b, ones(2))
    with pytest.raises(ValueError, match="bias"):
        int8.int8_linear(a, ones(2), b, ones(3), bias=ones(4))
    with pytest.raises(TypeError, match="bias"):
        int8.int8_linear(a, ones(2), b, ones(3), bias=np.ones(3, np.int32))
    with pytest.raises(TypeError, match="relu"):
        int8.int8_linear(a, ones(2), b, ones(3), relu=1)
    with pytest.raises(TypeError, match="scale_c"):
        int8.int8_linear(a, ones(2), b, ones(3), scale_c="1")
    with pytest.raises(ValueError, match="scale_c"):
        int8.int8_linear(a, ones(2), b, ones(3), scale_c=float("nan"))
    with pytest.raises(ValueError, match="out_dtype"):
        int8.int8_linear(a, ones(2), b, ones(3), out_dtype="int32")
    with pytest.raises(TypeError, match="bfloat16 output needs a torch tensor"):
        int8.int8_linear(a, ones(2), b, ones(3), out_dtype="bfloat16")
    with pytest.raises(ValueError, match="K mismatch"):
        int8.int8_linear(a, ones(2), b[:, :8].copy(), ones(3))
    with pytest.raises(ValueError, match="K="):
        k = int8.MAX_MATMUL_K + 1
        int8.int8_linear(np.zeros((1, k), np.int8), ones(1), np.zeros((1, k), np.int8), ones(1))


def test_native_adapters_refuse_bad_sizes():
    """Direct _native calls check sizes and dtypes again: no out-of-bounds access."""
    w = q4_0.quantize(np.ones((4, 64), F32))
    x = np.ones((2, 64), F32)
    with pytest.raises(ValueError, match="out"):
        q4_0._native.gemm(x, w.buffers["blocks"], np.empty((2, 3), F32), 4, 2, 64)
    with pytest.raises(ValueError, match="x"):
        q4_0._native.linear(x, w.buffers["blocks"], np.empty((3, 4), F32), 4, 3, 64)
    with pytest.raises(TypeError, match="x"):
        q4_0._native.gemm(x.astype(np.float64), w.buffers["blocks"], np.empty((2, 4), F32), 4, 2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_0._native.linear(x, w.buffers["blocks"], np.empty((2, 4), F32), 4, 2, 48)
    a = np.zeros((2, 16), np.int8)
    with pytest.raises(ValueError, match="x_scale"):
        int8._native.int8_linear(a, np.ones(3, F32), a, np.ones(2, F32), None, False, 1.0, np.empty((2, 2), F32),
                                 2, 2, 16)
    with pytest.raises(ValueError, match="bias"):
        int8._native.int8_linear(a, np.ones(2, F32), a, np.ones(2, F32), np.ones(3, F32), False, 1.0,
                                 np.empty((2, 2), F32), 2, 2, 16)
    with pytest.raises(TypeError, match="out"):
        int8._native.int8_linear(a, np.ones(2, F32), a, np.ones(2, F32), None, False, 1.0,
                                 np.empty((2, 2), np.int32), 2, 2, 16)
    q8 = int8.quantize(np.ones((4, 64), F32))
    with pytest.raises(ValueError, match="unit_len"):
        int8._native.gemm(x, q8.buffers["q"], q8.buffers["scale"], np.empty((2, 4), F32), 2, 64, 4, 48)
    with pytest.raises(ValueError, match="scale"):
        int8._native.gemm(x, q8.buffers["q"], q8.buffers["scale"], np.empty((2, 4), F32), 2, 64, 4, 32)
    with pytest.raises(ValueError, match="q"):
        int8._native.make_linear(q8.buffers["q"], q8.buffers["scale"], 5, 64, 64)
    with pytest.raises(TypeError, match="scale"):
        int8._native.make_linear(q8.buffers["q"], q8.buffers["scale"].astype(np.float64), 4, 64, 64)
    with pytest.raises(ValueError, match="K mismatch"):
        int8.gemm(np.ones((2, 32), F32), q8)
    qn = nf4.quantize(np.ones((4, 64), F32))
    with pytest.raises(ValueError, match="x"):
        nf4._native.gemm(np.ones((2, 32), F32), qn.buffers["packed"], qn.buffers["absmax"], np.empty((2, 4), F32),
                         4, 64, 64)
