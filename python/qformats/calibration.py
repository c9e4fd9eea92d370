"""Calibration capture: the calibration samples (token-id windows), the activations' second
moments per input column (forward hooks), the sensitivity they give mixed2bit's calibrated group
choice, and the inputs of a model's first transformer block (hidden states and keyword
arguments) that block-by-block training starts from.

Used by the model-level methods: calibrated round to nearest (:mod:`qformats.model`),
trainable rounding (:mod:`qformats.signround`) and the budget (:mod:`qformats.budget`).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import nn

__all__ = ["calibration_samples", "context_length", "capture_second_moments", "model_second_moments",
           "sensitivity_from_moments", "capture_block_inputs", "forward_without_cache"]


def forward_without_cache(model: nn.Module, ids: torch.Tensor) -> Any:
    """``model(ids, use_cache=False)``: one forward over the token ids ``ids`` (int64
    ``[B, L]``) without filling a key / value cache (nothing is generated after it), or
    ``model(ids)`` when that call raises TypeError (a model whose forward does not take
    ``use_cache``). Returns what the model returns."""
    try:
        return model(ids, use_cache=False)
    except TypeError:
        return model(ids)


# -- calibration data ----------------------------------------------------------------------------

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


def context_length(model: nn.Module, seqlen: int) -> int:
    """``seqlen`` capped at the model's ``config.max_position_embeddings`` (when it has one)."""
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(int(seqlen), int(ctx)) if isinstance(ctx, int) and ctx > 0 else int(seqlen)


# -- second moments and sensitivity ------------------------------------------------------------

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
                forward_without_cache(model, torch.cat(b).to(dev))

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


# -- the inputs of the first block --------------------------------------------------------------

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


def capture_block_inputs(model: nn.Module, block: nn.Module, samples: Sequence[torch.Tensor],
                         device: Optional[torch.device] = None) -> list:
    """``[(hidden_states float32 [1, L, H], kwargs)]`` per sample: what ``block`` gets in the
    model's forward (captured by a forward pre-hook, which then stops the forward). Cache
    arguments are dropped (``past_key_values=None``, ``use_cache=False``). The samples go to
    ``device`` (default: the model's first parameter's device)."""
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
    dev = device if device is not None else next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in samples:
                try:
                    forward_without_cache(model, ids.to(dev))
                except _Stop:
                    pass
                else:
                    raise ValueError("signround: the model's forward never reached its first block")
    finally:
        h.remove()
    return got
