"""mixed2bit's fake quantization for trainable rounding (:mod:`qformats.signround`): groups
without outliers with a trainable rounding offset ``V`` and clipping factors ``alpha`` /
``beta``, second-order quantization included.

2-bit groups (:func:`fake_quant_2bit`): per group ``lo = min(min(w), 0) * beta``,
``hi = max(w) * alpha``, ``scale = (hi - lo) / 3``, ``m = -lo``; per block of ``scale_block``
groups the fp16 fields ``d = max(scale) / 15``, ``dm = max(m) / 15`` (fp16 rounding with a
straight-through gradient), 4-bit codes ``sc = rint(scale / d)``, ``mc = rint(m / dm)``;
``q = clamp(rint((w + dm*mc) / (d*sc) + V), 0, 3)``, ``w' = q * (d*sc) - dm*mc``. The export
(:func:`export_2bit`) writes those codes and fields, so mixed2bit's ``dequantize`` equals ``w'``
bit for bit; at ``V = 0``, ``alpha = beta = 1`` the buffers equal
:func:`qformats.mixed2bit.quantize`'s (``ratio_4bit=0``).

With 4-bit groups (``ratio_4bit > 0``): the 4-bit groups are chosen first and kept fixed during
training, by the format's own selection rule (:func:`select_4bit` calls
:func:`qformats.mixed2bit.quantize`): the groups with the largest ``sum(sensitivity * w**2)``
(``sensitivity``: the calibrated mean squared input per column, see
:mod:`qformats.calibration`), or by range without one. The 4-bit groups train with
``qmax = 15`` and their own second-order list (8-bit codes ``sc, mc`` in ``0..255`` against
``d = max(scale) / 255``, ``dm = max(m) / 255`` per block of ``scale_block`` 4-bit groups in id
order). The export (:func:`export_mixed2bit`) writes the group map, both code arrays and both
second-order lists, so the packed layer decodes to the trained ``w'`` bit for bit.

Layout ``"tiled"`` (``mixed2bit_tiled.h``): the 4-bit groups are the format's per-tile choice
(:func:`select_4bit` with ``layout="tiled"``), and the second-order fields follow that layout:
a 2-bit group's ``d, dm`` over the 2-bit groups of its block of ``scale_block`` consecutive
positions of its row (against 15), a 4-bit group's over the 4-bit groups of its tile of 256
positions (against 255). :func:`export_mixed2bit` then writes the tiled buffers.

Needs torch; reached through ``qformats.mixed2bit.SPEC.rounding``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .._core import QuantizedTensor, validate
from .._rounding import WeightMemo, round_ste, ste
from . import DEFAULT_SCALE_BLOCK, FORMAT, SPEC, _check_layout, expected_buffers, quantize
from .reference import TILE_GROUPS, n4_count, tiled_counts, tiled_is4

__all__ = ["fake_quant_2bit", "export_2bit", "fake_quant_mixed2bit", "export_mixed2bit", "select_4bit",
           "Mixed2bitRounding", "for_layer"]


class _Groups:
    """What :func:`_m2_parts` computes from ``w`` and ``is4`` alone (constant while ``V``,
    ``alpha``, ``beta`` train): the groups ``g [n, gs]`` (-0 read as +0), their unclipped
    bounds ``lo0 = min(min(g), 0)``, ``hi0 = max(g)`` ``[n, 1]``, ``qmax`` / ``smax`` per group,
    and the two lists' group ids (None when every group is 2-bit: no gather, no scatter).

    ``peak_ok``: whether every second-order field is finite in fp16 for any ``alpha, beta`` in
    ``[0, 1]`` (they peak at round to nearest: ``scale <= max(hi0, 0) - lo0`` over ``qmax``,
    ``m <= -lo0``), so that training skips the per-step check (a host sync on the GPU).

    ``rows`` (the tiled layout): the second-order fields go by row position (blocks of a row,
    tiles), kept as ``is4_rows`` ``[rows, G]``; the lists' ids are not used.
    """

    def __init__(self, w: torch.Tensor, group_size: int, is4: Optional[torch.Tensor] = None,
                 tiled: bool = False):
        g = w.reshape(-1, group_size) + 0.0        # -0 read as +0, as the format does
        n = g.shape[0]
        if is4 is not None:
            is4 = is4.reshape(-1)
            if is4.numel() != n:
                raise ValueError(f"is4: expected {n} group flags, got {is4.numel()}")
        self.g, self.n = g, n
        self.rows = int(w.shape[0]) if tiled else None
        if tiled:
            flags = torch.zeros(n, dtype=torch.bool, device=w.device) if is4 is None else is4.to(torch.bool)
            self.is4_rows = flags.reshape(self.rows, -1)
        self.lo0 = torch.clamp(g.min(dim=1, keepdim=True).values, max=0.0)
        self.hi0 = g.max(dim=1, keepdim=True).values
        if is4 is None or not bool(is4.any()):
            self.ids = None
            self.qmax = torch.full((n, 1), 3.0, device=w.device)
            self.smax = torch.full((n, 1), 15.0, device=w.device)
        else:
            ids2, ids4 = torch.nonzero(~is4).reshape(-1), torch.nonzero(is4).reshape(-1)
            self.ids = (ids2, ids4)
            order = torch.cat([ids2, ids4])
            self.order, self.inverse = order, torch.argsort(order)
            self.qmax = torch.where(is4, 15.0, 3.0).to(torch.float32).reshape(-1, 1)
            self.smax = torch.where(is4, 255.0, 15.0).to(torch.float32).reshape(-1, 1)
        peak = torch.maximum((torch.clamp(self.hi0, min=0.0) - self.lo0) / self.qmax, -self.lo0) / self.smax
        self.peak_ok = n == 0 or bool(torch.isfinite(peak.max().to(torch.float16)))


def _row_fields(val: torch.Tensor, block: int, S: float, check: bool):
    """fp16 fields (float32 values) ``[rows, ceil(G / block)]`` of the blocks of ``block``
    consecutive positions of each row of ``val`` ``[rows, G]`` (>= +0; the last block may be
    short), and the per-position field ``[rows, G]``: the tiled layout's blocks, and a list's
    (:func:`_block_fields`) as one row."""
    rows, G = val.shape
    nb = -(-G // block)
    pad = nb * block - G
    vv = torch.cat([val, val.new_zeros(rows, pad)], dim=1) if pad else val
    bmax = vv.reshape(rows, nb, block).max(dim=2).values / S if G else val.new_zeros(rows, 0)
    b16 = ste(bmax, bmax.to(torch.float16).to(torch.float32))
    if check and not torch.isfinite(b16).all():
        raise ValueError("values too large for mixed2bit's fp16 second-order scales")
    return b16, b16.repeat_interleave(block, dim=1)[:, :G]


def _block_fields(val: torch.Tensor, scale_block: int, S: float, check: bool):
    """fp16 fields (float32 values) of the blocks of ``scale_block`` consecutive entries of
    ``val`` ``[k]`` (a list in id order), and the per-entry field ``[k]``: :func:`_row_fields`
    of the list as one row."""
    f, per = _row_fields(torch.clamp(val, min=0.0).reshape(1, -1), scale_block, S, check)
    return f[0], per[0]


def _group_fields(grp: _Groups, val: torch.Tensor, scale_block: int, check: bool):
    """The per-group second-order field ``[n, 1]`` of ``val`` ``[n, 1]`` (the 2-bit list
    against 15, the 4-bit list against 255), and the blocks' fields of each list."""
    if grp.rows is not None:  # tiled: 2-bit groups by blocks of a row, 4-bit groups by tiles
        is4 = grp.is4_rows
        v = torch.clamp(val.reshape(grp.rows, -1), min=0.0)
        zero = torch.zeros_like(v)
        f2, per2 = _row_fields(torch.where(is4, zero, v), scale_block, 15.0, check)
        f4, per4 = _row_fields(torch.where(is4, v, zero), TILE_GROUPS, 255.0, check)
        return torch.where(is4, per4, per2).reshape(-1, 1), f2, f4
    if grp.ids is None:
        f2, per = _block_fields(val.reshape(-1), scale_block, 15.0, check)
        return per.reshape(-1, 1), f2, val.new_zeros(0)
    k2 = grp.ids[0].numel()
    vals = val.reshape(-1)[grp.order]
    f2, per2 = _block_fields(vals[:k2], scale_block, 15.0, check)
    f4, per4 = _block_fields(vals[k2:], scale_block, 255.0, check)
    return torch.cat([per2, per4])[grp.inverse].reshape(-1, 1), f2, f4


