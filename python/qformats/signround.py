"""Trainable rounding (SignRound / AutoRound style) for int4 asymmetric groups and mixed2bit
(2-bit groups, and 4-bit groups chosen by calibrated sensitivity).

Per quantized ``nn.Linear`` weight ``W`` ``[out, in]`` (groups of ``group_size`` along ``in``)
three sets of parameters are trained:

* ``V`` ``[out, in]`` in ``[-0.5, 0.5]``: a rounding offset added before rounding;
* ``alpha`` ``[out, in // gs]`` in ``[0.5, 1]``: scales the group's max ``hi``;
* ``beta``  ``[out, in // gs]`` in ``[0.5, 1]``: scales the group's min ``lo``.

The fake quantization is int4's asymmetric rule with those parameters, every step in float32::

    lo = min(min(w), 0) * beta          hi = max(max(w), 0) * alpha
    scale = (hi - lo) / 15              zero = clamp(rint(-lo / scale), 0, 15)
    q = clamp(rint(w / scale + V) + zero, 0, 15)
    w' = (q - zero) * scale             (int4's dequantize formula)

``rint`` is round half to even with a straight-through estimator
(``(round(x) - x).detach() + x``) so gradients reach ``V``, ``alpha`` and ``beta``. A group
whose scale is 0 (all zeros) gets codes 0, zero 0, scale 0, as int4's rule. With ``V = 0``,
``alpha = beta = 1`` the codes, scales and zeros are exactly :func:`qformats.int4.quantize`'s
(round to nearest), which is where training starts.

Training is block by block: the inputs of the first transformer block are captured from the
model's own forward (hidden states and the keyword arguments the block takes: attention mask,
position embeddings, ...); each block is trained on its own (a float32 copy, its Linears
replaced by the fake-quantized ones) to reproduce the full-precision block's output on the same
inputs (MSE), where those inputs are the outputs of the already-quantized previous blocks.
The optimizer is SignSGD (``p -= lr_t * sign(grad)``, no momentum) with a linearly decaying
learning rate ``lr_t = lr * (1 - t / iters)``; after each step the parameters are clamped to
their ranges. The parameters with the lowest loss seen (evaluated before every step and once
after the last) are kept. The export writes the trained codes, the clipped scales and the zeros
into an int4 QuantizedTensor: its ``dequantize`` equals the trained ``w'`` bit for bit.

2-bit (``bits=2``: mixed2bit with ``ratio_4bit=0``, no outliers): the same parameters on
mixed2bit's rule, second-order quantization included (:func:`fake_quant_2bit`): per group
``lo = min(min(w), 0) * beta``, ``hi = max(w) * alpha``, ``scale = (hi - lo) / 3``,
``m = -lo``; per block of ``scale_block`` groups the fp16 fields ``d = max(scale) / 15``,
``dm = max(m) / 15`` (fp16 rounding with a straight-through gradient), 4-bit codes
``sc = rint(scale / d)``, ``mc = rint(m / dm)``; ``q = clamp(rint((w + dm*mc) / (d*sc) + V), 0, 3)``,
``w' = q * (d*sc) - dm*mc``. The export (:func:`export_2bit`) writes those codes and fields,
so mixed2bit's ``dequantize`` equals ``w'`` bit for bit; at ``V = 0``, ``alpha = beta = 1``
the buffers equal :func:`qformats.mixed2bit.quantize`'s (``ratio_4bit=0``).

mixed2bit with 4-bit groups (``ratio_4bit > 0``, no outliers): the 4-bit groups are chosen
first and kept fixed during training, by the format's own selection rule
(:func:`select_4bit` calls :func:`qformats.mixed2bit.quantize`): the groups with the largest
``sum(sensitivity * w**2)``, where ``sensitivity`` is the mean squared input of the layer per
input column (the diagonal of ``X^T X`` / tokens, :func:`capture_second_moments`) over the
calibration samples as the block-by-block procedure feeds them to the block (outputs of the
already-quantized previous blocks), raised to ``sensitivity_power``; with
``selection="range"`` by range. Then the same ``V``, ``alpha``, ``beta`` are trained for
every group: the 2-bit groups as above, the 4-bit groups with ``qmax = 15`` and their own
second-order list (8-bit codes ``sc, mc`` in ``0..255`` against ``d = max(scale) / 255``,
``dm = max(m) / 255`` per block of ``scale_block`` 4-bit groups in id order). The export
(:func:`export_mixed2bit`) writes the group map, both code arrays and both second-order lists,
so the packed layer decodes to the trained ``w'`` bit for bit.

Used through :func:`qformats.quantize_model` with ``method="signround"``.
"""
from __future__ import annotations

import copy
import math
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._core import QuantizedTensor, format_spec, validate
from .nn import QuantizedLinear

