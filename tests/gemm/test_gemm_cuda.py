"""CUDA GEMMs against float64 references (float kernels) and the CPU kernels (integer ones).

Float kernels: ||got - x w^T|| <= tol ||(|x| |w|^T)|| with the float64 product of the operands as
the kernel sees them (x rounded to its dtype, w dequantized exactly); tol 1e-5 for float32
output, 1e-3 for float16 and 4e-3 for bfloat16 (the output rounding: 2^-11 / 2^-8 relative).
Integer kernels and the fused int8 epilogue: equal to the CPU's bits. Every native call writes
into a poisoned output, so unwritten elements show; all N of the issue's list, odd M, K at the
block granularity. Run on the GPU machine (tools/gpu_check.sh); skipped without a device.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import requires_cuda  # noqa: E402
from qformats import int4, int8, mixed2bit, nf4, q4_0, q8_1  # noqa: E402

pytestmark = requires_cuda

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 4e-3}
N_VALUES = (1, 2, 3, 4, 8, 9, 16, 17, 64)


def assert_close(got: torch.Tensor, x: torch.Tensor, w64: np.ndarray, tol: float) -> None:
    x64 = x.double().cpu().numpy()
    g = got.double().cpu().numpy()
    ref = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    assert g.shape == ref.shape
    assert np.isfinite(g).all(), "unwritten (poisoned) or non-finite outputs"
    err = np.linalg.norm(g - ref)
    assert err <= tol * np.linalg.norm(scale) + 1e-30, (err / np.linalg.norm(scale), tol)


def weight(fmt: str, m: int, k: int, seed: int, **params):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((m, k)) * rng.uniform(0.05, 3)).astype(np.float32)
    q = {"nf4": nf4, "int4": int4, "q4_0": q4_0, "mixed2bit": mixed2bit}[fmt].quantize(w, **params)
    mod = {"nf4": nf4, "int4": int4, "q4_0": q4_0, "mixed2bit": mixed2bit}[fmt]
    w64 = np.asarray(mod.dequantize(q, dtype="float32"), dtype=np.float64)
    return mod, q, q.to("cuda"), w64


CASES = [
    ("nf4", {}), ("nf4", {"blocksize": 32}), ("nf4", {"blocksize": 256, "compress_statistics": True}),
    ("int4", {"group_size": 128}), ("int4", {"group_size": 32, "symmetric": True}), ("int4", {"group_size": 64}),
    ("q4_0", {}),
    ("mixed2bit", {}), ("mixed2bit", {"group_size": 32, "ratio_4bit": 0.25}), ("mixed2bit", {"ratio_4bit": 0.0}),
    ("mixed2bit", {"ratio_4bit": 1.0, "scale_block": 4}),
    ("mixed2bit", {"layout": "tiled"}), ("mixed2bit", {"layout": "tiled", "group_size": 32, "ratio_4bit": 0.25}),
    ("mixed2bit", {"layout": "tiled", "ratio_4bit": 1.0, "scale_block": 4}),
]


@pytest.mark.parametrize("fmt,params", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", N_VALUES)
def test_weight_only_gemm_cuda(fmt, params, dtype, n):
    m, k = 37, 256 if fmt != "mixed2bit" else 512  # 37 rows: 9 full warps of 4 and one row
    mod, _, qc, w64 = weight(fmt, m, k, n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(DTYPES[dtype]).cuda()
    got = mod.gemm(x, qc)
    assert got.dtype == x.dtype and got.device == x.device and got.shape == (n, m)
    assert_close(got, x, w64, TOL[dtype])


def native_gemm_into_nan(fmt, mod, q, qc, x, m):
    """The format's native CUDA GEMM of x [N, K] and weight qc [m, K], written into an output
    pre-filled with NaN (so unwritten elements show), on torch's current stream."""
    n, k = x.shape
    out = torch.full((n, m), float("nan"), device="cuda", dtype=x.dtype)
    stream = torch.cuda.current_stream().cuda_stream
    if fmt == "nf4":
        mod._native.gemm(x, qc.buffers["packed"], nf4.decoded_absmax(qc), out, m, k, q.params["blocksize"], stream)
    elif fmt == "int4":
        mod._native.gemm(x, qc.buffers["qweight"], qc.buffers["scales"], qc.buffers.get("zeros"), out, n, k, m,
                         q.params["group_size"], stream, tiles=qc.params.get("layout") == "tiles")
    elif fmt == "q4_0":
        mod._native.gemm(x, qc.buffers["blocks"], out, m, n, k, stream)
    elif qc.params.get("layout") == "tiled":
        mod._native.make_tiled_linear(*mixed2bit._tiled_args(qc))(x, out, None, stream)
    else:
        mod._native.gemm(x, *mixed2bit._native_args(qc), out, mixed2bit._row_index(qc), stream)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("fmt,params", [("nf4", {}), ("int4", {"group_size": 32}), ("q4_0", {}),
                                        ("mixed2bit", {"group_size": 16}), ("mixed2bit", {"layout": "tiled"}),
                                        ("mixed2bit", {"layout": "tiled", "group_size": 64})])
def test_weight_only_poison_and_long_k(fmt, params):
    """Outputs pre-filled with NaN are all overwritten; K spans many warp steps (K = 4096 + a
    partial step; + 192 for groups of 64), M not a multiple of the 16 rows of a CTA."""
    m, k, n = 53, 4096 + (192 if params.get("group_size") == 64 else 96), 5
    mod, q, qc, w64 = weight(fmt, m, k, 7, **params)
    x = torch.randn(n, k, device="cuda", dtype=torch.float16)
    assert_close(native_gemm_into_nan(fmt, mod, q, qc, x, m), x, w64, TOL["float16"])