def _m2_parts(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
              group_size: int, scale_block: int, is4: Optional[torch.Tensor] = None,
              groups: Optional[_Groups] = None, tiled: bool = False):
    """mixed2bit groups without outliers (``mixed2bit.h`` steps 4-6) with clipping.

    Per group (read with -0 as +0) ``lo = min(min(v), 0) * beta``, ``hi = max(v) * alpha``,
    ``scale = (hi - lo) / qmax`` (qmax 3, or 15 for the groups where ``is4``), ``m = 0 - lo``;
    the 2-bit groups in id order and the 4-bit groups in id order form two lists, each cut
    into blocks of ``scale_block`` groups with ``d16 = fp16(max(0, scale_i) / S)``,
    ``dm16 = fp16(max(0, m_i) / S)`` (S = 15 or 255; fp16 rounding with a straight-through
    gradient); ``sc = clamp(rint(scale / d16), 0, S)`` (0 if d16 = 0), likewise ``mc``;
    ``s_eff = d16 * sc``, ``m_eff = dm16 * mc``; ``q = clamp(rint((w + m_eff) / s_eff + V), 0, qmax)``
    (0 if s_eff = 0).

    Args:
        w, v: float32 ``[out, in]``; alpha, beta: float32 ``[out, in // group_size]``.
        is4: bool ``[n_groups]`` (row-major group ids) or None (all 2-bit).
        groups: ``_Groups(w, group_size, is4, tiled)`` computed before (training reuses it;
            then the fields are checked once there, not at every call), or None.
        tiled: the tiled layout's second-order blocks (module docstring) instead of the lists'.
    Returns:
        float32 ``(q [n, gs], s_eff [n, 1], m_eff [n, 1], sc [n, 1], mc [n, 1],
        fields2 (d16, dm16), fields4 (d16, dm16))``, n = n_groups; the fields ``[nb2]`` and
        ``[nb4]`` per list, or (tiled) ``[rows, blocks of a row]`` and ``[rows, tiles]``.
    Raises:
        ValueError: a second-order field that is inf in fp16 ("values too large ...").
    """
    check = groups is None
    grp = _Groups(w, group_size, is4, tiled) if groups is None else groups
    if not check and not grp.peak_ok:
        raise ValueError("values too large for mixed2bit's fp16 second-order scales")
    g, qmax, smax = grp.g, grp.qmax, grp.smax
    lo = grp.lo0 * beta.reshape(-1, 1)
    hi = grp.hi0 * alpha.reshape(-1, 1)
    scale = (hi - lo) / qmax
    m = 0.0 - lo
    dg, d2, d4 = _group_fields(grp, scale, scale_block, check)
    dmg, dm2, dm4 = _group_fields(grp, m, scale_block, check)

    def code(val, dd):
        ok = dd > 0
        safe = torch.where(ok, dd, torch.ones_like(dd))
        c = torch.minimum(torch.clamp(round_ste(val / safe), min=0.0), smax)
        return torch.where(ok, c, torch.zeros_like(c))

    sc = code(scale, dg)
    mc = code(m, dmg)
    s_eff = dg * sc
    m_eff = dmg * mc
    ok = s_eff > 0
    safe = torch.where(ok, s_eff, torch.ones_like(s_eff))
    q = torch.minimum(torch.clamp(round_ste((g + m_eff) / safe + v.reshape(-1, group_size)), min=0.0), qmax)
    q = torch.where(ok, q, torch.zeros_like(q))
    return q, s_eff, m_eff, sc, mc, (d2, dm2), (d4, dm4)


