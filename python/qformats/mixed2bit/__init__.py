"""mixed2bit: intra-matrix mixed 2/4-bit weights with second-order scales and fp16 outliers.

Source: Jin et al., "Fast and Efficient 2-bit LLM Inference on GPU: 2/4/16-bit in a Weight
Matrix with Asynchronous Dequantization", arXiv 2311.16442. A weight matrix ``[rows, K]`` is
cut into groups of ``group_size`` values along K; the ``round(ratio_4bit * n_groups)`` groups
with the largest range (or, given a per-column ``sensitivity`` such as a Hessian diagonal, the
largest ``sum(sensitivity * w**2)``) are asymmetric 4-bit, the rest asymmetric 2-bit. The
groups' scales and zero offsets are themselves quantized (4-bit codes for 2-bit groups, 8-bit
codes for 4-bit groups) against one fp16 pair per block of ``scale_block`` groups, and an
optional ``outlier_ratio`` of the 2-bit groups' largest-magnitude elements is kept as fp16.
2-bit and 4-bit groups are stored in separate arrays so a GEMV can stream each.

Buffers (all C-contiguous; n_groups = rows * K / group_size, n2 = n_groups - n4,
B = scale_block):

=============  =======  ===============================  ==========================================
name           dtype    shape                            content
=============  =======  ===============================  ==========================================
group_map      uint8    [ceil(n_groups / 8)]             bit g % 8 of byte g / 8: group g is 4-bit
codes2         int32    [n2, group_size / 16]            2-bit codes, value i in bits 2i..2i+1
codes4         int32    [n4, group_size / 8]             4-bit codes, value i in bits 4i..4i+3
scales2        uint8    [n2]                             sc | mc << 4
scales4        uint8    [n4, 2]                          [sc, mc]
so2, so4       float16  [ceil(n2 or n4 / B), 2]          [d, dm] per block of B groups
outlier_idx    int32    [n_out]                          flat indices r * K + k, increasing
outlier_val    float16  [n_out]                          the outliers' values
=============  =======  ===============================  ==========================================

Layout "tiled" (``quantize(..., layout="tiled")``, ``src/formats/mixed2bit/mixed2bit_tiled.h``):
the same per-group rules, with ``round(ratio_4bit * 256)`` 4-bit groups chosen in every tile of
256 consecutive groups of a row (so every row has the same count), no outliers, and buffers a
row-wise kernel reads by column: ``codes`` int32 [rows, K / 16] (2 bits per value of every
group: a 4-bit group's high bits), ``scales`` uint8 [rows, G] (sc | mc << 4, or a 4-bit group's
8-bit sc), ``so`` float16 [rows, ceil(G / scale_block), 2] (blocks of consecutive positions),
``map`` uint32 [rows, ceil(G / 32)] (bit c: group c is 4-bit), ``lo`` int32 [rows, n4_row,
group_size / 16] (the 4-bit groups' low bits, in position order), ``mc4`` uint8 [rows, n4_row]
and ``so4`` float16 [rows, ceil(G / 256), 2]. About 2.95 bits per weight at the defaults. It
runs on the CPU and on CUDA devices like the global layout; its CUDA dequantizer decodes a tile
whose map does not mark its count of 4-bit groups to NaN (the CPU raises ValueError), and its
CUDA GEMM checks the map once per weight.

Decoded value: ``q * (d * sc) - (dm * mc)`` (float32), outliers replaced by their fp16 value.
At the defaults this stores ~2.94 bits per weight (every buffer counted by
:attr:`QuantizedTensor.avg_bits`). The exact rules are in ``src/formats/mixed2bit/mixed2bit.h``
and :mod:`qformats.mixed2bit.reference`.

Error bound (per non-outlier element x of a group with first-order ``scale``, ``m`` and
decoded ``s_eff = d * sc``, ``m_eff = dm * mc``, qmax = 3 or 15): the codes pick the nearest
point of the grid ``{q * s_eff - m_eff}``, which covers ``[-m_eff, qmax * s_eff - m_eff]`` while
x lies in ``[-m, -m + qmax * scale]``, so
``|x - x'| <= max(s_eff / 2, |m - m_eff| + qmax * |scale - s_eff|)`` up to float32 rounding;
the second-order codes make ``|scale - s_eff| <= d16 / 2`` and ``|m - m_eff| <= dm16 / 2``
(d16, dm16 the block's fp16 fields; more only where a code is clamped at its maximum after
the fp16 rounding of d or dm). Outliers decode to their fp16 value exactly.

Devices: numpy arrays and torch tensors on the CPU, and (CUDA builds) torch tensors on a CUDA
device: quantize, dequantize, pack_2bit and unpack_2bit then run there, on torch's current
stream, with the same bytes as the CPU. The CUDA quantizer selects the 4-bit groups and the
outliers with an exact radix select (the CPU's total orders), takes its scratch memory from
torch's allocator, and waits for its kernels once at the end (a 16-byte copy of error flags) so
that the "values too large" ValueError is raised by the call, as on the CPU. The CUDA
dequantizer is asynchronous; buffers that contradict their params (map popcount != n4, outlier
indices not increasing or out of range), which the CPU rejects with ValueError, decode to NaN
there (:func:`gemm` on CUDA checks the map once per weight and raises ValueError).
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Any

import numpy as np

from .. import _arrays as A
from .._core import QuantizedTensor, check_quantized, output_dtype
from .._spec import TUNE_ROWS, WEIGHT_ONLY_ROWS, FormatSpec, LinearKernel
from . import _native, reference
from ._gemm import _check_tiled_map, _row_index, gemm_cuda_supported

FORMAT = "mixed2bit"
GROUP_MULTIPLE = 16          #: group_size must be a multiple of this
DEFAULT_GROUP_SIZE = 16
DEFAULT_RATIO_4BIT = 0.1
DEFAULT_SCALE_BLOCK = 16
BUFFER_NAMES = reference.BUFFER_NAMES
PARAM_NAMES = ("group_size", "ratio_4bit", "outlier_ratio", "scale_block", "selection", "n4", "n_out")
LAYOUTS = ("global", "tiled")  #: "global": mixed2bit.h; "tiled": mixed2bit_tiled.h
TILED_BUFFER_NAMES = reference.TILED_BUFFER_NAMES
_MAX_INT32 = 2**31 - 1
_TILED_FLAGS_BYTES = 16  # the CUDA quantizer's error flags (kFlagsBytes of mixed2bit_tiled.h)

__all__ = ["SPEC", "quantize", "dequantize", "expected_buffers", "gemm", "gemm_cuda_supported", "pack_2bit",
           "unpack_2bit", "nmse",
           "FORMAT", "BUFFER_NAMES", "TILED_BUFFER_NAMES", "LAYOUTS", "reference"]


# -- parameter checks ------------------------------------------------------------------------

def _check_ratio(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, Real):
        raise TypeError(f"{name}: expected a float in [0, 1], got {type(v).__name__}")
    v = float(v)
    if not (0.0 <= v <= 1.0):  # also rejects NaN
        raise ValueError(f"{name}: must be in [0, 1], got {v}")
    return v


def _check_group_size(group_size: Any) -> int:
    gs = A.check_int(group_size, "group_size", minimum=GROUP_MULTIPLE)
    if gs % GROUP_MULTIPLE:
        raise ValueError(f"group_size: must be a multiple of {GROUP_MULTIPLE}, got {gs}")
    return gs


def _check_sensitivity(sensitivity: Any, K: int) -> np.ndarray:
    """float32 numpy [K] copy-free when possible; TypeError / ValueError on bad input."""
    if not (isinstance(sensitivity, np.ndarray) or A.is_torch(sensitivity)):
        raise TypeError(f"sensitivity: expected a numpy array or a torch tensor, got "
                        f"{type(sensitivity).__name__}")
    if A.dtype_name(sensitivity) not in A.FLOAT_DTYPES + ("float64",):
        raise TypeError(f"sensitivity: expected a float array, got {A.dtype_name(sensitivity)}")
    if tuple(sensitivity.shape) != (K,):
        raise ValueError(f"sensitivity: expected shape ({K},), got {tuple(sensitivity.shape)}")
    s = np.ascontiguousarray(A.to_numpy(sensitivity), dtype=np.float32)
    if not np.isfinite(s).all():
        raise ValueError("sensitivity: contains NaN or Inf (or values beyond float32)")
    if (s < 0).any():
        raise ValueError("sensitivity: must be >= 0")
    return s


def _shape2(shape: Any) -> tuple[int, int]:
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"mixed2bit needs a 2-D [rows, K] shape, got {shape}")
    rows, K = (A.check_int(s, "shape") for s in shape)
    return rows, K


# -- public API ------------------------------------------------------------------------------

def expected_buffers(shape, params) -> dict:
    """Buffer names -> ``(dtype, shape)`` of a mixed2bit tensor.

    Args:
        shape: the logical ``(rows, K)``.
        params: the QuantizedTensor's params: ``group_size``, ``ratio_4bit``, ``outlier_ratio``,
            ``scale_block``, ``selection`` ("range" or "sensitivity"), ``n4``, ``n_out``, and for
            the tiled layout ``layout="tiled"`` (absent: the global layout).
    Returns:
        ``{name: (dtype_str, shape_tuple)}`` for the nine buffers of the global layout or the
        seven of the tiled one (see the module docstring).
    Raises:
        ValueError: missing/unknown params, bad values, K not a multiple of group_size, or n4 /
            n_out not the counts the ratios give for this shape.
        TypeError: a param of the wrong type.
    """
    if not isinstance(params, dict) or set(params) - {"layout"} != set(PARAM_NAMES):
        raise ValueError(f"mixed2bit params must have exactly the keys {PARAM_NAMES} (and optionally "
                         f"'layout'), got {sorted(params) if isinstance(params, dict) else params!r}")
    layout = _check_layout(params.get("layout", "global"))
    rows, K = _shape2(shape)
    gs = _check_group_size(params["group_size"])
    if K % gs:
        raise ValueError(f"K={K} is not a multiple of group_size={gs}")
    ratio = _check_ratio(params["ratio_4bit"], "ratio_4bit")
    orat = _check_ratio(params["outlier_ratio"], "outlier_ratio")
    sb = A.check_int(params["scale_block"], "scale_block", minimum=1)
    if params["selection"] not in ("range", "sensitivity"):
        raise ValueError(f"selection: expected 'range' or 'sensitivity', got {params['selection']!r}")
    n4 = A.check_int(params["n4"], "n4")
    n_out = A.check_int(params["n_out"], "n_out")
    n_groups = rows * (K // gs)
    if layout == "tiled":
        _check_tiled(orat, sb)
        n4_row = reference.tiled_counts(K, gs, ratio)[2]
        if n4 != rows * n4_row or n_out != 0:
            raise ValueError(f"n4={n4}, n_out={n_out} but the tiled layout of ratio_4bit={ratio} gives "
                             f"n4={rows * n4_row}, n_out=0")
        return reference.tiled_buffer_shapes(rows, K, gs, sb, n4_row)
    if n4 != reference.n4_count(ratio, n_groups):
        raise ValueError(f"n4={n4} but ratio_4bit={ratio} of {n_groups} groups gives "
                         f"{reference.n4_count(ratio, n_groups)}")
    if n_out != reference.n_out_count(orat, n_groups - n4, gs):
        raise ValueError(f"n_out={n_out} but outlier_ratio={orat} gives "
                         f"{reference.n_out_count(orat, n_groups - n4, gs)}")
    return reference.buffer_shapes(rows, K, gs, sb, n4, n_out)


def quantize(w: Any, group_size: int = DEFAULT_GROUP_SIZE, ratio_4bit: float = DEFAULT_RATIO_4BIT,
             sensitivity: Any = None, outlier_ratio: float = 0.0,
             scale_block: int = DEFAULT_SCALE_BLOCK, layout: str = "global") -> QuantizedTensor:
    """Quantize a weight matrix to mixed 2/4-bit groups.

    Args:
        w: float32, float16 or bfloat16 array/tensor ``[rows, K]`` (C-contiguous, finite), K a
            multiple of ``group_size``; numpy, torch on the CPU, or torch on a CUDA device (CUDA
            builds: kernels on the current stream, buffers on that device; the call waits for
            its kernels once at the end, to raise the "values too large" error like the CPU).
        group_size: values per group along K; a multiple of 16 (default 16).
        ratio_4bit: fraction of groups stored as 4-bit, in [0, 1] (default 0.1); exactly
            ``floor(ratio_4bit * n_groups + 0.5)`` groups. 0 gives plain 2-bit.
        sensitivity: optional per-column importance, float ``[K]``, finite, >= 0 (e.g. a
            Hessian diagonal / mean squared activation), on any device; not stored. Given,
            groups are ranked by ``sum(sensitivity * w**2)`` instead of their range.
        outlier_ratio: fraction of the 2-bit groups' elements kept as fp16 outliers (largest
            ``|w|`` first), in [0, 1] (default 0). Needs rows * K < 2**31 when non-zero.
        scale_block: groups per second-order block (fp16 [d, dm] pair), >= 1 (default 16); the
            tiled layout: a power of two <= 256 (blocks of consecutive positions of a row).
        layout: "global" (default; the 4-bit groups chosen over the whole matrix,
            ``mixed2bit.h``) or "tiled" (``round(ratio_4bit * 256)`` 4-bit groups in every tile
            of 256 consecutive groups of a row, every group's high 2 bits at its column, no
            outliers; ``mixed2bit_tiled.h``).
    Returns:
        A :class:`~qformats.QuantizedTensor` (format ``"mixed2bit"``) whose buffers are in the
        library of ``w`` (numpy or torch); params hold the arguments above (sensitivity as
        ``selection``), ``n4`` and ``n_out``.
    Raises:
        TypeError: w or sensitivity not a numpy array / torch tensor or not a float dtype, or a
            parameter of the wrong type.
        ValueError: w not 2-D, K not a multiple of group_size, non-contiguous, NaN/Inf,
            group_size not a multiple of 16, a ratio outside [0, 1], scale_block < 1,
            sensitivity of the wrong shape, negative or non-finite, too many elements for
            int32 outlier indices, or values too large for the fp16 second-order fields
            (message "values too large ..."): in a 2-bit group a minimum below about -9.8e5
            or a range above about 2.9e6 (4-bit groups: 17x and 85x more), or an fp16 outlier
            beyond 65504; the tiled layout with outlier_ratio > 0 or a scale_block that is not a
            power of two <= 256.
    """
    gs = _check_group_size(group_size)
    ratio = _check_ratio(ratio_4bit, "ratio_4bit")
    orat = _check_ratio(outlier_ratio, "outlier_ratio")
    sb = A.check_int(scale_block, "scale_block", minimum=1)
    layout = _check_layout(layout)
    A.check_float(w, "w", ndim=2, multiple_of=gs)
    rows, K = (int(s) for s in w.shape)
    sens = None if sensitivity is None else _check_sensitivity(sensitivity, K)
    if layout == "tiled":
        return _quantize_tiled(w, sens, gs, ratio, orat, sb)
    n_groups = rows * (K // gs)
    n4 = reference.n4_count(ratio, n_groups)
    n_out = reference.n_out_count(orat, n_groups - n4, gs)
    if n_out > 0 and rows * K > _MAX_INT32:
        raise ValueError(f"outliers need rows * K < 2**31 (int32 indices), got {rows * K}")
    params = {"group_size": gs, "ratio_4bit": ratio, "outlier_ratio": orat, "scale_block": sb,
              "selection": "range" if sens is None else "sensitivity", "n4": n4, "n_out": n_out}
    shapes = expected_buffers((rows, K), params)
    bufs = {name: A.empty(w, shape, dt) for name, (dt, shape) in shapes.items()}
    _quantize_into(w, sens, gs, sb, n4, n_out, bufs)
    return QuantizedTensor(FORMAT, (rows, K), A.dtype_name(w), params, bufs)


def _on_cuda(x: Any) -> bool:
    return A.is_torch(x) and x.device.type == "cuda"


def _check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_tiled(outlier_ratio: float, scale_block: int) -> None:
    if outlier_ratio != 0.0:
        raise ValueError("the tiled layout has no outliers: outlier_ratio must be 0")
    if scale_block > reference.TILE_GROUPS or scale_block & (scale_block - 1):
        raise ValueError(f"scale_block: the tiled layout needs a power of two <= {reference.TILE_GROUPS}, "
                         f"got {scale_block}")


def _quantize_tiled(w: Any, sens: np.ndarray | None, gs: int, ratio: float, orat: float,
                    sb: int) -> QuantizedTensor:
    _check_tiled(orat, sb)
    rows, K = (int(s) for s in w.shape)
    params = {"group_size": gs, "ratio_4bit": ratio, "outlier_ratio": 0.0, "scale_block": sb,
              "selection": "range" if sens is None else "sensitivity",
              "n4": rows * reference.tiled_counts(K, gs, ratio)[2], "n_out": 0, "layout": "tiled"}
    shapes = expected_buffers((rows, K), params)
    bufs = {name: A.empty(w, shape, dt) for name, (dt, shape) in shapes.items()}
    with A.stream_for(w) as stream:
        flags = None
        if _on_cuda(w):
            if sens is not None:
                sens = A._torch().from_numpy(sens).to(w.device)
            flags = A.empty(w, (_TILED_FLAGS_BYTES,), "uint8")
        _native.tiled_quantize(w, sens, gs, sb, *reference.tiled_tile_counts(K, gs, ratio),
                               *(bufs[n] for n in TILED_BUFFER_NAMES), flags, stream)
    return QuantizedTensor(FORMAT, (rows, K), A.dtype_name(w), params, bufs)


def _tiled_args(q: QuantizedTensor) -> tuple:
    """(rows, K, group_size, scale_block, n4_full, n4_last, *buffers) after checking the buffers."""
    p = q.params
    for name, (dt, _) in expected_buffers(q.shape, p).items():
        A.check_array(q.buffers[name], name, dt)
    A.same_device(*((n, q.buffers[n]) for n in TILED_BUFFER_NAMES))
    rows, K = q.shape
    gs = p["group_size"]
    return (rows, K, gs, p["scale_block"], *reference.tiled_tile_counts(K, gs, p["ratio_4bit"]),
            *(q.buffers[n] for n in TILED_BUFFER_NAMES))


def _tiled(q: QuantizedTensor) -> bool:
    return q.params.get("layout", "global") == "tiled"


def _quantize_into(w: Any, sens: np.ndarray | None, gs: int, sb: int, n4: int, n_out: int,
                   bufs: dict) -> None:
    """The native quantizer writing every buffer of ``bufs`` (checked arguments). On CUDA the
    sensitivity is copied to w's device and the kernels' scratch is a torch uint8 tensor
    (torch's caching allocator on the current stream, so torch accounts for it)."""
    with A.stream_for(w) as stream:
        ws = None
        if _on_cuda(w):
            rows, K = (int(s) for s in w.shape)
            if sens is not None:
                sens = A._torch().from_numpy(sens).to(w.device)
            ws = A.empty(w, (_native.quantize_workspace_bytes(rows, K, gs, sb, n4, n_out),), "uint8")
        _native.quantize(w, sens, gs, sb, n4, n_out, *(bufs[n] for n in BUFFER_NAMES), ws, stream)


def _native_args(q: QuantizedTensor) -> tuple:
    """(rows, K, group_size, scale_block, n4, n_out, *buffers) after checking the buffers."""
    p = q.params
    for name, (dt, _) in expected_buffers(q.shape, p).items():
        A.check_array(q.buffers[name], name, dt)  # C-contiguous, supported device (validate checked shapes)
    A.same_device(*((n, q.buffers[n]) for n in BUFFER_NAMES))
    return (*q.shape, p["group_size"], p["scale_block"], p["n4"], p["n_out"],
            *(q.buffers[n] for n in BUFFER_NAMES))


def dequantize(q: QuantizedTensor, dtype: str | None = None) -> Any:
    """Decode a mixed2bit QuantizedTensor.

    Args:
        q: a mixed2bit :class:`~qformats.QuantizedTensor` (buffers numpy, torch on the CPU, or
            torch on a CUDA device: decoded there, on the current stream, asynchronously).
        dtype: output dtype, "float32", "float16" or "bfloat16" (default: the original dtype).
    Returns:
        ``[rows, K]`` in ``dtype``, in the buffers' library and device: ``q * s_eff - m_eff`` per
        element in float32, outliers replaced by their fp16 values, rounded once to ``dtype``.
    Raises:
        TypeError: not a QuantizedTensor, or a bad dtype. ValueError: another format, or
        buffers that do not match the params (shape, dtype, device; on the CPU also the map
        count and the outlier indices: on CUDA such buffers decode to all-NaN instead, since
        raising would need a synchronization).
        NotImplementedError: buffers on a device without kernels in this build.
    """
    q = check_quantized(q, FORMAT)
    if _tiled(q):
        args = _tiled_args(q)
        like = q.buffers["codes"]
        out = A.empty(like, q.shape, output_dtype(q, dtype))
        if q.numel:
            with A.stream_for(like) as stream:
                _native.tiled_dequantize(*args, out, stream)
        return out
    args = _native_args(q)
    like = q.buffers["codes2"]
    out = A.empty(like, q.shape, output_dtype(q, dtype))
    if q.numel == 0:  # nothing to decode: (2**28, 0) must not make the native code size per-row work
        return out
    with A.stream_for(like) as stream:
        ws = None
        if _on_cuda(like):
            ws = A.empty(like, (_native.dequantize_workspace_bytes(*args[:6]),), "uint8")
        _native.dequantize(*args, out, ws, stream)
    return out


def _check_int_array(v: Any, name: str) -> None:
    if not (isinstance(v, np.ndarray) or A.is_torch(v)):
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(v).__name__}")
    if A.is_torch(v):
        ok = not (v.dtype.is_floating_point or v.dtype.is_complex) and A.dtype_name(v) != "bool"
    else:
        ok = np.issubdtype(v.dtype, np.integer)
    if not ok:
        raise TypeError(f"{name}: expected an integer dtype, got {A.dtype_name(v)}")
    A._check_cpu_contiguous(v, name)