GEMV_FORMATS = [("int4", {"group_size": 32}), ("int4", {"group_size": 64, "symmetric": True}),
                ("int4", {"group_size": 128}), ("q4_0", {}), ("mixed2bit", {"layout": "tiled"})]


@pytest.mark.parametrize("fmt,params,k", [(f, p, k) for f, p in GEMV_FORMATS for k in (32 * 10, 32 * 131, 4096)
                                          if k % p.get("group_size", 32) == 0], ids=str)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_weight_only_gemv_poison_and_partial_steps(fmt, params, k, n, dtype):
    """One and two activation rows, fp16 and bf16: NaN-filled outputs all overwritten, K with a
    partial last warp step (10 and 131 units of 32: a lane's second unit past the row) and with
    whole steps, M = 53 (a partial 16-row CTA)."""
    m = 53
    mod, q, qc, w64 = weight(fmt, m, k, k + n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k)).to(DTYPES[dtype]).cuda()
    assert_close(native_gemm_into_nan(fmt, mod, q, qc, x, m), x, w64, TOL[dtype])


# The offset GEMV (gemm/weight_only_gemv_cuda.cuh) takes int4 with groups of >= 128 at one fp16
# row. K in chunks of 128: 1 and 15 (4 warps a CTA, some with no chunk), 16 and 63 (8, an uneven
# split), 64, 112 and 431 (16; x's table past 48 KB); 880 chunks is past the shared memory x
# needs, so that product falls back to the tensor-core driver. M: partial 16-row CTAs and fewer
# than 16 rows. Two rows run the tensor-core driver, under the same checks.
OFFSET_GEMV_SHAPES = [(5, 128), (53, 128 * 15), (16, 2048), (53, 128 * 63), (37, 128 * 64), (21, 14336),
                      (17, 128 * 431), (3, 128 * 880)]
OFFSET_GEMV_PARAMS = [{"group_size": 128}, {"group_size": 256, "symmetric": True}, {"group_size": 512}]


@pytest.mark.parametrize("params,m,k", [(p, m, k) for p in OFFSET_GEMV_PARAMS for m, k in OFFSET_GEMV_SHAPES
                                        if k % p["group_size"] == 0], ids=str)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("x_kind", ["normal", "offset"])
def test_offset_gemv(params, m, k, n, x_kind):
    """int4 at one (and two) fp16 rows against float64, NaN-filled outputs all overwritten, the same
    bits on a second call, and the bias added bitwise as `y + bias` in fp16. "offset": X = 8 + 0.5 N(0,
    1), so every chunk's sums of X are large and the decode's offsets (about 5e5 per chunk and row,
    taken off in float32) must cancel to within the output's rounding."""
    from qformats import format_spec

    mod, q, qc, w64 = weight("int4", m, k, k + m + n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n))
    if x_kind == "offset":
        x = 8 + 0.5 * x
    x = x.half().cuda()
    y = native_gemm_into_nan("int4", mod, q, qc, x, m)
    assert_close(y, x, w64, TOL["float16"])
    assert torch.equal(native_gemm_into_nan("int4", mod, q, qc, x, m), y)
    run = format_spec("int4").make_linear(qc).run
    bias = torch.randn(m, generator=torch.Generator().manual_seed(m)).half().cuda()
    yb = torch.full((n, m), float("nan"), device="cuda", dtype=torch.float16)
    run(x, yb, bias, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(yb, y + bias)


# int4's "tiles" layout (formats/int4/int4.h): the same groups in the kernels' order. Every CUDA
# driver reads it through the same decode as the rows layout (the prefill kernel's copies through a
# 4-D tensor map that lands the same boxes), so the products are equal bit for bit where both layouts
# take the same driver (same_driver). K from 1 to 880 chunks of 128 (the offset GEMV's warp counts
# and its fallback, as above), group sizes 32-512.
TILES_SHAPES = [(16, 128), (48, 128 * 15), (32, 2048), (16, 128 * 63), (64, 128 * 64), (16, 14336),
                (32, 128 * 431), (16, 128 * 880)]
TILES_PARAMS = [{"group_size": 128}, {"group_size": 256, "symmetric": True}, {"group_size": 512},
                {"group_size": 32}, {"group_size": 64, "symmetric": True}]


def same_driver(params: dict, n: int) -> bool:
    """Whether both layouts take the same kernel: the offset GEMV takes one row of either layout
    (the tiles layout at groups of 128 only) and two rows of the tiles layout only."""
    if n == 1:
        return params["group_size"] <= 128
    return n != 2 or params["group_size"] != 128


@pytest.mark.parametrize("params,m,k", [(p, m, k) for p in TILES_PARAMS for m, k in TILES_SHAPES
                                        if k % p["group_size"] == 0], ids=str)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("x_kind", ["normal", "offset"])
def test_int4_tiles_gemv(params, m, k, n, x_kind):
    """One and two fp16 rows on the tiles layout: against float64, NaN-filled outputs all overwritten,
    the same bits on a second call, and equal to the rows layout's product bit for bit where both take
    the same kernel (X = 8 + 0.5 N(0, 1) too, as in test_offset_gemv)."""
    mod, q, qc, w64 = weight("int4", m, k, k + m + n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n))
    if x_kind == "offset":
        x = 8 + 0.5 * x
    x = x.half().cuda()
    qt = int4.relayout(qc, "tiles")
    y = native_gemm_into_nan("int4", mod, q, qt, x, m)
    assert_close(y, x, w64, TOL["float16"])
    assert torch.equal(native_gemm_into_nan("int4", mod, q, qt, x, m), y)
    if same_driver(params, n):
        assert torch.equal(y, native_gemm_into_nan("int4", mod, q, qc, x, m))


