"""Pure-numpy reference codec for q4_0: the pack spec in executable form.

Source: llama.cpp ggml/src/ggml-quants.c ``quantize_row_q4_0_ref`` (built without FMA) and
the gguf package's ``gguf.quants.Q4_0``; the layout is ``block_q4_0`` in ggml-common.h. Every
operation is a separately rounded float32 operation (numpy never fuses multiply and add).
See ``src/formats/q4_0/q4_0.h`` for the rules and corner cases. Scales beyond fp16 are stored
as inf, as llama.cpp and gguf store them (the public API refuses such input).
"""
from __future__ import annotations

import numpy as np

QK = 32
BLOCK_BYTES = 18


def quantize(x: np.ndarray) -> np.ndarray:
    """float [..., K] (K % 32 == 0) -> uint8 [..., K // 32, 18] q4_0 blocks."""
    x = np.asarray(x, dtype=np.float32)
    lead, k = x.shape[:-1], x.shape[-1]
    b = x.reshape(-1, QK)
    n = b.shape[0]
    imax = np.abs(b).argmax(axis=-1) if n else np.zeros(0, dtype=np.int64)  # first on ties
    mx = b[np.arange(n), imax]
    with np.errstate(all="ignore"):
        d = mx / np.float32(-8)
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = (b * inv[:, None]) + np.float32(8.5)
        q = np.where(np.isfinite(v), np.minimum(np.trunc(v), 15), 0).astype(np.uint8)
        d16 = d.astype("<f2")
    out = np.empty((n, BLOCK_BYTES), dtype=np.uint8)
    out[:, :2] = d16.view(np.uint8).reshape(n, 2)
    out[:, 2:] = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
    return out.reshape(*lead, k // QK, BLOCK_BYTES)


def dequantize(blocks: np.ndarray) -> np.ndarray:
    """uint8 [..., nb, 18] q4_0 blocks -> float32 [..., nb * 32]: (q - 8) * fp16 d."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    lead, nb = blocks.shape[:-2], blocks.shape[-2]
    b = blocks.reshape(-1, BLOCK_BYTES)
    d = np.ascontiguousarray(b[:, :2]).view("<f2").astype(np.float32)  # [n, 1]
    qs = b[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32) - np.float32(8)
    with np.errstate(all="ignore"):  # an inf scale decodes to inf/NaN
        return (q * d).reshape(*lead, nb * QK)