def fake_quant_2bit(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                    group_size: int, scale_block: int = 16) -> torch.Tensor:
    """The fake-quantized float32 weight ``q * s_eff - m_eff`` ``[out, in]`` of plain 2-bit
    mixed2bit groups (see :func:`_m2_parts`): mixed2bit's dequantize, bit for bit."""
    return fake_quant_mixed2bit(w, v, alpha, beta, group_size, scale_block, None)


def fake_quant_mixed2bit(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                         group_size: int, scale_block: int = 16,
                         is4: Optional[torch.Tensor] = None, layout: str = "global") -> torch.Tensor:
    """The fake-quantized weight of mixed2bit groups with trainable rounding and clipping.

    Args:
        w: float32 ``[out, in]``, ``in`` a multiple of ``group_size`` (a multiple of 16).
        v: float32 ``[out, in]``, rounding offsets in ``[-0.5, 0.5]``.
        alpha, beta: float32 ``[out, in // group_size]``, clipping factors of the group's max
            and min, in ``[0.5, 1]``.
        group_size, scale_block: mixed2bit's parameters.
        is4: bool ``[out * in // group_size]``: the 4-bit groups (row-major group ids), or None
            for plain 2-bit. See :func:`select_4bit`.
        layout: ``"global"`` or ``"tiled"`` (which second-order blocks; module docstring).
    Returns:
        float32 ``[out, in]``: ``q * s_eff - m_eff`` per element (module docstring), equal bit
        for bit to ``mixed2bit.dequantize`` of :func:`export_mixed2bit`'s tensor; differentiable
        in v, alpha, beta through straight-through estimators.
    Raises:
        ValueError: fp16 second-order fields that overflow, ``is4`` of the wrong size, or an
            unknown ``layout``.
    """
    return _dequant(w, _m2_parts(w, v, alpha, beta, group_size, scale_block, is4, tiled=_is_tiled(layout)))


