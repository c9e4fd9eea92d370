"""Pure-numpy reference codec for q8_1: the pack spec in executable form.

Source: llama.cpp ggml/src/ggml-quants.c ``quantize_row_q8_1_ref``; layout ``block_q8_1``
in ggml-common.h. See ``src/formats/q8_1/q8_1.h`` for the rules and corner cases. Scales
beyond fp16 are stored as inf, as llama.cpp stores them (the public API refuses such input).
"""
from __future__ import annotations

import numpy as np

QK = 32
BLOCK_BYTES = 36


def quantize(x: np.ndarray) -> np.ndarray:
    """float [..., K] (K % 32 == 0) -> uint8 [..., K // 32, 36] q8_1 blocks."""
    x = np.asarray(x, dtype=np.float32)
    lead, k = x.shape[:-1], x.shape[-1]
    b = x.reshape(-1, QK)
    n = b.shape[0]
    amax = np.abs(b).max(axis=-1) if n else np.zeros(0, dtype=np.float32)
    with np.errstate(all="ignore"):
        d = amax / np.float32(127)
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = b * inv[:, None]
        # C's roundf (halves away from zero): floor(|v| + 0.5) is exact in float64.
        r = np.copysign(np.floor(np.abs(v.astype(np.float64)) + 0.5), v)
        q = np.where(np.isfinite(v), np.clip(r, -127, 127), 0).astype(np.int8)
        s = q.astype(np.int32).sum(axis=-1).astype(np.float32) * d
        d16, s16 = d.astype("<f2"), s.astype("<f2")
    out = np.empty((n, BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:2] = d16.view(np.uint8).reshape(n, 2)
    out[:, 2:4] = s16.view(np.uint8).reshape(n, 2)
    out[:, 4:] = q.view(np.uint8)
    return out.reshape(*lead, k // QK, BLOCK_BYTES)


def dequantize(blocks: np.ndarray) -> np.ndarray:
    """uint8 [..., nb, 36] q8_1 blocks -> float32 [..., nb * 32]: q * fp16 d."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    lead, nb = blocks.shape[:-2], blocks.shape[-2]
    b = blocks.reshape(-1, BLOCK_BYTES)
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2").astype(np.float32)
    q = np.ascontiguousarray(b[:, 4:]).view(np.int8).astype(np.float32)
    with np.errstate(all="ignore"):  # an inf scale decodes to inf/NaN
        return (q * d).reshape(*lead, nb * QK)
