"""int8: symmetric absmax int8 with float32 scales per tensor, per row or per group; the
rounding of bitsandbytes' ``int8_vectorwise_quant`` (LLM.int8() vector-wise quantization).

Buffers: ``q`` int8 codes in [-127, 127] with the input's shape, and ``scale`` float32 =
``absmax / 127`` per unit, shaped ``[1] * ndim`` (granularity "tensor"), ``[..., 1]``
("row", the last axis) or ``[..., K // group_size]`` ("group"). Decoded value:
``q * scale`` (float32). The exact rule is in ``src/formats/int8/int8.h`` and
:mod:`qformats.int8.reference`: ``m = fl32(127 / absmax)`` once per unit, then
``q = clamp(rint(fl32(x * m)), -127, 127)``, round half to even.

Error bound, per element of a unit with stored scale ``s`` (derived in ``tests/int8``):
``|x - q*s| <= s * (1/2 + 2^-14) + 2^-140`` before the decode's float32 rounding, i.e. half
a step plus float32 rounding of ``m``, ``x*m`` and ``s``, plus a subnormal floor. Clamping
costs nothing beyond that (``|x * m| < 127.5`` whenever m is finite). Exceptions, documented in
the header: a unit with ``0 < absmax < 127 / FLT_MAX`` (~3.7e-37) has an infinite ``m`` and
saturates every nonzero code to +-127 (error <= absmax); ``q * s`` can overflow to +-inf
when absmax is within a rounding of FLT_MAX.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _arrays as A
from .._core import QuantizedTensor, check_quantized, output_dtype
from .._spec import WEIGHT_ONLY_ROWS, FormatSpec, LinearKernel
from . import _native, reference

FORMAT = "int8"
QMAX = 127                                   #: codes are in [-QMAX, QMAX]
GRANULARITIES = ("tensor", "row", "group")   #: what one scale covers
MAX_MATMUL_K = 131071                        #: largest K with an exact int32 int8_matmul

__all__ = ["SPEC", "quantize", "dequantize", "quantize_tensor", "dequantize_tensor", "gemm", "int8_matmul",
           "int8_linear", "expected_buffers", "FORMAT", "QMAX", "GRANULARITIES", "MAX_MATMUL_K", "reference"]


def _check_params(granularity: Any, group_size: Any) -> dict:
    """Canonical params dict; ``group_size`` is only checked (and kept) for "group"."""
    if not isinstance(granularity, str) or granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if granularity != "group":
        return {"granularity": granularity}
    return {"granularity": "group", "group_size": A.check_int(group_size, "group_size", minimum=1)}


def _unit_len(shape: tuple, params: dict) -> int:
    return reference.unit_len(tuple(shape), params["granularity"], params.get("group_size", 0))


def _scale_shape(shape: tuple, params: dict) -> tuple:
    return reference.scale_shape(tuple(shape), params["granularity"], params.get("group_size", 0))


def expected_buffers(shape, params) -> dict:
    """Buffer names -> (dtype, shape) for an int8 tensor of logical ``shape``.

    Args:
        shape: the logical shape (at least 1-D).
        params: ``{"granularity": "tensor" | "row" | "group", "group_size": int}``; missing
            keys take :func:`quantize`'s defaults ("row", 128).
    Returns:
        ``{"q": ("int8", shape), "scale": ("float32", scale shape)}``.
    Raises:
        ValueError: unknown keys, a bad granularity or group size, a scalar shape, or a
            last dimension not divisible by the group size.
    """
    params = dict(params or {})
    unknown = set(params) - {"granularity", "group_size"}
    if unknown:
        raise ValueError(f"int8: unknown parameters {sorted(unknown)}")
    try:
        p = _check_params(params.get("granularity", "row"), params.get("group_size", 128))
    except TypeError as e:
        raise ValueError(str(e)) from e
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("int8: shape must be at least 1-D")
    if p["granularity"] == "group" and shape[-1] % p["group_size"]:
        raise ValueError(f"shape {shape}: last dimension must be a multiple of group_size={p['group_size']}")
    return {"q": ("int8", shape), "scale": ("float32", _scale_shape(shape, p))}


def _quantize(x: Any, params: dict) -> tuple:
    A.check_float(x, "x", multiple_of=params.get("group_size"))
    shape = tuple(x.shape)
    q = A.empty(x, shape, "int8")
    scale = A.empty(x, _scale_shape(shape, params), "float32")
    with A.stream_for(x) as stream:
        _native.quantize(x, q, scale, _unit_len(shape, params), stream)
    return q, scale


def _decode(codes: Any, scale: Any, shape: tuple, unit_len: int, dtype: str) -> Any:
    """``codes * scale`` decoded in float32 and rounded once to ``dtype``, in one native pass
    on the buffers' device."""
    A.check_array(codes, "q", "int8")
    A.check_array(scale, "scale", "float32")
    A.same_device(("q", codes), ("scale", scale))
    out = A.empty(codes, shape, dtype)
    with A.stream_for(codes) as stream:
        _native.dequantize(codes, scale, out, unit_len, stream)
    return out


