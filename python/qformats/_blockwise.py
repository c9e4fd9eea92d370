"""The Python side of GGML's fixed-block formats (q4_0, q8_0, q8_1), written once: blocks of
``qk`` values along the last axis, ``block_bytes`` bytes each, the fp16 scale ``d`` in the first
two bytes, coded by the format's native module. What differs between the formats (the layout
and the rule) is in their headers and ``reference`` modules; this is the plumbing around the
native codec: argument checks, the output in the caller's library and device, the call on the
current stream, the refusal of a scale beyond fp16, and the ``blocks`` buffer of a
:class:`~qformats.QuantizedTensor`. The C++ counterpart is ``src/common/blockwise_cuda.cuh``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _arrays as A
from ._core import QuantizedTensor, check_quantized, float_dtype, output_dtype

__all__ = ["BlockCodec"]


@dataclass(frozen=True)
class BlockCodec:
    """One fixed-block format.

    Attributes:
        name: the format's name.
        qk: values per block.
        block_bytes: bytes per block; bytes 0..1 hold the fp16 scale ``d``.
        d_limit: the bound on ``max |x|`` of a block below which ``d`` fits in fp16, as the
            error message writes it (``"65520 * 127"``).
        native: the format's ``_native`` module: ``quantize(x, out, stream)`` and
            ``dequantize(blocks, out, stream)``.
    """

    name: str
    qk: int
    block_bytes: int
    d_limit: str
    native: Any

    def quantize(self, x: Any) -> Any:
        """Blocks uint8 ``[..., K // qk, block_bytes]`` of float ``x`` ``[..., K]``, in x's
        library and on its device. TypeError / ValueError as the formats' ``quantize_*`` say."""
        A.check_float(x, "x", multiple_of=self.qk)
        out = A.empty(x, (*x.shape[:-1], x.shape[-1] // self.qk, self.block_bytes), "uint8")
        with A.stream_for(x) as stream:
            self.native.quantize(x, out, stream)
        if A.fp16_field_overflowed(out, 0):
            # llama.cpp would store d = inf here and decode inf/NaN; refuse instead of returning
            # blocks that cannot be decoded.
            raise ValueError(f"x: a block's scale d overflows fp16: {self.name} needs |x| < {self.d_limit} "
                             "in every block")
        return out

    def dequantize(self, x_q: Any, K: int, dtype: str = "float32") -> Any:
        """``[..., K]`` of ``dtype`` decoded from blocks ``x_q`` uint8 ``[..., K // qk,
        block_bytes]``, in x_q's library and on its device. TypeError / ValueError for a wrong
        dtype or shape, K not a multiple of ``qk``."""
        K = A.check_int(K, "K")
        if K % self.qk:
            raise ValueError(f"K={K} is not a multiple of {self.qk}")
        A.check_array(x_q, "x_q", "uint8")
        want = (K // self.qk, self.block_bytes)
        if x_q.ndim < 2 or tuple(x_q.shape[-2:]) != want:
            raise ValueError(f"x_q: expected shape [..., {want[0]}, {want[1]}], got {tuple(x_q.shape)}")
        out = A.empty(x_q, (*x_q.shape[:-2], K), float_dtype(dtype))
        with A.stream_for(x_q) as stream:
            self.native.dequantize(x_q, out, stream)
        return out

    def expected_buffers(self, shape, params) -> dict:
        """``{"blocks": ("uint8", [..., K // qk, block_bytes])}`` for logical ``shape``; ValueError
        for any params (these formats take none) or a last dimension not a multiple of ``qk``."""
        if params:
            raise ValueError(f"{self.name} takes no parameters, got {params}")
        if not shape or shape[-1] % self.qk:
            raise ValueError(f"shape {shape}: last dimension must be a multiple of {self.qk}")
        return {"blocks": ("uint8", (*shape[:-1], shape[-1] // self.qk, self.block_bytes))}

    def quantize_tensor(self, x: Any) -> QuantizedTensor:
        """A QuantizedTensor of this format holding :meth:`quantize`'s blocks of ``x``."""
        blocks = self.quantize(x)
        return QuantizedTensor(self.name, tuple(x.shape), A.dtype_name(x), {}, {"blocks": blocks})

    def dequantize_tensor(self, q: QuantizedTensor, dtype: str | None = None) -> Any:
        """A QuantizedTensor of this format decoded to ``q.shape`` in ``dtype`` (default: the
        original). TypeError / ValueError for another format or buffers that do not match."""
        q = check_quantized(q, self.name)
        return self.dequantize(q.buffers["blocks"], q.shape[-1], output_dtype(q, dtype))
