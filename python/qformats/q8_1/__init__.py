"""q8_1: GGML's 8-bit activation block format (llama.cpp ``block_q8_1``), byte-compatible
with llama.cpp's CPU ``quantize_row_q8_1_ref``.

Blocks of 32 values along the last axis, 36 bytes each: fp16 ``d``, fp16 ``s = d * sum(qs)``,
``int8 qs[32]``; 9 bits/value. Decoded value: ``q * d``. The exact rule is in
``src/formats/q8_1/q8_1.h`` and :mod:`qformats.q8_1.reference`. Error bound:
``|x - x'| <= |d| / 2`` (plus fp16 rounding of ``d``), ``d = max|x| / 127`` of the block.
Pair it with q4_0 weights in :func:`qformats.q4_0.gemm_q4_0_q8_1`.
"""
from __future__ import annotations

from typing import Any

from .._blockwise import BlockCodec
from .._core import QuantizedTensor
from .._spec import FormatSpec, fixed_blocks
from . import _native, reference

FORMAT = "q8_1"
QK = 32           #: values per block
BLOCK_BYTES = 36  #: bytes per block

__all__ = ["SPEC", "quantize", "dequantize", "quantize_q8_1", "dequantize_q8_1", "QK", "BLOCK_BYTES",
           "reference"]

_CODEC = BlockCodec(FORMAT, QK, BLOCK_BYTES, "65520 * 127", _native)


def quantize_q8_1(x: Any) -> Any:
    """Quantize to q8_1 blocks along the last axis.

    Args:
        x: float32, float16 or bfloat16 ``[..., K]``, K a multiple of 32, C-contiguous, finite;
            numpy, torch on the CPU, or torch on a CUDA device (CUDA builds; current stream).
    Returns:
        uint8 ``[..., K // 32, 36]`` in the library of ``x``.
    Raises:
        TypeError: not an array/tensor or not a float dtype.
        ValueError: K not a multiple of 32, a scalar, non-contiguous, NaN or Inf, or a
            block whose scale overflows fp16 (``max |x|`` of a block >= 65520 * 127).
            ``s`` is stored as llama.cpp stores it and saturates to inf once
            ``|d * sum(q)| >= 65520`` (block sums of large activations); the decoded values
            do not use it.
    """
    return _CODEC.quantize(x)


def dequantize_q8_1(x_q: Any, K: int, dtype: str = "float32") -> Any:
    """Decode q8_1 blocks uint8 ``[..., K // 32, 36]`` to ``[..., K]`` of ``dtype`` (float32
    default, float16, or bfloat16 for torch), decoded in float32 and rounded once, in the
    library and on the device of ``x_q``."""
    return _CODEC.dequantize(x_q, K, dtype)


def expected_buffers(shape, params) -> dict:
    """Buffer names -> (dtype, shape) for a q8_1 tensor of logical ``shape`` (no params)."""
    return _CODEC.expected_buffers(shape, params)


def quantize(x: Any) -> QuantizedTensor:
    """Quantize ``x`` ([..., K], K % 32 == 0) to a q8_1 QuantizedTensor with one buffer,
    ``blocks`` (uint8 ``[..., K // 32, 36]``). Raises as :func:`quantize_q8_1`."""
    return _CODEC.quantize_tensor(x)


def dequantize(q: QuantizedTensor, dtype: str | None = None) -> Any:
    """Decode a q8_1 QuantizedTensor to ``q.shape`` in ``dtype`` (default: the original)."""
    return _CODEC.dequantize_tensor(q, dtype)

# -- the format's face --------------------------------------------------------------------------

SPEC = FormatSpec(
    name=FORMAT,
    summary="GGML blocks of 32: fp16 d, fp16 s = d * sum(q), 32 int8 (9 bits)",
    source="llama.cpp ggml-common.h block_q8_1, quantize_row_q8_1_ref",
    defaults={},
    group_param=None,
    block=lambda p: QK,
    with_group_size=fixed_blocks(FORMAT, QK),
    quantize=quantize,
    dequantize=dequantize,
    expected_buffers=expected_buffers,
)
