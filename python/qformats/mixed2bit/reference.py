"""Pure-numpy reference codec for mixed2bit: the pack spec in executable form.

Source: Jin et al., "Fast and Efficient 2-bit LLM Inference on GPU: 2/4/16-bit in a Weight
Matrix with Asynchronous Dequantization", arXiv 2311.16442 (intra-matrix mixed 2/4-bit groups
chosen by range or sensitivity, second-order quantized scales, 16-bit sparse outliers); the
exact rules, byte layout and corner cases are the project's spec in
``src/formats/mixed2bit/mixed2bit.h``. Every operation is a separately rounded float32
operation (numpy never fuses multiply and add); fp16 stores are ``astype(float16)`` (round to
nearest even).

Functions take and return plain numpy arrays; the buffers are the dict
``{"group_map", "codes2", "codes4", "scales2", "scales4", "so2", "so4", "outlier_idx",
"outlier_val"}`` with the dtypes and shapes of :func:`buffer_shapes`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

QMAX2, QMAX4 = 3, 15   #: largest 2-bit / 4-bit code
S2, S4 = 15, 255       #: largest second-order code of a 2-bit / 4-bit group
TOO_LARGE = "values too large for mixed2bit's fp16 second-order scales (or fp16 outliers)"
BUFFER_NAMES = ("group_map", "codes2", "codes4", "scales2", "scales4", "so2", "so4",
                "outlier_idx", "outlier_val")
_F0 = np.float32(0)


def n4_count(ratio_4bit: float, n_groups: int) -> int:
    """Number of 4-bit groups: ``floor(ratio_4bit * n_groups + 0.5)`` in float64."""
    return int(math.floor(float(ratio_4bit) * n_groups + 0.5))


def n_out_count(outlier_ratio: float, n2: int, group_size: int) -> int:
    """Number of outliers: ``floor(outlier_ratio * n2 * group_size + 0.5)`` in float64."""
    return int(math.floor(float(outlier_ratio) * (n2 * group_size) + 0.5))


def buffer_shapes(rows: int, K: int, group_size: int, scale_block: int, n4: int, n_out: int) -> dict:
    """{name: (dtype, shape)} of every buffer (see mixed2bit.h)."""
    n_groups = rows * (K // group_size)
    n2 = n_groups - n4
    return {
        "group_map": ("uint8", (-(-n_groups // 8),)),
        "codes2": ("int32", (n2, group_size // 16)),
        "codes4": ("int32", (n4, group_size // 8)),
        "scales2": ("uint8", (n2,)),
        "scales4": ("uint8", (n4, 2)),
        "so2": ("float16", (-(-n2 // scale_block), 2)),
        "so4": ("float16", (-(-n4 // scale_block), 2)),
        "outlier_idx": ("int32", (n_out,)),
        "outlier_val": ("float16", (n_out,)),
    }


def _pos_zero(x: np.ndarray) -> np.ndarray:
    """x with -0 read as +0 (x + 0 in float32; every other value unchanged)."""
    return (x + _F0).astype(np.float32)


def group_scores(w: np.ndarray, group_size: int, sensitivity: np.ndarray | None = None) -> np.ndarray:
    """Step 1: float32 [n_groups] scores of w [rows, K] (groups in id order).

    By range ``max - min`` (values read with -0 as +0), or with ``sensitivity`` (float32 [K])
    ``s = 0; s = s + sens[k] * (w * w)`` in group order.
    """
    rows, K = w.shape
    G = K // group_size
    g = w.reshape(rows * G, group_size)
    if sensitivity is None:
        if g.shape[0] == 0:
            return np.zeros(0, np.float32)
        gp = _pos_zero(g)
        with np.errstate(over="ignore"):
            return (gp.max(axis=1) - gp.min(axis=1)).astype(np.float32)
    sg = np.broadcast_to(np.asarray(sensitivity, np.float32).reshape(1, G, group_size),
                         (rows, G, group_size)).reshape(rows * G, group_size)
    s = np.zeros(rows * G, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(group_size):
            s = s + sg[:, k] * (g[:, k] * g[:, k])
    return s.astype(np.float32)


def select_4bit(scores: np.ndarray, n4: int) -> np.ndarray:
    """Step 2: bool [n_groups], True for the n4 largest scores (ties: smaller group id).

    Raises ValueError (:data:`TOO_LARGE`) for a NaN score (only from w * w overflowing).
    """
    if np.isnan(scores).any():
        raise ValueError(TOO_LARGE)
    order = np.argsort(-scores, kind="stable")  # stable: equal scores keep id order
    is4 = np.zeros(scores.shape[0], bool)
    is4[order[:n4]] = True
    return is4


def select_outliers(w: np.ndarray, is4: np.ndarray, group_size: int, n_out: int) -> np.ndarray:
    """Step 3: int64 sorted flat indices of the n_out elements of 2-bit groups with the largest
    ``|w|`` (ties: the smaller flat index)."""
    if n_out == 0:
        return np.zeros(0, np.int64)
    in2 = np.repeat(~is4, group_size)                  # per flat element: in a 2-bit group?
    cand = np.flatnonzero(in2)                         # ascending flat indices
    a = np.abs(w.reshape(-1)[cand])
    order = np.argsort(-a, kind="stable")              # ties keep the smaller index first
    return np.sort(cand[order[:n_out]])


class Analysis(NamedTuple):
    """Intermediate values of one quantization (all in group-id order)."""
    scores: np.ndarray       # float32 [n_groups]
    is4: np.ndarray          # bool [n_groups]
    outlier_idx: np.ndarray  # int64 [n_out], sorted
    scale: np.ndarray        # float32 [n_groups], first-order scale
    m: np.ndarray            # float32 [n_groups], first-order offset (-lo)
    qmax: np.ndarray         # float32 [n_groups], 3 or 15


def first_order(w: np.ndarray, group_size: int, is4: np.ndarray, outlier_idx: np.ndarray):
    """Step 4: (scale, m) float32 [n_groups] over each group's non-outlier values."""
    n_groups = is4.shape[0]
    g = _pos_zero(w.reshape(n_groups, group_size))
    keep = np.ones(g.size, bool)
    keep[outlier_idx] = False
    keep = keep.reshape(g.shape)
    any_kept = keep.any(axis=1)
    inf = np.float32(np.inf)
    mn = np.where(keep, g, inf).min(axis=1, initial=inf)
    mx = np.where(keep, g, -inf).max(axis=1, initial=-inf)
    mn = np.where(any_kept, mn, _F0).astype(np.float32)
    hi = np.where(any_kept, mx, _F0).astype(np.float32)
    lo = np.where(mn < 0, mn, _F0).astype(np.float32)
    qmax = np.where(is4, np.float32(QMAX4), np.float32(QMAX2)).astype(np.float32)
    with np.errstate(over="ignore"):
        scale = ((hi - lo) / qmax).astype(np.float32)
    m = (_F0 - lo).astype(np.float32)
    return scale, m, qmax


