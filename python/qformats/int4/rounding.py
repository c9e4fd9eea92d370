"""int4's fake quantization for trainable rounding (:mod:`qformats.signround`): asymmetric
groups with a trainable rounding offset ``V`` and clipping factors ``alpha`` / ``beta``, every
step in float32::

    lo = min(min(w), 0) * beta          hi = max(max(w), 0) * alpha
    scale = (hi - lo) / 15              zero = clamp(rint(-lo / scale), 0, 15)
    q = clamp(rint(w / scale + V) + zero, 0, 15)
    w' = (q - zero) * scale             (int4's dequantize formula)

``rint`` is round half to even with a straight-through estimator so that gradients reach
``V``, ``alpha`` and ``beta``. A group whose scale is 0 (all zeros) gets codes 0, zero 0,
scale 0, as int4's rule. With ``V = 0``, ``alpha = beta = 1`` the codes, scales and zeros are
exactly :func:`qformats.int4.quantize`'s (round to nearest). The export writes the trained
codes, the clipped scales and the zeros into an int4 QuantizedTensor whose ``dequantize``
equals ``w'`` bit for bit.

Needs torch; reached through ``qformats.int4.SPEC.rounding``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .._core import QuantizedTensor, validate
from .._rounding import WeightMemo, round_ste
from . import FORMAT, SPEC, relayout

__all__ = ["fake_quant_int4", "export_int4", "Int4Rounding", "for_layer"]


def _int4_bounds(w: torch.Tensor, group_size: int):
    """What :func:`_int4_parts` computes from ``w`` alone: the groups ``[n_groups, gs]`` and
    their unclipped ``min(min(w), 0)``, ``max(max(w), 0)`` ``[n_groups, 1]``."""
    g = w.reshape(-1, group_size)
    mn = torch.clamp(g.min(dim=1, keepdim=True).values, max=0.0)
    mx = torch.clamp(g.max(dim=1, keepdim=True).values, min=0.0)
    return g, mn, mx


def _int4_parts(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                group_size: int, bounds: Optional[tuple] = None):
    """(q, zero, scale) as float32 tensors ``[n_groups, gs]``, ``[n_groups, 1]``, ``[n_groups, 1]``
    for a float32 weight ``[out, in]``; differentiable in v, alpha, beta through the STE.
    ``bounds``: ``_int4_bounds(w, group_size)`` computed before (training reuses it), or None."""
    g, mn, mx = _int4_bounds(w, group_size) if bounds is None else bounds
    vg = v.reshape(-1, group_size)
    lo = mn * beta.reshape(-1, 1)
    hi = mx * alpha.reshape(-1, 1)
    scale = (hi - lo) / 15.0
    ok = scale != 0
    safe = torch.where(ok, scale, torch.ones_like(scale))
    zero = torch.clamp(round_ste(-lo / safe), 0.0, 15.0)
    q = torch.clamp(round_ste(g / safe + vg) + zero, 0.0, 15.0)
    zero = torch.where(ok, zero, torch.zeros_like(zero))
    q = torch.where(ok, q, torch.zeros_like(q))
    return q, zero, scale


def fake_quant_int4(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """The fake-quantized float32 weight ``(q - zero) * scale`` ``[out, in]`` (module docstring)."""
    return _dequant(w, _int4_parts(w, v, alpha, beta, group_size))


def _dequant(w: torch.Tensor, parts: tuple) -> torch.Tensor:
    q, zero, scale = parts
    return ((q - zero) * scale).reshape(w.shape)


def export_int4(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                group_size: int, dtype: str = "float32") -> QuantizedTensor:
    """The int4 (asymmetric) QuantizedTensor of the trained parameters (torch buffers on w's device):
    codes packed two per byte (element 2j in the low nibble), float32 clipped scales, uint8 zeros.
    ``dtype`` is the recorded original weight dtype. Validated with ``qformats._core.validate``."""
    out_f, in_f = w.shape
    with torch.no_grad():
        q, zero, scale = _int4_parts(w.float(), v, alpha, beta, group_size)
    codes = q.reshape(out_f, in_f).to(torch.uint8)
    qweight = ((codes[:, 0::2] & 0x0F) | (codes[:, 1::2] << 4)).contiguous()
    bufs = {"qweight": qweight,
            "scales": scale.reshape(out_f, in_f // group_size).to(torch.float32).contiguous(),
            "zeros": zero.reshape(out_f, in_f // group_size).to(torch.uint8).contiguous()}
    qt = QuantizedTensor(FORMAT, (out_f, in_f), dtype, {"group_size": int(group_size), "symmetric": False}, bufs)
    validate(qt)
    return qt


class Int4Rounding:
    """Trainable rounding of int4 asymmetric groups of ``group_size`` (the interface of
    :class:`qformats._rounding.Rounding`)."""

    def __init__(self, group_size: int, layout: str = "rows"):
        self.group_size = int(group_size)
        self.layout = layout
        self._bounds = WeightMemo(lambda w: _int4_bounds(w, self.group_size))

    def fake_quant(self, w, v, alpha, beta):
        """:func:`fake_quant_int4`, bit for bit, with the groups' bounds computed once per
        weight."""
        return _dequant(w, _int4_parts(w, v, alpha, beta, self.group_size, self._bounds(w)))

    def export(self, w, v, alpha, beta, dtype: str = "float32") -> QuantizedTensor:
        return relayout(export_int4(w, v, alpha, beta, self.group_size, dtype), self.layout)


def for_layer(weight: torch.Tensor, params: Mapping[str, Any],
              sensitivity: Optional[torch.Tensor] = None) -> Int4Rounding:
    """``SPEC.rounding``: the trainable rounding of one layer with int4 ``params`` (asymmetric;
    ``sensitivity`` is not used: int4 has no calibrated choice)."""
    p = SPEC.params(**params)
    return Int4Rounding(p["group_size"], p.get("layout", "rows"))