@pytest.mark.parametrize("params", TILES_PARAMS, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", N_VALUES)
def test_int4_tiles_every_driver(params, dtype, n):
    """Every activation row count of the issue's list and every dtype: the tiles layout against float64
    and equal to the rows layout bit for bit; the bound kernel's dequantize (the dequantizing path of
    QuantizedLinear) writes the rows layout's values in row order."""
    from qformats import format_spec

    m, k = 48, 2048
    mod, q, qc, w64 = weight("int4", m, k, n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(DTYPES[dtype]).cuda()
    qt = int4.relayout(qc, "tiles")
    y = native_gemm_into_nan("int4", mod, q, qt, x, m)
    assert_close(y, x, w64, TOL[dtype])
    if same_driver(params, n):
        assert torch.equal(y, native_gemm_into_nan("int4", mod, q, qc, x, m))
    dense = torch.full((m, k), float("nan"), device="cuda", dtype=DTYPES[dtype])
    format_spec("int4").make_linear(qt).run.dequantize(dense, None, torch.cuda.current_stream().cuda_stream)
    assert torch.equal(dense, int4.dequantize(qc, dtype=dtype))


@pytest.mark.parametrize("params", [{"layout": "tiled"}, {"layout": "tiled", "ratio_4bit": 0.3, "scale_block": 4},
                                    {"layout": "tiled", "ratio_4bit": 1.0, "scale_block": 256},
                                    {"layout": "tiled", "ratio_4bit": 0.0}], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2])
def test_mixed2bit_tiled_gemv_many_tiles(params, dtype, n):
    """One and two activation rows on the tiled layout's own GEMV kernel (groups of 16, K a multiple of 64):
    rows of two full 256-group tiles and a partial third (K = 16 * 612: a partial last step too),
    eight warps per CTA whose runs start mid-tile and mid-map-word, no / some / only 4-bit groups,
    scale blocks of 4 to 256 groups, M = 53; NaN-filled outputs all overwritten."""
    m, k = 53, 16 * 612
    mod, q, qc, w64 = weight("mixed2bit", m, k, 11, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(5)).to(DTYPES[dtype]).cuda()
    assert_close(native_gemm_into_nan("mixed2bit", mod, q, qc, x, m), x, w64, TOL[dtype])


@pytest.mark.parametrize("fmt,params,k", [(f, p, k) for f, p in [("nf4", {}), ("int4", {"group_size": 32}),
                                                                   ("int4", {"group_size": 128}), ("q4_0", {}),
                                                                   ("mixed2bit", {"layout": "tiled"})]
                                          for k in (32 * 131, 4096 + 96, 14336) if k % p.get("group_size", 32) == 0],
                         ids=str)
@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_weight_only_staged_activations(fmt, params, k, n, dtype):
    """2..8 activation rows, where the tensor-core kernel's warps copy X into shared memory step by
    step (cp.async, two stages): K of many warp steps with a partial last one (131 units, 4096 + 96)
    or whole ones (14336), rows of X past N never read, M = 53; NaN-filled outputs all overwritten."""
    m = 53
    mod, q, qc, w64 = weight(fmt, m, k, k + n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)).to(DTYPES[dtype]).cuda()
    assert_close(native_gemm_into_nan(fmt, mod, q, qc, x, m), x, w64, TOL[dtype])


WIDE_FORMATS = [("nf4", {}), ("int4", {"group_size": 32}), ("int4", {"group_size": 128}), ("q4_0", {}),
                ("mixed2bit", {"layout": "tiled"})]


@pytest.mark.parametrize("fmt,params,m,k", [(f, p, m, k) for f, p in WIDE_FORMATS
                                            for m, k in ((53, 4096 + 96), (300, 32 * 131), (130, 14336), (17000, 512))
                                            if k % p.get("group_size", 32) == 0], ids=str)
@pytest.mark.parametrize("n", [9, 16, 24, 33, 64])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_weight_only_wide(fmt, params, m, k, n, dtype):
    """9..64 activation rows: on sm_90 the kernel whose CTAs take 128 weight rows and one K slice
    each, the slices of a cluster summed through distributed shared memory. These K leave the
    last slices partial or empty (131 units; 4096 + 96) or split evenly (14336), M is not a
    multiple of 128, and 17000 rows (133 CTAs of 128) take one slice per CTA; NaN-filled outputs all overwritten.
    On an sm_90a build, 33 and 64 rows of int4, nf4 and q4_0 on 17000 x 512 run the prefill kernel
    instead (133 tiles; X's box cut to 40 or 64 of its 128 rows). Below sm_90 the same cases run the
    two-tile kernel."""
    mod, q, qc, w64 = weight(fmt, m, k, k + n + m, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)).to(DTYPES[dtype]).cuda()
    assert_close(native_gemm_into_nan(fmt, mod, q, qc, x, m), x, w64, TOL[dtype])


