"""Pure-numpy reference codec for q8_1: the pack spec in executable form.

Source: llama.cpp ggml/src/ggml-quants.c ``quantize_row_q8_1_ref``; layout ``block_q8_1``
in ggml-common.h. See ``src/formats/q8_1/q8_1.h`` for the layout and rules; the scale and
codes are the int8 block rule shared with q8_0 (:mod:`qformats._int8_block`, stated with its
corner case in ``src/common/int8_block.h``). Scales beyond fp16 are stored as inf, as
llama.cpp stores them (the public API refuses such input).
"""
from __future__ import annotations

import numpy as np

from .. import _int8_block

QK = 32
BLOCK_BYTES = 36


def quantize(x: np.ndarray) -> np.ndarray:
    """float [..., K] (K % 32 == 0) -> uint8 [..., K // 32, 36] q8_1 blocks."""
    x = np.asarray(x, dtype=np.float32)
    lead, k = x.shape[:-1], x.shape[-1]
    b = x.reshape(-1, QK)
    n = b.shape[0]
    d, q = _int8_block.quantize(b)
    with np.errstate(all="ignore"):  # d and s beyond fp16 become inf
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
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2")
    q = np.ascontiguousarray(b[:, 4:]).view(np.int8)
    return _int8_block.dequantize(d, q).reshape(*lead, nb * QK)