def _block_max(v: np.ndarray, block: int) -> np.ndarray:
    """Max of consecutive blocks of ``block`` values (the last may be partial); v >= +0."""
    nb = -(-v.shape[0] // block)
    padded = np.zeros(nb * block, np.float32)
    padded[: v.shape[0]] = v
    return padded.reshape(nb, block).max(axis=1, initial=_F0)


def _second_order(scale: np.ndarray, m: np.ndarray, S: int, block: int):
    """Step 5 for one list: so float16 [nb, 2] ([d, dm]) and the codes sc, mc (uint8)."""
    with np.errstate(over="ignore"):
        d = (_block_max(scale, block) / np.float32(S)).astype(np.float16)
        dm = (_block_max(m, block) / np.float32(S)).astype(np.float16)
    so = np.stack([d, dm], axis=1) if d.size else np.zeros((0, 2), np.float16)
    return so, _codes(scale, d, S, block), _codes(m, dm, S, block)


def _param_codes(v: np.ndarray, d: np.ndarray, S) -> np.ndarray:
    """``d > 0 ? clamp(rint(v / d), 0, S) : 0`` elementwise (d float32 like v; S a number or an
    array like v)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = np.rint(v / d)
    r = np.where(r > 0, np.minimum(r, np.float32(S) if np.isscalar(S) else S), _F0)
    return np.where(d > 0, r, _F0).astype(np.uint8)


def _codes(v: np.ndarray, d16: np.ndarray, S: int, block: int) -> np.ndarray:
    """``d16 > 0 ? clamp(rint(v / d16), 0, S) : 0`` with each value's block field."""
    return _param_codes(v, np.repeat(d16.astype(np.float32), block)[: v.shape[0]], S)


def _encode(g: np.ndarray, s_eff: np.ndarray, m_eff: np.ndarray, qmax) -> np.ndarray:
    """Step 6: uint8 codes [n, gs] of groups g with per-group s_eff, m_eff (float32 [n]); qmax a
    number or float32 [n]."""
    qm = np.float32(qmax) if np.isscalar(qmax) else np.asarray(qmax, np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = np.rint((g + m_eff[:, None]) / s_eff[:, None])
    r = np.where(r > 0, np.minimum(r, qm), _F0)
    return np.where(s_eff[:, None] > 0, r, _F0).astype(np.uint8)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [n, gs] -> int32 [n, gs * bits / 32]; value i at bits bits*(i % per_word)."""
    per = 32 // bits
    n, gs = codes.shape
    c = codes.reshape(n, gs // per, per).astype(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(bits))
    return np.bitwise_or.reduce(c << shifts, axis=2).astype(np.uint32).view(np.int32)


def _unpack(words: np.ndarray, bits: int, gs: int) -> np.ndarray:
    """Inverse of :func:`_pack`: int32 [n, gs * bits / 32] -> uint8 [n, gs]."""
    per = 32 // bits
    u = words.view(np.uint32)[:, :, None] >> (np.arange(per, dtype=np.uint32) * np.uint32(bits))
    return (u & np.uint32((1 << bits) - 1)).astype(np.uint8).reshape(words.shape[0], gs)


def analyze(w, group_size: int = 16, ratio_4bit: float = 0.1, sensitivity=None,
            outlier_ratio: float = 0.0, scale_block: int = 16) -> Analysis:
    """Steps 1-4 on float32 w [rows, K]: scores, 4-bit selection, outliers, first order.
    Raises ValueError (:data:`TOO_LARGE`) for a NaN score."""
    w = np.asarray(w, np.float32)
    rows, K = w.shape
    n_groups = rows * (K // group_size)
    scores = group_scores(w, group_size, None if sensitivity is None else np.asarray(sensitivity, np.float32))
    is4 = select_4bit(scores, n4_count(ratio_4bit, n_groups))
    n2 = n_groups - int(is4.sum())
    oidx = select_outliers(w, is4, group_size, n_out_count(outlier_ratio, n2, group_size)) \
        if outlier_ratio > 0 else np.zeros(0, np.int64)
    scale, m, qmax = first_order(w, group_size, is4, oidx)
    return Analysis(scores, is4, oidx, scale, m, qmax)


def quantize(w, group_size: int = 16, ratio_4bit: float = 0.1, sensitivity=None,
             outlier_ratio: float = 0.0, scale_block: int = 16) -> dict:
    """float w [rows, K] -> the dict of buffers (see :func:`buffer_shapes`).

    No argument checking beyond what the arithmetic needs (the package front end checks).
    Raises ValueError (:data:`TOO_LARGE`) when a stored fp16 (d, dm or an outlier) is inf.
    """
    w = np.asarray(w, np.float32)
    rows, K = w.shape
    gs = group_size
    a = analyze(w, gs, ratio_4bit, sensitivity, outlier_ratio, scale_block)
    n_groups = a.is4.shape[0]
    n4 = int(a.is4.sum())
    n_out = a.outlier_idx.shape[0]
    g = w.reshape(n_groups, gs)
    bufs = {}
    for key, sel, S, qmax, bits in (("2", ~a.is4, S2, QMAX2, 2), ("4", a.is4, S4, QMAX4, 4)):
        so, sc, mc = _second_order(a.scale[sel], a.m[sel], S, scale_block)
        if not np.isfinite(so).all():
            raise ValueError(TOO_LARGE)
        d = np.repeat(so[:, 0].astype(np.float32), scale_block)[: sc.shape[0]]
        dm = np.repeat(so[:, 1].astype(np.float32), scale_block)[: sc.shape[0]]
        s_eff = (d * sc.astype(np.float32)).astype(np.float32)
        m_eff = (dm * mc.astype(np.float32)).astype(np.float32)
        codes = _encode(g[sel], s_eff, m_eff, qmax)
        bufs["codes" + key] = _pack(codes, bits).reshape(codes.shape[0], gs * bits // 32)
        bufs["scales" + key] = ((sc | (mc << 4)).astype(np.uint8) if key == "2"
                                else np.stack([sc, mc], axis=1).reshape(-1, 2))
        bufs["so" + key] = so.reshape(-1, 2)
    with np.errstate(over="ignore"):
        oval = w.reshape(-1)[a.outlier_idx].astype(np.float16)
    if not np.isfinite(oval).all():
        raise ValueError(TOO_LARGE)
    bufs["outlier_idx"] = a.outlier_idx.astype(np.int32)
    bufs["outlier_val"] = oval
    bufs["group_map"] = np.packbits(a.is4, bitorder="little") if n_groups else np.zeros(0, np.uint8)
    shapes = buffer_shapes(rows, K, gs, scale_block, n4, n_out)
    return {k: np.ascontiguousarray(bufs[k].astype(shapes[k][0]).reshape(shapes[k][1])) for k in BUFFER_NAMES}


def effective_params(bufs: dict, rows: int, K: int, group_size: int, scale_block: int):
    """Per group (id order): (is4 bool, s_eff float32, m_eff float32) from the buffers."""
    n_groups = rows * (K // group_size)
    is4 = np.unpackbits(np.asarray(bufs["group_map"], np.uint8), bitorder="little")[:n_groups].astype(bool)
    s_eff = np.zeros(n_groups, np.float32)
    m_eff = np.zeros(n_groups, np.float32)
    sc2 = bufs["scales2"] & 0x0F
    mc2 = bufs["scales2"] >> 4
    sc4 = bufs["scales4"][:, 0]
    mc4 = bufs["scales4"][:, 1]
    for sel, so, sc, mc in ((~is4, bufs["so2"], sc2, mc2), (is4, bufs["so4"], sc4, mc4)):
        d = np.repeat(so[:, 0].astype(np.float32), scale_block)[: sc.shape[0]]
        dm = np.repeat(so[:, 1].astype(np.float32), scale_block)[: sc.shape[0]]
        s_eff[sel] = d * sc.astype(np.float32)
        m_eff[sel] = dm * mc.astype(np.float32)
    return is4, s_eff, m_eff


def codes(bufs: dict, rows: int, K: int, group_size: int, scale_block: int) -> np.ndarray:
    """uint8 [rows, K]: every element's code (2-bit or 4-bit) from the packed buffers."""
    n_groups = rows * (K // group_size)
    is4, _, _ = effective_params(bufs, rows, K, group_size, scale_block)
    q = np.zeros((n_groups, group_size), np.uint8)
    q[~is4] = _unpack(np.asarray(bufs["codes2"]), 2, group_size)
    q[is4] = _unpack(np.asarray(bufs["codes4"]), 4, group_size)
    return q.reshape(rows, K)


def dequantize(bufs: dict, rows: int, K: int, group_size: int, scale_block: int) -> np.ndarray:
    """Buffers -> float32 [rows, K]: ``q * s_eff - m_eff``, then the outliers' fp16 values."""
    n_groups = rows * (K // group_size)
    _, s_eff, m_eff = effective_params(bufs, rows, K, group_size, scale_block)
    q = codes(bufs, rows, K, group_size, scale_block).reshape(n_groups, group_size).astype(np.float32)
    y = ((q * s_eff[:, None]).astype(np.float32) - m_eff[:, None]).astype(np.float32).reshape(-1)
    y[np.asarray(bufs["outlier_idx"], np.int64)] = np.asarray(bufs["outlier_val"]).astype(np.float32)
    return y.reshape(rows, K)


def pack_2bit(values: np.ndarray) -> np.ndarray:
    """Integer values 0..3 [..., n] (n % 16 == 0) -> int32 [..., n / 16]; value i of each run of
    16 in bits 2i..2i+1."""
    v = np.asarray(values)
    lead = v.shape[:-1]
    flat = v.reshape(-1, 16).astype(np.uint8)
    return _pack(flat, 2).reshape(*lead, v.shape[-1] // 16)


def unpack_2bit(packed: np.ndarray, num_elements: int) -> np.ndarray:
    """int32 words (any shape) -> uint8 [num_elements]: the first values, in order."""
    p = np.asarray(packed, np.int32).reshape(-1, 1)
    return _unpack(p, 2, 16).reshape(-1)[:num_elements]


# -- layout "tiled" -------------------------------------------------------------------------------
# The same per-group rules (steps 1, 4, 6) with the 4-bit groups chosen per tile of TILE_GROUPS
# consecutive groups of a row (a fixed count per tile), every group's 2 high bits in one regular
# stream, and second-order blocks along the row. The spec is in
# ``src/formats/mixed2bit/mixed2bit_tiled.h``.

TILE_GROUPS = 256   #: groups per tile (the last tile of a row may be shorter)
TILED_BUFFER_NAMES = ("codes", "scales", "so", "map", "lo", "mc4", "so4")


def tiled_tile_counts(K: int, group_size: int, ratio_4bit: float) -> tuple[int, int]:
    """(n4_full, n4_last): 4-bit groups of a full tile and of the row's last, shorter tile (0
    when the row has none), ``n4_count(ratio_4bit, tile size)`` each."""
    rest = (K // group_size) % TILE_GROUPS
    return n4_count(ratio_4bit, TILE_GROUPS), (n4_count(ratio_4bit, rest) if rest else 0)


def tiled_counts(K: int, group_size: int, ratio_4bit: float) -> tuple[int, int, int]:
    """(G, n_tiles, n4_row): groups and tiles per row, 4-bit groups per row (every row has the
    same)."""
    G = K // group_size
    n4_full, n4_last = tiled_tile_counts(K, group_size, ratio_4bit)
    return G, -(-G // TILE_GROUPS), (G // TILE_GROUPS) * n4_full + n4_last


def tiled_buffer_shapes(rows: int, K: int, group_size: int, scale_block: int, n4_row: int) -> dict:
    """{name: (dtype, shape)} of every buffer of the tiled layout (see mixed2bit_tiled.h)."""
    G = K // group_size
    return {
        "codes": ("int32", (rows, K // 16)),
        "scales": ("uint8", (rows, G)),
        "so": ("float16", (rows, -(-G // scale_block), 2)),
        "map": ("uint32", (rows, -(-G // 32))),
        "lo": ("int32", (rows, n4_row, group_size // 16)),
        "mc4": ("uint8", (rows, n4_row)),
        "so4": ("float16", (rows, -(-G // TILE_GROUPS), 2)),
    }


def select_4bit_tiled(scores: np.ndarray, rows: int, G: int, ratio_4bit: float) -> np.ndarray:
    """Step 2 of the tiled layout: bool [rows, G], per tile the ``n4_count(ratio_4bit, tile
    size)`` largest scores (ties: the smaller position). Raises ValueError (:data:`TOO_LARGE`)
    for a NaN score."""
    if np.isnan(scores).any():
        raise ValueError(TOO_LARGE)
    s = scores.reshape(rows, G)
    is4 = np.zeros((rows, G), bool)
    for t0 in range(0, G, TILE_GROUPS):
        tile = s[:, t0:t0 + TILE_GROUPS]
        n = n4_count(ratio_4bit, tile.shape[1])
        order = np.argsort(-tile, axis=1, kind="stable")[:, :n]  # stable: ties keep position order
        np.put_along_axis(is4[:, t0:t0 + TILE_GROUPS], order, True, axis=1)
    return is4


def _row_block_max(v: np.ndarray, block: int) -> np.ndarray:
    """float32 [rows, ceil(G / block)]: max of v [rows, G] (>= +0) over consecutive blocks of
    each row (the last may be partial; an empty max is 0)."""
    rows, G = v.shape
    nb = -(-G // block)
    padded = np.zeros((rows, nb * block), np.float32)
    padded[:, :G] = v
    return padded.reshape(rows, nb, block).max(axis=2, initial=_F0)


def quantize_tiled(w, group_size: int = 16, ratio_4bit: float = 0.1, sensitivity=None,
                   scale_block: int = 16) -> dict:
    """float w [rows, K] -> the dict of tiled-layout buffers (see :func:`tiled_buffer_shapes`).

    No argument checking beyond what the arithmetic needs (the package front end checks).
    Raises ValueError (:data:`TOO_LARGE`) for a NaN score or an inf second-order fp16.
    """
    w = np.asarray(w, np.float32)
    rows, K = w.shape
    gs = group_size
    G, n_tiles, n4_row = tiled_counts(K, gs, ratio_4bit)
    shapes = tiled_buffer_shapes(rows, K, gs, scale_block, n4_row)
    scores = group_scores(w, gs, None if sensitivity is None else np.asarray(sensitivity, np.float32))
    is4 = select_4bit_tiled(scores, rows, G, ratio_4bit)                 # [rows, G]
    scale, m, _ = first_order(w, gs, is4.reshape(-1), np.zeros(0, np.int64))
    scale, m = scale.reshape(rows, G), m.reshape(rows, G)
    g = w.reshape(rows, G, gs)

    with np.errstate(over="ignore"):
        # 2-bit groups: blocks of scale_block positions along the row, 4-bit groups left out
        d2 = (_row_block_max(np.where(is4, _F0, scale), scale_block) / np.float32(S2)).astype(np.float16)
        dm2 = (_row_block_max(np.where(is4, _F0, m), scale_block) / np.float32(S2)).astype(np.float16)
        # 4-bit groups: one block per tile
        d4 = (_row_block_max(np.where(is4, scale, _F0), TILE_GROUPS) / np.float32(S4)).astype(np.float16)
        dm4 = (_row_block_max(np.where(is4, m, _F0), TILE_GROUPS) / np.float32(S4)).astype(np.float16)
    if not (np.isfinite(d2).all() and np.isfinite(dm2).all() and np.isfinite(d4).all() and np.isfinite(dm4).all()):
        raise ValueError(TOO_LARGE)
    pos = np.arange(G)
    d = np.where(is4, d4[:, pos // TILE_GROUPS], d2[:, pos // scale_block]).astype(np.float32)
    dm = np.where(is4, dm4[:, pos // TILE_GROUPS], dm2[:, pos // scale_block]).astype(np.float32)
    S = np.where(is4, np.float32(S4), np.float32(S2)).astype(np.float32)
    sc, mc = _param_codes(scale, d, S), _param_codes(m, dm, S)
    s_eff = (d * sc.astype(np.float32)).astype(np.float32)
    m_eff = (dm * mc.astype(np.float32)).astype(np.float32)
    qmax = np.where(is4, np.float32(QMAX4), np.float32(QMAX2)).astype(np.float32)
    q = _encode(g.reshape(-1, gs), s_eff.reshape(-1), m_eff.reshape(-1), qmax.reshape(-1)).reshape(rows, G, gs)

    hi = np.where(is4[..., None], q >> 2, q).astype(np.uint8)
    bufs = {
        "codes": _pack(hi.reshape(-1, 16), 2).reshape(rows, K // 16),
        "scales": np.where(is4, sc, sc | (mc << 4)).astype(np.uint8),
        "so": np.stack([d2, dm2], axis=2),
        "map": _map_words(is4, shapes["map"][1][1]),
        "lo": _pack((q[is4] & 3).reshape(-1, 16), 2).reshape(rows, n4_row, gs // 16),
        "mc4": mc[is4].reshape(rows, n4_row),
        "so4": np.stack([d4, dm4], axis=2),
    }
    return {k: np.ascontiguousarray(bufs[k].astype(shapes[k][0]).reshape(shapes[k][1])) for k in TILED_BUFFER_NAMES}


def _map_words(is4: np.ndarray, words: int) -> np.ndarray:
    """uint32 [rows, words]: bit c % 32 of word c / 32 = is4[:, c] (padding bits 0)."""
    rows, G = is4.shape
    bits = np.zeros((rows, words * 32), bool)
    bits[:, :G] = is4
    return np.packbits(bits.reshape(rows, words * 4, 8), axis=2, bitorder="little").reshape(rows, words * 4) \
        .copy().view("<u4").astype(np.uint32)


def tiled_is4(bufs: dict, rows: int, K: int, group_size: int) -> np.ndarray:
    """bool [rows, G]: the map's bits."""
    G = K // group_size
    words = np.asarray(bufs["map"]).astype(np.uint64)
    bits = (words[:, :, None] >> np.arange(32, dtype=np.uint64)) & np.uint64(1)
    return bits.reshape(rows, words.shape[1] * 32)[:, :G].astype(bool)


def dequantize_tiled(bufs: dict, rows: int, K: int, group_size: int, scale_block: int) -> np.ndarray:
    """Tiled-layout buffers -> float32 [rows, K]: ``q * s_eff - m_eff`` per element, q the 2-bit
    code, or ``hi << 2 | lo`` for a 4-bit group."""
    gs = group_size
    G = K // gs
    is4 = tiled_is4(bufs, rows, K, gs)
    hi = _unpack(np.asarray(bufs["codes"]).reshape(-1, 1), 2, 16).reshape(rows, G, gs)
    q = hi.copy()
    lo = _unpack(np.asarray(bufs["lo"]).reshape(-1, 1), 2, 16).reshape(-1, gs)
    q[is4] = (hi[is4] << 2) | lo
    sb = np.asarray(bufs["scales"], np.uint8)
    mc = np.where(is4, 0, sb >> 4).astype(np.uint8)
    mc[is4] = np.asarray(bufs["mc4"], np.uint8).reshape(-1)
    sc = np.where(is4, sb, sb & 0x0F)
    so, so4 = np.asarray(bufs["so"]).astype(np.float32), np.asarray(bufs["so4"]).astype(np.float32)
    pos = np.arange(G)
    d = np.where(is4, so4[:, pos // TILE_GROUPS, 0], so[:, pos // scale_block, 0])
    dm = np.where(is4, so4[:, pos // TILE_GROUPS, 1], so[:, pos // scale_block, 1])
    s_eff = (d * sc.astype(np.float32)).astype(np.float32)
    m_eff = (dm * mc.astype(np.float32)).astype(np.float32)
    y = ((q.astype(np.float32) * s_eff[..., None]).astype(np.float32) - m_eff[..., None]).astype(np.float32)
    return y.reshape(rows, K)