@pytest.mark.parametrize("fmt,params,n,m,k", [(f, p, n, m, k) for f, p in WIDE_FORMATS if f != "mixed2bit"
                                                for n, m, k in ((65, 53, 4096 + 96), (128, 300, 32 * 131),
                                                                (300, 130, 1024), (512, 257, 14336))
                                                if k % p.get("group_size", 32) == 0], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_weight_only_many_rows(fmt, params, n, m, k, dtype):
    """More than 64 activation rows through the format's native gemm: on an sm_90a build the prefill
    kernel where K is a multiple of 128 (1024, 14336), else the wgmma kernel with 128 activation
    rows per CTA (grid.y covers more; 65 and 300 leave a partial last column of CTAs), elsewhere the
    two-tile kernel; against float64, NaN-filled outputs all overwritten."""
    mod, q, qc, w64 = weight(fmt, m, k, k + n + m, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)).to(DTYPES[dtype]).cuda()
    assert_close(native_gemm_into_nan(fmt, mod, q, qc, x, m), x, w64, TOL[dtype])


# int4, nf4 and q4_0 with fp16 or bf16 activations from 33 rows on an sm_90a build: the kernel that
# decodes in its wgmma main loop (gemm/weight_only_prefill_cuda.cuh). The shapes take each of its
# tiles on a GPU of ~132 SMs: 64 x 128 (few CTAs), 128 x 128, 128 x 192 and 128 x 256 (weight x
# activation rows); M and N leave partial tiles; K = 448 is not a multiple of 128 (nor q4_0's 256),
# and nf4 blocks of 32 are not whole steps (the wgmma kernel takes those). More tiles than the GPU
# holds CTAs, so CTAs take a second tile, partial ones included: 500 x 14333 (224 tiles of
# 128 x 256), 300 x 14333 (224 of 128 x 192, as many waves as 128 x 256) and 600 x 4000 (128 of
# 128 x 192, four columns). 160 x 12800 x 512: 100 tiles of 128 x 192. Unsplit tiles short of
# 3/4 of the SMs, where 128 x 128 would take two waves: 150 x 8900 x 512 (70 of 128 x 192) and
# 250 x 8900 x 512 (70 of 128 x 256). K split over clusters (on an H200, which runs 30 clusters of
# 4 such CTAs at once): 500 x 4000 x 2304, 64 tiles of 128 x 256 in clusters of 2 (the second span
# starting inside a group of 256); 300 x 4000 x 2304, 64 tiles of 128 x 192 in clusters of 2 (as many
# as of 128 x 256, with a quarter less to multiply); 300 x 1800 x 4096, 30 tiles of 128 x 192 in
# clusters of 4; 250 x 3150 x 4096, 25 tiles of 128 x 256 in clusters of 4;
# 200 x 4050 x 4096, 32 tiles of 128 x 256 do not fit clusters of 4 in one wave, so 64 tiles of
# 128 x 128 in clusters of 2; 100 x 4050 x 2304, 32 tiles of 128 x 128 that no cluster size splits
# (36 steps), so 64 tiles of 64 x 128 in clusters of 2 (the second span inside a group). Up to 64
# rows the tiles are 16, 32 or 64 rows of X: 40 x 20000 x 512, 157 tiles of 128 x 64 (CTAs taking a
# second); 40 x 4050 x 2304, 64 x 64 in clusters of 2; 40 x 3150 x 4096, 128 x 64 in clusters of 4;
# for q4_0 (from 16 rows), 20 x 14333 x 512, 112 of 128 x 32, and 16 x 3150 x 4096, 128 x 16 in
# clusters of 4 (the other formats take the wgmma kernel there).
# tests/gemm/test_prefill_plan.py checks these tile claims against the launcher's rules on the CPU.
PREFILL_SHAPES = [(129, 300, 1024), (400, 4173, 256), (300, 14333, 512), (500, 14333, 512), (600, 4000, 512),
                  (500, 4000, 2304), (300, 4000, 2304), (300, 1800, 4096), (250, 3150, 4096), (200, 4050, 4096),
                  (100, 4050, 2304), (160, 12800, 512), (150, 8900, 512), (250, 8900, 512), (200, 520, 8192),
                  (2048, 77, 512), (160, 100, 448), (40, 20000, 512), (40, 4050, 2304), (40, 3150, 4096),
                  (20, 14333, 512), (16, 3150, 4096)]


@pytest.mark.parametrize("fmt,params", [("int4", {"group_size": 128}), ("int4", {"group_size": 64, "symmetric": True}),
                                        ("int4", {"group_size": 256}), ("nf4", {}),
                                        ("nf4", {"blocksize": 256, "compress_statistics": True}),
                                        ("nf4", {"blocksize": 32}), ("q4_0", {})], ids=str)
@pytest.mark.parametrize("n,m,k", PREFILL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill_rows(fmt, params, n, m, k, dtype):
    """Many fp16 or bf16 activation rows of int4, nf4 and q4_0 against float64; NaN-filled outputs
    all overwritten."""
    if fmt == "int4" and k % params["group_size"]:
        pytest.skip("K not a multiple of the group")
    mod, q, qc, w64 = weight(fmt, m, k, k + n + m, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)).to(DTYPES[dtype]).cuda()
    assert_close(native_gemm_into_nan(fmt, mod, q, qc, x, m), x, w64, TOL[dtype])


@pytest.mark.parametrize("fmt,params", [("int4", {"group_size": 128}), ("int4", {"group_size": 64, "symmetric": True}),
                                        ("nf4", {}), ("q4_0", {})], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill_small_scales(fmt, params, dtype):
    """Weights of magnitude ~1e-5 (int4 scales ~4e-6: a scale / 16 would be a deep fp16 subnormal)
    decode as precisely as the format's dequantize to fp16 or bf16 allows: within the tolerance of
    the activations' type."""
    m, k, n = 300, 1024, 200
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((m, k)) * 1e-5).astype(np.float32)
    mod = {"int4": int4, "nf4": nf4, "q4_0": q4_0}[fmt]
    q = mod.quantize(w, **params)
    w64 = np.asarray(mod.dequantize(q, dtype="float32"), dtype=np.float64)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(3)).to(DTYPES[dtype]).cuda()
    assert_close(native_gemm_into_nan(fmt, mod, q, q.to("cuda"), x, m), x, w64, TOL[dtype])


