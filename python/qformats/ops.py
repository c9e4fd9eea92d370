"""torch operators on quantized weights, registered with ``torch.library`` so that
``torch.compile(model, fullgraph=True)`` traces through them.

Two custom operators, opaque to dynamo and described to it by fake (meta) implementations
that only compute output shapes and dtypes:

``qformats::dequantize(str meta, Tensor[] buffers, ScalarType dtype) -> Tensor``
    decode a weight to a dense tensor of ``dtype``.
``qformats::linear(Tensor x, str meta, Tensor[] buffers, Tensor? bias) -> Tensor``
    ``y = x @ W^T + bias`` with a quantized ``W`` ``[out_features, in_features]``.

``meta`` is a canonical JSON string of a weight's format, logical shape, original dtype,
params and buffer names (:func:`weight_meta`); ``buffers`` are its packed buffers in that
order. A string is a constant to dynamo, so one compiled graph serves every call of a layer.

:func:`linear` is **the** place where a quantized weight meets an activation: every
:class:`qformats.nn.QuantizedLinear` forward goes through it, and through
:func:`_linear_dispatch` inside the operator. Today that dequantizes ``W`` to the
activation's dtype and calls ``torch.nn.functional.linear`` (correct for float32, float16
and bfloat16 activations on every device the format decodes on), except where a GEMM kernel is
registered with :func:`register_linear_kernel`: at import, CUDA activations with at most
``CUDA_GEMV_MAX_ROWS`` rows and ``CUDA_GEMV_FORMATS`` weights go through the library's
weight-only kernels, which decode the weight in registers (:func:`use_builtin_kernels`).

Backward: ``qformats::linear`` has an autograd formula for ``x`` and ``bias``
(``grad_x = grad_y @ W``, ``grad_bias = sum grad_y``); the packed weight gets no gradient.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ._core import QuantizedTensor, format_module

__all__ = ["linear", "linear_packed", "dequantize", "dequantize_packed", "weight_meta",
           "register_linear_kernel", "use_builtin_kernels", "FLOAT_DTYPES", "CUDA_GEMV_MAX_ROWS"]

#: Activation / output dtypes the operators take.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: ``(format, device type) -> kernel(x, qweight, bias) -> Tensor | NotImplemented``.
_KERNELS: dict[tuple[str, str], Callable] = {}


# -- the weight description ---------------------------------------------------------------------

def weight_meta(qt: QuantizedTensor) -> str:
    """The ``meta`` string of the operators for QuantizedTensor ``qt``: canonical JSON
    ``{"buffers": [names in order], "dtype", "format", "params", "shape"}`` (buffers in
    ``qt.buffers`` order). Equal weights' descriptions give equal strings."""
    return json.dumps({"format": qt.format, "shape": list(qt.shape), "dtype": qt.dtype,
                       "params": qt.params, "buffers": list(qt.buffers)}, sort_keys=True)


