"""Trainable rounding (SignRound / AutoRound style) for the formats whose ``SPEC.trainable``
says so: int4 asymmetric groups and mixed2bit without outliers (2-bit groups, and 4-bit groups
chosen by calibrated sensitivity).

Per quantized ``nn.Linear`` weight ``W`` ``[out, in]`` (groups of ``group_size`` along ``in``)
three sets of parameters are trained:

* ``V`` ``[out, in]`` in ``[-0.5, 0.5]``: a rounding offset added before rounding;
* ``alpha`` ``[out, in // gs]`` in ``[0.5, 1]``: scales the group's max ``hi``;
* ``beta``  ``[out, in // gs]`` in ``[0.5, 1]``: scales the group's min ``lo``.

The fake quantization with those parameters is the format's own, reached through
``SPEC.rounding`` (:class:`qformats._rounding.Rounding`): int4's asymmetric rule in
:mod:`qformats.int4.rounding`, mixed2bit's groups with their second-order scales in
:mod:`qformats.mixed2bit.rounding`; every step in float32, ``rint`` with a straight-through
estimator so that gradients reach ``V``, ``alpha`` and ``beta``. With ``V = 0``,
``alpha = beta = 1`` the codes are the format's round to nearest, which is where training
starts; the export writes the trained codes into the format's QuantizedTensor, whose
``dequantize`` equals the trained weight bit for bit.

Training is block by block: the inputs of the first transformer block are captured from the
model's own forward (hidden states and the keyword arguments the block takes: attention mask,
position embeddings, ...; :func:`qformats.calibration.capture_block_inputs`); each block is
trained on its own (a float32 copy, its Linears replaced by the fake-quantized ones) to
reproduce the full-precision block's output on the same inputs (MSE), where those inputs are
the outputs of the already-quantized previous blocks. The optimizer is SignSGD
(``p -= lr_t * sign(grad)``, no momentum) with a linearly decaying learning rate
``lr_t = lr * (1 - t / iters)``; after each step the parameters are clamped to their ranges.
The parameters with the lowest loss seen (evaluated before every step and once after the last)
are kept; the forward over all samples that measures the kept parameters' loss also gives the
next block its inputs.

What this costs is the blocks' matrix products (``benchmarks/README.md``, "Trainable rounding
and the budget on the CPU", has the cost model). The fake quantization is one autograd node per
layer: the weight-only part of the format's rule is computed once per layer (group bounds,
group kinds), the rest once per step (cached for forwards without gradients), and on the CPU it
and the SignSGD step run on :data:`WEIGHT_OP_THREADS` thread(s), since their weight-sized ops
gain little from more threads and wait at every op's barrier when the cores are busy.

mixed2bit with 4-bit groups (``ratio_4bit > 0``): the format chooses its 4-bit groups before
training and keeps them fixed, by ``sum(sensitivity * w**2)`` where ``sensitivity`` is the mean
squared input of the layer per input column (the diagonal of ``X^T X`` / tokens,
:func:`qformats.calibration.capture_second_moments`) over the calibration samples as the
block-by-block procedure feeds them to the block, raised to ``sensitivity_power``; with
``selection="range"`` by range.

Used through :func:`qformats.quantize_model` with ``method="signround"`` (options:
:class:`qformats.config.SignRoundConfig`).
"""
from __future__ import annotations

import copy
import math
import time
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ._core import QuantizedTensor, format_spec
from .calibration import (calibration_samples, capture_block_inputs, capture_second_moments,
                          sensitivity_from_moments)
from .config import SignRoundConfig
from .nn import QuantizedLinear
from .progress import progress_bar

# Defined in qformats.calibration and qformats.config, first defined here: still importable
# from here for existing callers.
from .calibration import model_second_moments  # noqa: E402,F401
from .config import SELECTIONS, check_selection  # noqa: E402,F401

__all__ = ["OPTIONS", "DEFAULTS", "SignRoundLinear", "find_blocks", "train_block", "quantize_plan"]

