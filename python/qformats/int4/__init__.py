"""int4: 4-bit integer codes packed two per byte, with a float32 scale (and, by default, an
integer zero point) per group of ``group_size`` values along the last axis.

Two modes, both in ``src/formats/int4/int4.h`` and :mod:`qformats.int4.reference`:

* asymmetric (default): GPTQ/AWQ/HQQ's min-max + integer zero point convention. Per group
  ``lo = min(min x, 0)``, ``hi = max(max x, 0)``, ``scale = (hi - lo) / 15``,
  ``zero = clamp(rint(-lo / scale), 0, 15)``, ``q = clamp(rint(x / scale) + zero, 0, 15)``;
  decoded ``(q - zero) * scale``. Buffers ``qweight`` uint8 ``[..., K // 2]``, ``scales``
  float32 and ``zeros`` uint8 ``[..., K // group_size]``.
* symmetric: ``scale = max|x| / 7``, ``q = clamp(rint(x / scale), -8, 7)`` stored as the
  two's-complement nibble; decoded ``q * scale``. Buffers ``qweight`` and ``scales``. These
  codes multiply exactly as integers (:func:`int4_matmul`).

Packing: element 2j in the low nibble, element 2j+1 in the high nibble of byte j.

Layouts (``layout=``): "rows" (default) stores the groups row after row, as above. "tiles"
(2-D weights ``[M, K]`` with ``M % 16 == 0``) stores the same groups, each with the same bytes,
in the order the GPU kernels read them: the rows in tiles of 16, a tile's groups one group column
after the other, the tile's 16 rows consecutive in each (row m's group c is stored group
``((m // 16) * C + c) * 16 + m % 16``, ``C = K // group_size``). Buffers ``qweight`` uint8
``[M // 16, C, 16, group_size // 2]``, ``scales`` (and ``zeros``) ``[M // 16, C, 16]``. A CUDA
warp multiplying 16 rows then reads 1 KB contiguous per group of 128 (the order of Marlin's tiles,
arXiv 2408.11743, without its permutation inside them); :func:`relayout` converts either way,
losslessly. Everything takes both layouts. CUDA products are the rows layout's bit for bit except
where a kernel takes one layout only (the one-row kernel takes "tiles" at groups of 128, and two
rows of it; ``docs/formats/int4.md``); on the CPU "tiles" is decoded through the tile path only
(no fused few-row kernel: up to 4 rows the sums differ from the rows layout's by float32 rounding).

Error bound, per element of a group with stored scale ``s`` (derived in ``tests/int4``):
``|x - x'| <= s * (1/2 + 2^-14) + 2^-140`` before the decode's float32 rounding: half a step
(the rounded zero point only moves the clamp window, by less than s/2 at each end, so
clamping adds nothing beyond it), float32 rounding noise, and a subnormal floor. The float32
decode can overflow to +-inf only when a group's values come within s/2 of FLT_MAX.
"""
from __future__ import annotations

from typing import Any

from .. import _arrays as A
from .._core import QuantizedTensor, check_quantized, output_dtype
from .._spec import PREFILL_TUNE_ROWS, WEIGHT_ONLY_ROWS, FormatSpec, LinearKernel
from . import _native, reference

FORMAT = "int4"
GROUP_MULTIPLE = 8            #: group_size must be a positive multiple of this
LAYOUTS = ("rows", "tiles")   #: the stored orders of the groups (module docstring)
TILE_ROWS = 16                #: rows per tile of the "tiles" layout
MAX_MATMUL_K = 33554431       #: largest K with an exact int32 int4_matmul (64 * K < 2^31)

__all__ = ["SPEC", "quantize", "dequantize", "expected_buffers", "relayout", "pack_int4", "unpack_int4",
           "int4_matmul", "gemm", "gemm_cuda_supported", "FORMAT", "GROUP_MULTIPLE", "LAYOUTS", "TILE_ROWS",
           "MAX_MATMUL_K", "reference"]


