"""q4_0: GGML's 4-bit block format (llama.cpp ``block_q4_0``), byte-compatible with
llama.cpp's ``quantize_row_q4_0_ref`` and the gguf package's ``Q4_0``.

Blocks of 32 values along the last axis, 18 bytes each: fp16 ``d`` then ``qs[16]``
(element j in the low nibble of ``qs[j]``, element j+16 in the high nibble); 4.5 bits/value.
Decoded value: ``(q - 8) * d``. The exact rule is in ``src/formats/q4_0/q4_0.h`` and
:mod:`qformats.q4_0.reference`. Error bound: ``|x - x'| <= |d| / 2`` (plus fp16 rounding of
``d``), where ``|d| = max|x| / 8`` of the block.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _arrays as A
from .._blockwise import BlockCodec
from .._core import QuantizedTensor, check_quantized
from .._spec import PREFILL_TUNE_ROWS, WEIGHT_ONLY_ROWS, FormatSpec, LinearKernel, fixed_blocks
from . import _native, reference

FORMAT = "q4_0"
QK = 32           #: values per block
BLOCK_BYTES = 18  #: bytes per block

__all__ = ["SPEC", "quantize", "dequantize", "quantize_q4_0", "dequantize_q4_0", "gemm_q4_0_q8_1", "linear",
           "gemm", "QK", "BLOCK_BYTES", "reference"]

_CODEC = BlockCodec(FORMAT, QK, BLOCK_BYTES, "65520 * 8", _native)


def quantize_q4_0(x: Any) -> Any:
    """Quantize to q4_0 blocks along the last axis.

    Args:
        x: float32, float16 or bfloat16 array/tensor ``[..., K]``, K a multiple of 32,
            C-contiguous, finite; numpy, torch on the CPU, or torch on a CUDA device (CUDA
            builds; launched on the current stream).
    Returns:
        uint8 ``[..., K // 32, 18]`` in the same library (numpy/torch) as ``x``.
    Raises:
        TypeError: not a numpy array / torch tensor, or not a float dtype.
        ValueError: K not a multiple of 32, a scalar, non-contiguous, NaN or Inf, or a
            block whose scale overflows fp16 (``max |x|`` of a block >= 65520 * 8).
    """
    return _CODEC.quantize(x)


def dequantize_q4_0(x_q: Any, K: int, dtype: str = "float32") -> Any:
    """Decode q4_0 blocks.

    Args:
        x_q: uint8 ``[..., K // 32, 18]`` as returned by :func:`quantize_q4_0`.
        K: values per row (a multiple of 32).
        dtype: output dtype, "float32" (default), "float16" or "bfloat16" (torch only); values
            are decoded in float32 and rounded once to it.
    Returns:
        ``[..., K]`` of ``dtype``, in the library and on the device of ``x_q``.
    Raises:
        TypeError / ValueError: wrong dtype, or shape not ``[..., K // 32, 18]``.
    """
    return _CODEC.dequantize(x_q, K, dtype)


def expected_buffers(shape, params) -> dict:
    """Buffer names -> (dtype, shape) for a q4_0 tensor of logical ``shape`` (no params)."""
    return _CODEC.expected_buffers(shape, params)


def quantize(x: Any) -> QuantizedTensor:
    """Quantize ``x`` ([..., K], K % 32 == 0; float32/float16/bfloat16, numpy or torch) to a
    q4_0 :class:`~qformats.QuantizedTensor` with one buffer, ``blocks`` (uint8
    ``[..., K // 32, 18]``). Raises as :func:`quantize_q4_0`."""
    return _CODEC.quantize_tensor(x)


def dequantize(q: QuantizedTensor, dtype: str | None = None) -> Any:
    """Decode a q4_0 QuantizedTensor to ``q.shape`` in ``dtype`` (default: the original)."""
    return _CODEC.dequantize_tensor(q, dtype)


def gemm_q4_0_q8_1(weight_q: Any, activation_q: Any, M: int, N: int, K: int) -> Any:
    """``W . A^T`` on quantized operands, as llama.cpp's q4_0 x q8_1 dot products
    (ggml-cpu ``ggml_vec_dot_q4_0_q8_0``, whose q8_0 codes are q8_1's; ggml-cuda
    ``vec_dot_q4_0_q8_1``).

    Args:
        weight_q: uint8 ``[M, K // 32, 18]`` q4_0 blocks (W is ``[M, K]``), numpy or torch (CPU
            or CUDA).
        activation_q: uint8 ``[N, K // 32, 36]`` q8_1 blocks from
            :func:`qformats.q8_1.quantize_q8_1` (A is ``[N, K]``).
        M, N, K: the sizes; K a multiple of 32.
    Returns:
        float32 ``[M, N]`` in the library and on the device of ``weight_q``: ``out[m, n] = sum_b d_w * d_a *
        sum_j (q_w - 8) * q_a`` over the K/32 blocks, each block sum an exact integer (the -8
        offset folded in integers, as llama.cpp's CPU kernel; q8_1's rounded ``s`` field is not
        used), float32 accumulation across blocks. The order of that float32 sum depends on
        the CPU's instruction set (AVX-512 VNNI, AVX2 or plain C++), never on the thread count.
        On CUDA the block sums are the same integers (dp4a: llama.cpp's mmvq for N <= 16; above,
        int8 tensor cores on sm_80+, on both operands unpacked to int8 codes and float32 block
        scales in a workspace of about ``(M + N) * (K + K // 8) + M * K // 8`` bytes, each block
        sum scaled by ``d_w`` then ``d_a``) and the float32 sum runs in another order.
    Raises:
        TypeError: not arrays/tensors, not uint8, M/N/K not ints.
        ValueError: K not a multiple of 32, shapes that do not match M, N, K, non-contiguous,
            operands on different devices.
    """
    M, N, K = (A.check_int(v, n) for v, n in ((M, "M"), (N, "N"), (K, "K")))
    if K % QK:
        raise ValueError(f"K={K} is not a multiple of {QK}")
    A.check_type(weight_q, "weight_q")
    A.check_type(activation_q, "activation_q")
    A.same_device(("weight_q", weight_q), ("activation_q", activation_q))
    A.check_array(weight_q, "weight_q", "uint8", (M, K // QK, BLOCK_BYTES))
    A.check_array(activation_q, "activation_q", "uint8", (N, K // QK, 36))
    out = A.empty(weight_q, (M, N), "float32")
    with A.stream_for(weight_q) as stream:
        _native.gemm_q4_0_q8_1(weight_q, activation_q, out, M, N, K, False,
                               workspace=_workspace(weight_q, M, N, K), stream=stream)
    return out


def _workspace(like: Any, M: int, N: int, K: int) -> Any:
    """CUDA scratch for :func:`gemm_q4_0_q8_1`'s tensor-core path (unpacked operands), allocated
    by the caller's library on ``like``'s device and stream; None where none is needed."""
    if not A.is_cuda(like):
        return None
    nbytes = _native.gemm_q4_0_q8_1_workspace_bytes(M, N, K)
    return A.empty(like, (nbytes,), "uint8") if nbytes else None


def _weight_and_x(name: str, x: Any, w: QuantizedTensor) -> tuple:
    """Checks shared by :func:`linear` and :func:`gemm`: (x, blocks, N, M, K)."""
    w = check_quantized(w, FORMAT)
    A.check_type(x, "x")
    A.check_float(x, "x", ndim=2)
    A.same_device(("x", x), ("blocks", w.buffers["blocks"]))
    if len(w.shape) != 2:
        raise ValueError(f"{name}: w must be a 2-D q4_0 tensor [M, K], got shape {w.shape}")
    (N, K), (M, Kw) = (int(s) for s in x.shape), w.shape
    if K != Kw:
        raise ValueError(f"{name}: K mismatch, x is {tuple(x.shape)} and w is {list(w.shape)}")
    blocks = A.check_array(w.buffers["blocks"], "blocks", "uint8", (M, K // QK, BLOCK_BYTES))
    return blocks, N, M, K


def _max_abs(x: Any) -> float:
    if A.is_torch(x):
        return float(x.abs().max()) if x.numel() else 0.0
    return float(np.abs(x).max()) if x.size else 0.0


def linear(x: Any, w: QuantizedTensor) -> Any:
    """llama.cpp's quantized linear layer: ``Y = X . W^T`` with the activations quantized to q8_1
    on the fly (exactly :func:`qformats.q8_1.quantize_q8_1`'s blocks) and the integer q4_0 x
    q8_1 dot products of :func:`gemm_q4_0_q8_1` (llama.cpp: ``quantize_row_q8_1`` then
    ggml-cpu ``ggml_vec_dot_q4_0_q8_0`` / ggml-cuda ``vec_dot_q4_0_q8_1``), threaded, with
    AVX-512 VNNI (VPDPBUSD) or AVX2 (VPMADDUBSW) integer dot products where the CPU has them.

    Args:
        x: float32, float16 or bfloat16 ``[N, K]`` activations (numpy or torch, CPU or CUDA,
            C-contiguous, finite, ``|x| < 65520 * 127`` so that every q8_1 scale fits fp16).
        w: a 2-D q4_0 :class:`~qformats.QuantizedTensor` ``[M, K]`` (K a multiple of 32) on
            x's device.
    Returns:
        ``[N, M]`` in the library and on the device of ``x``: float32 on the CPU, bitwise equal
        to ``gemm_q4_0_q8_1(w.buffers["blocks"], quantize_q8_1(x), M, N, K).T``; on CUDA in
        x's dtype, x quantized by the q8_1 CUDA kernel (the same bytes) and multiplied by the
        kernels of :func:`gemm_q4_0_q8_1` (float32 sum rounded once). Its error against
        ``x . dequantize(w)^T`` is the q8_1 rounding of x (at most half a step, ``max|x| / 254``
        per block); against the dequantized operands it is float32 summation only.
    Raises:
        TypeError: x not a float array/tensor, w not a QuantizedTensor.
        ValueError: x not 2-D, w not 2-D or not q4_0, K mismatch, non-contiguous, NaN/Inf, or
            ``|x|`` too large for q8_1's fp16 scale (both checks are skipped inside
            :func:`qformats.skip_finite_check`, where such x gives llama.cpp's inf scales).
    """
    blocks, N, M, K = _weight_and_x("q4_0.linear", x, w)
    too_large = False
    if A._check_finite:  # like the NaN scan, a full read and (on CUDA) a host sync
        amax = np.float32(_max_abs(x))
        with np.errstate(over="ignore"):
            too_large = bool(np.isinf(np.float16(amax / np.float32(127.0))))
    if too_large:
        raise ValueError("x: a q8_1 block scale would overflow fp16: q4_0.linear needs |x| < 65520 * 127")
    if A.is_cuda(x):
        from ..q8_1 import _native as q8_native

        xq = A.empty(x, (N, K // QK, 36), "uint8")
        out = A.empty(x, (N, M), A.dtype_name(x))
        with A.stream_for(x) as stream:
            q8_native.quantize(x, xq, stream)
            _native.gemm_q4_0_q8_1(blocks, xq, out, M, N, K, True, workspace=_workspace(x, M, N, K), stream=stream)
        return out
    out = A.empty(x, (N, M), "float32")
    _native.linear(x, blocks, out, M, N, K)
    return out


def gemm(x: Any, w: QuantizedTensor) -> Any:
    """Weight-only GEMM ``Y = X . W^T``: float activations, q4_0 weights (llama.cpp
    ``block_q4_0``) decoded in cache-sized tiles on the CPU (in registers for N <= 4 on AVX-512
    and AVX2 CPUs; on AVX2 each block as ``d * (sum q x - 8 sum x)``) and in registers on the
    GPU, never materialized whole; threaded.

    Args:
        x: float32, float16 or bfloat16 ``[N, K]`` (16-bit values are converted to float32
            exactly), numpy or torch (CPU, or CUDA with w's blocks on the same device),
            C-contiguous, finite.
        w: a 2-D q4_0 :class:`~qformats.QuantizedTensor` ``[M, K]``.
    Returns:
        ``[N, M]`` in the library and on the device of ``x`` (float32 on the CPU, ``x``'s dtype
        on CUDA): float32 dot products of x with exactly the values :func:`dequantize` gives
        (``(q - 8) * d``), FMA-accumulated in an order fixed by the CPU's instruction set (not
        by the thread count); on the GPU each block's ``d`` multiplies the block's sum. Range:
        with float16 activations on CUDA the tensor-core decoder forms ``16 * (q - 8) * d`` in
        float16 for half of the nibbles, so weights of magnitude 4096 or more (``|d| > 512``)
        come out as Inf / NaN; real checkpoints are orders of magnitude below that.
    Raises:
        TypeError: x not a float array/tensor, w not a QuantizedTensor.
        ValueError: x not 2-D, w not 2-D or not q4_0, K mismatch, non-contiguous, NaN/Inf, x and
            w on different devices.
    """
    w = check_quantized(w, FORMAT)
    A.check_type(x, "x")
    A.check_float(x, "x", ndim=2)
    if len(w.shape) != 2:
        raise ValueError(f"q4_0.gemm: w must be a 2-D q4_0 tensor [M, K], got shape {w.shape}")
    (N, K), (M, Kw) = (int(s) for s in x.shape), w.shape
    if K != Kw:
        raise ValueError(f"q4_0.gemm: K mismatch, x is {tuple(x.shape)} and w is {list(w.shape)}")
    A.same_device(("x", x), ("blocks", w.buffers["blocks"]))
    blocks = A.check_array(w.buffers["blocks"], "blocks", "uint8", (M, K // QK, BLOCK_BYTES))
    x, out = A.gemm_operands(x, N, M)
    with A.stream_for(x) as stream:
        _native.gemm(x, blocks, out, M, N, K, stream, A.gemm_workspace(x, N, M))
    return out

# -- the format's face --------------------------------------------------------------------------

def _make_linear(q: QuantizedTensor, derived: Any = None) -> LinearKernel | None:
    """q4_0 weight ``q`` [M, K] bound to the native kernels: on CUDA the weight-only kernel, on
    the CPU llama.cpp's product with the activations quantized to q8_1 (as :func:`linear`)."""
    M, K = q.shape
    blocks = A.check_array(q.buffers["blocks"], "blocks", "uint8", (M, K // QK, BLOCK_BYTES))
    return LinearKernel(_native.make_linear(blocks, M, K, q8_1_activations=not A.is_cuda(blocks)))


SPEC = FormatSpec(
    name=FORMAT,
    summary="GGML blocks of 32: fp16 d + 16 bytes of nibbles (4.5 bits)",
    source="llama.cpp ggml-common.h block_q4_0, quantize_row_q4_0_ref; gguf Q4_0",
    defaults={},
    group_param=None,
    block=lambda p: QK,
    with_group_size=fixed_blocks(FORMAT, QK),
    quantize=quantize,
    dequantize=dequantize,
    expected_buffers=expected_buffers,
    gemm=gemm,
    linear_rows=WEIGHT_ONLY_ROWS,
    tune_rows=PREFILL_TUNE_ROWS,
    make_linear=_make_linear,
    ggml_type="Q4_0",
)