def _is_tiled(layout: str) -> bool:
    return _check_layout(layout) == "tiled"  # ValueError for another name


def _dequant(w: torch.Tensor, parts: tuple) -> torch.Tensor:
    q, s_eff, m_eff, *_ = parts
    return (q * s_eff - m_eff).reshape(w.shape)


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words of codes ``q`` [n, gs] (float or int), 32 // bits per word, value i of a
    word in bits ``bits * i`` (bit 31 included: negative words)."""
    per = 32 // bits
    n, gs = q.shape
    qi = q.to(torch.int64).reshape(n, gs // per, per)
    shifts = bits * torch.arange(per, device=q.device, dtype=torch.int64)
    words = (qi << shifts).sum(dim=2)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32).contiguous()


def export_mixed2bit(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                     group_size: int, scale_block: int = 16, is4: Optional[torch.Tensor] = None,
                     ratio_4bit: float = 0.0, selection: str = "range",
                     dtype: str = "float32", layout: str = "global") -> QuantizedTensor:
    """The mixed2bit QuantizedTensor (no outliers) of trained parameters.

    Args:
        w, v, alpha, beta, group_size, scale_block, is4, layout: as :func:`fake_quant_mixed2bit`.
        ratio_4bit: the format parameter recorded in the params; ``floor(ratio_4bit *
            n_groups + 0.5)`` must equal the number of True flags in ``is4`` (tiled: per tile,
            ``floor(ratio_4bit * tile groups + 0.5)``).
        selection: recorded in the params: ``"sensitivity"`` or ``"range"`` (how ``is4`` was
            chosen).
        dtype: the recorded original weight dtype.
    Returns:
        a validated QuantizedTensor with torch buffers on w's device: ``group_map`` from
        ``is4``, 2-bit codes 16 per int32 word, 4-bit codes 8 per word, ``scales2 = sc | mc << 4``,
        ``scales4 = [sc, mc]``, fp16 ``so2`` / ``so4`` ``[d, dm]`` per block; or the tiled
        layout's buffers (``mixed2bit_tiled.h``). Its dequantize equals
        :func:`fake_quant_mixed2bit` bit for bit.
    Raises:
        ValueError: ``is4`` inconsistent with ``ratio_4bit``, or the checks of
            :func:`qformats._core.validate`.
    """
    if _is_tiled(layout):
        return _export_tiled(w, v, alpha, beta, group_size, scale_block, is4, ratio_4bit, selection, dtype)
    out_f, in_f = w.shape
    n = out_f * (in_f // group_size)
    dev = w.device
    flags = torch.zeros(n, dtype=torch.bool, device=dev) if is4 is None else is4.reshape(-1).to(torch.bool)
    n4 = int(flags.sum())
    if n4 != n4_count(ratio_4bit, n):
        raise ValueError(f"is4 holds {n4} 4-bit groups but ratio_4bit={ratio_4bit} of {n} groups "
                         f"gives {n4_count(ratio_4bit, n)}")
    with torch.no_grad():
        q, _, _, sc, mc, (d2, dm2), (d4, dm4) = _m2_parts(w.float(), v, alpha, beta, group_size,
                                                          scale_block, flags)
    params = {"group_size": int(group_size), "ratio_4bit": float(ratio_4bit), "outlier_ratio": 0.0,
              "scale_block": int(scale_block), "selection": selection, "n4": n4, "n_out": 0}
    shapes = expected_buffers((out_f, in_f), params)
    bufs = {name: torch.zeros(shape, dtype=getattr(torch, dt), device=dev)
            for name, (dt, shape) in shapes.items()}
    nbytes = shapes["group_map"][1][0]
    bits = torch.zeros(nbytes * 8, dtype=torch.int64, device=dev)
    bits[:n] = flags.to(torch.int64)
    bufs["group_map"] = (bits.reshape(-1, 8) << torch.arange(8, device=dev)).sum(1).to(torch.uint8)
    ids2, ids4 = ~flags, flags
    bufs["codes2"] = _pack_codes(q[ids2], 2).reshape(shapes["codes2"][1])
    bufs["codes4"] = _pack_codes(q[ids4], 4).reshape(shapes["codes4"][1])
    sc, mc = sc.reshape(-1).to(torch.int64), mc.reshape(-1).to(torch.int64)
    bufs["scales2"] = (sc[ids2] | (mc[ids2] << 4)).to(torch.uint8).contiguous()
    scales4 = torch.stack([sc[ids4], mc[ids4]], dim=1).to(torch.uint8)
    bufs["scales4"] = scales4.reshape(shapes["scales4"][1]).contiguous()
    bufs["so2"] = torch.stack([d2, dm2], dim=1).to(torch.float16).reshape(shapes["so2"][1]).contiguous()
    bufs["so4"] = torch.stack([d4, dm4], dim=1).to(torch.float16).reshape(shapes["so4"][1]).contiguous()
    qt = QuantizedTensor(FORMAT, (out_f, in_f), dtype, params, bufs)
    validate(qt)
    return qt


def _export_tiled(w, v, alpha, beta, group_size: int, scale_block: int, is4, ratio_4bit: float,
                  selection: str, dtype: str) -> QuantizedTensor:
    """:func:`export_mixed2bit` for the tiled layout (the buffers of ``quantize_tiled`` in
    :mod:`qformats.mixed2bit.reference`)."""
    rows, K = (int(s) for s in w.shape)
    gs = int(group_size)
    G, _, n4_row = tiled_counts(K, gs, ratio_4bit)
    dev = w.device
    flags = (torch.zeros(rows * G, dtype=torch.bool, device=dev) if is4 is None
             else is4.reshape(-1).to(torch.bool).to(dev))
    for t0 in range(0, G, TILE_GROUPS):  # the layout's count in every tile of every row
        want = n4_count(ratio_4bit, min(TILE_GROUPS, G - t0))
        got = flags.reshape(rows, G)[:, t0:t0 + TILE_GROUPS].sum(1)
        if rows and not bool((got == want).all()):
            raise ValueError(f"is4: the tiled layout of ratio_4bit={ratio_4bit} needs {want} 4-bit groups "
                             f"in the tile at group {t0} of every row")
    with torch.no_grad():
        q, _, _, sc, mc, (d2, dm2), (d4, dm4) = _m2_parts(w.float(), v, alpha, beta, gs, scale_block,
                                                          flags, tiled=True)
    params = {"group_size": gs, "ratio_4bit": float(ratio_4bit), "outlier_ratio": 0.0,
              "scale_block": int(scale_block), "selection": selection, "n4": rows * n4_row, "n_out": 0,
              "layout": "tiled"}
    shapes = expected_buffers((rows, K), params)
    f2 = flags.reshape(rows, G)
    q = q.to(torch.int64).reshape(rows, G, gs)
    hi = torch.where(f2[..., None], q >> 2, q)
    words = -(-G // 32)
    bits = torch.zeros(rows, words * 32, dtype=torch.int64, device=dev)
    bits[:, :G] = f2.to(torch.int64)
    map_words = (bits.reshape(rows, words, 32) << torch.arange(32, device=dev)).sum(2)
    sc, mc = sc.reshape(rows, G).to(torch.int64), mc.reshape(rows, G).to(torch.int64)
    bufs = {
        "codes": _pack_codes(hi.reshape(-1, 16), 2).reshape(shapes["codes"][1]),
        "scales": torch.where(f2, sc, sc | (mc << 4)).to(torch.uint8),
        "so": torch.stack([d2, dm2], dim=2).to(torch.float16),
        "map": map_words.to(torch.uint32),
        "lo": _pack_codes((q[f2] & 3).reshape(-1, 16), 2).reshape(shapes["lo"][1]),
        "mc4": mc[f2].reshape(shapes["mc4"][1]).to(torch.uint8),
        "so4": torch.stack([d4, dm4], dim=2).to(torch.float16),
    }
    bufs = {k: t.reshape(shapes[k][1]).contiguous() for k, t in bufs.items()}
    qt = QuantizedTensor(FORMAT, (rows, K), dtype, params, bufs)
    validate(qt)
    return qt


def export_2bit(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                group_size: int, scale_block: int = 16, dtype: str = "float32") -> QuantizedTensor:
    """The mixed2bit QuantizedTensor (ratio_4bit = 0, no outliers) of the trained parameters:
    :func:`export_mixed2bit` with ``is4=None``."""
    return export_mixed2bit(w, v, alpha, beta, group_size, scale_block, None, 0.0, "range", dtype)


def select_4bit(w: torch.Tensor, group_size: int, ratio_4bit: float, sensitivity: Any = None,
                scale_block: int = 16, layout: str = "global") -> torch.Tensor:
    """mixed2bit's 4-bit groups of ``w`` as the format chooses them (its step 2, run by
    :func:`qformats.mixed2bit.quantize` itself, so the choice is the format's, bit for bit).

    Args:
        w: float ``[out, in]`` tensor.
        group_size, ratio_4bit, scale_block, layout: mixed2bit's parameters (the tiled layout
            chooses per tile of 256 groups of a row).
        sensitivity: float ``[in]`` (>= 0, finite) or None (by range).
    Returns:
        bool ``[out * in // group_size]`` on w's device, True for the 4-bit groups.
    Raises:
        ValueError / TypeError: as :func:`qformats.mixed2bit.quantize`.
    """
    n = w.shape[0] * (w.shape[1] // group_size)
    qt = quantize(w.detach().float().contiguous().cpu(), group_size=group_size, ratio_4bit=ratio_4bit,
                  sensitivity=sensitivity, scale_block=scale_block, layout=layout)
    if _is_tiled(layout):
        bufs = {"map": qt.buffers["map"].numpy()}
        flags = tiled_is4(bufs, int(w.shape[0]), int(w.shape[1]), group_size)
        return torch.from_numpy(flags.reshape(-1).copy()).to(w.device)
    gm = qt.buffers["group_map"].to(torch.int64)
    bits = ((gm.reshape(-1, 1) >> torch.arange(8)) & 1).reshape(-1)[:n]
    return bits.to(torch.bool).to(w.device)


class Mixed2bitRounding:
    """Trainable rounding of the mixed2bit groups of a weight of ``shape`` ``[out, in]`` (the
    interface of :class:`qformats._rounding.Rounding`).

    Args:
        shape: the weight's ``(out, in)``; ``in`` a multiple of ``group_size``.
        group_size, scale_block: mixed2bit's parameters.
        is4: bool ``[out * in // group_size]`` flags of the 4-bit groups (see
            :func:`select_4bit`), or None (plain 2-bit).
        ratio_4bit, selection: the recorded parameters (``is4`` must hold
            ``floor(ratio_4bit * n_groups + 0.5)`` groups; tiled: that count per tile).
        layout: ``"global"`` or ``"tiled"``.
    Raises:
        ValueError: ``is4`` with the wrong size or count.
    """

    def __init__(self, shape, group_size: int, scale_block: int = 16, is4: Optional[torch.Tensor] = None,
                 ratio_4bit: float = 0.0, selection: str = "range", layout: str = "global"):
        out_f, in_f = (int(s) for s in shape)
        self.group_size, self.scale_block = int(group_size), int(scale_block)
        self.ratio_4bit, self.selection = float(ratio_4bit), selection
        self.layout, self.tiled = layout, _is_tiled(layout)
        ng = out_f * (in_f // self.group_size)
        if is4 is not None:
            is4 = is4.reshape(-1).to(torch.bool)
            if is4.numel() != ng:
                raise ValueError(f"is4: expected {ng} mixed2bit group flags, got {is4.numel()} ({FORMAT})")
            want = (out_f * tiled_counts(in_f, self.group_size, self.ratio_4bit)[2] if self.tiled
                    else n4_count(self.ratio_4bit, ng))
            if int(is4.sum()) != want:
                raise ValueError(f"is4 holds {int(is4.sum())} 4-bit groups, ratio_4bit={ratio_4bit} "
                                 f"gives {want}")
        self.is4 = is4
        self._groups = WeightMemo(lambda w: _Groups(w, self.group_size, self._flags(w), self.tiled))

    def _flags(self, w: torch.Tensor) -> Optional[torch.Tensor]:
        return None if self.is4 is None else self.is4.to(w.device)

    def fake_quant(self, w, v, alpha, beta):
        """:func:`fake_quant_mixed2bit`, bit for bit, with what depends on ``w`` alone computed
        once per weight (``alpha``, ``beta`` in [0.5, 1], as training keeps them)."""
        return _dequant(w, _m2_parts(w, v, alpha, beta, self.group_size, self.scale_block,
                                     groups=self._groups(w), tiled=self.tiled))

    def export(self, w, v, alpha, beta, dtype: str = "float32") -> QuantizedTensor:
        return export_mixed2bit(w, v, alpha, beta, self.group_size, self.scale_block, self._flags(w),
                                self.ratio_4bit, self.selection, dtype, self.layout)


def for_layer(weight: torch.Tensor, params: Mapping[str, Any],
              sensitivity: Optional[torch.Tensor] = None) -> Mixed2bitRounding:
    """``SPEC.rounding``: the trainable rounding of one layer ``weight`` ``[out, in]`` with
    mixed2bit ``params`` (no outliers). With 4-bit groups (``ratio_4bit > 0``) they are chosen
    here, once, by :func:`select_4bit`: by ``sensitivity`` (float ``[in]``) when given, else by
    range; the choice is recorded as the ``selection`` parameter."""
    full = SPEC.params(**params)
    gs = int(full["group_size"])
    sb = int(params.get("scale_block", DEFAULT_SCALE_BLOCK))
    layout = str(params.get("layout", "global"))
    if not SPEC.calibrated(full):
        return Mixed2bitRounding(weight.shape, gs, sb, layout=layout)
    ratio = float(full["ratio_4bit"])
    is4 = select_4bit(weight, gs, ratio, sensitivity, sb, layout)
    return Mixed2bitRounding(weight.shape, gs, sb, is4, ratio,
                             "range" if sensitivity is None else "sensitivity", layout)