def _check_params(group_size: Any, symmetric: Any, layout: Any = "rows") -> dict:
    """The params dict; "layout" only when it is "tiles" (absent: rows, as before layouts)."""
    gs = A.check_int(group_size, "group_size", minimum=1)
    if gs % GROUP_MULTIPLE:
        raise ValueError(f"group_size: must be a positive multiple of {GROUP_MULTIPLE}, got {gs}")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric: expected a bool, got {type(symmetric).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return {"group_size": gs, "symmetric": symmetric, **({"layout": "tiles"} if layout == "tiles" else {})}


def _is_tiles(p) -> bool:
    return p.get("layout", "rows") == "tiles"


def _buffer_shapes(shape: tuple, p: dict) -> dict:
    if _is_tiles(p):
        if len(shape) != 2 or shape[0] % TILE_ROWS:
            raise ValueError(f"shape {shape}: the tiles layout needs a 2-D weight [M, K] with M % {TILE_ROWS} == 0")
        (m, k), gs = shape, p["group_size"]
        meta = (m // TILE_ROWS, k // gs, TILE_ROWS)
        out = {"qweight": ("uint8", (*meta, gs // 2)), "scales": ("float32", meta)}
        if not p["symmetric"]:
            out["zeros"] = ("uint8", meta)
        return out
    lead, k = tuple(shape[:-1]), int(shape[-1])
    out = {"qweight": ("uint8", (*lead, k // 2)),
           "scales": ("float32", (*lead, k // p["group_size"]))}
    if not p["symmetric"]:
        out["zeros"] = ("uint8", (*lead, k // p["group_size"]))
    return out


def expected_buffers(shape, params) -> dict:
    """Buffer names -> (dtype, shape) for an int4 tensor of logical ``shape``.

    Args:
        shape: the logical shape (at least 1-D, last dimension a multiple of group_size).
        params: ``{"group_size": int, "symmetric": bool, "layout": "rows" | "tiles"}``; missing
            keys take :func:`quantize`'s defaults (128, False, "rows").
    Returns:
        ``{"qweight": ("uint8", [..., K//2]), "scales": ("float32", [..., K//gs])}`` plus
        ``"zeros": ("uint8", [..., K//gs])`` in the asymmetric mode; in the tiles layout qweight
        ``[M//16, K//gs, 16, gs//2]`` and scales, zeros ``[M//16, K//gs, 16]``.
    Raises:
        ValueError: unknown keys, bad values, a scalar shape, K not divisible by group_size,
            a tiles shape that is not 2-D with M % 16 == 0.
    """
    params = dict(params or {})
    unknown = set(params) - {"group_size", "symmetric", "layout"}
    if unknown:
        raise ValueError(f"int4: unknown parameters {sorted(unknown)}")
    try:
        p = _check_params(params.get("group_size", 128), params.get("symmetric", False),
                          params.get("layout", "rows"))
    except TypeError as e:
        raise ValueError(str(e)) from e
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("int4: shape must be at least 1-D")
    if shape[-1] % p["group_size"]:
        raise ValueError(f"shape {shape}: last dimension must be a multiple of group_size={p['group_size']}")
    return _buffer_shapes(shape, p)


def quantize(x: Any, group_size: int = 128, symmetric: bool = False, layout: str = "rows") -> QuantizedTensor:
    """Quantize to int4 groups along the last axis.

    Args:
        x: float32, float16 or bfloat16 numpy array / torch tensor ``[..., K]``,
            C-contiguous, finite, at least 1-D, on the CPU or (CUDA builds) a CUDA device,
            launched on the current stream; computed in float32 (exact for 16-bit input).
        group_size: values per group, a positive multiple of 8 (32/64/128 typical);
            K % group_size == 0.
        symmetric: False (default) for GPTQ-style codes 0..15 with a zero point per group,
            True for signed codes -8..7 (absmax / 7 scale, no zero point).
        layout: "rows" (default) or "tiles" (x 2-D ``[M, K]`` with M % 16 == 0; the same
            groups in the GPU kernels' order: module docstring).
    Returns:
        A :class:`~qformats.QuantizedTensor` (format "int4", params ``{"group_size",
        "symmetric"}`` plus ``"layout": "tiles"`` for that layout) with buffers ``qweight``
        (uint8 ``[..., K // 2]``), ``scales`` (float32 ``[..., K // group_size]``) and,
        asymmetric only, ``zeros`` (uint8, same shape as scales), in the library and on the
        device of ``x``; the tiles layout's shapes are :func:`expected_buffers`'.
    Raises:
        TypeError: not a numpy array / torch tensor, not a float dtype, group_size not an
            int, symmetric not a bool.
        ValueError: group_size not a positive multiple of 8, K not divisible by it, a
            scalar, non-contiguous, NaN or Inf, an unknown layout, a tiles x that is not 2-D
            with M % 16 == 0.
    """
    p = _check_params(group_size, symmetric, layout)
    A.check_float(x, "x", multiple_of=p["group_size"])
    shape = tuple(x.shape)
    _buffer_shapes(shape, p)  # (the tiles layout's shape checks, before any work)
    rows = {"group_size": p["group_size"], "symmetric": symmetric}
    bufs = {name: A.empty(x, s, dt) for name, (dt, s) in _buffer_shapes(shape, rows).items()}
    with A.stream_for(x) as stream:
        _native.quantize(x, bufs["qweight"], bufs["scales"], bufs.get("zeros"), p["group_size"], stream)
        q = QuantizedTensor(FORMAT, shape, A.dtype_name(x), rows, bufs)
        return relayout(q, layout) if layout != "rows" else q


def relayout(q: QuantizedTensor, layout: str) -> QuantizedTensor:
    """The same int4 weight in another layout ("rows" or "tiles", module docstring; spec in
    ``src/formats/int4/int4.h``, the tile order of Marlin, arXiv 2408.11743): the same groups with
    the same bytes, moved (one copy of the buffers, in their library and on their device, torch on
    the current stream; lossless both ways). ``q`` itself is returned where it already has that
    layout; its buffers are never modified.

    Args:
        q: an int4 QuantizedTensor (numpy or torch buffers, CPU or CUDA); for "tiles" 2-D
            ``[M, K]`` with M % 16 == 0.
        layout: "rows" or "tiles".
    Returns:
        A QuantizedTensor with the params of ``q`` but the layout: rows qweight uint8
        ``[M, K // 2]``, scales float32 / zeros uint8 ``[M, K // gs]``; tiles qweight uint8
        ``[M // 16, K // gs, 16, gs // 2]``, scales / zeros ``[M // 16, K // gs, 16]``
        (:func:`expected_buffers`).
    Raises:
        TypeError: not a QuantizedTensor. ValueError: not int4, malformed buffers, an unknown
            layout, a tiles shape that is not 2-D with M % 16 == 0.
    """
    q = check_quantized(q, FORMAT)
    p = _check_params(q.params.get("group_size", 128), q.params.get("symmetric", False), layout)
    if _is_tiles(p) == _is_tiles(q.params):
        return q
    new = _buffer_shapes(q.shape, p)
    (m, k), gs = q.shape, p["group_size"]
    groups = (m // TILE_ROWS, TILE_ROWS, k // gs)  # rows: [tiles, rows, groups, ...] -> swap axes 1, 2
    bufs = {}
    for name, buf in q.buffers.items():
        tail = (gs // 2,) if name == "qweight" else (1,)
        seen = (*groups, *tail) if _is_tiles(p) else (groups[0], groups[2], groups[1], *tail)
        bufs[name] = A.permuted_copy(buf, seen, (0, 2, 1, 3), new[name][1])
    return QuantizedTensor(FORMAT, q.shape, q.dtype, p, bufs)


def _decode_args(q: QuantizedTensor) -> tuple:
    """(qweight, scales, zeros or None, group_size) of a validated int4 QuantizedTensor,
    checked to be C-contiguous buffers on one device."""
    b = q.buffers
    qweight = A.check_array(b["qweight"], "qweight", "uint8")
    scales = A.check_array(b["scales"], "scales", "float32")
    zeros = None if q.params.get("symmetric", False) else A.check_array(b["zeros"], "zeros", "uint8")
    A.same_device(("qweight", qweight), ("scales", scales), *([("zeros", zeros)] if zeros is not None else []))
    return qweight, scales, zeros, q.params.get("group_size", 128)


def dequantize(q: QuantizedTensor, dtype: str | None = None) -> Any:
    """Decode an int4 QuantizedTensor: ``(q - zero) * scale`` (asymmetric) or ``q * scale``
    (symmetric), in float32, rounded once to ``dtype`` (written directly: one pass).

    Args:
        q: a QuantizedTensor of format "int4" (validated against :func:`expected_buffers`).
        dtype: "float32", "float16" or "bfloat16" (default: the dtype ``q`` was made from;
            bfloat16 needs torch buffers).
    Returns:
        ``q.shape`` array/tensor in the buffers' library, on their device.
    Raises:
        TypeError: not a QuantizedTensor, or a bad dtype. ValueError: malformed buffers, or
            buffers on different devices.
    """
    q = check_quantized(q, FORMAT)
    qweight, scales, zeros, gs = _decode_args(q)
    out = A.empty(qweight, q.shape, output_dtype(q, dtype))
    with A.stream_for(qweight) as stream:
        _native.dequantize(qweight, scales, zeros, out, gs, stream, tiles_K=q.shape[-1] if _is_tiles(q.params) else 0)
    return out


def pack_int4(values: Any) -> Any:
    """Pack 4-bit codes two per byte (element 2j low nibble, 2j+1 high nibble).

    Args:
        values: int8 codes in [-8, 7] (stored as two's-complement nibbles) or uint8 codes in
            [0, 15], ``[..., K]`` with K even; numpy array or torch tensor (CPU or CUDA),
            C-contiguous.
    Returns:
        uint8 ``[..., K // 2]`` in the library and on the device of ``values``.
    Raises:
        TypeError: not an array/tensor, or not int8/uint8.
        ValueError: a scalar, K odd, codes out of range, non-contiguous.
    """
    A.check_type(values, "values")
    dt = A.dtype_name(values)
    if dt not in ("int8", "uint8"):
        raise TypeError(f"values: expected int8 or uint8, got {dt}")
    A.check_array(values, "values", dt)
    if values.ndim < 1 or values.shape[-1] % 2:
        raise ValueError(f"values: expected [..., K] with K even, got shape {tuple(values.shape)}")
    lo, hi = (-8, 7) if dt == "int8" else (0, 15)
    if values.numel() if A.is_torch(values) else values.size:
        vmin, vmax = int(values.min()), int(values.max())
        if vmin < lo or vmax > hi:
            raise ValueError(f"values: {dt} codes must lie in [{lo}, {hi}], got [{vmin}, {vmax}]")
    out = A.empty(values, (*values.shape[:-1], values.shape[-1] // 2), "uint8")
    with A.stream_for(values) as stream:
        _native.pack(values, out, stream)
    return out


def unpack_int4(packed: Any, signed: bool = False) -> Any:
    """Inverse of :func:`pack_int4`.

    Args:
        packed: uint8 ``[..., K // 2]`` (numpy array or torch tensor, CPU or CUDA,
            C-contiguous).
        signed: False: codes as uint8 0..15; True: as int8 -8..7 (two's-complement nibbles).
    Returns:
        ``[..., K]`` uint8 or int8 in the library and on the device of ``packed``.
    Raises:
        TypeError: not an array/tensor or not uint8, ``signed`` not a bool.
        ValueError: a scalar, non-contiguous.
    """
    A.check_array(packed, "packed", "uint8")
    if not isinstance(signed, bool):
        raise TypeError(f"signed: expected a bool, got {type(signed).__name__}")
    if packed.ndim < 1:
        raise ValueError("packed: expected at least 1-D input, got a scalar")
    out = A.empty(packed, (*packed.shape[:-1], 2 * packed.shape[-1]), "int8" if signed else "uint8")
    with A.stream_for(packed) as stream:
        _native.unpack(packed, out, stream)
    return out


def int4_matmul(a: Any, b: Any) -> Any:
    """Exact integer ``A . B^T`` on symmetric packed int4 codes.

    Args:
        a: uint8 ``[N, K // 2]``: signed nibbles (e.g. ``quantize(..., symmetric=True)``'s
            ``qweight``, or :func:`pack_int4` of int8 codes), numpy or torch (CPU or CUDA).
        b: uint8 ``[M, K // 2]``, the same packing, on a's device.
    Returns:
        int32 ``[N, M]``, ``out[n, m] = sum_k a[n, k] * b[m, k]`` over the unpacked signed
        codes, in the library and on the device of ``a``. Exact (``|a * b| <= 64`` and
        K <= 33554431); on CUDA the nibbles are sign-extended in registers and multiplied with
        dp4a.
    Raises:
        TypeError: not arrays/tensors, or not uint8.
        ValueError: not 2-D, K mismatch, K > 33554431, non-contiguous, different devices.
    """
    N, M, K = A.check_matmul_operands("int4_matmul", a, b, "uint8", 2, MAX_MATMUL_K)
    out = A.empty(a, (N, M), "int32")
    with A.stream_for(a) as stream:
        _native.int4_matmul(a, b, out, N, M, K, stream)
    return out


def gemm_cuda_supported(w: QuantizedTensor) -> bool:
    """Whether the CUDA GEMM kernel takes int4 weight ``w``: group_size = 32 * 2^j (32, 64,
    128, ...). :func:`gemm` raises ValueError for CUDA operands otherwise."""
    return bool(_native.gemm_cuda_supports(int(w.params["group_size"])))


def gemm(x: Any, w: QuantizedTensor) -> Any:
    """Weight-only GEMM ``Y = X . W^T`` with float activations and int4 weights.

    On the CPU, for N <= 4 and group_size % 32 == 0, in registers: on AVX-512 CPUs the exact
    values of :func:`dequantize` times x, on AVX2 CPUs per group ``scale * (sum q x - zero *
    sum x)`` (float32, ``src/gemm/cpu_kernels_avx2.cpp``); otherwise the weights are decoded to
    exactly :func:`dequantize`'s values a cache-sized tile at a time and multiplied in float32
    (FMA; ``src/gemm/weight_only_cpu.h``). Threaded, in an order fixed by the CPU's instruction
    set (not by the thread count); within float32 rounding of ``x @ dequantize(w).T``. On the GPU
    in registers (``src/gemm/weight_only_cuda.cuh``: float32 sums of ``(q - zero) * x`` per
    group, times the group's scale), never materialized whole.

    Args:
        x: ``[N, K]`` float32, float16 or bfloat16, numpy or torch (CPU, or CUDA with w's
            buffers on the same device), C-contiguous, finite.
        w: a 2-D int4 QuantizedTensor ``[M, K]``, either mode. On CUDA group_size must be
            32 * 2^j (32, 64, 128, ...).
    Returns:
        ``[N, M]`` in the library and on the device of ``x``: float32 on the CPU, ``x``'s dtype
        on CUDA (one rounding of the float32 result). Range: with float16 activations on CUDA
        the tensor-core decoder forms ``16 * w`` in float16 for half of the nibbles, so weights
        of magnitude 4096 or more (a scale above about 270) come out as Inf / NaN; real
        checkpoints are orders of magnitude below that.
    Raises:
        TypeError: x not a float array/tensor, w not a QuantizedTensor.
        ValueError: x not 2-D, w not 2-D or not int4, K mismatch, non-contiguous, NaN/Inf,
            x and w on different devices, a CUDA group_size that is not 32 * 2^j.
    """
    A.check_type(x, "x")
    w = check_quantized(w, FORMAT)
    A.check_float(x, "x", ndim=2)
    if len(w.shape) != 2:
        raise ValueError(f"gemm: w must be a 2-D int4 tensor [M, K], got shape {w.shape}")
    (N, K), (M, Kw) = x.shape, w.shape
    if K != Kw:
        raise ValueError(f"gemm: K mismatch, x is {tuple(x.shape)} and w is {w.shape}")
    A.same_device(("x", x), *w.buffers.items())
    qweight, scales, zeros, gs = _decode_args(w)
    if A.is_cuda(x) and not gemm_cuda_supported(w):
        raise ValueError(f"int4.gemm on CUDA needs group_size = 32 * 2^j, got {gs}")
    x, out = A.gemm_operands(x, N, M)
    with A.stream_for(x) as stream:
        _native.gemm(x, qweight, scales, zeros, out, N, K, M, gs, stream, A.gemm_workspace(x, N, M),
                     tiles=_is_tiles(w.params))
    return out

# -- the format's face --------------------------------------------------------------------------

def _make_linear(q: QuantizedTensor, derived: Any = None) -> LinearKernel | None:
    """int4 weight ``q`` [M, K] bound to the native weight-only kernel (None on CUDA for a
    group_size the kernel does not take)."""
    qweight, scales, zeros, gs = _decode_args(q)
    if A.is_cuda(qweight) and not gemm_cuda_supported(q):
        return None
    return LinearKernel(_native.make_linear(qweight, scales, zeros, *q.shape, gs, tiles=_is_tiles(q.params)))


def _rounding(weight, params, sensitivity=None):
    """``SPEC.rounding``: :func:`qformats.int4.rounding.for_layer`. That module needs torch, so it
    is imported here on first use: ``qformats.int4`` itself imports with numpy alone."""
    from .rounding import for_layer

    return for_layer(weight, params, sensitivity)


SPEC = FormatSpec(
    name=FORMAT,
    summary="4-bit integer codes, two per byte, float32 scale (+ uint8 zero point) per group",
    source="GPTQ / AWQ group convention (asymmetric min-max with an integer zero point, or symmetric)",
    defaults={"group_size": 128, "symmetric": False},  # (layout "rows": absent)
    group_param="group_size",
    block=lambda p: int(p.get("group_size", 128)),
    row_block=lambda p: TILE_ROWS if _is_tiles(p) else 1,
    quantize=quantize,
    dequantize=dequantize,
    expected_buffers=expected_buffers,
    gemm=gemm,
    linear_rows=WEIGHT_ONLY_ROWS,
    tune_rows=PREFILL_TUNE_ROWS,
    make_linear=_make_linear,
    trainable=lambda p: not p.get("symmetric", False),
    rounding=_rounding,
)