#: quantize_model keyword arguments that belong to signround (not to the format) and their
#: defaults: the fields of :class:`qformats.config.SignRoundConfig`.
OPTIONS = SignRoundConfig.names()
DEFAULTS = SignRoundConfig.defaults()

V_RANGE = (-0.5, 0.5)
SCALE_RANGE = (0.5, 1.0)

#: CPU threads of the work on weight-sized tensors (10^5 - 10^6 floats): the fake
#: quantization (some 60 elementwise ops, forward and backward) and the SignSGD step. Split
#: over threads each such op gains little and pays a barrier, which on a machine whose cores
#: are busy with other work waits for a descheduled thread (benchmarks/README.md, "Trainable
#: rounding"). The block's matrix products keep torch's setting.
WEIGHT_OP_THREADS = 1


class _cpu_threads:
    """Context manager (reusable): torch's intra-op CPU threads set to ``n`` inside; nothing
    changes for a CUDA device."""

    def __init__(self, n: int, device: torch.device):
        self.n, self.cpu = int(n), device.type == "cpu"
        self.old = None

    def __enter__(self):
        self.old = torch.get_num_threads()
        if self.cpu and self.old != self.n:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        if torch.get_num_threads() != self.old:
            torch.set_num_threads(self.old)
        return False


class _FakeQuant(torch.autograd.Function):
    """The layer's fake quantization as one autograd node, so that its own graph runs its
    forward and backward with :data:`WEIGHT_OP_THREADS` CPU threads: the gradients are those
    of the format's ``fake_quant`` graph, bit for bit (the same ops, run on fewer threads)."""

    @staticmethod
    def forward(ctx, layer, v, alpha, beta):
        leaves = [t.detach().requires_grad_(True) for t in (v, alpha, beta)]
        with _cpu_threads(WEIGHT_OP_THREADS, v.device), torch.enable_grad():
            out = layer.rounding.fake_quant(layer.weight, *leaves)
        ctx.graph = (out, leaves)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        out, leaves = ctx.graph
        del ctx.graph
        with _cpu_threads(WEIGHT_OP_THREADS, grad.device):
            gv, ga, gb = torch.autograd.grad(out, leaves, grad)
        return None, gv, ga, gb


