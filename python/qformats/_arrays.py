"""Array plumbing shared by every format: the caller's array library (numpy or torch) in,
the same library out, checks that turn bad input into clear exceptions before any native
code runs. torch is optional: numpy-only use never imports it.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

FLOAT_DTYPES = ("float32", "float16", "bfloat16")

# Whether quantizers scan their input for NaN/Inf (one extra read pass, and a host sync for
# CUDA tensors). On by default; `qformats.skip_finite_check()` turns it off for callers who
# know their input is finite (the codecs' output for NaN/Inf input is then unspecified).
_check_finite = True


@contextmanager
def skip_finite_check() -> Iterator[None]:
    """Context manager: quantizers skip the NaN/Inf scan of their input inside it.

    Use it only for input known to be finite (the output for NaN/Inf is then unspecified,
    though never an out-of-bounds access). It saves a full read of the input and, for CUDA
    tensors, a synchronization; the codec benchmark reports both modes.
    """
    global _check_finite
    old, _check_finite = _check_finite, False
    try:
        yield
    finally:
        _check_finite = old


def _torch():
    """The torch module if the caller could have passed a tensor (already imported), else None."""
    return sys.modules.get("torch")


_tensor_type: Any = None  # torch.Tensor once torch is imported (looked up on every check otherwise)


def is_torch(x: Any) -> bool:
    global _tensor_type
    if _tensor_type is None:
        t = _torch()
        if t is None:
            return False
        _tensor_type = t.Tensor
    return isinstance(x, _tensor_type)


# dtype -> name, one table per library (a numpy dtype compared with a torch dtype may raise):
# np.dtype(...).name costs microseconds, and a product checks several buffers per call.
_NP_NAMES: dict = {}
_TORCH_NAMES: dict = {}


def dtype_name(x: Any) -> str:
    """'float32', 'uint8', 'bfloat16', ... for a numpy array or a torch tensor."""
    dt, torch_dtype = x.dtype, is_torch(x)
    names = _TORCH_NAMES if torch_dtype else _NP_NAMES
    name = names.get(dt)
    if name is None:
        name = names[dt] = str(dt).removeprefix("torch.") if torch_dtype else np.dtype(dt).name
    return name


def device_of(x: Any) -> str:
    return str(x.device) if is_torch(x) else "cpu"


def check_type(x: Any, name: str) -> None:
    """TypeError unless x is a numpy array or a dense torch tensor that the native code reads
    as it is. Read-only arrays and memory maps (``np.memmap(..., mode="r")``) are accepted as
    they are, without a copy: every array the public API is given is an input, which the
    native code only reads (its outputs are allocated here). Refused, each with a message
    saying what to do instead:

    - numpy masked arrays (the mask is not honoured by any codec; pass ``x.filled(v)`` or
      ``x.data`` to say what the masked values are);
    - arrays whose byte order is not the machine's (big-endian ``>f4`` on x86/ARM):
      ``x.astype(x.dtype.newbyteorder("="))``;
    - sparse torch tensors (``x.to_dense()``) and tensors with the lazy negation / conjugation
      bit set (``torch._neg_view``, ``x.conj()``: ``x.resolve_neg()`` / ``x.resolve_conj()``),
      whose memory does not hold the values they stand for.
    """
    if is_torch(x):
        t = _torch()
        if x.layout != t.strided:
            raise TypeError(f"{name}: sparse or non-strided tensors ({x.layout}) are not "
                            "supported; pass x.to_dense()")
        if x.is_neg() or x.is_conj():
            raise TypeError(f"{name}: tensor has its lazy negation/conjugation bit set (its memory "
                            "does not hold its values); pass x.resolve_neg().resolve_conj()")
        return
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name}: numpy masked arrays are not supported (the mask would be "
                        "ignored); pass x.filled(value) or x.data")
    if not x.dtype.isnative:
        raise TypeError(f"{name}: byte order {x.dtype.str!r} is not the machine's; pass "
                        "x.astype(x.dtype.newbyteorder('='))")


def cuda_built() -> bool:
    # imported on first use: `import qformats` loads no native module (the formats load theirs
    # when first used), so a broken or partial build still imports
    from ._runtime import cuda_built as built

    return bool(built())


def _check_cpu_contiguous(x: Any, name: str) -> None:
    if is_torch(x):
        if x.requires_grad:
            raise ValueError(f"{name}: tensor requires grad; pass x.detach() (quantization is not differentiable)")
        if x.device.type == "cuda" and not cuda_built():
            raise NotImplementedError(
                f"{name} is on {x.device}, but this build of qformats has no CUDA kernels "
                f"(no GPU was visible when it was built: QFORMATS_CUDA=ON pip install ... builds them); "
                f"move it with .cpu()"
            )
        if x.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"{name} is on {x.device}: only CPU and CUDA are supported")
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor; call .contiguous() first")
    elif not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array; call np.ascontiguousarray() first")


def check_float(
    x: Any,
    name: str = "x",
    *,
    multiple_of: int | None = None,
    ndim: int | None = None,
    finite: bool = True,
) -> Any:
    """Validate a float input: numpy array or torch tensor of float32/float16/bfloat16,
    C-contiguous, on the CPU (or CUDA, in a CUDA build), at least 1-D (exactly ``ndim`` if given), last axis a
    multiple of ``multiple_of``, no NaN/Inf (when ``finite``). Returns ``x`` unchanged.

    Raises TypeError (wrong type or dtype), ValueError (shape, layout, non-finite values),
    NotImplementedError (a device without kernels in this build).
    """
    check_type(x, name)
    dt = dtype_name(x)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {dt}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D input, got shape {tuple(x.shape)}")
    if x.ndim < 1:
        raise ValueError(f"{name}: expected at least 1-D input, got a scalar")
    if multiple_of is not None and x.shape[-1] % multiple_of:
        raise ValueError(
            f"{name}: last dimension {x.shape[-1]} is not a multiple of the block size {multiple_of}"
        )
    _check_cpu_contiguous(x, name)
    if finite and _check_finite and not _all_finite(x):
        raise ValueError(f"{name}: contains NaN or Inf")
    return x


def _all_finite(x: Any) -> bool:
    if is_torch(x):
        return bool(_torch().isfinite(x).all())
    return bool(np.isfinite(x).all())


def check_array(x: Any, name: str, dtype: str, shape: Sequence[int] | None = None) -> Any:
    """Validate a packed buffer: type, exact dtype, C-contiguous on the CPU (or CUDA in a CUDA
    build), and shape if given."""
    check_type(x, name)
    dt = dtype_name(x)
    if dt != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {dt}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    _check_cpu_contiguous(x, name)
    return x


def check_int(v: Any, name: str, *, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {v}")
    return int(v)


def empty(like: Any, shape: Sequence[int], dtype: str) -> Any:
    """Uninitialized output in the caller's library, on the caller's device (torch's caching
    allocator for CUDA tensors)."""
    shape = tuple(int(s) for s in shape)
    if is_torch(like):
        t = _torch()
        return t.empty(shape, dtype=getattr(t, dtype), device=like.device)
    if dtype == "bfloat16":
        raise TypeError("bfloat16 output needs a torch tensor (numpy has no bfloat16)")
    return np.empty(shape, dtype=dtype)


def permuted_copy(x: Any, shape: Sequence[int], axes: Sequence[int], out_shape: Sequence[int]) -> Any:
    """``x`` seen as ``shape``, its axes put in the order ``axes``, copied to a new C-contiguous
    array of ``out_shape`` in x's library and on x's device (one pass; torch on x's current
    stream)."""
    v = x.reshape(tuple(shape))
    if is_torch(x):
        return v.permute(*axes).contiguous().reshape(tuple(out_shape))
    return np.ascontiguousarray(v.transpose(tuple(axes))).reshape(tuple(out_shape))


def gemm_workspace(x: Any, N: int, M: int) -> Any:
    """The device workspace of a CUDA weight-only GEMM of ``x`` (``N`` activation rows, its last
    dimension deep) by ``M`` weight rows on ``x``'s device (an uninitialized uint8 tensor from
    torch's caching allocator), or None where it takes none (the CPU; a GPU or shape without the
    prefill kernel's stream-K schedule, ``src/gemm/weight_only_prefill_cuda.cuh``). Call it with
    ``x``'s device current (:func:`stream_for`)."""
    if not is_cuda(x):
        return None
    from ._runtime import _native as runtime
    nbytes = runtime.weight_only_workspace_bytes(N, M, x.shape[-1])
    return empty(x, (nbytes,), "uint8") if nbytes else None


