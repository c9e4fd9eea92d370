"""What trainable rounding (:mod:`qformats.signround`) asks of a format, and the
straight-through estimators the formats' fake quantizations share.

A format that trainable rounding applies to sets ``SPEC.rounding`` (see
:class:`qformats._spec.FormatSpec`): ``rounding(weight, params, sensitivity=None)`` returns an
object with the interface of :class:`Rounding`, made in the format's own ``rounding`` module
(``qformats.int4.rounding``, ``qformats.mixed2bit.rounding``). The trained parameters are the
same for every format: a rounding offset ``V`` ``[out, in]`` in ``[-0.5, 0.5]`` and clipping
factors ``alpha`` / ``beta`` ``[out, in // group_size]`` in ``[0.5, 1]`` of each group's max and
min.

Needs torch (imported only by the formats' ``rounding`` modules, which need it too).
"""
from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Rounding", "round_ste", "ste", "WeightMemo"]


class Rounding(Protocol):
    """One layer's fake quantization with trainable rounding and clipping, for one format.

    Attributes:
        group_size: values per group along ``in``: ``alpha`` and ``beta`` are
            ``[out, in // group_size]``.
    """

    group_size: int

    def fake_quant(self, w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
        """The fake-quantized float32 weight ``[out, in]`` of float32 ``w``, differentiable in
        ``v``, ``alpha``, ``beta`` (straight-through estimators)."""
        ...

    def export(self, w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
               dtype: str = "float32"):
        """The format's validated QuantizedTensor (torch buffers on w's device) of the trained
        parameters; its dequantize equals :meth:`fake_quant` bit for bit. ``dtype`` is the
        recorded original weight dtype."""
        ...


class _RoundSTE(torch.autograd.Function):
    """``(round(x) - x) + x`` forward (``round(x)`` with -0 read as +0, NaN for infinite x),
    identity backward: one graph node instead of three, the same values bit for bit."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x).sub_(x).add_(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round half to even forward, identity backward. ``(round(x) - x) + x`` equals
    ``round(x)`` exactly in float (``round(x) - x`` is exact by Sterbenz / for |x| < 1/2)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RoundSTE.apply(x)
    return torch.round(x).sub_(x).add_(x)


def ste(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` forward, identity (gradient of ``x``) backward."""
    return (y - x).detach() + x


class WeightMemo:
    """The part of a fake quantization that depends on the weight alone (group minima and
    maxima, group kinds), computed by ``make(w)`` once and reused while the same tensor ``w``
    is passed unchanged: training calls the fake quantization with the same frozen weight at
    every step, and only ``V``, ``alpha``, ``beta`` move. An in-place change of ``w`` (its
    version counter) or another tensor recomputes it."""

    def __init__(self, make):
        self.make = make
        self.w = None
        self.version = -1
        self.value = None

    def __call__(self, w: torch.Tensor):
        if self.w is not w or self.version != w._version:
            with torch.no_grad():
                self.value = self.make(w)
            self.w, self.version = w, w._version
        return self.value