class SignRoundLinear(nn.Module):
    """A Linear whose weight is fake-quantized with trainable V / alpha / beta (float32).

    Args:
        linear: the ``nn.Linear`` to copy (weight ``[out, in]``, bias kept as float32).
        rounding: the format's fake quantization of this layer (``SPEC.rounding(weight,
            params, sensitivity)``, see :meth:`for_layer`).
    Raises:
        ValueError: ``in`` not a multiple of the rounding's group size.
    """

    def __init__(self, linear: nn.Linear, rounding: Any):
        super().__init__()
        self.rounding = rounding
        group_size = int(rounding.group_size)
        w = linear.weight.detach().to(torch.float32).clone()
        out_f, in_f = w.shape
        if in_f % group_size:
            raise ValueError(f"in_features={in_f} is not a multiple of group_size={group_size}")
        self.group_size = group_size
        self.register_buffer("weight", w)
        b = linear.bias
        self.register_buffer("bias", None if b is None else b.detach().to(torch.float32).clone())
        self.v = nn.Parameter(torch.zeros(out_f, in_f))
        self.alpha = nn.Parameter(torch.ones(out_f, in_f // group_size))
        self.beta = nn.Parameter(torch.ones(out_f, in_f // group_size))
        self._cached: tuple = (None, None)  # (key, weight) of forwards without gradients

    @classmethod
    def for_layer(cls, linear: nn.Linear, fmt: str, params: Mapping[str, Any],
                  sensitivity: Optional[torch.Tensor] = None) -> "SignRoundLinear":
        """The SignRoundLinear of ``linear`` quantized to ``fmt`` with ``params``; the format
        makes its calibrated choice (mixed2bit's 4-bit groups) from ``sensitivity`` (float
        ``[in]``) when given, else by range.

        Raises:
            ValueError: a format or params that trainable rounding does not apply to.
        """
        spec = format_spec(fmt)
        if spec.rounding is None or not spec.trainable(params):
            raise ValueError(f"signround: {fmt} {dict(params)} is not trainable")
        return cls(linear, spec.rounding(linear.weight, params, sensitivity))

    def qweight(self) -> torch.Tensor:
        """The fake-quantized float32 weight ``[out, in]`` (differentiable in v, alpha, beta).
        Without gradients it is computed once per parameter values (evaluations over several
        batches reuse it)."""
        ps = (self.v, self.alpha, self.beta)
        if torch.is_grad_enabled() and any(p.requires_grad for p in ps):
            return _FakeQuant.apply(self, *ps)
        key = tuple((t._version, t.data_ptr()) for t in (self.weight, *ps))
        if self._cached[0] != key:
            with _cpu_threads(WEIGHT_OP_THREADS, self.v.device), torch.no_grad():
                self._cached = (key, self.rounding.fake_quant(self.weight, *ps))
        return self._cached[1]

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
        return self.rounding.export(self.weight, self.v.detach(), self.alpha.detach(), self.beta.detach(),
                                    dtype)


# -- the blocks ----------------------------------------------------------------------------------

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


def _forward_all(block: nn.Module, inputs: list, batch_size: int,
                 targets: Optional[list] = None) -> tuple:
    """``(outputs, loss)``: the block's outputs ``[1, L, H]`` per input, computed in batches,
    without gradients; with ``targets`` the MSE over all inputs (each batch's mean weighted by
    its share of the inputs), else None."""
    n = len(inputs)
    outs: list = [None] * n
    total = 0.0
    with torch.no_grad():
        for grp in _groups(inputs, range(n), batch_size):
            y = _block_out(block, torch.cat([inputs[i][0] for i in grp]), inputs[grp[0]][1])
            if targets is not None:
                total += float(F.mse_loss(y, torch.cat([targets[i] for i in grp])) * (len(grp) / n))
            for j, i in enumerate(grp):
                outs[i] = y[j:j + 1].detach()
    return outs, (total if targets is not None else None)


def train_block(block: nn.Module, linears: dict, inputs: list, targets: list, iters: int,
                lr: Optional[float], batch_size: int, seed: int = 0,
                keep_outputs: bool = False) -> dict:
    """Train the SignRoundLinears of ``block`` (a float32 module already holding them:
    ``linears`` ``{name: SignRoundLinear}``) to map ``inputs`` ``[(x, kwargs)]`` to
    ``targets`` (MSE, mean over the batch's samples), SignSGD with linearly decaying lr.

    Leaves the best parameters seen in the modules. Returns stats: ``rtn_loss`` and ``loss``
    (the loss over all samples before / after training), ``best_loss`` / ``best_iter`` (the
    lowest batch loss seen and the step whose parameters it was; ``iters`` = after the last
    step), ``losses`` (the batch loss of every evaluated parameter set); with
    ``keep_outputs`` also ``outputs``: the trained block's outputs per input, from the forward
    that measured ``loss`` (the next block's inputs)."""
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

    rtn_loss = _forward_all(block, inputs, bs, targets)[1]
    weight_ops = _cpu_threads(WEIGHT_OP_THREADS, params[0].device if params else torch.device("cpu"))
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
            with torch.no_grad(), weight_ops:
                for b, p in zip(best, params):
                    b.copy_(p)
        if last:
            break
        lr_t = lr * (1.0 - t / iters)
        with torch.no_grad(), weight_ops:
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
    outs, loss = _forward_all(block, inputs, bs, targets)
    st = {"rtn_loss": rtn_loss, "loss": loss, "best_loss": best_loss, "best_iter": best_iter,
          "losses": losses}
    if keep_outputs:
        st["outputs"] = outs
    return st


# -- the model-level driver -------------------------------------------------------------------

def quantize_plan(model: nn.Module, plan: list, options: Union[SignRoundConfig, Mapping],
                  progress: bool = False) -> tuple:
    """Quantize ``plan`` ``[(name, nn.Linear, format, params)]`` of ``model`` with SignRound.

    Linears inside the model's transformer blocks (:func:`find_blocks`) are trained block by
    block; any other planned Linear is rounded to nearest (as ``method="rtn"``). The model is
    not modified. Returns ``(new, stats)``: ``new`` ``[(name, QuantizedLinear, seconds)]`` in
    plan order, ``stats`` ``{"blocks": [per-block train_block stats + "seconds", "layers"],
    "options": {...}}``.
    ``options`` is a :class:`qformats.config.SignRoundConfig` (or a dict of its fields).
    Layers whose format makes a calibrated choice (mixed2bit with ``ratio_4bit > 0``: its 4-bit
    groups, :func:`qformats.mixed2bit.rounding.select_4bit`) make it before training, by the
    calibrated sensitivity (``selection == "sensitivity"``, the default: mean squared inputs of
    the layer in its block's forward, ``** sensitivity_power``) or by range (``"range"``).

    Raises:
        NotImplementedError: a planned layer that is neither int4 asymmetric nor mixed2bit
            without outliers.
        ValueError: bad options (iters < 0, selection, sensitivity_power, calibration data).
    """
    config = options if isinstance(options, SignRoundConfig) else SignRoundConfig(**options)
    for name, m, fmt, qp in plan:
        spec = format_spec(fmt)
        if spec.rounding is None or not spec.trainable(qp):
            raise NotImplementedError(
                f"method='signround' supports int4 asymmetric groups (bits=4) and mixed2bit "
                f"without outliers (bits=2, any ratio_4bit, outlier_ratio=0) only; layer {name} "
                f"asks for {fmt} {qp}")
    iters = int(config.iters)
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    samples = calibration_samples(config.calibration, config.tokenizer, config.nsamples, config.seqlen)
    blocks_name, blocks = find_blocks(model)
    by_id = {id(m): (name, fmt, qp) for name, m, fmt, qp in plan}
    results: dict = {}
    stats: dict = {"blocks": [], "options": config.options(data=False)}
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
        # layers whose format makes a calibrated choice (mixed2bit's 4-bit groups): their
        # inputs' second moments, from the same forward that computes the targets (the inputs
        # the training sees)
        mixed = {rel: fblock.get_submodule(rel) for rel, (_, fmt, qp) in names
                 if format_spec(fmt).calibrated(qp)}
        moments: dict = {}
        if mixed and config.selection == "sensitivity":
            def run():
                nonlocal targets
                targets = _forward_all(fblock, inputs, config.batch_size)[0]
            targets = None
            moments = capture_second_moments(mixed, run)
        else:
            targets = _forward_all(fblock, inputs, config.batch_size)[0]
        linears = {}
        for rel, (name, fmt, qp) in names:
            sens = None
            if rel in moments:
                sens = sensitivity_from_moments(moments[rel], config.sensitivity_power)
            srl = SignRoundLinear.for_layer(fblock.get_submodule(rel), fmt, qp, sens)
            _replace(fblock, rel, srl)
            linears[rel] = srl
        outs = None
        if linears:
            st = train_block(fblock, linears, inputs, targets, iters, config.lr,
                             config.batch_size, config.seed + bi, keep_outputs=True)
            outs = st.pop("outputs")
            secs = time.perf_counter() - t0
            for rel, (name, fmt, qp) in names:
                orig = block.get_submodule(rel)
                qt = linears[rel].export(str(orig.weight.dtype).removeprefix("torch."))
                q = QuantizedLinear.from_quantized(qt, orig.bias)
                results[name] = (q, secs / len(names))
            st["seconds"] = secs
            st["layers"] = [n for _, (n, _, _) in names]
            stats["blocks"].append(st)
        if outs is None:
            outs = _forward_all(fblock, inputs, config.batch_size)[0]
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