def quantize(x: Any, granularity: str = "row", group_size: int = 128) -> QuantizedTensor:
    """Quantize to symmetric absmax int8.

    Args:
        x: float32, float16 or bfloat16 numpy array / torch tensor ``[..., K]``,
            C-contiguous, finite, at least 1-D; on the CPU or (CUDA builds) a CUDA device,
            launched on the current stream. Computed in float32 (exact for 16-bit input).
        granularity: "tensor" (one scale), "row" (one per slice along the last axis, as
            bitsandbytes' vector-wise quantization) or "group" (one per ``group_size``
            consecutive values along the last axis).
        group_size: values per group (a positive int, K % group_size == 0); used only for
            granularity "group".
    Returns:
        A :class:`~qformats.QuantizedTensor` (format "int8", params ``{"granularity": ...}``
        plus ``"group_size"`` for "group") with buffers ``q`` (int8, ``x.shape``) and
        ``scale`` (float32: ``[1] * ndim``, ``[..., 1]`` or ``[..., K // group_size]``), in
        the library and on the device of ``x``.
    Raises:
        TypeError: not a numpy array / torch tensor, not a float dtype, group_size not an int.
        ValueError: unknown granularity, group_size < 1, K not divisible by group_size, a
            scalar, non-contiguous, NaN or Inf.
    """
    params = _check_params(granularity, group_size)
    q, scale = _quantize(x, params)
    return QuantizedTensor(FORMAT, tuple(x.shape), A.dtype_name(x), params, {"q": q, "scale": scale})


def dequantize(q: QuantizedTensor, dtype: str | None = None) -> Any:
    """Decode an int8 QuantizedTensor: ``q * scale`` in float32, rounded once to ``dtype``
    (written directly: one pass).

    Args:
        q: a QuantizedTensor of format "int8" (validated against :func:`expected_buffers`).
        dtype: "float32", "float16" or "bfloat16" (default: the dtype ``q`` was made from;
            bfloat16 needs torch buffers).
    Returns:
        ``q.shape`` array/tensor in the buffers' library, on their device.
    Raises:
        TypeError: not a QuantizedTensor, or a bad dtype. ValueError: malformed buffers, or
            buffers on different devices.
    """
    q = check_quantized(q, FORMAT)
    return _decode(q.buffers["q"], q.buffers["scale"], q.shape, _unit_len(q.shape, q.params),
                   output_dtype(q, dtype))


def quantize_tensor(x: Any) -> tuple:
    """Per-tensor symmetric int8 (one scale for the whole tensor).

    Args:
        x: float32/float16/bfloat16 ``[...]`` (at least 1-D), C-contiguous, finite; CPU or
            a CUDA device.
    Returns:
        ``(q, scale)``: q int8 of ``x.shape``, scale float32 of shape ``[1] * x.ndim``
        (``absmax / 127``), in the library of ``x``.
    Raises:
        TypeError / ValueError: as :func:`quantize`.
    """
    return _quantize(x, {"granularity": "tensor"})


def dequantize_tensor(q: Any, scale: Any) -> Any:
    """Decode per-tensor int8: float32 ``q * scale``.

    Args:
        q: int8 array/tensor (at least 1-D, C-contiguous; CPU or a CUDA device).
        scale: float32 array/tensor with exactly one element (e.g. shape ``[1] * q.ndim``),
            on the device of ``q``.
    Returns:
        float32 of ``q.shape`` in the library and on the device of ``q``.
    Raises:
        TypeError: wrong types or dtypes. ValueError: scale not a single element, layout,
            devices differ.
    """
    A.check_array(q, "q", "int8")
    A.check_array(scale, "scale", "float32")
    if q.ndim < 1:
        raise ValueError("q: expected at least 1-D input, got a scalar")
    n_scale = 1
    for s in scale.shape:
        n_scale *= int(s)
    if n_scale != 1:
        raise ValueError(f"scale: expected a single element, got shape {tuple(scale.shape)}")
    shape = tuple(q.shape)
    return _decode(q, scale, shape, reference.unit_len(shape, "tensor", 0), "float32")


