"""Budgeted per-layer bits: ``quantize_model(..., method="budget")``.

Given a quality budget (``max_perplexity_increase`` in percent and/or
``max_per_token_kl_divergence`` in nats per token, against the unquantized model on the
calibration windows), choose for every layer one of several candidate formats (default: 8-bit
int8, 4-bit int4 g128, mixed 2/4-bit at 10% 4-bit groups, plain 2-bit; see
:data:`DEFAULT_CANDIDATES`) so that the quantized model meets the budget with the fewest stored
bits. This is the Bitween seed's "gradual quantization", done as a measured knapsack:

1. Every layer is quantized once with every candidate (RTN), and the metric of the model with
   only that one layer quantized is measured: ``delta[layer][candidate]`` (its sensitivity).
2. Starting from the largest candidate everywhere, layers move down one candidate at a time,
   best ``bits saved / delta added`` first, while the sum of the deltas stays within the budget
   (deltas are nearly additive for small perturbations: the usual first-order assumption of
   mixed-precision search such as HAWQ). More sensitive layers thus keep more bits.
   Per layer only the Pareto front of (bits, delta) is kept: an option is dropped when
   another one has no more bits and no larger delta.
3. The assembled model is evaluated for real. While it exceeds the budget, the move with the
   worst ratio is undone and the model re-evaluated; the report says whether the budget holds.

Candidates are ``(format, params)`` (round to nearest) or ``(format, params, "signround")``
(trained with :mod:`qformats.signround` on the same calibration windows, one run over all
eligible layers per candidate; options in ``signround={"iters": ..., ...}``). mixed2bit
candidates with ``ratio_4bit > 0`` choose their 4-bit groups by the calibrated sensitivity
(the layer's mean squared input per column over the calibration windows, ``selection=
"sensitivity"``, the default) or by range (``selection="range"``).

Metrics: the perplexity budget is ``nll <= nll0 + log(1 + p / 100)`` (mean NLL per predicted
token over the windows); the KL budget is the mean per-token KL(reference || quantized) with the
reference log-probabilities computed once from the float model.
"""
from __future__ import annotations

import math
import time
from typing import Mapping, Union

import torch
import torch.nn as nn

from ._core import format_spec
from .calibration import (calibration_samples, forward_without_cache, model_second_moments,
                          sensitivity_from_moments)
from .config import BudgetConfig, SignRoundConfig
from .nn import QuantizedLinear
from .plan import fits, resolve_spec, set_submodule
from .progress import progress_bar
from .signround import find_blocks, quantize_plan

# Defined in qformats.config, first defined here: still importable from here.
from .config import CANDIDATE_METHODS, DEFAULT_CANDIDATES  # noqa: E402,F401

__all__ = ["quantize_budget", "OPTIONS", "DEFAULTS"]

#: The budget method's keyword arguments of quantize_model and their defaults: the fields of
#: :class:`qformats.config.BudgetConfig` (where :data:`DEFAULT_CANDIDATES` is defined too).
OPTIONS = BudgetConfig.names()
DEFAULTS = BudgetConfig.defaults()


class _Cached(nn.Module):
    """Stands in for transformer block ``j`` of the float model: returns (a copy of) what the
    block returned on the current batch in the reference run. Other attributes are the
    block's (a model's forward may read e.g. its attention type)."""

    def __init__(self, metric: "_Metric", j: int, block: nn.Module):
        super().__init__()
        self.j = j
        self._refs = (metric, block)  # neither a submodule

    def forward(self, *args, **kwargs):
        m = self._refs[0]
        return _clone(m.cache[self.j][m.batch])

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._refs[1], name)


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_clone(x) for x in v)
    return v


