"""Trainable rounding (SignRound / AutoRound style) for int4 asymmetric groups and plain
2-bit mixed2bit groups.

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

from ._core import QuantizedTensor, validate
from .nn import QuantizedLinear

__all__ = ["OPTIONS", "pop_options", "fake_quant_int4", "export_int4", "fake_quant_2bit",
           "export_2bit", "SignRoundLinear",
           "calibration_samples", "find_blocks", "capture_block_inputs", "train_block",
           "quantize_plan"]

#: quantize_model keyword arguments that belong to signround (not to the format).
OPTIONS = ("calibration", "tokenizer", "iters", "nsamples", "seqlen", "lr", "batch_size", "seed")
DEFAULTS = {"calibration": None, "tokenizer": None, "iters": 200, "nsamples": 128, "seqlen": 2048,
            "lr": None, "batch_size": 8, "seed": 0}

V_RANGE = (-0.5, 0.5)
SCALE_RANGE = (0.5, 1.0)


def pop_options(params: dict) -> dict:
    """Remove signround's options from ``params`` (in place) and return them with defaults."""
    out = dict(DEFAULTS)
    for k in OPTIONS:
        if k in params:
            out[k] = params.pop(k)
    return out


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
              group_size: int, scale_block: int):
    """mixed2bit plain 2-bit groups (ratio_4bit = 0, no outliers; ``mixed2bit.h`` steps 4-6)
    with clipping: per group ``lo = min(min(v), 0) * beta``, ``hi = max(v) * alpha``,
    ``scale = (hi - lo) / 3``, ``m = 0 - lo``; per block of ``scale_block`` groups (row-major
    id order) ``d16 = fp16(max(0, scale_i) / 15)``, ``dm16 = fp16(max(0, m_i) / 15)``;
    ``sc = clamp(rint(scale / d16), 0, 15)`` (0 if d16 = 0), likewise ``mc``;
    ``s_eff = d16 * sc``, ``m_eff = dm16 * mc``; ``q = clamp(rint((w + m_eff) / s_eff + V), 0, 3)``
    (0 if s_eff = 0). Returns float32 (q [n, gs], s_eff [n, 1], m_eff [n, 1], sc, mc, d16 [nb],
    dm16 [nb])."""
    g = w.reshape(-1, group_size) + 0.0        # -0 read as +0, as the format does
    vg = v.reshape(-1, group_size)
    n = g.shape[0]
    mn = g.min(dim=1, keepdim=True).values
    mx = g.max(dim=1, keepdim=True).values
    lo = torch.clamp(mn, max=0.0) * beta.reshape(-1, 1)
    hi = mx * alpha.reshape(-1, 1)
    scale = (hi - lo) / 3.0
    m = 0.0 - lo
    nb = -(-n // scale_block)
    pad = nb * scale_block - n

    def block_field(val):
        vv = torch.clamp(val.reshape(-1), min=0.0)
        if pad:
            vv = torch.cat([vv, vv.new_zeros(pad)])
        bmax = vv.reshape(nb, scale_block).max(dim=1).values / 15.0
        b16 = _ste(bmax, bmax.to(torch.float16).to(torch.float32))
        if not torch.isfinite(b16).all():
            raise ValueError("values too large for mixed2bit's fp16 second-order scales")
        return b16

    d16 = block_field(scale)
    dm16 = block_field(m)
    dg = d16.repeat_interleave(scale_block)[:n].reshape(-1, 1)
    dmg = dm16.repeat_interleave(scale_block)[:n].reshape(-1, 1)

    def code(val, dd):
        ok = dd > 0
        safe = torch.where(ok, dd, torch.ones_like(dd))
        c = torch.clamp(_round_ste(val / safe), 0.0, 15.0)
        return torch.where(ok, c, torch.zeros_like(c))

    sc = code(scale, dg)
    mc = code(m, dmg)
    s_eff = dg * sc
    m_eff = dmg * mc
    ok = s_eff > 0
    safe = torch.where(ok, s_eff, torch.ones_like(s_eff))
    q = torch.clamp(_round_ste((g + m_eff) / safe + vg), 0.0, 3.0)
    q = torch.where(ok, q, torch.zeros_like(q))
    return q, s_eff, m_eff, sc, mc, d16, dm16


def fake_quant_2bit(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                    group_size: int, scale_block: int = 16) -> torch.Tensor:
    """The fake-quantized float32 weight ``q * s_eff - m_eff`` ``[out, in]`` of plain 2-bit
    mixed2bit groups (see :func:`_m2_parts`): mixed2bit's dequantize, bit for bit."""
    q, s_eff, m_eff, *_ = _m2_parts(w, v, alpha, beta, group_size, scale_block)
    return (q * s_eff - m_eff).reshape(w.shape)


def export_2bit(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                group_size: int, scale_block: int = 16, dtype: str = "float32") -> QuantizedTensor:
    """The mixed2bit QuantizedTensor (ratio_4bit = 0, no outliers) of the trained parameters:
    2-bit codes 16 per int32 word, ``scales2 = sc | mc << 4``, fp16 ``so2 = [d, dm]`` per block;
    torch buffers on w's device, validated."""
    from .mixed2bit import expected_buffers

    out_f, in_f = w.shape
    with torch.no_grad():
        q, _, _, sc, mc, d16, dm16 = _m2_parts(w.float(), v, alpha, beta, group_size, scale_block)
    params = {"group_size": int(group_size), "ratio_4bit": 0.0, "outlier_ratio": 0.0,
              "scale_block": int(scale_block), "selection": "range", "n4": 0, "n_out": 0}
    shapes = expected_buffers((out_f, in_f), params)
    dev = w.device
    bufs = {name: torch.zeros(shape, dtype=getattr(torch, dt), device=dev)
            for name, (dt, shape) in shapes.items()}
    qi = q.to(torch.int64).reshape(-1, group_size // 16, 16)
    shifts = 2 * torch.arange(16, device=dev, dtype=torch.int64)
    words = (qi << shifts).sum(dim=2)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    bufs["codes2"] = words.to(torch.int32).contiguous()
    bufs["scales2"] = (sc.reshape(-1).to(torch.int64) | (mc.reshape(-1).to(torch.int64) << 4)).to(torch.uint8)
    bufs["so2"] = torch.stack([d16, dm16], dim=1).to(torch.float16).contiguous()
    qt = QuantizedTensor("mixed2bit", (out_f, in_f), dtype, params, bufs)
    validate(qt)
    return qt


class SignRoundLinear(nn.Module):
    """A Linear whose weight is fake-quantized with trainable V / alpha / beta (float32)."""

    def __init__(self, linear: nn.Linear, group_size: int, fmt: str = "int4", scale_block: int = 16):
        super().__init__()
        if fmt not in ("int4", "mixed2bit"):
            raise ValueError(f"signround: format {fmt!r} is not supported (int4, mixed2bit)")
        self.fmt, self.scale_block = fmt, int(scale_block)
        w = linear.weight.detach().to(torch.float32).clone()
        out_f, in_f = w.shape
        if in_f % group_size:
            raise ValueError(f"in_features={in_f} is not a multiple of group_size={group_size}")
        self.group_size = int(group_size)
        self.register_buffer("weight", w)
        b = linear.bias
        self.register_buffer("bias", None if b is None else b.detach().to(torch.float32).clone())
        ng = out_f * (in_f // group_size)
        self.v = nn.Parameter(torch.zeros(out_f, in_f))
        self.alpha = nn.Parameter(torch.ones(out_f, in_f // group_size))
        self.beta = nn.Parameter(torch.ones(out_f, in_f // group_size))
        assert self.alpha.numel() == ng

    def qweight(self) -> torch.Tensor:
        if self.fmt == "mixed2bit":
            return fake_quant_2bit(self.weight, self.v, self.alpha, self.beta, self.group_size,
                                   self.scale_block)
        return fake_quant_int4(self.weight, self.v, self.alpha, self.beta, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qweight(), self.bias)

    def clamp_(self) -> None:
        with torch.no_grad():
            self.v.clamp_(*V_RANGE)
            self.alpha.clamp_(*SCALE_RANGE)
            self.beta.clamp_(*SCALE_RANGE)

    def export(self, dtype: str = "float32") -> QuantizedTensor:
        if self.fmt == "mixed2bit":
            return export_2bit(self.weight, self.v.detach(), self.alpha.detach(), self.beta.detach(),
                               self.group_size, self.scale_block, dtype)
        return export_int4(self.weight, self.v.detach(), self.alpha.detach(), self.beta.detach(),
                           self.group_size, dtype)


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
    Raises NotImplementedError for a planned layer that is neither int4 asymmetric nor plain
    2-bit mixed2bit (ratio_4bit=0, no outliers).
    """
    for name, m, fmt, qp in plan:
        ok4 = fmt == "int4" and not qp.get("symmetric", False)
        ok2 = (fmt == "mixed2bit" and float(qp.get("ratio_4bit", 0.1)) == 0.0
               and float(qp.get("outlier_ratio", 0.0)) == 0.0 and qp.get("sensitivity") is None)
        if not (ok4 or ok2):
            raise NotImplementedError(
                f"method='signround' supports int4 asymmetric groups (bits=4) and plain 2-bit "
                f"mixed2bit groups (bits=2: ratio_4bit=0, no outliers) only; layer {name} asks "
                f"for {fmt} {qp}")
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
        targets = _forward_all(fblock, inputs, options["batch_size"])
        names = [(rel, by_id[id(sub)]) for rel, sub in block.named_modules() if id(sub) in by_id]
        linears = {}
        for rel, (name, fmt, qp) in names:
            gs = qp.get("group_size", 128 if fmt == "int4" else 16)
            srl = SignRoundLinear(fblock.get_submodule(rel), gs, fmt, qp.get("scale_block", 16))
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