@functools.lru_cache(maxsize=4096)
def _parse_meta(meta: str) -> tuple:
    try:
        m = json.loads(meta)
        return (m["format"], tuple(int(s) for s in m["shape"]), m["dtype"], m["params"],
                tuple(m["buffers"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"qformats: malformed weight description {meta!r}: {e}") from e


@torch.compiler.assume_constant_result
def _in_features(meta: str) -> int:
    """The weight's in_features (last dimension): a constant to torch.compile."""
    return _parse_meta(meta)[1][-1]


def _rebuild(meta: str, buffers: Sequence[torch.Tensor]) -> QuantizedTensor:
    fmt, shape, dtype, params, names = _parse_meta(meta)
    if len(names) != len(buffers):
        raise ValueError(f"qformats: {fmt} weight has buffers {list(names)}, got {len(buffers)} tensors")
    # params is shared with the cache: the format modules only read it.
    return QuantizedTensor(fmt, shape, dtype, params, dict(zip(names, buffers)))


def _as_torch(qt: QuantizedTensor, device) -> QuantizedTensor:
    """``qt`` with torch buffers (numpy ones wrapped without a copy), moved to ``device``
    when one is given."""
    bufs = {k: torch.from_numpy(v) if not isinstance(v, torch.Tensor) else v
            for k, v in qt.buffers.items()}
    if device is not None:
        bufs = {k: v.to(device) for k, v in bufs.items()}
    return QuantizedTensor(qt.format, qt.shape, qt.dtype, qt.params, bufs)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- qformats::dequantize ----------------------------------------------------------------------

@torch.library.custom_op("qformats::dequantize", mutates_args=())
def _dequantize_op(meta: str, buffers: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    qt = _rebuild(meta, buffers)
    return format_module(qt.format).dequantize(qt, dtype=_dtype_name(dtype))


@_dequantize_op.register_fake
def _(meta, buffers, dtype):
    _, shape, _, _, _ = _parse_meta(meta)
    return buffers[0].new_empty(shape, dtype=dtype)


# -- qformats::linear ---------------------------------------------------------------------------

def _linear_dispatch(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ W^T + bias`` for a quantized ``W``: a registered kernel for (format, device) if
    one takes it, else dequantize ``W`` to ``x.dtype`` and ``F.linear`` (the reference path)."""
    kernel = _KERNELS.get((qt.format, x.device.type))
    if kernel is not None:
        y = kernel(x, qt, bias)
        if y is not NotImplemented:
            return y
    w = format_module(qt.format).dequantize(qt, dtype=_dtype_name(x.dtype))
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, w, bias)


@torch.library.custom_op("qformats::linear", mutates_args=())
def _linear_op(x: torch.Tensor, meta: str, buffers: list[torch.Tensor],
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    return _linear_dispatch(x, _rebuild(meta, buffers), bias)


@_linear_op.register_fake
def _(x, meta, buffers, bias):
    _, shape, _, _, _ = _parse_meta(meta)
    return x.new_empty((*x.shape[:-1], shape[0]))


def _linear_setup_context(ctx, inputs, output):
    x, meta, buffers, bias = inputs
    ctx.meta = meta
    ctx.x_dtype = x.dtype
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(*buffers)


def _linear_backward(ctx, grad):
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = torch.ops.qformats.dequantize(ctx.meta, list(ctx.saved_tensors), grad.dtype)
        grad_x = (grad @ w).to(ctx.x_dtype)
    if ctx.has_bias and ctx.needs_input_grad[3]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
    return grad_x, None, [None] * len(ctx.saved_tensors), grad_bias


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# -- Python entry points ------------------------------------------------------------------------

def _check_activation(x: Any, in_features: int, buffers: Sequence[torch.Tensor], name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16 activations, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != in_features:
        raise ValueError(f"{name}: expected shape [..., {in_features}], got {tuple(x.shape)}")
    if buffers and buffers[0].device != x.device:
        raise ValueError(f"{name}: x is on {x.device} but the weight is on {buffers[0].device}; "
                         "move the module with .to(device)")


def linear_packed(x: torch.Tensor, meta: str, buffers: Sequence[torch.Tensor],
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.ops.qformats.linear`` with argument checks: what
    :class:`~qformats.nn.QuantizedLinear` calls.

    Args:
        x: float32 / float16 / bfloat16 tensor ``[..., in_features]``, on the weight's device.
        meta: the weight's description (:func:`weight_meta`).
        buffers: its packed buffers, in the order ``meta`` names them.
        bias: optional ``[out_features]`` (any float dtype; used in ``x.dtype``).
    Returns:
        ``[..., out_features]`` in ``x.dtype`` on ``x.device``.
    Raises:
        TypeError: x not a float tensor of those dtypes.
        ValueError: x's last dimension is not in_features, or x and W are on different devices.
    """
    _check_activation(x, _in_features(meta), buffers, "x")
    return torch.ops.qformats.linear(x, meta, list(buffers), bias)


def linear(x: torch.Tensor, qweight: QuantizedTensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x @ W^T + bias`` with a quantized weight, like ``torch.nn.functional.linear``.

    Args:
        x: float32 / float16 / bfloat16 tensor ``[..., K]``.
        qweight: a 2-D QuantizedTensor ``[M, K]`` of any format with torch buffers on ``x``'s
            device (numpy buffers are wrapped for CPU ``x``).
        bias: optional tensor ``[M]``.
    Returns:
        ``[..., M]`` in ``x.dtype``: ``F.linear(x, dequantize(W, x.dtype), bias)`` exactly, or a
        registered GEMM kernel's result (:func:`register_linear_kernel`; the built-in CUDA GEMV
        sums in float32 and rounds once, within float rounding of that).
    Raises:
        TypeError / ValueError: as :func:`linear_packed`; ValueError for a weight that is not
        2-D or not a valid QuantizedTensor of its format.
    """
    if not isinstance(qweight, QuantizedTensor):
        raise TypeError(f"qweight: expected a QuantizedTensor, got {type(qweight).__name__}")
    if len(qweight.shape) != 2:
        raise ValueError(f"qweight: expected a 2-D weight [out, in], got shape {qweight.shape}")
    if isinstance(x, torch.Tensor):
        qweight = _as_torch(qweight, x.device)
    return linear_packed(x, weight_meta(qweight), list(qweight.buffers.values()), bias)


def dequantize_packed(meta: str, buffers: Sequence[torch.Tensor],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.ops.qformats.dequantize``: the weight described by ``meta`` decoded to ``dtype``
    (float32 / float16 / bfloat16) on the buffers' device. Raises TypeError for another dtype."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    return torch.ops.qformats.dequantize(meta, list(buffers), dtype)


def dequantize(qweight: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A QuantizedTensor with torch buffers decoded to ``dtype`` through the traceable
    operator (the same values as ``qweight.dequantize(dtype)``)."""
    if not isinstance(qweight, QuantizedTensor):
        raise TypeError(f"qweight: expected a QuantizedTensor, got {type(qweight).__name__}")
    qweight = _as_torch(qweight, None)
    return dequantize_packed(weight_meta(qweight), list(qweight.buffers.values()), dtype)


def register_linear_kernel(format: str, device_type: str,
                           kernel: Optional[Callable]) -> Optional[Callable]:
    """Route :func:`linear` for weights of ``format`` and activations on ``device_type``
    (``"cpu"``, ``"cuda"``) through ``kernel(x, qweight, bias) -> Tensor``.

    The kernel gets ``x`` ``[..., K]`` (any float dtype), the QuantizedTensor ``[M, K]`` and
    the bias (or None) and returns ``[..., M]`` in ``x.dtype``, or ``NotImplemented`` to fall
    back to dequantize + ``F.linear`` (e.g. for a dtype or shape it does not cover). It runs
    inside the custom operator, so torch.compile needs nothing more. ``kernel=None`` removes
    the registration. Returns the kernel registered before (or None).
    """
    format_module(format)  # ValueError for an unknown format
    key = (format, str(device_type))
    old = _KERNELS.pop(key, None)
    if kernel is not None:
        _KERNELS[key] = kernel
    return old


# -- built-in GEMM kernels ----------------------------------------------------------------------

#: Activation rows up to which QuantizedLinear on CUDA uses the library's weight-only kernels
#: (one row: ``src/gemm/weight_only_cuda.cuh``; 2-16 rows of fp16/bf16: the tensor-core kernel
#: of ``src/gemm/weight_only_mma_cuda.cuh``); above it, dequantize to x's dtype + cuBLAS is
#: faster (H200, benchmarks/gemm.py, 14336x4096: 46-56 us at 16 rows against 76-82 us for
#: "+cuBLAS"; at 64 rows 124-174 us against 77 us).
CUDA_GEMV_MAX_ROWS = 16
#: Formats whose CUDA kernels beat dequantize + cuBLAS at few rows, with the most activation
#: rows each takes (at most ``CUDA_GEMV_MAX_ROWS``). mixed2bit's tensor-core kernel too
#: (14336x4096 at 16 rows: 38 us against 96 us for "+cuBLAS"; 128 against 96 at 64 rows).
CUDA_GEMV_FORMATS = {"nf4": CUDA_GEMV_MAX_ROWS, "int4": CUDA_GEMV_MAX_ROWS, "q4_0": CUDA_GEMV_MAX_ROWS,
                     "mixed2bit": CUDA_GEMV_MAX_ROWS}


def _cuda_weight_only(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor]):
    """The CUDA weight-only GEMV of nf4 / int4 / q4_0 / mixed2bit for few activation rows;
    NotImplemented (-> dequantize + F.linear) for many rows or parameters the kernels do not take."""
    from . import _arrays as A

    K = qt.shape[-1]
    x2 = x.reshape(-1, K)
    rows = min(CUDA_GEMV_MAX_ROWS, CUDA_GEMV_FORMATS.get(qt.format, 0))
    if x2.shape[0] > rows or x2.shape[0] == 0 or K % 32:
        return NotImplemented
    mod = format_module(qt.format)
    supported = getattr(mod, "gemm_cuda_supported", None)  # int4, mixed2bit: parameter limits
    if supported is not None and not supported(qt):
        return NotImplemented
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    with A.skip_finite_check():  # F.linear does not scan activations either (and no host sync)
        y = mod.gemm(x2, qt)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], qt.shape[0])


def use_builtin_kernels(cuda: bool = True) -> None:
    """Route CUDA :func:`linear` calls of ``CUDA_GEMV_FORMATS`` weights with at most that
    format's number of activation rows through the library's kernels (on by default,
    at import). ``cuda=False`` restores dequantize + ``F.linear`` everywhere. The CPU always takes dequantize + ``F.linear`` (bitwise the
    reference); the CPU GEMMs are reached through the format modules' ``gemm``."""
    for fmt in CUDA_GEMV_FORMATS:
        register_linear_kernel(fmt, "cuda", _cuda_weight_only if cuda else None)


use_builtin_kernels(True)