__all__ = ["OPTIONS", "pop_options", "fake_quant_int4", "export_int4", "fake_quant_2bit",
           "export_2bit", "fake_quant_mixed2bit", "export_mixed2bit", "select_4bit",
           "capture_second_moments", "model_second_moments", "sensitivity_from_moments",
           "check_selection", "SignRoundLinear",
           "calibration_samples", "find_blocks", "capture_block_inputs", "train_block",
           "quantize_plan"]

#: quantize_model keyword arguments that belong to signround (not to the format).
OPTIONS = ("calibration", "tokenizer", "iters", "nsamples", "seqlen", "lr", "batch_size", "seed",
           "selection", "sensitivity_power")
DEFAULTS = {"calibration": None, "tokenizer": None, "iters": 200, "nsamples": 128, "seqlen": 2048,
            "lr": None, "batch_size": 8, "seed": 0, "selection": "sensitivity",
            "sensitivity_power": 1.0}
#: How mixed2bit's 4-bit groups are chosen: by the calibrated sensitivity, or by range.
SELECTIONS = ("sensitivity", "range")

V_RANGE = (-0.5, 0.5)
SCALE_RANGE = (0.5, 1.0)


def pop_options(params: dict) -> dict:
    """Remove signround's options (:data:`OPTIONS`) from ``params`` (in place) and return them
    with :data:`DEFAULTS` filled in.

    Raises:
        ValueError: ``selection`` not in :data:`SELECTIONS`, or ``sensitivity_power`` not a
            finite number > 0.
    """
    out = dict(DEFAULTS)
    for k in OPTIONS:
        if k in params:
            out[k] = params.pop(k)
    check_selection(out["selection"], out["sensitivity_power"])
    return out


def check_selection(selection: Any, power: Any) -> None:
    """Raise ValueError unless ``selection`` is one of :data:`SELECTIONS` and ``power`` a
    finite number > 0."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection: expected one of {SELECTIONS}, got {selection!r}")
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not (0 < power < math.inf):
        raise ValueError(f"sensitivity_power: expected a finite number > 0, got {power!r}")


# -- the fake quantization -----------------------------------------------------------------------

def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round half to even forward, identity backward. ``(round(x) - x) + x`` equals
    ``round(x)`` exactly in float (``round(x) - x`` is exact by Sterbenz / for |x| < 1/2)."""
    return (torch.round(x) - x).detach() + x


def _int4_parts(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                group_size: int):
    """(q, zero, scale) as float32 tensors ``[n_groups, gs]``, ``[n_groups, 1]``, ``[n_groups, 1]``
    for a float32 weight ``[out, in]``; differentiable in v, alpha, beta through the STE."""
    out_f, in_f = w.shape
    g = w.reshape(-1, group_size)
    vg = v.reshape(-1, group_size)
    mn = torch.clamp(g.min(dim=1, keepdim=True).values, max=0.0)
    mx = torch.clamp(g.max(dim=1, keepdim=True).values, min=0.0)
    lo = mn * beta.reshape(-1, 1)
    hi = mx * alpha.reshape(-1, 1)
    scale = (hi - lo) / 15.0
    ok = scale != 0
    safe = torch.where(ok, scale, torch.ones_like(scale))
    zero = torch.clamp(_round_ste(-lo / safe), 0.0, 15.0)
    q = torch.clamp(_round_ste(g / safe + vg) + zero, 0.0, 15.0)
    zero = torch.where(ok, zero, torch.zeros_like(zero))
    q = torch.where(ok, q, torch.zeros_like(q))
    return q, zero, scale


