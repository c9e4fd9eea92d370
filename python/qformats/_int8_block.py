"""The int8 block rule of GGML's 8-bit formats in numpy, shared by the reference codecs of q8_0
and q8_1 (:mod:`qformats.q8_0.reference`, :mod:`qformats.q8_1.reference`): the executable form
of ``src/common/int8_block.h``, which states the rule and its corner case. Source: llama.cpp
ggml/src/ggml-quants.c ``quantize_row_q8_0_ref`` and ``quantize_row_q8_1_ref``, which compute the
scale and the codes of a block with the same lines.

Every operation is a separately rounded float32 operation, as in the C++ (numpy never fuses a
multiply and an add). Pure numpy: imports nothing from the package.
"""
from __future__ import annotations

import numpy as np

__all__ = ["roundf", "quantize", "dequantize"]


def roundf(v: np.ndarray) -> np.ndarray:
    """C's ``roundf`` of float32 ``v`` (halves away from zero), as float64: ``floor(|v| + 0.5)``
    is exact in float64 for every float32 ``|v|``, and the sign is put back (``-0.0`` stays
    ``-0.0``). inf and NaN pass through."""
    return np.copysign(np.floor(np.abs(np.asarray(v, np.float32).astype(np.float64)) + 0.5), v)


def quantize(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scale and the codes of each block of float32 ``blocks`` ``[n, QK]``.

    Returns:
        ``(d, q)``: ``d`` float32 ``[n]``, ``max |x| / 127`` unrounded (the formats store
        ``fp16(d)``; q8_1 also forms ``s`` from it), and ``q`` int8 ``[n, QK]``,
        ``roundf(x * id)`` with ``id = 1 / d`` (0 where ``d == 0``); 0 where ``x * id`` is not
        finite (``1 / d`` overflows for ``max |x| < ~3.7e-37``).
    """
    blocks = np.asarray(blocks, dtype=np.float32)
    n = blocks.shape[0]
    amax = np.abs(blocks).max(axis=-1) if blocks.size else np.zeros(n, dtype=np.float32)
    with np.errstate(all="ignore"):
        d = amax / np.float32(127)
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = blocks * inv[:, None]
        q = np.where(np.isfinite(v), np.clip(roundf(v), -127, 127), 0).astype(np.int8)
    return d, q


def dequantize(d16: np.ndarray, q: np.ndarray) -> np.ndarray:
    """float32 ``q * float(d)`` from the stored scales ``d16`` (float16 ``[n, 1]``) and the codes
    ``q`` (int8 ``[n, QK]``): ``[n, QK]``. A scale of inf decodes to inf / NaN, as in llama.cpp."""
    with np.errstate(all="ignore"):
        return q.astype(np.float32) * np.asarray(d16, np.float16).astype(np.float32)