@pytest.mark.parametrize("fmt", ["int4", "nf4", "q4_0"])
@pytest.mark.parametrize("n,m,k", [(300, 14333, 1024), (129, 300, 1024), (300, 4000, 2304), (200, 4050, 4096),
                                   (100, 4050, 2304), (160, 12800, 512), (40, 3150, 4096), (20, 14333, 512)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill_bias_and_streams(fmt, n, m, k, dtype):
    """The prefill kernel's bias is bitwise the product rounded to the activations' type plus the
    bias in that type (K split or not), and a call on a side stream gives the same bits as on the
    default stream."""
    from qformats import format_spec

    _, _, qc, _ = weight(fmt, m, k, n)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(DTYPES[dtype]).cuda()
    bias = torch.randn(m, generator=torch.Generator().manual_seed(m)).to(DTYPES[dtype]).cuda()
    run = format_spec(fmt).make_linear(qc).run
    y, y0, y1 = (torch.full((n, m), float("nan"), device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
    run(x, y, bias, torch.cuda.current_stream().cuda_stream)
    run(x, y0, None, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        run(x, y1, None, side.cuda_stream)
    side.synchronize()
    assert torch.equal(y, y0 + bias)
    assert torch.equal(y1, y0)


# Stream-K (gemm/prefill_plan.h, prefill_stream_k_tiles): where the tiles fill more than one wave
# of the GPU's SMs and the last wave is at most 70% full, the last two waves' tiles are shared out
# as equal spans of their K steps, a tile cut between two CTAs summed through the workspace. The
# weight rows are set from the device's SM count (sms) so that every shape takes it: whole tiles
# of 128 x 256 (N = 256, 1.5 waves, all tiles shared out, spans of 9 or 10 step pairs over tiles
# of 6), 128 x 192 (N = 300: two columns, two waves and two tiles, so one round of whole tiles
# first), 128 x 192 at 129 rows (2.33 waves) and 128 x 128 at 80 rows; M and N leave partial tiles.
STREAM_K_SHAPES = {"256 x 1.5 waves": (256, lambda sms: 128 * (sms + sms // 2) + 77, 768),
                   "300 x 2 waves + 2": (300, lambda sms: 128 * sms + 1, 1024),
                   "129 x 2.33 waves": (129, lambda sms: 128 * (2 * sms + sms // 3), 512),
                   "80 x 1.5 waves": (80, lambda sms: 128 * (sms + sms // 2) - 5, 1024)}


@pytest.mark.parametrize("fmt,params", [("int4", {"group_size": 128}), ("int4", {"group_size": 256, "symmetric": True}),
                                        ("nf4", {}), ("nf4", {"blocksize": 256, "compress_statistics": True}),
                                        ("q4_0", {})], ids=str)
@pytest.mark.parametrize("shape,dtype", [(s, "float16") for s in STREAM_K_SHAPES] + [("256 x 1.5 waves", "bfloat16")],
                         ids=str)
def test_prefill_stream_k(fmt, params, shape, dtype):
    """With the workspace that gemm_workspace asks for (filled with 0xFF bytes first), the prefill
    kernel's stream-K schedule agrees with float64, adds the bias bitwise as the kernel without a
    workspace does, and differs from that kernel only by float32 rounding (a cut tile's two K
    spans summed in another order); NaN-filled outputs all overwritten. On a compute capability
    9.0 device the workspace is asked for."""
    from qformats import format_spec

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, m_of, k = STREAM_K_SHAPES[shape]
    m = m_of(sms)
    mod, q, qc, w64 = weight(fmt, m, k, k + n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)).to(DTYPES[dtype]).cuda()
    bias = torch.randn(m, generator=torch.Generator().manual_seed(m)).to(DTYPES[dtype]).cuda()
    run = format_spec(fmt).make_linear(qc).run
    nbytes = run.gemm_workspace(n)
    sk = torch.cuda.get_device_capability() == (9, 0)  # (a build for the device: sm_90a code)
    if sk:
        assert nbytes > 0
    ws = torch.full((max(nbytes, 1),), 255, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    y, yb, y0 = (torch.full((n, m), float("nan"), device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
    run(x, y, None, stream, ws)
    run(x, yb, bias, stream, ws)
    run(x, y0, None, stream)
    torch.cuda.synchronize()
    assert_close(y, x, w64, TOL[dtype])
    assert torch.equal(yb, y + bias)
    d = (y.float() - y0.float()).abs()
    assert bool((d <= 2 * TOL[dtype] * y0.float().abs() + 1e-3).all()), float(d.max())
    if sk:  # the cut tiles' sums in another order: some outputs round differently
        assert not torch.equal(y, y0)


# The prefill kernel on int4's tiles layout: partial 64- and 128-row tiles (M a multiple of 16 only),
# K split or not, 16 to 2048 rows; and the stream-K schedule over 1.5 waves of tiles.
TILES_PREFILL_SHAPES = [(129, 304, 1024), (300, 4096, 512), (500, 2048, 2304), (40, 14336, 512), (2048, 96, 512),
                        (16, 3152, 4096), (200, 4048, 4096)]


@pytest.mark.parametrize("params", [{"group_size": 128}, {"group_size": 64, "symmetric": True}, {"group_size": 256}],
                         ids=str)
@pytest.mark.parametrize("n,m,k", TILES_PREFILL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int4_tiles_prefill(params, n, m, k, dtype):
    """Many activation rows on the tiles layout: against float64, NaN-filled outputs all overwritten,
    and equal to the rows layout bit for bit."""
    mod, q, qc, w64 = weight("int4", m, k, k + n + m, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)).to(DTYPES[dtype]).cuda()
    qt = int4.relayout(qc, "tiles")
    y = native_gemm_into_nan("int4", mod, q, qt, x, m)
    assert_close(y, x, w64, TOL[dtype])
    assert torch.equal(y, native_gemm_into_nan("int4", mod, q, qc, x, m))


@pytest.mark.parametrize("params", [{"group_size": 128}, {"group_size": 64, "symmetric": True}], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int4_tiles_prefill_stream_k(params, dtype):
    """The stream-K schedule (1.5 waves of 128-row tiles, the workspace filled with 0xFF first) on
    the tiles layout: outputs all written and equal to the rows layout's bit for bit."""
    from qformats import format_spec

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m2 = 128 * (sms + sms // 2) + 80
    _, _, qc2, _ = weight("int4", m2, 768, 3, **params)
    x2 = torch.randn(256, 768, generator=torch.Generator().manual_seed(2)).to(DTYPES[dtype]).cuda()
    outs = []
    for w in (qc2, int4.relayout(qc2, "tiles")):
        run = format_spec("int4").make_linear(w).run
        ws = torch.full((max(run.gemm_workspace(256), 1),), 255, dtype=torch.uint8, device="cuda")
        outs.append(torch.full((256, m2), float("nan"), device="cuda", dtype=DTYPES[dtype]))
        run(x2, outs[-1], None, torch.cuda.current_stream().cuda_stream, ws)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("fmt,params", WIDE_FORMATS, ids=str)
@pytest.mark.parametrize("n,m,k", [(24, 300, 14336), (64, 17000, 512)])
def test_weight_only_wide_bias(fmt, params, n, m, k):
    """The bias added in the epilogue of the wide kernel (split K summed over a cluster, and one
    slice) is bitwise the product rounded to fp16 plus the bias in fp16."""
    from qformats import format_spec

    mod, q, qc, _ = weight(fmt, m, k, n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).half().cuda()
    bias = torch.randn(m, generator=torch.Generator().manual_seed(m)).half().cuda()
    run = format_spec(fmt).make_linear(qc).run
    stream = torch.cuda.current_stream().cuda_stream
    y, y0 = (torch.full((n, m), float("nan"), device="cuda", dtype=torch.float16) for _ in range(2))
    run(x, y, bias, stream)
    run(x, y0, None, stream)
    torch.cuda.synchronize()
    assert torch.equal(y, y0 + bias)


@pytest.mark.parametrize("fmt,params", [("int4", {"group_size": 32}), ("q4_0", {}), ("mixed2bit", {"group_size": 16}),
                                        ("mixed2bit", {"layout": "tiled"})], ids=str)
@pytest.mark.parametrize("n,k", [(1, 20480 - 32), (1, 20480 + 256), (2, 16128 - 32), (2, 16128 + 256),
                                 (2, 19456), (2, 19456 + 64)])
def test_weight_only_gemv_activation_table_limit(fmt, params, n, k):
    """One or two fp16 activation rows on the tensor-core kernel, K on either side of the largest
    rows its shared-memory activation table takes (one row: 40 KB, K = 20480 rounded up to whole
    8-unit steps; two rows: 64 KB, K = 16128 for units of 32 values; above it the kernel reads X
    from global memory or stages it per step): a partial last step below the limit. The tiled
    layout's own GEMV takes two rows up to K = 19456 (96 KB of tables), the driver above."""
    m = 19
    mod, q, qc, w64 = weight(fmt, m, k, k + n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k)).to(torch.float16).cuda()
    assert_close(native_gemm_into_nan(fmt, mod, q, qc, x, m), x, w64, TOL["float16"])


# Both weight-only kernels split K over up to 8 warps of a CTA when M is small: the float32
# kernel (float32 activations; nf4 at one row) in runs of 32-unit steps, the tensor-core kernel
# (mixed2bit with 16-bit activations) in contiguous runs of 8-unit steps. K spans 9 to 37 warp
# steps with a partial last one, and group_map rows start at odd bit offsets (G odd), so that a
# warp's first unit and its chunk-index entries start mid-chunk and mid-byte.
SPLIT_CASES = [("mixed2bit", {"group_size": 16}, 16 * (32 * 9 + 3)),
               ("mixed2bit", {"group_size": 16, "ratio_4bit": 0.3}, 16 * (32 * 33 + 5)),
               ("mixed2bit", {"group_size": 64, "ratio_4bit": 0.5, "scale_block": 4}, 64 * 265),
               ("mixed2bit", {"group_size": 512, "ratio_4bit": 0.25}, 512 * 33),
               ("mixed2bit", {"layout": "tiled"}, 16 * (32 * 9 + 3)),
               ("mixed2bit", {"layout": "tiled", "group_size": 64, "ratio_4bit": 0.5, "scale_block": 4}, 64 * 265),
               ("mixed2bit", {"layout": "tiled", "group_size": 512, "ratio_4bit": 0.25}, 512 * 33),
               ("nf4", {}, 32 * (32 * 33 + 7))]


# (nf4 with 16-bit activations takes the tensor-core kernel above one row: not listed)
@pytest.mark.parametrize("fmt,params,k,n,dtype", [
    (f, p, k, n, d) for f, p, k in SPLIT_CASES
    for n, d in [(1, "float16"), (1, "bfloat16"), (3, "float32"), (9, "float16")]
    if not (f == "nf4" and d != "float32" and n > 1)], ids=str)
def test_weight_only_float_kernel_k_split(fmt, params, k, n, dtype):
    m = 21
    mod, q, qc, w64 = weight(fmt, m, k, k + n, **params)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(k)).to(DTYPES[dtype]).cuda()
    assert_close(native_gemm_into_nan(fmt, mod, q, qc, x, m), x, w64, TOL[dtype])


def test_weight_only_misaligned_x_is_copied_not_misread():
    mod, _, qc, w64 = weight("nf4", 20, 64, 1)
    base = torch.randn(3 * 64 + 1, device="cuda", dtype=torch.float16)
    x = base[1:].view(3, 64)  # data pointer 2 bytes past an aligned one
    assert x.data_ptr() % 16
    assert_close(nf4.gemm(x, qc), x, w64, TOL["float16"])


def test_weight_only_bad_inputs():
    _, _, qc, _ = weight("int4", 8, 64, 0, group_size=32)
    with pytest.raises(ValueError, match="device"):
        int4.gemm(torch.randn(2, 64), qc)  # x on the CPU, w on the GPU
    with pytest.raises(ValueError, match="contiguous"):
        int4.gemm(torch.randn(64, 2, device="cuda").T, qc)
    with pytest.raises(ValueError, match="NaN"):
        int4.gemm(torch.full((2, 64), float("nan"), device="cuda"), qc)
    with pytest.raises(ValueError):
        int4.gemm(torch.randn(2, 48, device="cuda"), qc)
    _, _, q48, _ = weight("int4", 8, 96, 0, group_size=48)
    with pytest.raises(ValueError, match="group_size"):
        int4.gemm(torch.randn(2, 96, device="cuda"), q48)
    # The native adapter checks on its own too: wrong out dtype, wrong sizes.
    out = torch.empty(2, 8, device="cuda", dtype=torch.float32)
    x = torch.randn(2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match="out"):
        int4._native.gemm(x, qc.buffers["qweight"], qc.buffers["scales"], qc.buffers["zeros"], out, 2, 64, 8, 32, 0)


def test_mixed2bit_outliers_fall_back_and_bad_map_raises():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 128)).astype(np.float32)
    q = mixed2bit.quantize(w, outlier_ratio=0.01)
    assert not mixed2bit.gemm_cuda_supported(q)
    qc = q.to("cuda")
    x = torch.randn(3, 128, device="cuda")
    w64 = np.asarray(mixed2bit.dequantize(q), np.float64)
    assert_close(mixed2bit.gemm(x, qc), x, w64, 1e-5)
    q2 = mixed2bit.quantize(w, ratio_4bit=0.2).to("cuda")
    q2.buffers["group_map"] = q2.buffers["group_map"].clone()
    q2.buffers["group_map"][0] ^= 1  # one group more or less than n4
    with pytest.raises(ValueError, match="group_map"):
        mixed2bit.gemm(x, q2)


def test_mixed2bit_tiled_bad_map_raises():
    """A tile whose map marks one 4-bit group more or less, or a bit past the row's last group:
    the tiled layout's CUDA GEMM and its QuantizedLinear refuse the weight."""
    from qformats import format_spec

    w = np.random.default_rng(4).standard_normal((6, 16 * 300)).astype(np.float32)
    x = torch.randn(2, 16 * 300, device="cuda")
    for word, bit in [(0, 0), (9, 31)]:  # word 9 holds groups 288..319 of a 300-group row: bit 31 is padding
        q = mixed2bit.quantize(w, layout="tiled")
        q.buffers["map"][3, word] ^= np.uint32(1 << bit)
        q = q.to("cuda")
        with pytest.raises(ValueError, match="map"):
            mixed2bit.gemm(x, q)
        with pytest.raises(ValueError, match="map"):
            format_spec("mixed2bit").make_linear(q)


# --- integer GEMMs: equal to the CPU ------------------------------------------------------------

@pytest.mark.parametrize("n,m,k", [(1, 1, 1), (3, 37, 33), (17, 64, 100), (65, 130, 256), (130, 67, 4096 + 16),
                                   (300, 260, 1040)])
def test_int8_matmul_cuda_equals_cpu(n, m, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    a = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    want = int8.int8_matmul(a, b)
    got = int8.int8_matmul(a.cuda(), b.cuda())
    assert got.dtype == torch.int32 and got.is_cuda
    assert torch.equal(got.cpu(), want)
    out = torch.full((n, m), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
    int8._native.int8_matmul(a.cuda(), b.cuda(), out, n, m, k, torch.cuda.current_stream().cuda_stream)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("n,m,k", [(1, 5, 2), (3, 37, 34), (70, 65, 256), (9, 130, 4096 + 64)])
def test_int4_matmul_cuda_equals_cpu(n, m, k):
    g = torch.Generator().manual_seed(k)
    a = int4.pack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g))
    b = int4.pack_int4(torch.randint(-8, 8, (m, k), dtype=torch.int8, generator=g))
    want = int4.int4_matmul(a, b)
    assert torch.equal(int4.int4_matmul(a.cuda(), b.cuda()).cpu(), want)


@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bias,relu,per_row", [(False, False, True), (True, True, True), (True, False, False)])
def test_int8_linear_cuda_bitwise_equals_cpu(out_dtype, bias, relu, per_row):
    n, m, k = 33, 70, 96
    g = torch.Generator().manual_seed(5)
    xq = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    wq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    xs = torch.rand(n if per_row else 1, generator=g) / 127
    ws = torch.rand(m if per_row else 1, generator=g) / 127
    b = torch.randn(m, generator=g).to(torch.bfloat16) if bias else None
    want = int8.int8_linear(xq, xs, wq, ws, b, relu=relu, scale_c=0.5, out_dtype=out_dtype)
    got = int8.int8_linear(xq.cuda(), xs.cuda(), wq.cuda(), ws.cuda(), None if b is None else b.cuda(),
                           relu=relu, scale_c=0.5, out_dtype=out_dtype)
    assert got.dtype == want.dtype and got.is_cuda
    assert torch.equal(got.cpu().view(torch.int16 if out_dtype != "float32" else torch.int32),
                       want.view(torch.int16 if out_dtype != "float32" else torch.int32))


@pytest.mark.parametrize("n", N_VALUES + (100,))
def test_q4_0_q8_1_cuda(n):
    """Both paths (mmvq-style GEMV for N <= 16, tiles above): the same exact block sums as the CPU,
    float32 sums in another order, so within 1e-5 of the CPU's result (and of float64)."""
    m, k = 45, 32 * 13
    rng = np.random.default_rng(n)
    wq = q4_0.quantize_q4_0(rng.standard_normal((m, k)).astype(np.float32))
    aq = q8_1.quantize_q8_1(rng.standard_normal((n, k)).astype(np.float32))
    want = q4_0.gemm_q4_0_q8_1(wq, aq, m, n, k)
    got = q4_0.gemm_q4_0_q8_1(torch.from_numpy(wq).cuda(), torch.from_numpy(aq).cuda(), m, n, k)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    w64 = np.asarray(q4_0.dequantize_q4_0(wq, k), np.float64)
    a64 = np.asarray(q8_1.dequantize_q8_1(aq, k), np.float64)
    scale = np.abs(w64) @ np.abs(a64).T
    g = got.cpu().double().numpy()
    assert np.isfinite(g).all()
    assert np.linalg.norm(g - want) <= 1e-5 * np.linalg.norm(scale)
    assert np.linalg.norm(g - w64 @ a64.T) <= 1e-5 * np.linalg.norm(scale)


@pytest.mark.parametrize("n,m,k", [(200, 300, 32 * 40), (129, 131, 32 * 67), (17, 1, 32)])
def test_q4_0_q8_1_cuda_tiles_with_and_without_workspace(n, m, k):
    """Above 16 rows: the tensor-core path (operands unpacked into the workspace, several CTAs
    along M and N, a partial last K stage) and the register-fetch tiles (no workspace) both
    within 1e-5 of the CPU; poisoned outputs are all written."""
    rng = np.random.default_rng(k + n)
    wq = q4_0.quantize_q4_0(rng.standard_normal((m, k)).astype(np.float32))
    aq = q8_1.quantize_q8_1(rng.standard_normal((n, k)).astype(np.float32))
    want = q4_0.gemm_q4_0_q8_1(wq, aq, m, n, k)
    w64 = np.asarray(q4_0.dequantize_q4_0(wq, k), np.float64)
    a64 = np.asarray(q8_1.dequantize_q8_1(aq, k), np.float64)
    scale = np.linalg.norm(np.abs(w64) @ np.abs(a64).T)
    nbytes = q4_0._native.gemm_q4_0_q8_1_workspace_bytes(m, n, k)
    # int8 codes of both, then per block A's float scales and W's (d, -kMagic d) pairs, rows
    # padded to the CTA tile (64 activation rows, 128 weight rows): int8_mma_cuda.cuh ScaledLayout
    assert nbytes == (m + n) * k + (k // 32) * (4 * -(-n // 64) * 64 + 8 * -(-m // 128) * 128)
    stream = torch.cuda.current_stream().cuda_stream
    for ws in (torch.empty(nbytes, dtype=torch.uint8, device="cuda"), None):
        out = torch.full((m, n), float("nan"), device="cuda")
        q4_0._native.gemm_q4_0_q8_1(torch.from_numpy(wq).cuda(), torch.from_numpy(aq).cuda(), out, m, n, k,
                                    workspace=ws, stream=stream)
        g = out.cpu().double().numpy()
        assert np.isfinite(g).all()
        assert np.linalg.norm(g - want) <= 1e-5 * scale
    with pytest.raises(ValueError, match="workspace"):
        q4_0._native.gemm_q4_0_q8_1(torch.from_numpy(wq).cuda(), torch.from_numpy(aq).cuda(), out, m, n, k,
                                    workspace=torch.empty(nbytes - 1, dtype=torch.uint8, device="cuda"),
                                    stream=stream)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [1, 7, 40])
def test_q4_0_linear_cuda(dtype, n):
    """x quantized to q8_1 on the GPU (the CPU's bytes), then the integer GEMM; out in x's dtype."""
    m, k = 29, 256
    rng = np.random.default_rng(n)
    qt = q4_0.quantize(rng.standard_normal((m, k)).astype(np.float32))
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(DTYPES[dtype])
    want = q4_0.linear(x, qt)  # CPU, float32
    got = q4_0.linear(x.cuda(), qt.to("cuda"))
    assert got.dtype == x.dtype and got.shape == (n, m)
    w64 = np.asarray(q4_0.dequantize(qt), np.float64)
    a64 = np.asarray(q8_1.dequantize_q8_1(q8_1.quantize_q8_1(x), k), np.float64)
    scale = np.abs(a64) @ np.abs(w64).T
    g = got.cpu().double().numpy()
    assert np.linalg.norm(g - want.double().numpy()) <= TOL[dtype] * np.linalg.norm(scale)