def fake_quant_int4(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """The fake-quantized float32 weight ``(q - zero) * scale`` ``[out, in]`` (module docstring)."""
    q, zero, scale = _int4_parts(w, v, alpha, beta, group_size)
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
    qt = QuantizedTensor("int4", (out_f, in_f), dtype, {"group_size": int(group_size), "symmetric": False}, bufs)
    validate(qt)
    return qt


def _ste(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` forward, identity (gradient of ``x``) backward."""
    return (y - x).detach() + x


def _m2_parts(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
              group_size: int, scale_block: int, is4: Optional[torch.Tensor] = None):
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
    Returns:
        float32 ``(q [n, gs], s_eff [n, 1], m_eff [n, 1], sc [n, 1], mc [n, 1],
        fields2 (d16 [nb2], dm16 [nb2]), fields4 (d16 [nb4], dm16 [nb4]))``, n = n_groups.
    Raises:
        ValueError: a second-order field that is inf in fp16 ("values too large ...").
    """
    g = w.reshape(-1, group_size) + 0.0        # -0 read as +0, as the format does
    vg = v.reshape(-1, group_size)
    n = g.shape[0]
    if is4 is None:
        is4 = torch.zeros(n, dtype=torch.bool, device=w.device)
    is4 = is4.reshape(-1)
    if is4.numel() != n:
        raise ValueError(f"is4: expected {n} group flags, got {is4.numel()}")
    qmax = torch.where(is4, 15.0, 3.0).to(torch.float32).reshape(-1, 1)
    smax = torch.where(is4, 255.0, 15.0).to(torch.float32).reshape(-1, 1)
    mn = g.min(dim=1, keepdim=True).values
    mx = g.max(dim=1, keepdim=True).values
    lo = torch.clamp(mn, max=0.0) * beta.reshape(-1, 1)
    hi = mx * alpha.reshape(-1, 1)
    scale = (hi - lo) / qmax
    m = 0.0 - lo

    def block_fields(val, sel, S):
        """fp16 fields (float32 values) of the blocks of the groups ``sel`` (ids ascending),
        and the per-group field [len(sel)]."""
        k = int(sel.numel())
        nb = -(-k // scale_block)
        if k == 0:
            return val.new_zeros(0), val.new_zeros(0)
        vv = torch.clamp(val.reshape(-1)[sel], min=0.0)
        pad = nb * scale_block - k
        if pad:
            vv = torch.cat([vv, vv.new_zeros(pad)])
        bmax = vv.reshape(nb, scale_block).max(dim=1).values / S
        b16 = _ste(bmax, bmax.to(torch.float16).to(torch.float32))
        if not torch.isfinite(b16).all():
            raise ValueError("values too large for mixed2bit's fp16 second-order scales")
        return b16, b16.repeat_interleave(scale_block)[:k]

    ids2 = torch.nonzero(~is4).reshape(-1)
    ids4 = torch.nonzero(is4).reshape(-1)
    d2, dg2 = block_fields(scale, ids2, 15.0)
    dm2, dmg2 = block_fields(m, ids2, 15.0)
    d4, dg4 = block_fields(scale, ids4, 255.0)
    dm4, dmg4 = block_fields(m, ids4, 255.0)
    dg = scale.new_zeros(n).index_put((ids2,), dg2).index_put((ids4,), dg4).reshape(-1, 1)
    dmg = scale.new_zeros(n).index_put((ids2,), dmg2).index_put((ids4,), dmg4).reshape(-1, 1)

    def code(val, dd):
        ok = dd > 0
        safe = torch.where(ok, dd, torch.ones_like(dd))
        c = torch.minimum(torch.clamp(_round_ste(val / safe), min=0.0), smax)
        return torch.where(ok, c, torch.zeros_like(c))

    sc = code(scale, dg)
    mc = code(m, dmg)
    s_eff = dg * sc
    m_eff = dmg * mc
    ok = s_eff > 0
    safe = torch.where(ok, s_eff, torch.ones_like(s_eff))
    q = torch.minimum(torch.clamp(_round_ste((g + m_eff) / safe + vg), min=0.0), qmax)
    q = torch.where(ok, q, torch.zeros_like(q))
    return q, s_eff, m_eff, sc, mc, (d2, dm2), (d4, dm4)


def fake_quant_2bit(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                    group_size: int, scale_block: int = 16) -> torch.Tensor:
    """The fake-quantized float32 weight ``q * s_eff - m_eff`` ``[out, in]`` of plain 2-bit
    mixed2bit groups (see :func:`_m2_parts`): mixed2bit's dequantize, bit for bit."""
    return fake_quant_mixed2bit(w, v, alpha, beta, group_size, scale_block, None)


def fake_quant_mixed2bit(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                         group_size: int, scale_block: int = 16,
                         is4: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fake-quantized weight of mixed2bit groups with trainable rounding and clipping.

    Args:
        w: float32 ``[out, in]``, ``in`` a multiple of ``group_size`` (a multiple of 16).
        v: float32 ``[out, in]``, rounding offsets in ``[-0.5, 0.5]``.
        alpha, beta: float32 ``[out, in // group_size]``, clipping factors of the group's max
            and min, in ``[0.5, 1]``.
        group_size, scale_block: mixed2bit's parameters.
        is4: bool ``[out * in // group_size]``: the 4-bit groups (row-major group ids), or None
            for plain 2-bit. See :func:`select_4bit`.
    Returns:
        float32 ``[out, in]``: ``q * s_eff - m_eff`` per element (module docstring), equal bit
        for bit to ``mixed2bit.dequantize`` of :func:`export_mixed2bit`'s tensor; differentiable
        in v, alpha, beta through straight-through estimators.
    Raises:
        ValueError: fp16 second-order fields that overflow, or ``is4`` of the wrong size.
    """
    q, s_eff, m_eff, *_ = _m2_parts(w, v, alpha, beta, group_size, scale_block, is4)
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
                     dtype: str = "float32") -> QuantizedTensor:
    """The mixed2bit QuantizedTensor (no outliers) of trained parameters.

    Args:
        w, v, alpha, beta, group_size, scale_block, is4: as :func:`fake_quant_mixed2bit`.
        ratio_4bit: the format parameter recorded in the params; ``floor(ratio_4bit *
            n_groups + 0.5)`` must equal the number of True flags in ``is4``.
        selection: recorded in the params: ``"sensitivity"`` or ``"range"`` (how ``is4`` was
            chosen).
        dtype: the recorded original weight dtype.
    Returns:
        a validated QuantizedTensor with torch buffers on w's device: ``group_map`` from
        ``is4``, 2-bit codes 16 per int32 word, 4-bit codes 8 per word, ``scales2 = sc | mc << 4``,
        ``scales4 = [sc, mc]``, fp16 ``so2`` / ``so4`` ``[d, dm]`` per block. Its dequantize
        equals :func:`fake_quant_mixed2bit` bit for bit.
    Raises:
        ValueError: ``is4`` inconsistent with ``ratio_4bit``, or the checks of
            :func:`qformats._core.validate`.
    """
    from .mixed2bit import expected_buffers
    from .mixed2bit.reference import n4_count

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
    qt = QuantizedTensor("mixed2bit", (out_f, in_f), dtype, params, bufs)
    validate(qt)
    return qt


def export_2bit(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                group_size: int, scale_block: int = 16, dtype: str = "float32") -> QuantizedTensor:
    """The mixed2bit QuantizedTensor (ratio_4bit = 0, no outliers) of the trained parameters:
    :func:`export_mixed2bit` with ``is4=None``."""
    return export_mixed2bit(w, v, alpha, beta, group_size, scale_block, None, 0.0, "range", dtype)


def select_4bit(w: torch.Tensor, group_size: int, ratio_4bit: float, sensitivity: Any = None,
                scale_block: int = 16) -> torch.Tensor:
    """mixed2bit's 4-bit groups of ``w`` as the format chooses them (its step 2, run by
    :func:`qformats.mixed2bit.quantize` itself, so the choice is the format's, bit for bit).

    Args:
        w: float ``[out, in]`` tensor.
        group_size, ratio_4bit, scale_block: mixed2bit's parameters.
        sensitivity: float ``[in]`` (>= 0, finite) or None (by range).
    Returns:
        bool ``[out * in // group_size]`` on w's device, True for the 4-bit groups.
    Raises:
        ValueError / TypeError: as :func:`qformats.mixed2bit.quantize`.
    """
    from . import mixed2bit

    n = w.shape[0] * (w.shape[1] // group_size)
    qt = mixed2bit.quantize(w.detach().float().contiguous().cpu(), group_size=group_size,
                            ratio_4bit=ratio_4bit, sensitivity=sensitivity, scale_block=scale_block)
    gm = qt.buffers["group_map"].to(torch.int64)
    bits = ((gm.reshape(-1, 1) >> torch.arange(8)) & 1).reshape(-1)[:n]
    return bits.to(torch.bool).to(w.device)


class SignRoundLinear(nn.Module):
    """A Linear whose weight is fake-quantized with trainable V / alpha / beta (float32).

    Args:
        linear: the ``nn.Linear`` to copy (weight ``[out, in]``, bias kept as float32).
        group_size: values per group along ``in``.
        fmt: ``"int4"`` (asymmetric) or ``"mixed2bit"``.
        scale_block: mixed2bit's groups per second-order block.
        is4: mixed2bit: bool ``[out * in // group_size]`` flags of the 4-bit groups (see
            :func:`select_4bit`), or None (plain 2-bit).
        ratio_4bit, selection: mixed2bit's recorded parameters (``is4`` must hold
            ``floor(ratio_4bit * n_groups + 0.5)`` groups).
    Raises:
        ValueError: an unsupported format, ``in`` not a multiple of group_size, or ``is4``
            with the wrong size or count.
    """

    def __init__(self, linear: nn.Linear, group_size: int, fmt: str = "int4", scale_block: int = 16,
                 is4: Optional[torch.Tensor] = None, ratio_4bit: float = 0.0, selection: str = "range"):
        super().__init__()
        if fmt not in ("int4", "mixed2bit"):
            raise ValueError(f"signround: format {fmt!r} is not supported (int4, mixed2bit)")
        self.fmt, self.scale_block = fmt, int(scale_block)
        self.ratio_4bit, self.selection = float(ratio_4bit), selection
        w = linear.weight.detach().to(torch.float32).clone()
        out_f, in_f = w.shape
        if in_f % group_size:
            raise ValueError(f"in_features={in_f} is not a multiple of group_size={group_size}")
        self.group_size = int(group_size)
        self.register_buffer("weight", w)
        b = linear.bias
        self.register_buffer("bias", None if b is None else b.detach().to(torch.float32).clone())
        ng = out_f * (in_f // group_size)
        if is4 is not None:
            from .mixed2bit.reference import n4_count

            is4 = is4.reshape(-1).to(torch.bool).to(w.device)
            if fmt != "mixed2bit" or is4.numel() != ng:
                raise ValueError(f"is4: expected {ng} mixed2bit group flags, got {is4.numel()} ({fmt})")
            if int(is4.sum()) != n4_count(self.ratio_4bit, ng):
                raise ValueError(f"is4 holds {int(is4.sum())} 4-bit groups, ratio_4bit={ratio_4bit} "
                                 f"gives {n4_count(self.ratio_4bit, ng)}")
        self.register_buffer("is4", is4)
        self.v = nn.Parameter(torch.zeros(out_f, in_f))
        self.alpha = nn.Parameter(torch.ones(out_f, in_f // group_size))
        self.beta = nn.Parameter(torch.ones(out_f, in_f // group_size))

    def qweight(self) -> torch.Tensor:
        """The fake-quantized float32 weight ``[out, in]`` (differentiable in v, alpha, beta)."""
        if self.fmt == "mixed2bit":
            return fake_quant_mixed2bit(self.weight, self.v, self.alpha, self.beta, self.group_size,
                                        self.scale_block, self.is4)
        return fake_quant_int4(self.weight, self.v, self.alpha, self.beta, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qweight(), self.bias)

    def clamp_(self) -> None:
        """Clamp V to [-0.5, 0.5] and alpha, beta to [0.5, 1] in place."""
        with torch.no_grad():
            self.v.clamp_(*V_RANGE)
            self.alpha.clamp_(*SCALE_RANGE)
            self.beta.clamp_(*SCALE_RANGE)

    def export(self, dtype: str = "float32") -> QuantizedTensor:
        """The packed QuantizedTensor of the current parameters (dequantizes to :meth:`qweight`
        bit for bit); ``dtype`` is the recorded original weight dtype."""
        if self.fmt == "mixed2bit":
            return export_mixed2bit(self.weight, self.v.detach(), self.alpha.detach(), self.beta.detach(),
                                    self.group_size, self.scale_block, self.is4, self.ratio_4bit,
                                    self.selection, dtype)
        return export_int4(self.weight, self.v.detach(), self.alpha.detach(), self.beta.detach(),
                           self.group_size, dtype)


# -- calibrated sensitivity ----------------------------------------------------------------------

def capture_second_moments(layers: dict, run) -> dict:
    """Mean squared input per input column of each of ``layers`` while ``run()`` executes.

    A forward pre-hook on every module of ``layers`` (``{name: nn.Linear}``) adds the squares
    of its input's rows to a float64 accumulator ``[in_features]`` (the diagonal of ``X^T X``;
    nothing else is kept), counting rows.

    Args:
        layers: ``{name: module}``; each module's first positional input is ``[..., in]``.
        run: a callable that runs the forward passes (e.g. the model over calibration samples).
    Returns:
        ``{name: float64 tensor [in] on the CPU}``: ``sum over rows of x**2 / rows`` (zeros for
        a layer that saw no input).
    """
    acc = {}
    count = {}
    hooks = []

    def make(name):
        def hook(mod, args):
            x = args[0].detach()
            x2 = x.reshape(-1, x.shape[-1]).to(torch.float64).square().sum(0).cpu()
            acc[name] = x2 if name not in acc else acc[name] + x2
            count[name] = count.get(name, 0) + x.numel() // x.shape[-1]
        return hook

    try:
        for name, mod in layers.items():
            hooks.append(mod.register_forward_pre_hook(make(name)))
        run()
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, mod in layers.items():
        k = mod.weight.shape[1]
        out[name] = acc[name] / count[name] if name in acc else torch.zeros(k, dtype=torch.float64)
    return out


def model_second_moments(model: nn.Module, layers: dict, samples: Sequence[torch.Tensor],
                         batch_size: int = 8) -> dict:
    """:func:`capture_second_moments` of ``layers`` over the model's forward on ``samples``
    (int64 token ids ``[1, L]`` from :func:`calibration_samples`; equal lengths batched
    ``batch_size`` at a time), without gradients, on the model's device."""
    dev = next(model.parameters()).device
    bs = max(1, int(batch_size))

    def run():
        with torch.no_grad():
            batches: list = []
            for t in samples:
                if batches and batches[-1][-1].shape[1] == t.shape[1] and len(batches[-1]) < bs:
                    batches[-1].append(t)
                else:
                    batches.append([t])
            for b in batches:
                ids = torch.cat(b).to(dev)
                try:
                    model(ids, use_cache=False)
                except TypeError:
                    model(ids)

    return capture_second_moments(layers, run)


def sensitivity_from_moments(moment: torch.Tensor, power: float = 1.0) -> torch.Tensor:
    """mixed2bit's ``sensitivity`` argument from a second moment: float32 ``moment ** power``
    ``[in]`` (moment normalized by its mean first, so that float32 holds it for any scale of
    the activations; the ranking of groups does not depend on that factor).

    Raises:
        ValueError: ``power`` not a finite number > 0.
    """
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not (0 < power < math.inf):
        raise ValueError(f"sensitivity_power: expected a finite number > 0, got {power!r}")
    m = moment.to(torch.float64).clamp_min(0)
    mean = float(m.mean()) if m.numel() else 0.0
    if mean > 0:
        m = m / mean
    return (m ** float(power)).to(torch.float32)


# -- calibration data and block inputs -------------------------------------------------------

def calibration_samples(calibration: Any, tokenizer: Any = None, nsamples: int = 128,
                        seqlen: int = 2048) -> list:
    """At most ``nsamples`` int64 token-id tensors ``[1, L]`` (L <= seqlen).

    ``calibration`` is a text (needs ``tokenizer``; cut into consecutive windows of ``seqlen``
    tokens, evenly spaced over the text when there are more than ``nsamples``), or a sequence
    of token-id tensors (each ``[L]`` or ``[B, L]``; every row is a sample, cut to its first
    ``seqlen`` tokens), or one 2-D tensor ``[n, L]``.
    """
    if calibration is None:
        raise ValueError("method='signround' needs calibration= (token-id tensors, or a text "
                         "with tokenizer=)")
    nsamples, seqlen = int(nsamples), int(seqlen)
    if nsamples < 1 or seqlen < 1:
        raise ValueError(f"nsamples and seqlen must be >= 1, got {nsamples}, {seqlen}")
    rows = []
    if isinstance(calibration, str):
        if tokenizer is None:
            raise ValueError("calibration is a text: pass tokenizer= as well")
        ids = tokenizer(calibration, return_tensors="pt")["input_ids"][0].to(torch.int64)
        n = max(1, ids.numel() // seqlen)
        k = min(n, nsamples)
        idx = [int(math.floor((j + 0.5) * n / k)) for j in range(k)]
        rows = [ids[i * seqlen:(i + 1) * seqlen] for i in idx]
    else:
        items = [calibration] if isinstance(calibration, torch.Tensor) else list(calibration)
        for t in items:
            t = torch.as_tensor(t)
            if t.dtype.is_floating_point:
                raise TypeError("calibration tensors must hold integer token ids")
            t = t.reshape(1, -1) if t.ndim <= 1 else t.reshape(-1, t.shape[-1])
            rows.extend(r[:seqlen] for r in t)
            if len(rows) >= nsamples:
                break
        rows = rows[:nsamples]
    rows = [r.to(torch.int64).reshape(1, -1) for r in rows if r.numel() > 0]
    if not rows:
        raise ValueError("calibration holds no tokens")
    return rows


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The transformer blocks: the ``nn.ModuleList`` holding the most ``nn.Linear`` layers
    (e.g. ``model.model.layers`` of a Hugging Face Llama). Returns (name, list)."""
    best, best_n = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            n = sum(isinstance(x, nn.Linear) for x in m.modules())
            if n > best_n:
                best, best_n = (name, m), n
    if best is None:
        raise ValueError("signround: found no nn.ModuleList of blocks holding nn.Linear layers")
    return best


class _Stop(Exception):
    pass


def _to_f32(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().to(torch.float32) if v.is_floating_point() else v.detach()
    if isinstance(v, tuple):
        return tuple(_to_f32(x) for x in v)
    if isinstance(v, list):
        return [_to_f32(x) for x in v]
    return v


def capture_block_inputs(model: nn.Module, block: nn.Module, samples: Sequence[torch.Tensor]) -> list:
    """``[(hidden_states float32 [1, L, H], kwargs)]`` per sample: what ``block`` gets in the
    model's forward (captured by a forward pre-hook, which then stops the forward). Cache
    arguments are dropped (``past_key_values=None``, ``use_cache=False``)."""
    got = []

    def hook(mod, args, kwargs):
        kw = dict(kwargs)
        if args:
            hs, rest = args[0], args[1:]
            if rest:
                raise ValueError("signround: the block takes more than one positional argument")
        else:
            hs = kw.pop("hidden_states")
        for k in ("past_key_values", "past_key_value", "layer_past"):
            if k in kw:
                kw[k] = None
        if "use_cache" in kw:
            kw["use_cache"] = False
        got.append((_to_f32(hs), _to_f32(kw)))
        raise _Stop

    h = block.register_forward_pre_hook(hook, with_kwargs=True)
    dev = next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in samples:
                try:
                    try:
                        model(ids.to(dev), use_cache=False)
                    except TypeError:
                        model(ids.to(dev))
                except _Stop:
                    pass
                else:
                    raise ValueError("signround: the model's forward never reached its first block")
    finally:
        h.remove()
    return got


def _block_out(block: nn.Module, x: torch.Tensor, kw: dict) -> torch.Tensor:
    y = block(x, **kw)
    if isinstance(y, (tuple, list)):
        y = y[0]
    return y


# -- training one block ----------------------------------------------------------------------

def _groups(inputs: list, idx: Sequence[int], limit: int = 0) -> list:
    """``idx`` split into runs of samples with equal hidden-state shapes (batched together in
    one forward with the first one's kwargs; at most ``limit`` per run when > 0)."""
    by: dict = {}
    for i in idx:
        by.setdefault(tuple(inputs[i][0].shape[1:]), []).append(i)
    out = []
    for g in by.values():
        step = limit if limit > 0 else len(g)
        out.extend(g[j:j + step] for j in range(0, len(g), step))
    return out


def _forward_all(block: nn.Module, inputs: list, batch_size: int) -> list:
    """The block's outputs ``[1, L, H]`` per input, computed in batches, without gradients."""
    outs: list = [None] * len(inputs)
    with torch.no_grad():
        for grp in _groups(inputs, range(len(inputs)), batch_size):
            y = _block_out(block, torch.cat([inputs[i][0] for i in grp]), inputs[grp[0]][1])
            for j, i in enumerate(grp):
                outs[i] = y[j:j + 1].detach()
    return outs


def train_block(block: nn.Module, linears: dict, inputs: list, targets: list, iters: int,
                lr: Optional[float], batch_size: int, seed: int = 0) -> dict:
    """Train the SignRoundLinears of ``block`` (a float32 module already holding them:
    ``linears`` ``{name: SignRoundLinear}``) to map ``inputs`` ``[(x, kwargs)]`` to
    ``targets`` (MSE, mean over the batch's samples), SignSGD with linearly decaying lr.

    Leaves the best parameters seen in the modules. Returns stats: ``rtn_loss`` and ``loss``
    (the loss over all samples before / after training), ``best_loss`` / ``best_iter`` (the
    lowest batch loss seen and the step whose parameters it was; ``iters`` = after the last
    step), ``losses`` (the batch loss of every evaluated parameter set)."""
    params = [p for m in linears.values() for p in (m.v, m.alpha, m.beta)]
    for p in block.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    n = len(inputs)
    bs = max(1, min(int(batch_size), n))
    lr = (1.0 / iters if iters else 0.0) if lr is None else float(lr)
    gen = torch.Generator().manual_seed(int(seed))

    def batch_loss(idx, grad: bool) -> float:
        total = 0.0
        for grp in _groups(inputs, idx, 0 if grad else bs):
            x = torch.cat([inputs[i][0] for i in grp])
            y = torch.cat([targets[i] for i in grp])
            with torch.set_grad_enabled(grad):
                loss = F.mse_loss(_block_out(block, x, inputs[grp[0]][1]), y) * (len(grp) / len(idx))
            if grad:
                loss.backward()
            total += float(loss.detach())
        return total

    def full_loss() -> float:
        with torch.no_grad():
            return batch_loss(range(n), False)

    rtn_loss = full_loss()
    best = [p.detach().clone() for p in params]
    best_loss, best_iter, losses = math.inf, 0, []
    for t in range(iters + 1):
        if bs >= n:
            idx = list(range(n))
        else:
            idx = torch.randperm(n, generator=gen)[:bs].tolist()
        last = t == iters
        for p in params:
            p.grad = None
        loss = batch_loss(idx, not last)
        losses.append(loss)
        if loss < best_loss:
            best_loss, best_iter = loss, t
            best = [p.detach().clone() for p in params]
        if last:
            break
        lr_t = lr * (1.0 - t / iters)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.sub_(lr_t * torch.sign(p.grad))
        for m in linears.values():
            m.clamp_()
    with torch.no_grad():
        for p, b in zip(params, best):
            p.copy_(b)
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    return {"rtn_loss": rtn_loss, "loss": full_loss(), "best_loss": best_loss,
            "best_iter": best_iter, "losses": losses}


# -- the model-level driver -------------------------------------------------------------------

def quantize_plan(model: nn.Module, plan: list, options: dict, progress: bool = False) -> tuple:
    """Quantize ``plan`` ``[(name, nn.Linear, format, params)]`` of ``model`` with SignRound.

    Linears inside the model's transformer blocks (:func:`find_blocks`) are trained block by
    block; any other planned Linear is rounded to nearest (as ``method="rtn"``). The model is
    not modified. Returns ``(new, stats)``: ``new`` ``[(name, QuantizedLinear, seconds)]`` in
    plan order, ``stats`` ``{"blocks": [per-block train_block stats + "seconds", "layers"],
    "options": {...}}``.
    mixed2bit layers with ``ratio_4bit > 0`` get their 4-bit groups chosen before training
    (:func:`select_4bit`) by the calibrated sensitivity (``options["selection"] ==
    "sensitivity"``, the default: mean squared inputs of the layer in its block's forward,
    ``** options["sensitivity_power"]``) or by range (``"range"``).

    Raises:
        NotImplementedError: a planned layer that is neither int4 asymmetric nor mixed2bit
            without outliers.
        ValueError: bad options (iters < 0, selection, sensitivity_power, calibration data).
    """
    for name, m, fmt, qp in plan:
        if not format_spec(fmt).trainable(qp):
            raise NotImplementedError(
                f"method='signround' supports int4 asymmetric groups (bits=4) and mixed2bit "
                f"without outliers (bits=2, any ratio_4bit, outlier_ratio=0) only; layer {name} "
                f"asks for {fmt} {qp}")
    check_selection(options.get("selection", "sensitivity"), options.get("sensitivity_power", 1.0))
    iters = int(options["iters"])
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    samples = calibration_samples(options["calibration"], options["tokenizer"],
                                  options["nsamples"], options["seqlen"])
    blocks_name, blocks = find_blocks(model)
    by_id = {id(m): (name, fmt, qp) for name, m, fmt, qp in plan}
    results: dict = {}
    stats: dict = {"blocks": [], "options": {k: v for k, v in options.items()
                                             if k not in ("calibration", "tokenizer")}}
    from .evaluate import progress_bar

    has_plan = any(id(x) in by_id for b in blocks for x in b.modules())
    inputs = capture_block_inputs(model, blocks[0], samples) if has_plan else []
    bar = progress_bar(list(enumerate(blocks)), enabled=progress, desc="signround", unit="block",
                       leave=False)
    last = max((i for i, b in enumerate(blocks) if any(id(x) in by_id for x in b.modules())), default=-1)
    for bi, block in bar:
        if bi > last:
            break
        t0 = time.perf_counter()
        fblock = copy.deepcopy(block).to(torch.float32)
        fblock.train(False)
        names = [(rel, by_id[id(sub)]) for rel, sub in block.named_modules() if id(sub) in by_id]
        # mixed2bit layers with 4-bit groups: their inputs' second moments, from the same
        # forward that computes the targets (the inputs the training sees)
        mixed = {rel: fblock.get_submodule(rel) for rel, (_, fmt, qp) in names
                 if format_spec(fmt).calibrated(qp)}
        moments: dict = {}
        if mixed and options.get("selection", "sensitivity") == "sensitivity":
            def run():
                nonlocal targets
                targets = _forward_all(fblock, inputs, options["batch_size"])
            targets = None
            moments = capture_second_moments(mixed, run)
        else:
            targets = _forward_all(fblock, inputs, options["batch_size"])
        linears = {}
        for rel, (name, fmt, qp) in names:
            spec = format_spec(fmt)
            full = spec.params(**qp)  # the format's defaults, then the layer's params
            gs = full[spec.group_param]
            sb = qp.get("scale_block", 16)
            is4, ratio, selection = None, 0.0, "range"
            if rel in mixed:
                ratio = float(full["ratio_4bit"])
                sens = None
                if rel in moments:
                    sens = sensitivity_from_moments(moments[rel], options.get("sensitivity_power", 1.0))
                    selection = "sensitivity"
                is4 = select_4bit(fblock.get_submodule(rel).weight, gs, ratio, sens, sb)
            srl = SignRoundLinear(fblock.get_submodule(rel), gs, fmt, sb, is4, ratio, selection)
            _replace(fblock, rel, srl)
            linears[rel] = srl
        if linears:
            st = train_block(fblock, linears, inputs, targets, iters, options["lr"],
                             options["batch_size"], options["seed"] + bi)
            secs = time.perf_counter() - t0
            for rel, (name, fmt, qp) in names:
                orig = block.get_submodule(rel)
                qt = linears[rel].export(str(orig.weight.dtype).removeprefix("torch."))
                q = QuantizedLinear.from_quantized(qt, orig.bias)
                results[name] = (q, secs / len(names))
            st["seconds"] = secs
            st["layers"] = [n for _, (n, _, _) in names]
            stats["blocks"].append(st)
        outs = _forward_all(fblock, inputs, options["batch_size"])
        inputs = [(y, kw) for y, (_, kw) in zip(outs, inputs)]
    bar.close()
    new = []
    for name, m, fmt, qp in plan:
        if name in results:
            q, secs = results[name]
        else:
            t1 = time.perf_counter()
            q = QuantizedLinear.from_linear(m, fmt, **qp)
            secs = time.perf_counter() - t1
        new.append((name, q, secs))
    return new, stats


def _replace(root: nn.Module, rel: str, new: nn.Module) -> None:
    parent_name, _, child = rel.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