def is_cuda(x: Any) -> bool:
    """True for a torch tensor on a CUDA device."""
    return is_torch(x) and x.device.type == "cuda"


def check_matmul_operands(name: str, a: Any, b: Any, dtype: str, values_per_element: int,
                          max_k: int) -> tuple[int, int, int]:
    """Checks for the integer GEMMs ``A . B^T``: a [N, Ka] and b [M, Ka] of ``dtype`` (each
    element holding ``values_per_element`` values, so K = Ka * values_per_element), 2-D,
    C-contiguous, on one device (CPU, or CUDA in a CUDA build), K <= max_k (so the int32
    result cannot overflow). Returns (N, M, K). Raises TypeError / ValueError /
    NotImplementedError (CUDA tensors in a build without CUDA kernels)."""
    check_array(a, "a", dtype)
    check_array(b, "b", dtype)
    same_device(("a", a), ("b", b))
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"{name}: expected 2-D a and b, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    (n, ka), (m, kb) = a.shape, b.shape
    if ka != kb:
        raise ValueError(f"{name}: K mismatch, a is {tuple(a.shape)} and b is {tuple(b.shape)}")
    k = ka * values_per_element
    if k > max_k:
        raise ValueError(f"{name}: K={k} > {max_k}, the int32 result could overflow")
    return int(n), int(m), int(k)