def pack_2bit(values: Any) -> Any:
    """Pack 2-bit values, 16 per int32: value i of each run of 16 in bits 2i..2i+1.

    Args:
        values: integer array/tensor ``[..., n]`` (n a multiple of 16, at least 1-D,
            C-contiguous; CPU or, in CUDA builds, a CUDA device) with values in 0..3.
    Returns:
        int32 ``[..., n // 16]`` in the library and on the device of ``values`` (bit 31 may be
        set: negative).
    Raises:
        TypeError: not an array/tensor, or not an integer dtype.
        ValueError: a scalar, n not a multiple of 16, non-contiguous, or a value outside 0..3.
    """
    _check_int_array(values, "values")
    if values.ndim < 1:
        raise ValueError("values: expected at least 1-D input, got a scalar")
    if values.shape[-1] % 16:
        raise ValueError(f"values: last dimension {values.shape[-1]} is not a multiple of 16")
    if bool(((values < 0) | (values > 3)).any()):
        raise ValueError("values: every value must be in 0..3")
    if A.is_torch(values):
        v8 = values.to(A._torch().uint8).contiguous()
    else:
        v8 = np.ascontiguousarray(values, dtype=np.uint8)
    out = A.empty(values, (*values.shape[:-1], values.shape[-1] // 16), "int32")
    with A.stream_for(values) as stream:
        _native.pack_2bit(v8, out, stream)
    return out


def unpack_2bit(packed: Any, num_elements: int) -> Any:
    """Inverse of :func:`pack_2bit`: the first ``num_elements`` 2-bit values of ``packed``.

    Args:
        packed: int32 array/tensor (any shape, C-contiguous; CPU or, in CUDA builds, a CUDA
            device), read in flat order.
        num_elements: values to unpack, 0 <= num_elements <= 16 * packed.size.
    Returns:
        uint8 ``[num_elements]`` (flattened) in the library and on the device of ``packed``,
        values 0..3.
    Raises:
        TypeError: not an int32 array/tensor or num_elements not an int.
        ValueError: num_elements negative or more than the words hold; non-contiguous.
    """
    A.check_array(packed, "packed", "int32")
    n = A.check_int(num_elements, "num_elements")
    size = int(np.prod(tuple(packed.shape), dtype=np.int64))
    if n > 16 * size:
        raise ValueError(f"num_elements={n} exceeds the {16 * size} values of {size} words")
    out = A.empty(packed, (n,), "uint8")
    with A.stream_for(packed) as stream:
        _native.unpack_2bit(packed, out, stream)
    return out


def nmse(w: Any, q: Any) -> float:
    """Normalized squared error ``||w - w'||^2 / ||w||^2`` in float64.

    Args:
        w: the original float array/tensor.
        q: a QuantizedTensor of w's shape (dequantized to float32) or a dense array/tensor w'.
    Returns:
        The ratio (0.0 when both norms are 0, inf when only ||w|| is 0).
    Raises:
        ValueError: shapes differ.
    """
    w64 = A.to_numpy(w).astype(np.float64)
    wq = q.dequantize("float32") if isinstance(q, QuantizedTensor) else q
    wq64 = A.to_numpy(wq).astype(np.float64)
    if w64.shape != wq64.shape:
        raise ValueError(f"shapes differ: {w64.shape} vs {wq64.shape}")
    num = float(np.sum((w64 - wq64) ** 2))
    den = float(np.sum(w64 ** 2))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def gemm(x: Any, w: QuantizedTensor) -> Any:
    """``Y = X . W^T`` with float activations and mixed2bit weights, never fully materialized:
    decoded a tile of rows at a time on the CPU (for N <= 4 on AVX2 / AVX-512 CPUs a row at a
    time in registers, with group_size 16 the 2-bit groups as ``s * sum(q x) - m * sum(x)``),
    in registers on the GPU (the 2-bit and 4-bit groups streamed from their own arrays: the
    asynchronous dequantization of arXiv 2311.16442).

    Args:
        x: float32, float16 or bfloat16 ``[N, K]`` array/tensor (16-bit values are converted to
            float32 exactly on the CPU), C-contiguous, finite; CPU, or CUDA with w's buffers on
            the same device.
        w: a mixed2bit QuantizedTensor of shape ``[M, K]``.
    Returns:
        ``[N, M]`` in the library and on the device of ``x``: float32 on the CPU (vectorized
        decoders for the 2- and 4-bit groups, outliers patched into each tile, FMA sums in an
        order fixed by the instruction set, not by the thread count); ``x``'s dtype on CUDA. There,
        float16 / bfloat16 ``x`` on sm_80+ runs on tensor cores with each weight rounded to x's
        dtype first (``q * s_eff - m_eff`` with s_eff, m_eff in that dtype: one rounding per
        weight, as dequantize + matmul rounds it) and float32 products and sums; float32 ``x``
        (or an older GPU) combines each 16-value unit's ``sum(q * x)`` and ``sum(x)`` as
        ``s_eff * sum(q x) - m_eff * sum(x)`` in float32 (``src/formats/mixed2bit/mixed2bit_gemm_cuda.cu``).
        Weights the CUDA kernel does not
        take (:func:`gemm_cuda_supported` False: outliers, other group sizes) are dequantized on
        the GPU and multiplied with torch.
    Raises:
        TypeError / ValueError: as :func:`dequantize` for ``w``; x not a float array, not 2-D,
            K mismatch, non-contiguous or non-finite; x and w on different devices; a group_map
            that does not mark n4 groups.
    The tiled layout runs the same way (on the CPU a panel of rows decoded at a time; on CUDA
    ``src/formats/mixed2bit/mixed2bit_tiled_gemm_cuda.cu``), its map checked once per weight,
    except one or two float16 / bfloat16 rows (N <= 2) at groups of 16, K a multiple of 64 and
    K <= 20480 on sm_80+: its own GEMV (``mixed2bit_tiled_gemv_cuda.cuh``) multiplies the exact codes on
    tensor cores and applies each group's ``s_eff``, ``m_eff`` to its float32 sums, as the float32
    path does (the weights are not rounded to x's dtype there).
    """
    w = check_quantized(w, FORMAT)
    A.check_type(x, "x")
    A.check_float(x, "x", ndim=2)
    M, K = w.shape
    if x.shape[1] != K:
        raise ValueError(f"x: expected K={K} columns, got shape {tuple(x.shape)}")
    A.same_device(("x", x), *w.buffers.items())
    if _tiled(w):
        args = _tiled_args(w)
        if not A.is_cuda(x):
            out = A.empty(x, (x.shape[0], M), "float32")
            _native.make_tiled_linear(*args)(x, out)
            return out
        if not gemm_cuda_supported(w):
            return x @ dequantize(w, dtype=A.dtype_name(x)).T
        _check_tiled_map(w, args[:6])
        x, out = A.gemm_operands(x, x.shape[0], M)
        with A.stream_for(x) as stream:
            _native.make_tiled_linear(*args)(x, out, None, stream)
        return out
    if A.is_cuda(x):
        if not gemm_cuda_supported(w):
            return x @ dequantize(w, dtype=A.dtype_name(x)).T
        n4_before = _row_index(w)
        x, out = A.gemm_operands(x, x.shape[0], M)
        with A.stream_for(x) as stream:
            _native.gemm(x, *_native_args(w), out, n4_before, stream)
        return out
    out = A.empty(x, (x.shape[0], M), "float32")
    _native.gemm(x, *_native_args(w), out)
    return out

# -- the format's face --------------------------------------------------------------------------

def _make_linear(q: QuantizedTensor, derived: Any = None) -> LinearKernel | None:
    """mixed2bit weight ``q`` [rows, K] bound to the native weight-only kernel; on CUDA with the
    chunk index (``derived["chunk_index"]``, made here when not given), None for params the
    CUDA kernel does not take (outliers, other group sizes)."""
    if _tiled(q):
        args = _tiled_args(q)
        if _on_cuda(q.buffers["codes"]):
            if not gemm_cuda_supported(q):
                return None
            _check_tiled_map(q, args[:6])
        return LinearKernel(_native.make_tiled_linear(*args))
    args = _native_args(q)
    if not _on_cuda(q.buffers["group_map"]):
        return LinearKernel(_native.make_linear(*args))
    if not gemm_cuda_supported(q):
        return None
    index = (derived or {}).get("chunk_index")
    if index is None:
        index = _row_index(q)
    return LinearKernel(_native.make_linear(*args, index), {"chunk_index": index})


def _rounding(weight, params, sensitivity=None):
    """``SPEC.rounding``: :func:`qformats.mixed2bit.rounding.for_layer`. That module needs torch, so it
    is imported here on first use: ``qformats.mixed2bit`` itself imports with numpy alone."""
    from .rounding import for_layer

    return for_layer(weight, params, sensitivity)


SPEC = FormatSpec(
    name=FORMAT,
    summary="2-bit and 4-bit groups in separate arrays, second-order scales, fp16 outliers",
    source="Jin et al., arXiv 2311.16442 (2/4/16-bit in a weight matrix)",
    defaults={"group_size": DEFAULT_GROUP_SIZE, "ratio_4bit": DEFAULT_RATIO_4BIT},
    group_param="group_size",
    block=lambda p: int(p.get("group_size", DEFAULT_GROUP_SIZE)),
    quantize=quantize,
    dequantize=dequantize,
    expected_buffers=expected_buffers,
    gemm=gemm,
    linear_rows=WEIGHT_ONLY_ROWS,
    tune_rows=TUNE_ROWS,
    make_linear=_make_linear,
    trainable=lambda p: float(p.get("outlier_ratio", 0.0)) == 0.0 and p.get("sensitivity") is None,
    rounding=_rounding,
    calibrated=lambda p: float(p.get("ratio_4bit", DEFAULT_RATIO_4BIT)) > 0,
)