def int8_matmul(a: Any, b: Any) -> Any:
    """Exact integer ``A . B^T`` (bitsandbytes' ``int8_linear_matmul`` convention).

    Args:
        a: int8 ``[N, K]`` (numpy array or torch tensor, CPU or CUDA, C-contiguous).
        b: int8 ``[M, K]`` on a's device.
    Returns:
        int32 ``[N, M]``, ``out[n, m] = sum_k a[n, k] * b[m, k]``, in the library and on the
        device of ``a``. Exact: with ``K <= 131071`` no sum can leave int32 (``|a * b| <= 2^14``).
        CPU: threaded, AVX-512 VNNI / AVX2 kernels where the CPU has them; CUDA: dp4a tiles on
        torch's current stream (the same integers everywhere).
    Raises:
        TypeError: not arrays/tensors, or not int8.
        ValueError: not 2-D, K mismatch, K > 131071, non-contiguous, different devices.
    """
    N, M, K = A.check_matmul_operands("int8_matmul", a, b, "int8", 1, MAX_MATMUL_K)
    out = A.empty(a, (N, M), "int32")
    with A.stream_for(a) as stream:
        _native.int8_matmul(a, b, out, N, M, K, stream)
    return out


def _scale_vector(s: Any, name: str, n: int, what: str) -> Any:
    """A float32 scale with ``n`` elements (one per row, any shape such as [n] or [n, 1]) or
    one element (a per-tensor scale); returned flattened."""
    A.check_array(s, name, "float32")
    size = 1
    for d in s.shape:
        size *= int(d)
    if size not in (n, 1):
        raise ValueError(f"{name}: expected {n} elements (one per {what}) or 1 (per tensor), got shape "
                         f"{tuple(s.shape)}")
    return s.reshape(-1)