def same_device(*named: tuple[str, Any]) -> None:
    """ValueError unless every (name, array) is on the device of the first."""
    dev0 = device_of(named[0][1])
    for name, a in named[1:]:
        if device_of(a) != dev0:
            raise ValueError(f"{name} is on {device_of(a)} but {named[0][0]} is on {dev0}; "
                             f"move them to one device first")


@contextmanager
def stream_for(x: Any) -> Iterator[int]:
    """The stream argument of a native call on ``x``'s device: 0 on the CPU; for a CUDA tensor,
    torch's current stream on that device (made the current device meanwhile), so kernels
    queue behind the caller's work like any torch operation."""
    if is_torch(x) and x.device.type == "cuda":
        t = _torch()
        with t.cuda.device(x.device):
            yield t.cuda.current_stream(x.device).cuda_stream
    else:
        yield 0


def gemm_operands(x: Any, N: int, M: int) -> tuple[Any, Any]:
    """``(x, out)`` for a weight-only GEMM: on the CPU ``x`` as given and a float32 ``[N, M]``
    output; on a CUDA device the output takes ``x``'s dtype and ``x`` is copied when its data
    is not 16-byte aligned (a view at an odd offset), as the kernels load 8 values at a time."""
    if is_cuda(x):
        if x.data_ptr() % 16:
            x = x.clone()
        return x, empty(x, (N, M), dtype_name(x))
    return x, empty(x, (N, M), "float32")


def zeros(like: Any, shape: Sequence[int], dtype: str) -> Any:
    shape = tuple(int(s) for s in shape)
    if is_torch(like):
        t = _torch()
        return t.zeros(shape, dtype=getattr(t, dtype), device=like.device)
    return np.zeros(shape, dtype=dtype)


def cast(x: Any, dtype: str) -> Any:
    """x converted to ``dtype`` (a no-op when it already is). bfloat16 needs torch."""
    if dtype_name(x) == dtype:
        return x
    if is_torch(x):
        return x.to(getattr(_torch(), dtype))
    if dtype == "bfloat16":
        raise TypeError("bfloat16 output needs a torch tensor (numpy has no bfloat16)")
    return x.astype(dtype)


def fp16_field_overflowed(blocks: Any, byte_offset: int) -> bool:
    """True if the little-endian fp16 field at ``byte_offset`` of any block (last axis = the
    block's bytes) is +-inf or NaN: exponent bits all ones, read from the high byte."""
    hi = blocks[..., byte_offset + 1]
    return bool(((hi & 0x7C) == 0x7C).any())


def to_numpy(x: Any) -> np.ndarray:
    """A numpy view or copy of x; bfloat16 tensors become float32 (exact)."""
    if is_torch(x):
        x = x.detach().cpu()
        if dtype_name(x) == "bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def float32_numpy(x: Any) -> np.ndarray:
    """x as a float32 numpy array (exact for float16/bfloat16 inputs): what the references compute on."""
    return to_numpy(x).astype(np.float32, copy=False)
