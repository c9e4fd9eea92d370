"""Pure-numpy reference codec for int4: the pack spec in executable form.

Source of the asymmetric convention: GPTQ's ``Quantizer`` (``find_params``: xmin/xmax widened
to contain 0, ``scale = (xmax - xmin) / maxq``, ``zero = round(-xmin / scale)``;
``quantize``: ``clamp(round(x / scale) + zero, 0, maxq)``), as used for GPTQ/AWQ/HQQ int4
weights; the symmetric mode is absmax / 7 with signed codes. Every operation is a separately
rounded float32 operation; ``np.rint`` rounds half to even. See ``src/formats/int4/int4.h``
for the layout, the rules and the corner cases.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32


def pack(codes: np.ndarray) -> np.ndarray:
    """Codes [..., K] (K even; uint8 0..15 or int8 -8..7) -> uint8 [..., K // 2]:
    element 2j in the low nibble of byte j, element 2j+1 in the high nibble."""
    c = np.asarray(codes).view(np.uint8) if np.asarray(codes).dtype == np.int8 else np.asarray(codes, np.uint8)
    return ((c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)).astype(np.uint8)


def unpack(packed: np.ndarray, signed: bool = False) -> np.ndarray:
    """uint8 [..., K // 2] -> uint8 0..15 (or int8 -8..7 when ``signed``) [..., K]."""
    p = np.asarray(packed, np.uint8)
    out = np.empty((*p.shape[:-1], 2 * p.shape[-1]), np.int16)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    if signed:
        return ((out ^ 8) - 8).astype(np.int8)
    return out.astype(np.uint8)


def _groups(x: np.ndarray, gs: int) -> np.ndarray:
    return np.asarray(x, dtype=F32).reshape(-1, gs)


def quantize_asym(x: np.ndarray, group_size: int):
    """float [..., K] -> (qweight uint8 [..., K//2], scales float32 [..., K//gs], zeros uint8 [..., K//gs]).

    Per group: lo = min(min x, 0), hi = max(max x, 0) (+0 unless some x < 0 / x > 0);
    scale = fl(hi - lo) / 15, or fl(hi / 15) - fl(lo / 15) where hi - lo overflows;
    scale == 0 -> zero 0 and codes 0; else zero = clip(rint(-lo / scale), 0, 15),
    q = clip(rint(x / scale) + zero, 0, 15).
    """
    x = np.asarray(x, dtype=F32)
    lead, k = x.shape[:-1], x.shape[-1]
    g = _groups(x, group_size)
    n = g.shape[0]
    mn = g.min(axis=-1) if n else np.zeros(0, F32)
    mx = g.max(axis=-1) if n else np.zeros(0, F32)
    lo = np.where(mn < 0, mn, F32(0)).astype(F32)[:, None]
    hi = np.where(mx > 0, mx, F32(0)).astype(F32)[:, None]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        rng = hi - lo
        scale = np.where(np.isinf(rng), hi / F32(15) - lo / F32(15), rng / F32(15)).astype(F32)
        zero = np.clip(np.rint(-lo / scale), 0, 15).astype(F32)
        q = np.clip(np.rint(g / scale) + zero, 0, 15)
    ok = scale != 0
    zero = np.where(ok, zero, F32(0))
    q = np.where(ok, q, F32(0)).astype(np.uint8)
    return (pack(q).reshape(*lead, k // 2), scale.reshape(*lead, k // group_size),
            zero.astype(np.uint8).reshape(*lead, k // group_size))


def quantize_sym(x: np.ndarray, group_size: int):
    """float [..., K] -> (qweight uint8 [..., K//2] of signed nibbles, scales float32 [..., K//gs]).

    Per group: scale = max|x| / 7; scale == 0 -> codes 0; else q = clip(rint(x / scale), -8, 7).
    """
    x = np.asarray(x, dtype=F32)
    lead, k = x.shape[:-1], x.shape[-1]
    g = _groups(x, group_size)
    absmax = np.abs(g).max(axis=-1) if g.shape[0] else np.zeros(0, F32)
    scale = (absmax.astype(F32) / F32(7))[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(g / scale), -8, 7)
    q = np.where(scale != 0, q, F32(0)).astype(np.int8)
    return pack(q).reshape(*lead, k // 2), scale.reshape(*lead, k // group_size)


def dequantize(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, group_size: int) -> np.ndarray:
    """Packed codes -> float32 [..., K]: (q - zero) * scale (asymmetric, ``zeros`` given) or
    q * scale (symmetric, ``zeros`` None, signed codes)."""
    qw = np.asarray(qweight, np.uint8)
    lead, k = qw.shape[:-1], 2 * qw.shape[-1]
    codes = unpack(qw, signed=zeros is None).astype(np.int16).reshape(-1, group_size)
    if zeros is not None:
        codes = codes - np.asarray(zeros, np.int16).reshape(-1, 1)
    s = np.asarray(scales, F32).reshape(-1, 1)
    with np.errstate(over="ignore"):  # (q - zero) * scale may round past FLT_MAX: the spec says so
        return (codes.astype(F32) * s).reshape(*lead, k)


TILE_ROWS = 16  #: rows per tile of the "tiles" layout


def tiles_group(m: np.ndarray, c: np.ndarray, groups_per_row: int) -> np.ndarray:
    """The stored index, in the "tiles" layout, of row m's group c (``int4.h``):
    ``((m // 16) * C + c) * 16 + m % 16`` with C = K // group_size."""
    m, c = np.asarray(m, np.int64), np.asarray(c, np.int64)
    return ((m // TILE_ROWS) * groups_per_row + c) * TILE_ROWS + m % TILE_ROWS


def _stored_index(M: int, C: int) -> np.ndarray:
    """For each rows-layout group i = m * C + c of a weight with M rows of C groups, its stored
    index in the "tiles" layout (:func:`tiles_group`)."""
    m, c = np.divmod(np.arange(M * C, dtype=np.int64), C)
    return tiles_group(m, c, C)


def to_tiles(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, group_size: int):
    """Rows-layout buffers of a weight [M, K] (M % 16 == 0: qweight uint8 [M, K // 2], scales
    float32 and zeros uint8 [M, C], C = K // group_size; zeros None for symmetric codes) -> the
    "tiles" layout's: qweight uint8 [M // 16, C, 16, gs // 2], scales float32 (and zeros uint8)
    [M // 16, C, 16]; each group moved whole to its stored index :func:`tiles_group`."""
    qw = np.asarray(qweight, np.uint8)
    M, C = qw.shape[0], qw.shape[1] * 2 // group_size
    dest = _stored_index(M, C)

    def move(a, *width):
        out = np.empty((M * C, *width), a.dtype)
        out[dest] = a.reshape(M * C, *width)
        return out.reshape(M // TILE_ROWS, C, TILE_ROWS, *width)

    return (move(qw, group_size // 2), move(np.asarray(scales, F32)),
            None if zeros is None else move(np.asarray(zeros, np.uint8)))


def from_tiles(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, group_size: int):
    """Inverse of :func:`to_tiles`: the "tiles" layout's buffers -> the rows layout's qweight uint8
    [M, K // 2], scales float32 (zeros uint8) [M, C]."""
    qw = np.asarray(qweight, np.uint8)
    M, C = qw.shape[0] * TILE_ROWS, qw.shape[1]
    src = _stored_index(M, C)

    def move(a, *width):
        return a.reshape(M * C, *width)[src].reshape(M, -1)

    return (move(qw, group_size // 2), move(np.asarray(scales, F32)),
            None if zeros is None else move(np.asarray(zeros, np.uint8)))


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Packed symmetric int4 [N, K//2] x [M, K//2] -> int64 [N, M] = A . B^T (exact)."""
    return unpack(a, signed=True).astype(np.int64) @ unpack(b, signed=True).astype(np.int64).T


def gemm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 X . W^T for X [N, K] and dequantized W [M, K]: the accuracy yardstick."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