class _Metric:
    """The budgeted quantity of the model on the windows: mean NLL per predicted token, and/or
    mean per-token KL(reference || model) against log-probs of the float model taken once.

    The reference run also keeps what every transformer block (:func:`qformats.signround.find_blocks`)
    returns on every batch, so that a model whose only change is in block ``k`` is evaluated
    from block ``k`` on (``metric(start=k)``): the blocks before it get the same inputs as in
    the reference run and would return the same outputs, so they are replaced by those
    outputs (the same logits, bit for bit, at a fraction of the forward)."""

    def __init__(self, model, samples, config: BudgetConfig):
        # batches of equal-length samples ([1, L] tensors from calibration.calibration_samples)
        bs = max(1, int(config.batch_size))
        self.batches = []
        for s in samples:
            last = self.batches[-1] if self.batches else None
            if last is not None and last[-1].shape[1] == s.shape[1] and len(last) < bs:
                last.append(s)
            else:
                self.batches.append([s])
        self.batches = [torch.cat(b) for b in self.batches]
        self.model = model
        self.use_kl = config.max_per_token_kl_divergence is not None
        self.use_ppl = config.max_perplexity_increase is not None
        self.evaluations = 0
        self.ref_logp = None
        try:
            self.blocks = find_blocks(model)[1]
        except ValueError:
            self.blocks = None
        self.cache: list = []
        self.batch = 0
        nll0, kl0, ref = self._run(keep=self.use_kl, record=self.blocks is not None)
        self.ref_logp = ref if self.use_kl else None
        self.nll0 = nll0
        self.limit_nll = (nll0 + math.log1p(config.max_perplexity_increase / 100.0)
                          if self.use_ppl else math.inf)
        self.limit_kl = config.max_per_token_kl_divergence if self.use_kl else math.inf

    def block_of(self, module: nn.Module) -> int:
        """The index of the transformer block holding ``module`` (0 when none does: such a
        layer is evaluated with the whole forward)."""
        if self.blocks is not None:
            for k, b in enumerate(self.blocks):
                if any(x is module for x in b.modules()):
                    return k
        return 0

    @torch.inference_mode()
    def _run(self, keep=False, record=False, start=0):
        self.evaluations += 1
        device = next(self.model.parameters(), torch.empty(0)).device
        hooks = []
        if record:
            self.cache = [[] for _ in self.blocks]
            for j, b in enumerate(self.blocks):
                hooks.append(b.register_forward_hook(
                    lambda mod, a, out, j=j: self.cache[j].append(_clone(out))))
        originals = []
        if start > 0 and self.cache:
            originals = [self.blocks[j] for j in range(start)]
            for j in range(start):
                self.blocks[j] = _Cached(self, j, originals[j])
        try:
            return self._windows(device, keep)
        finally:
            for h in hooks:
                h.remove()
            for j, b in enumerate(originals):
                self.blocks[j] = b

    def _windows(self, device, keep):
        nll = kl = 0.0
        count = 0
        kept = []
        for i, w in enumerate(self.batches):
            self.batch = i
            w = w.to(device)
            out = forward_without_cache(self.model, w)
            logits = (out.logits if hasattr(out, "logits") else out)[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            nll += float(-logp.gather(-1, w[:, 1:, None]).sum())
            count += w.shape[0] * (w.shape[1] - 1)
            if keep:
                kept.append(logp.cpu())
            if self.ref_logp is not None:
                ref = self.ref_logp[i].to(device)
                kl += float((ref.exp() * (ref - logp)).sum())
        return nll / count, kl / count, kept

    def __call__(self, start: int = 0) -> tuple[float, float]:
        """(nll, kl) of the model as it is now; ``start``: the first block that differs from
        the float model (the blocks before it are not run again)."""
        nll, kl, _ = self._run(start=start)
        return nll, kl

    def excess(self, nll: float, kl: float) -> float:
        """How far (nll, kl) is over the budget, as a fraction of it (<= 0: within)."""
        e = []
        if self.use_ppl:
            e.append((nll - self.limit_nll) / max(self.limit_nll - self.nll0, 1e-12))
        if self.use_kl:
            e.append((kl - self.limit_kl) / max(self.limit_kl, 1e-12))
        return max(e)

    def cost(self, nll: float, kl: float) -> float:
        """A layer's delta in budget units (fractions of each budget, the larger one)."""
        c = []
        if self.use_ppl:
            c.append((nll - self.nll0) / max(self.limit_nll - self.nll0, 1e-12))
        if self.use_kl:
            c.append(kl / max(self.limit_kl, 1e-12))
        return max(c)


def quantize_budget(model: nn.Module, plan: list, options: Union[BudgetConfig, Mapping],
                    progress: bool = False):
    """The budget method (module docstring) over the layers of ``plan``; called by
    :func:`qformats.quantize_model`, which validated the plan.

    Args:
        model: a causal LM whose forward on int64 token ids ``[B, L]`` returns logits
            ``[B, L, vocab]`` (or an object with ``.logits``), on any device.
        plan: ``[(name, nn.Linear, fmt, params)]``: the eligible layers (fmt / params unused:
            the candidates replace them).
        options: a :class:`qformats.config.BudgetConfig` (or a dict of its fields).
            ``calibration`` is cut by
            :func:`qformats.calibration.calibration_samples` into ``nsamples`` windows of at most
            ``seqlen`` tokens; ``batch_size`` windows per forward; ``selection`` /
            ``sensitivity_power`` for calibrated mixed2bit; ``signround`` (a dict of
            :class:`qformats.config.SignRoundConfig` fields) for signround candidates: by default they
            train on the budget's own calibration windows, ``nsamples`` / ``seqlen`` /
            ``batch_size`` / ``selection`` / ``sensitivity_power`` as the budget's; the dict
            overrides any of them, ``calibration`` (+ ``tokenizer``) included.
        progress: tqdm bar over the sensitivity evaluations.
    Returns:
        ``([(name, QuantizedLinear, seconds to quantize)], stats)``, the model's own Linear layers
        left in place (quantize_model swaps the chosen ones in). ``stats``: ``holds`` (bool),
        ``ppl_reference`` / ``ppl`` (exp of the mean NLL per predicted token on the windows),
        ``ppl_increase_percent``, ``kl`` (nats per token, or None), ``avg_bits`` (stored bits
        per weight over the plan's layers), ``estimated_cost`` (sum of the per-layer costs, in
        budget units), ``moves_undone``, ``evaluations`` (forward passes over the windows),
        ``windows`` ([count, max length]), ``choices`` ({name: format, params, bits, cost,
        method}), ``fronts`` ({name: the layer's Pareto front, most bits first: format,
        method, bits, cost}),
        ``seconds``.
    Raises:
        ValueError: a layer that no candidate's block size fits, a bad candidate spec (a
            signround candidate that is not int4 asymmetric or mixed2bit without outliers), or
            calibration data calibration_samples rejects.
    """
    config = options if isinstance(options, BudgetConfig) else BudgetConfig(**options)
    t0 = time.perf_counter()
    samples = calibration_samples(config.calibration, config.tokenizer, int(config.nsamples),
                                  int(config.seqlen))
    cands = []  # (fmt, params, method)
    for c in config.candidates:
        fmt, params = c[0], dict(c[1])
        meth = c[2] if len(c) == 3 else "rtn"
        gs = params.pop("group_size", None)
        fmt, params = resolve_spec(fmt, None, gs, **params)
        if meth == "signround":
            if not format_spec(fmt).trainable(params):
                raise ValueError(f"candidates: signround trains int4 asymmetric and mixed2bit without "
                                 f"outliers only, got {fmt} {params}")
        cands.append((fmt, params, meth))
    metric = _Metric(model, samples, config)

    # calibrated mixed2bit: the 4-bit groups of RTN candidates chosen by the mean squared input
    # per column over the calibration windows (one forward with hooks on the float model)
    sens: dict = {}
    if config.selection == "sensitivity" and any(
            format_spec(f).calibrated(p) and me == "rtn" for f, p, me in cands):
        moments = model_second_moments(model, {name: m for name, m, _, _ in plan}, samples,
                                       int(config.batch_size))
        sens = {n: sensitivity_from_moments(v, config.sensitivity_power) for n, v in moments.items()}

    # signround candidates: one training run over every layer that fits, per candidate; by
    # default on the budget's own windows, which config.signround may replace
    trained: dict = {}  # (candidate index, layer name) -> (QuantizedLinear, seconds)
    for ci, (fmt, params, meth) in enumerate(cands):
        if meth != "signround":
            continue
        sub = [(name, m, fmt, params) for name, m, _, _ in plan if fits(fmt, params, m)]
        sro = SignRoundConfig(calibration=samples, tokenizer=None, nsamples=config.nsamples,
                              seqlen=config.seqlen, batch_size=config.batch_size,
                              selection=config.selection, sensitivity_power=config.sensitivity_power)
        sro = sro.replace(**(config.signround or {}))  # may bring its own calibration data
        new_layers, _ = quantize_plan(model, sub, sro, progress=progress)
        for name, q, secs in new_layers:
            trained[(ci, name)] = (q, secs)

    # 1. every (layer, candidate): quantize, and measure the model with only that layer quantized
    layers = []  # (name, module, [(bits, QuantizedLinear, cost, seconds)] sorted by bits desc)
    bar = progress_bar(total=len(plan) * len(cands), enabled=progress, desc="budget: sensitivity",
                       unit="eval", leave=False)
    for name, m, _, _ in plan:
        opts = []
        start = metric.block_of(m)  # only this layer differs from the float model
        for ci, (fmt, params, meth) in enumerate(cands):
            bar.update(1)
            if not fits(fmt, params, m):
                continue
            if meth == "signround":
                q, secs = trained[(ci, name)]
            else:
                t1 = time.perf_counter()
                extra = ({"sensitivity": sens[name]} if name in sens and format_spec(fmt).calibrated(params)
                         else {})
                q = QuantizedLinear.from_linear(m, fmt, **params, **extra)
                secs = time.perf_counter() - t1
            set_submodule(model, name, q)
            cost = metric.cost(*metric(start))
            set_submodule(model, name, m)
            opts.append((q.avg_bits, q, max(cost, 0.0), secs, meth))
        if not opts:
            raise ValueError(f"layer {name}: no budget candidate fits in_features={m.in_features}")
        # keep the Pareto front: drop an option when another has no more bits and no more cost
        # (e.g. a trained candidate at the same bits as its RTN twin)
        front = []
        for o in sorted(opts, key=lambda o: (o[0], o[2])):  # fewest bits first, then cheapest
            if not front or o[2] < front[-1][2]:
                front.append(o)
        opts = front[::-1]  # most bits (and least cost) first
        layers.append((name, m, opts))
    bar.close()

    # 2. greedy knapsack: move down one candidate at a time, best bits saved per cost first
    choice = [0] * len(layers)
    total = sum(opts[0][2] for _, _, opts in layers)
    moves = []  # (layer index, previous choice, ratio)
    while True:
        best = None
        for i, (_, m, opts) in enumerate(layers):
            c = choice[i]
            if c + 1 >= len(opts):
                continue
            saved = (opts[c][0] - opts[c + 1][0]) * m.weight.numel()
            added = opts[c + 1][2] - opts[c][2]
            if total + added > 1.0:
                continue
            ratio = saved / max(added, 1e-9)
            if best is None or ratio > best[2]:
                best = (i, added, ratio)
        if best is None:
            break
        i, added, ratio = best
        moves.append((i, choice[i], ratio))
        choice[i] += 1
        total += added

    # 3. the assembled model, evaluated; undo the weakest moves while over budget
    def assemble():
        for (name, _, opts), c in zip(layers, choice):
            set_submodule(model, name, opts[c][1])

    assemble()
    nll, kl = metric()
    undone = 0
    while metric.excess(nll, kl) > 0 and moves:
        j = min(range(len(moves)), key=lambda t: moves[t][2])
        i, prev, _ = moves.pop(j)
        choice[i] = prev
        undone += 1
        assemble()
        nll, kl = metric()
    for name, m, _ in layers:  # quantize_model swaps the chosen ones in
        set_submodule(model, name, m)

    new = [(name, opts[c][1], opts[c][3]) for (name, _, opts), c in zip(layers, choice)]
    n_w = sum(m.weight.numel() for _, m, _ in layers)
    avg_bits = sum(opts[c][0] * m.weight.numel() for (_, m, opts), c in zip(layers, choice)) / max(n_w, 1)
    stats = {
        "budget": {"max_perplexity_increase": config.max_perplexity_increase,
                   "max_per_token_kl_divergence": config.max_per_token_kl_divergence},
        "ppl_reference": math.exp(metric.nll0),
        "ppl": math.exp(nll),
        "ppl_increase_percent": 100.0 * (math.exp(nll - metric.nll0) - 1.0),
        "kl": kl if metric.use_kl else None,
        "holds": metric.excess(nll, kl) <= 0,
        "avg_bits": avg_bits,
        "estimated_cost": total,
        "moves_undone": undone,
        "evaluations": metric.evaluations,
        "windows": [len(samples), max(int(t.shape[1]) for t in samples)],
        "choices": {name: {"format": opts[c][1].format, "params": dict(opts[c][1].params),
                           "bits": opts[c][0], "cost": opts[c][2], "method": opts[c][4]}
                    for (name, _, opts), c in zip(layers, choice)},
        "fronts": {name: [{"format": o[1].format, "method": o[4], "bits": o[0], "cost": o[2]} for o in opts]
                   for name, _, opts in layers},
        "seconds": time.perf_counter() - t0,
    }
    return new, stats
