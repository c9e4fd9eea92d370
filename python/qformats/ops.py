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

``meta`` may also name ``derived`` tensors (after the packed buffers in ``buffers``): what a
format's kernel reads besides the packed bytes (nf4's decoded absmax, mixed2bit's CUDA chunk
index), made once by :class:`qformats.nn.QuantizedLinear` so that no forward allocates them.

How a product runs (:func:`_linear_dispatch`, inside the operator): a kernel registered with
:func:`register_linear_kernel` first; else, for at most ``spec.linear_rows[device type]``
activation rows (the format's :class:`~qformats._spec.FormatSpec`), the format's native kernel
(:func:`run_linear`: the weight decoded in registers on CUDA, the threaded AVX-512 / AVX2
kernels on the CPU, the bias added in the kernel); else the weight dequantized to the
activation's dtype and ``torch.nn.functional.linear``. :class:`qformats.nn.QuantizedLinear`
calls :func:`run_linear` directly in eager inference (no operator, no re-validation) and the
operator otherwise (autograd, torch.compile).

Backward: ``qformats::linear`` has an autograd formula for ``x`` and ``bias``
(``grad_x = grad_y @ W``, ``grad_bias = sum grad_y``); the packed weight gets no gradient.
"""
from __future__ import annotations

import functools
import json
import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ._core import QuantizedTensor, format_module, format_spec

__all__ = ["linear", "linear_packed", "dequantize", "dequantize_packed", "weight_meta", "run_linear", "run_dense",
           "register_linear_kernel", "use_builtin_kernels", "kernel_rows", "kernels_on", "FLOAT_DTYPES"]

#: Activation / output dtypes the operators take.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: ``(format, device type) -> kernel(x, qweight, bias) -> Tensor | NotImplemented``.
_KERNELS: dict[tuple[str, str], Callable] = {}


# -- the weight description ---------------------------------------------------------------------

def weight_meta(qt: QuantizedTensor, derived: Sequence[str] = ()) -> str:
    """The ``meta`` string of the operators for QuantizedTensor ``qt``: canonical JSON
    ``{"buffers": [names in order], "derived": [names], "dtype", "format", "params", "shape"}``
    (buffers in ``qt.buffers`` order; ``derived``: the names of the kernel's derived tensors
    that follow the buffers in the operator's tensor list). Equal weights' descriptions give
    equal strings."""
    return json.dumps({"format": qt.format, "shape": list(qt.shape), "dtype": qt.dtype,
                       "params": qt.params, "buffers": list(qt.buffers), "derived": list(derived)},
                      sort_keys=True)


@functools.lru_cache(maxsize=4096)
def _parse_meta(meta: str) -> tuple:
    try:
        m = json.loads(meta)
        return (m["format"], tuple(int(s) for s in m["shape"]), m["dtype"], m["params"],
                tuple(m["buffers"]), tuple(m.get("derived", ())))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"qformats: malformed weight description {meta!r}: {e}") from e


@torch.compiler.assume_constant_result
def _in_features(meta: str) -> int:
    """The weight's in_features (last dimension): a constant to torch.compile."""
    return _parse_meta(meta)[1][-1]


def _rebuild(meta: str, buffers: Sequence[torch.Tensor]) -> tuple[QuantizedTensor, dict]:
    """(the weight, its derived tensors by name) from an operator's arguments."""
    fmt, shape, dtype, params, names, derived = _parse_meta(meta)
    if len(names) + len(derived) != len(buffers):
        raise ValueError(f"qformats: {fmt} weight has buffers {list(names)} and derived tensors "
                         f"{list(derived)}, got {len(buffers)} tensors")
    # params is shared with the cache: the format modules only read it.
    qt = QuantizedTensor(fmt, shape, dtype, params, dict(zip(names, buffers[:len(names)])))
    return qt, dict(zip(derived, buffers[len(names):]))


def _as_torch(qt: QuantizedTensor, device) -> QuantizedTensor:
    """``qt`` with torch buffers (numpy ones wrapped without a copy), moved to ``device``
    when one is given."""
    bufs = {k: _wrap(v) if not isinstance(v, torch.Tensor) else v for k, v in qt.buffers.items()}
    if device is not None:
        bufs = {k: v.to(device) for k, v in bufs.items()}
    return QuantizedTensor(qt.format, qt.shape, qt.dtype, qt.params, bufs)


def _wrap(a: Any) -> torch.Tensor:
    """A numpy buffer as a torch tensor on its memory. torch warns when that memory is read-only
    (a loaded memory map): its tensors are writable. These tensors live for one call of this
    module, which only reads them, so the warning would be about nothing the caller holds."""
    if not isinstance(a, np.ndarray) or a.flags.writeable:
        return torch.from_numpy(a)  # (TypeError for what is no array, as before)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- qformats::dequantize ----------------------------------------------------------------------

@torch.library.custom_op("qformats::dequantize", mutates_args=())
def _dequantize_op(meta: str, buffers: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    qt, _ = _rebuild(meta, buffers)
    return format_module(qt.format).dequantize(qt, dtype=_dtype_name(dtype))


@_dequantize_op.register_fake
def _(meta, buffers, dtype):
    shape = _parse_meta(meta)[1]
    return buffers[0].new_empty(shape, dtype=dtype)


# -- qformats::linear ---------------------------------------------------------------------------

#: Device types on which the formats' native kernels are used (:func:`use_builtin_kernels`).
_BUILTIN_ON = {"cpu": True, "cuda": True}

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def kernels_on(device_type: str) -> bool:
    """Whether the formats' native kernels are switched on for ``device_type`` (``"cpu"``,
    ``"cuda"``; :func:`use_builtin_kernels`). Any other device type: False."""
    return _BUILTIN_ON.get(device_type, False)


def kernel_rows(spec, device_type: str) -> int:
    """The most activation rows for which weights of ``spec``'s format (a
    :class:`~qformats.FormatSpec`) go to its native kernel on ``device_type``: its
    ``linear_rows[device_type]`` while :func:`kernels_on`, else 0 (dequantize + ``F.linear``)."""
    return spec.linear_rows.get(device_type, 0) if kernels_on(device_type) else 0


def _stream(device: torch.device) -> int:
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def run_linear(run: Callable, x: torch.Tensor, bias: Optional[torch.Tensor], M: int) -> torch.Tensor:
    """``x @ W^T + bias`` through a bound native kernel (``LinearKernel.run``) of a weight
    ``[M, K]`` on x's device: x ``[..., K]`` float32 / float16 / bfloat16 (copied when not
    contiguous, or on CUDA not 16-byte aligned), bias ``[M]`` or None. Returns ``[..., M]`` in
    x's dtype: on CUDA the kernel writes it (bias cast to x's dtype, added in the kernel's
    epilogue exactly as ``y + bias`` in that dtype would); on the CPU the float32 product plus
    a float32 bias, cast to x's dtype. Launches on torch's current stream of x's device, which
    must be the current device; on CUDA with the device workspace the kernel asks for
    (``run.gemm_workspace(rows)`` bytes, torch's caching allocator; the prefill kernel's stream-K
    partial sums), freed on return. ``run`` checks what it is given: ValueError for a device,
    shape or size that does not fit the bound weight, TypeError for a dtype."""
    if not x.is_contiguous():
        x = x.contiguous()
    if x.is_cuda:
        if x.data_ptr() % 16:
            x = x.clone()
        out = torch.empty((*x.shape[:-1], M), dtype=x.dtype, device=x.device)
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            bias = bias.to(x.dtype).contiguous()
        ws_bytes = run.gemm_workspace(out.numel() // M) if M else 0
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=x.device) if ws_bytes else None
        run(x, out, bias, _stream(x.device), ws)
        return out
    out = torch.empty((*x.shape[:-1], M), dtype=torch.float32)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    run(x, out, bias, 0)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def run_dense(run: Callable, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``W`` ``[M, K]`` decoded to ``x.dtype`` by a bound native
    kernel (``LinearKernel.run.dequantize``): the numbers of the operator's dequantizing path
    (the same decode, the same ``F.linear``) without its per-call validation of the packed
    buffers, which the bound kernel did once. The decode is the format's own (its spec:
    ``qformats.<fmt>.SPEC.source``), float32 rounded once to x's dtype.

    Args:
        run: a bound native ``Linear`` (:attr:`qformats.FormatSpec.make_linear`) of a weight
            ``[M, K]``.
        x: float32 / float16 / bfloat16 ``[..., K]`` on the weight's device (the current
            device on CUDA; launched on its current stream).
        bias: ``[M]`` in x's dtype, or None.
    Returns:
        ``[..., M]`` in x's dtype. The decoded weight is a temporary of ``M * K`` elements of
        x's dtype (and, where the format needs one, a device workspace of
        ``run.dequantize_workspace`` bytes), freed on return.
    Raises:
        ValueError: x on another device than the weight (the decode refuses its output).
        RuntimeError: x's last dimension is not K (from ``F.linear``).
    """
    w = torch.empty((run.M, run.K), dtype=x.dtype, device=x.device)
    ws_bytes = run.dequantize_workspace
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=x.device) if ws_bytes else None
    run.dequantize(w, ws, _stream(x.device) if x.is_cuda else 0)
    return F.linear(x, w, bias)


def _linear_dispatch(x: torch.Tensor, qt: QuantizedTensor, bias: Optional[torch.Tensor],
                     derived: Optional[dict] = None) -> torch.Tensor:
    """``x @ W^T + bias`` for a quantized ``W``: a registered kernel for (format, device) if
    one takes it; the format's native kernel for few rows; else dequantize ``W`` to
    ``x.dtype`` and ``F.linear`` (the reference path)."""
    kernel = _KERNELS.get((qt.format, x.device.type))
    if kernel is not None:
        y = kernel(x, qt, bias)
        if y is not NotImplemented:
            return y
    spec = format_spec(qt.format)
    M, K = qt.shape
    rows = x.numel() // K if K else 0
    if spec.make_linear is not None and 0 < rows <= kernel_rows(spec, x.device.type):
        bound = spec.make_linear(qt, derived)
        if bound is not None:
            if x.is_cuda:
                with torch.cuda.device(x.device):
                    return run_linear(bound.run, x, bias, M)
            return run_linear(bound.run, x, bias, M)
    w = spec.dequantize(qt, dtype=_dtype_name(x.dtype))
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, w, bias)


@torch.library.custom_op("qformats::linear", mutates_args=())
def _linear_op(x: torch.Tensor, meta: str, buffers: list[torch.Tensor],
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    qt, derived = _rebuild(meta, buffers)
    return _linear_dispatch(x, qt, bias, derived)


@_linear_op.register_fake
def _(x, meta, buffers, bias):
    shape = _parse_meta(meta)[1]
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
        w = torch.ops.qformats.dequantize(ctx.meta, list(ctx.saved_tensors), grad.dtype)  # derived ignored
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

def use_builtin_kernels(cuda: bool = True, cpu: bool = True) -> None:
    """Whether :func:`linear` (and every QuantizedLinear) runs the formats' native kernels for
    few activation rows (``FormatSpec.linear_rows``) on CUDA and on the CPU (both on by
    default). With a device switched off, that device always takes dequantize + ``F.linear``
    (bitwise the reference)."""
    _BUILTIN_ON["cuda"] = bool(cuda)
    _BUILTIN_ON["cpu"] = bool(cpu)
