"""q8_0: GGML's 8-bit block format (llama.cpp ``block_q8_0``), byte-compatible with llama.cpp's
``quantize_row_q8_0_ref`` and the gguf package's ``Q8_0``.

Blocks of 32 values along the last axis, 34 bytes each: fp16 ``d`` then ``int8 qs[32]``
(element j in ``qs[j]``); 8.5 bits/value. Decoded value: ``q * d``. The exact rule is in
``src/formats/q8_0/q8_0.h`` (the scale and codes: ``src/common/int8_block.h``, shared with
q8_1) and :mod:`qformats.q8_0.reference`. Error bound: ``|x - x'| <= |d| / 2`` (plus fp16
rounding of ``d``), ``d = max|x| / 127`` of the block. q8_0 is :mod:`qformats.q8_1` without
its ``s`` field: the same ``d`` and codes, 2 bytes less per block.
"""
from __future__ import annotations

from typing import Any

from .._blockwise import BlockCodec
from .._core import QuantizedTensor
from .._spec import FormatSpec, fixed_blocks
from . import _native, reference

FORMAT = "q8_0"
QK = 32           #: values per block
BLOCK_BYTES = 34  #: bytes per block

__all__ = ["SPEC", "quantize", "dequantize", "quantize_q8_0", "dequantize_q8_0", "QK", "BLOCK_BYTES",
           "reference"]

_CODEC = BlockCodec(FORMAT, QK, BLOCK_BYTES, "65520 * 127", _native)


def quantize_q8_0(x: Any) -> Any:
    """Quantize to q8_0 blocks along the last axis, as llama.cpp's ``quantize_row_q8_0_ref``
    (ggml/src/ggml-quants.c; layout ``block_q8_0``, ggml/src/ggml-common.h).

    Args:
        x: float32, float16 or bfloat16 ``[..., K]``, K a multiple of 32, C-contiguous, finite;
            numpy, torch on the CPU, or torch on a CUDA device (CUDA builds; current stream).
            16-bit input is converted to float32 exactly first. Read-only arrays are read in
            place.
    Returns:
        uint8 ``[..., K // 32, 34]`` in the library (and on the device) of ``x``: per block the
        fp16 scale ``d`` (bytes 0..1, little-endian) and 32 int8 codes (bytes 2..33).
    Raises:
        TypeError: not a numpy array / torch tensor, or not a float dtype.
        ValueError: K not a multiple of 32, a scalar, non-contiguous, NaN or Inf, a tensor
            that requires grad, or a block whose scale overflows fp16 (``max |x|`` of a block
            >= 65520 * 127; llama.cpp would store ``d = inf``).
        NotImplementedError: a CUDA tensor in a build without CUDA kernels.
    """
    return _CODEC.quantize(x)


def dequantize_q8_0(x_q: Any, K: int, dtype: str = "float32") -> Any:
    """Decode q8_0 blocks: ``x' = qs[j] * float(d)`` per block (llama.cpp
    ``dequantize_row_q8_0``).

    Args:
        x_q: uint8 ``[..., K // 32, 34]`` as returned by :func:`quantize_q8_0`.
        K: values per row (a multiple of 32).
        dtype: output dtype, "float32" (default), "float16" or "bfloat16" (torch only); values
            are decoded in float32 and rounded once to it.
    Returns:
        ``[..., K]`` of ``dtype``, in the library and on the device of ``x_q``.
    Raises:
        TypeError: ``x_q`` not a numpy array / torch tensor or not uint8, K not an int, an
            unknown ``dtype``, or bfloat16 for a numpy ``x_q``.
        ValueError: K not a multiple of 32 or negative, shape not ``[..., K // 32, 34]``,
            non-contiguous.
    """
    return _CODEC.dequantize(x_q, K, dtype)


def expected_buffers(shape, params) -> dict:
    """Buffer names -> (dtype, shape) for a q8_0 tensor of logical ``shape`` (no params):
    ``{"blocks": ("uint8", (*shape[:-1], shape[-1] // 32, 34))}``. Raises ValueError for params
    or a last dimension that is not a multiple of 32."""
    return _CODEC.expected_buffers(shape, params)


def quantize(x: Any) -> QuantizedTensor:
    """Quantize ``x`` (``[..., K]``, K % 32 == 0; float32/float16/bfloat16, numpy or torch) to a
    q8_0 :class:`~qformats.QuantizedTensor` with one buffer, ``blocks`` (uint8
    ``[..., K // 32, 34]``). Raises as :func:`quantize_q8_0`."""
    return _CODEC.quantize_tensor(x)


def dequantize(q: QuantizedTensor, dtype: str | None = None) -> Any:
    """Decode a q8_0 QuantizedTensor to ``q.shape`` in ``dtype`` (default: the original dtype),
    in the library and on the device of its buffers. Raises TypeError / ValueError for another
    format or buffers that do not match ``q.shape``."""
    return _CODEC.dequantize_tensor(q, dtype)

# -- the format's face --------------------------------------------------------------------------

SPEC = FormatSpec(
    name=FORMAT,
    summary="GGML blocks of 32: fp16 d, 32 int8 (8.5 bits)",
    source="llama.cpp ggml-common.h block_q8_0, quantize_row_q8_0_ref; gguf.quants.Q8_0",
    defaults={},
    group_param=None,
    block=lambda p: QK,
    with_group_size=fixed_blocks(FORMAT, QK),
    quantize=quantize,
    dequantize=dequantize,
    expected_buffers=expected_buffers,
    ggml_type="Q8_0",
)