def int8_linear(x_q: Any, x_scale: Any, w_q: Any, w_scale: Any, bias: Any = None, relu: bool = False,
                scale_c: float = 1.0, out_dtype: str = "float32") -> Any:
    """Fused int8 linear layer: the exact int32 product ``acc = x_q . w_q^T`` (as
    :func:`int8_matmul`), dequantized, biased and optionally rectified in the same pass
    (bitsandbytes' ``int8_linear_matmul`` + ``int8_mm_dequant``; the seed's fused matmul + bias +
    ReLU). Per output element, in float32::

        y[n, m] = acc[n, m] * ((x_scale[n] * w_scale[m]) * scale_c) + bias[m]
        y = max(y, 0) if relu;   then rounded once to out_dtype

    With this module's scales (``absmax / 127``, e.g. ``quantize(x, "row")``) ``scale_c = 1``
    gives ``x . w^T``; with bitsandbytes' row/column statistics (absmax) use
    ``scale_c = 1 / 127**2``.

    Args:
        x_q: int8 ``[N, K]`` activation codes (numpy or torch, CPU or CUDA, C-contiguous; every
            other tensor argument on the same device).
        x_scale: float32 per-row scales, N elements (``[N]`` or ``[N, 1]``, as
            ``quantize(x, "row")``'s ``scale``) or 1 element (per tensor).
        w_q: int8 ``[M, K]`` weight codes.
        w_scale: float32 per-output-row scales, M elements (``[M]`` or ``[M, 1]``) or 1.
        bias: None, or float32/float16/bfloat16 ``[M]`` (converted to float32 exactly).
        relu: apply ``max(., 0)`` after the bias (NaN stays NaN).
        scale_c: a float multiplied into every scale (rounded to float32).
        out_dtype: "float32" (default), "float16" or "bfloat16" (torch only).
    Returns:
        ``[N, M]`` of ``out_dtype`` in the library and on the device of ``x_q``; the CPU and
        the GPU give the same bits (exact integers, the same float32 formula).
    Raises:
        TypeError: wrong types or dtypes (relu not a bool, scale_c not a real number).
        ValueError: shapes (not 2-D, K mismatch, scale or bias sizes), K > 131071,
            non-contiguous, a non-finite scale_c, a bad out_dtype, arguments on different
            devices.
    """
    N, M, K = A.check_matmul_operands("int8_linear", x_q, w_q, "int8", 1, MAX_MATMUL_K)
    A.check_type(x_scale, "x_scale")
    A.check_type(w_scale, "w_scale")
    A.same_device(("x_q", x_q), ("x_scale", x_scale), ("w_scale", w_scale),
                  *((("bias", bias),) if bias is not None else ()))
    xs = _scale_vector(x_scale, "x_scale", N, "row of x_q")
    ws = _scale_vector(w_scale, "w_scale", M, "row of w_q")
    if bias is not None:
        A.check_float(bias, "bias", ndim=1, finite=False)
        if int(bias.shape[0]) != M:
            raise ValueError(f"bias: expected shape ({M},), got {tuple(bias.shape)}")
    if not isinstance(relu, bool):
        raise TypeError(f"relu: expected a bool, got {type(relu).__name__}")
    if isinstance(scale_c, bool) or not isinstance(scale_c, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale_c: expected a real number, got {type(scale_c).__name__}")
    if not np.isfinite(scale_c) or abs(float(scale_c)) > float(np.finfo(np.float32).max):
        raise ValueError(f"scale_c: expected a finite float32 number, got {scale_c}")
    if not isinstance(out_dtype, str):
        raise TypeError(f"out_dtype: expected a str, got {type(out_dtype).__name__}")
    if out_dtype not in A.FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {A.FLOAT_DTYPES}, got {out_dtype!r}")
    if bias is not None and A.is_cuda(bias):
        bias = bias.float()  # exact; the CUDA adapter takes float32
    out = A.empty(x_q, (N, M), out_dtype)
    with A.stream_for(x_q) as stream:
        _native.int8_linear(x_q, xs, w_q, ws, bias, relu, float(scale_c), out, N, M, K, stream)
    return out

def gemm(x: Any, w: QuantizedTensor) -> Any:
    """Weight-only GEMM ``Y = X . W^T`` with float activations and an int8 weight (CPU).

    For N <= 4 activation rows and scale units of a multiple of 16 values (every row- and
    per-tensor scale of such rows, groups of 16 k) on AVX2 / AVX-512 CPUs, each unit's float32
    sum of ``q * x`` is scaled once by the unit's scale (``src/formats/int8/int8_gemm_cpu_avx2.cpp``);
    otherwise the weight is decoded to exactly :func:`dequantize`'s values a tile at a time and
    multiplied in float32. Either way within float32 rounding of ``x @ dequantize(w).T``,
    threaded, in an order that does not depend on the thread count.

    Args:
        x: ``[N, K]`` float32, float16 or bfloat16 numpy array / torch tensor on the CPU,
            C-contiguous, finite.
        w: a 2-D int8 QuantizedTensor ``[M, K]`` with CPU buffers, any granularity.
    Returns:
        float32 ``[N, M]`` in the library of ``x``.
    Raises:
        TypeError: x not a float array/tensor, w not a QuantizedTensor.
        ValueError: x not 2-D, w not 2-D or not int8, K mismatch, non-contiguous, NaN/Inf,
            buffers on a CUDA device (there is no CUDA kernel: dequantize instead).
    """
    A.check_type(x, "x")
    w = check_quantized(w, FORMAT)
    A.check_float(x, "x", ndim=2)
    if len(w.shape) != 2:
        raise ValueError(f"gemm: w must be a 2-D int8 tensor [M, K], got shape {w.shape}")
    (N, K), (M, Kw) = x.shape, w.shape
    if K != Kw:
        raise ValueError(f"gemm: K mismatch, x is {tuple(x.shape)} and w is {w.shape}")
    A.same_device(("x", x), *w.buffers.items())
    if A.is_cuda(x):
        raise ValueError("int8.gemm runs on the CPU only (no CUDA weight-only kernel)")
    x, out = A.gemm_operands(x, N, M)
    _native.gemm(x, w.buffers["q"], w.buffers["scale"], out, N, K, M, _unit_len(w.shape, w.params))
    return out


def _make_linear(q: QuantizedTensor, derived: Any = None) -> LinearKernel | None:
    """int8 weight ``q`` [M, K] bound to the native weight-only kernel (on CUDA, which has no
    such kernel, bound for its decode only: ``linear_rows["cuda"]`` is 0)."""
    codes, scale = q.buffers["q"], q.buffers["scale"]
    return LinearKernel(_native.make_linear(codes, scale, *q.shape, _unit_len(q.shape, q.params)))


# -- the format's face --------------------------------------------------------------------------

def _with_group_size(params: dict, group_size: int) -> dict:
    return {**params, "granularity": "group", "group_size": group_size}


SPEC = FormatSpec(
    name=FORMAT,
    summary="int8 codes with a float32 scale per tensor, row or group",
    source="bitsandbytes int8_vectorwise_quant rounding (LLM.int8(), arXiv 2208.07339)",
    defaults={"granularity": "row"},
    group_param="group_size",
    block=lambda p: int(p.get("group_size", 128)) if p.get("granularity", "row") == "group" else 1,
    with_group_size=_with_group_size,
    quantize=quantize,
    dequantize=dequantize,
    expected_buffers=expected_buffers,
    gemm=gemm,
    linear_rows={"cpu": WEIGHT_ONLY_ROWS["cpu"], "cuda": 0},
    make_linear=_make_linear,
)
