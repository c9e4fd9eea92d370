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

A step runs each sample of its batch through a forward and backward of its own and adds the
samples' weight gradients in a fixed pairwise-tree order (:func:`_batch_loss`), so the sum does
not depend on how many processes compute it: under ``torch.distributed`` (NCCL on GPUs, gloo on
the CPU; every rank calls :func:`quantize_plan` with the same model and options) the ranks split
each step's samples and the forwards over all samples, and every rank ends with one process's
bytes. On CUDA the steps use the math backend of scaled-dot-product attention, whose backward
is deterministic.

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
:class:`qformats.config.SignRoundConfig`), and :func:`qformats.streaming.quantize_checkpoint`
for a checkpoint not loaded: both run the one block loop, :func:`train_blocks`, which asks a
store for each block's weights when its turn comes and hands it the block's layers and the
next block's inputs (:class:`KeptBlocks`: a model in memory; streaming's reads each block
from the checkpoint and writes its results to files).
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ._core import QuantizedTensor, format_spec
from ._dist import Ranks
from .calibration import (calibration_samples, capture_block_inputs, capture_second_moments,
                          sensitivity_from_moments)
from .config import SignRoundConfig
from .nn import QuantizedLinear
from .progress import progress_bar

# Defined in qformats.calibration and qformats.config, first defined here: still importable
# from here for existing callers.
from .calibration import model_second_moments  # noqa: E402,F401
from .config import SELECTIONS, check_selection  # noqa: E402,F401

__all__ = ["OPTIONS", "DEFAULTS", "SignRoundLinear", "find_blocks", "train_block", "quantize_plan",
           "train_blocks", "KeptBlocks", "check_plan", "block_plan"]

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
        self.v = nn.Parameter(torch.zeros(out_f, in_f, device=w.device))
        self.alpha = nn.Parameter(torch.ones(out_f, in_f // group_size, device=w.device))
        self.beta = nn.Parameter(torch.ones(out_f, in_f // group_size, device=w.device))
        self._cached: tuple = (None, None)  # (key, weight) of forwards without gradients
        self._step: Optional[torch.Tensor] = None  # the weight leaf during a training step

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
        batches reuse it). Inside a training step (:func:`train_block`) it is the step's weight,
        a leaf tensor, so that each sample's weight gradient lands there."""
        if self._step is not None:
            return self._step
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
                 targets: Optional[list] = None, ranks: Optional[Ranks] = None) -> tuple:
    """``(outputs, loss)``: the block's outputs ``[1, L, H]`` per input, computed in batches,
    without gradients; with ``targets`` the MSE over all inputs (each batch's mean weighted by
    its share of the inputs), else None. With several ``ranks`` the batches are split over
    them (batch ``j`` on rank ``j % world``) and broadcast: every rank gets every output, the
    same bytes as one process computing them all (the same batches, so the same products)."""
    n = len(inputs)
    groups = _groups(inputs, range(n), batch_size)
    world, rank = (ranks.world, ranks.rank) if ranks is not None else (1, 0)
    ys: dict = {}
    with torch.no_grad():
        for j, grp in enumerate(groups):
            if j % world == rank:
                ys[j] = _block_out(block, torch.cat([inputs[i][0] for i in grp]), inputs[grp[0]][1])
        if world > 1:
            shapes = ranks.gather_objects({j: (tuple(y.shape), y.dtype) for j, y in ys.items()})
            for j, grp in enumerate(groups):
                src = j % world
                if src != rank:
                    shape, dt = shapes[src][j]
                    ys[j] = torch.empty(shape, dtype=dt, device=inputs[grp[0]][0].device)
                ys[j] = ranks.broadcast(ys[j], src)
        outs: list = [None] * n
        total = 0.0
        for j, grp in enumerate(groups):
            y = ys.pop(j)
            if targets is not None:
                total += float(F.mse_loss(y, torch.cat([targets[i] for i in grp])) * (len(grp) / n))
            for k, i in enumerate(grp):
                outs[i] = y[k:k + 1].detach()
    return outs, (total if targets is not None else None)


# -- sums whose order does not depend on the number of ranks ------------------------------------
#
# A step's weight gradient is a sum over its samples. Floating-point addition is not
# associative, so the order of that sum is fixed once: the pairwise tree below, over the
# samples in batch order. One process evaluates the whole tree; several ranks each evaluate
# some of its subtrees (_nodes) and then every rank adds the gathered subtree sums up the same
# tree, which repeats one process's additions exactly.

def _half(lo: int, hi: int) -> int:
    """Where the tree over terms ``[lo, hi)`` splits: the left part has the rounded-up half."""
    return lo + (hi - lo + 1) // 2


def _owners(nodes: list, world: int) -> tuple:
    """Ranks for ``nodes`` (subtrees ``(lo, hi)``), largest first, each to the rank with the
    fewest terms so far (ties: the earlier subtree, the lower rank); and that most terms."""
    load, owner = [0] * world, [0] * len(nodes)
    for k in sorted(range(len(nodes)), key=lambda k: (nodes[k][0] - nodes[k][1], k)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += nodes[k][1] - nodes[k][0]
    return owner, max(load)


def _nodes(n: int, world: int) -> tuple:
    """The subtrees ``(lo, hi)`` of the tree over ``n`` terms that ``world`` ranks share, in
    term order, and the rank of each (:func:`_owners`): the tree expanded level by level until
    there are at least ``world`` subtrees (or only single terms), then its first largest subtree
    split again while that lowers the most terms one rank computes (3 ranks and 8 terms: 3 3 2
    instead of a level's 4 2 2). A subtree more costs its rank one more gathered sum."""
    nodes = [(0, n)]
    while len(nodes) < world and any(hi - lo > 1 for lo, hi in nodes):
        nodes = [part for lo, hi in nodes
                 for part in (((lo, _half(lo, hi)), (_half(lo, hi), hi)) if hi - lo > 1 else ((lo, hi),))]
    owner, worst = _owners(nodes, world)
    while True:
        big = min(range(len(nodes)), key=lambda k: (nodes[k][0] - nodes[k][1], k))
        lo, hi = nodes[big]
        if hi - lo <= 1:
            break
        trial = nodes[:big] + [(lo, _half(lo, hi)), (_half(lo, hi), hi)] + nodes[big + 1:]
        trial_owner, trial_worst = _owners(trial, world)
        if trial_worst >= worst:
            break
        nodes, owner, worst = trial, trial_owner, trial_worst
    return nodes, owner


def _tree_sum(lo: int, hi: int, term, known: Optional[dict] = None) -> list:
    """The tree sum of the terms ``[lo, hi)``, each a list of tensors (summed elementwise):
    ``term(i)`` gives term ``i`` (new tensors, added into in place), ``known[(lo, hi)]`` a
    subtree's sum computed elsewhere."""
    if known is not None and (lo, hi) in known:
        return known[(lo, hi)]
    if hi - lo == 1:
        return term(lo)
    left = _tree_sum(lo, _half(lo, hi), term, known)
    torch._foreach_add_(left, _tree_sum(_half(lo, hi), hi, term, known))
    return left


def _attention_for_training(device: torch.device):
    """On CUDA, scaled_dot_product_attention's math backend while gradients are computed: the
    memory-efficient backend's backward adds with atomics (bits that change from run to run),
    the math backend's does not. Elsewhere nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _batch_loss(block: nn.Module, linears: dict, inputs: list, targets: list, idx: Sequence[int],
                grad: bool, ranks: Optional[Ranks]) -> float:
    """The loss of samples ``idx`` (the mean of the samples' MSEs, summed in ``idx`` order) and,
    with ``grad``, the gradients of the layers' V / alpha / beta in their ``.grad``.

    Each sample is a forward (and backward) of its own. The step's fake-quantized weights are
    computed once, as leaves that take each sample's weight gradients (the layers'
    :meth:`SignRoundLinear.qweight`); the samples' gradients are added in the fixed tree order
    (:func:`_tree_sum`), then go back through the fake quantization once.
    With several ``ranks`` the subtrees (:func:`_nodes`) are split over them and gathered: every
    rank ends with the bytes one process computes."""
    n = len(idx)
    world, rank = (ranks.world, ranks.rank) if ranks is not None else (1, 0)
    nodes, owner = _nodes(n, world)
    mine = [k for k in range(len(nodes)) if owner[k] == rank]
    ms = list(linears.values())
    losses = [0.0] * n
    ws: list = []
    leaves: list = []
    if grad:
        ws = [_FakeQuant.apply(m, m.v, m.alpha, m.beta) for m in ms]
        leaves = [w.detach().requires_grad_(True) for w in ws]
        for m, leaf in zip(ms, leaves):
            m._step = leaf

    def term(j: int) -> Optional[list]:
        i = idx[j]
        x, kw = inputs[i]
        with torch.set_grad_enabled(grad):
            loss = F.mse_loss(_block_out(block, x, kw), targets[i]) / n
        if grad:
            loss.backward()
        losses[j] = float(loss.detach())
        if not grad:
            return None
        gs = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        return gs

    try:
        sums = []
        with _attention_for_training(inputs[idx[0]][0].device):
            for k in mine:
                lo, hi = nodes[k]
                if grad:
                    sums.append(_tree_sum(lo, hi, term))
                else:
                    for j in range(lo, hi):
                        term(j)
    finally:
        for m in ms:
            m._step = None
    if world > 1:  # every rank's losses, taken from the rank that computed each
        got = ranks.gather(torch.tensor(losses, dtype=torch.float64))
        for k, (lo, hi) in enumerate(nodes):
            for j in range(lo, hi):
                losses[j] = float(got[owner[k]][j])
    if grad:
        if world > 1:  # each rank's subtree sums, flat, in one buffer: [subtrees per rank, P]
            sizes = [w.numel() for w in ws]
            buf = ws[0].new_zeros(max(owner.count(r) for r in range(world)), sum(sizes))
            for row, gs in zip(buf, sums):
                torch.cat([g.reshape(-1) for g in gs], out=row)
            del sums
            got = ranks.gather(buf)
            row_of = [owner[:k].count(owner[k]) for k in range(len(nodes))]  # its place among its rank's
            known = {nodes[k]: [g.view(w.shape) for g, w in
                                zip(got[owner[k]][row_of[k]].split(sizes), ws)]
                     for k in range(len(nodes))}
        else:
            known = {nodes[0]: sums[0]}
        total = _tree_sum(0, n, None, known)
        del known
        torch.autograd.backward(ws, total)
    return sum(losses, 0.0)


def train_block(block: nn.Module, linears: dict, inputs: list, targets: list, iters: int,
                lr: Optional[float], batch_size: int, seed: int = 0,
                keep_outputs: bool = False, ranks: Optional[Ranks] = None) -> dict:
    """Train the SignRoundLinears of ``block`` (a float32 module already holding them:
    ``linears`` ``{name: SignRoundLinear}``) to map ``inputs`` ``[(x, kwargs)]`` to
    ``targets`` (MSE, mean over the batch's samples), SignSGD with linearly decaying lr.

    A step's batch is ``batch_size`` samples drawn with ``seed``; each sample's forward and
    backward runs on its own and the gradients are added in a fixed order
    (:func:`_batch_loss`). With several ``ranks`` (:class:`qformats._dist.Ranks`; every rank
    calls this with the same block, data and options) the samples of each step and the
    forwards over all samples are split over the ranks, and every rank ends with the
    parameters one process reaches, bit for bit.

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

    rtn_loss = _forward_all(block, inputs, bs, targets, ranks)[1]
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
        loss = _batch_loss(block, linears, inputs, targets, idx, not last, ranks)
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
    outs, loss = _forward_all(block, inputs, bs, targets, ranks)
    st = {"rtn_loss": rtn_loss, "loss": loss, "best_loss": best_loss, "best_iter": best_iter,
          "losses": losses}
    if keep_outputs:
        st["outputs"] = outs
    return st


# -- the model-level driver -------------------------------------------------------------------

class KeptBlocks:
    """Where :func:`train_blocks` finds the blocks' weights and leaves its results, for a model
    in memory: the weights are there, and the results are kept here. :mod:`qformats.streaming`
    has one that reads each block from a checkpoint when its turn comes and writes its results
    to files.

    Attributes:
        layers: ``{layer name: (QuantizedLinear, seconds)}`` of the blocks trained so far.
        stats: the per-block :func:`train_block` stats (+ ``"seconds"``, ``"layers"``), in
            block order.
    """

    def __init__(self):
        self.layers: dict = {}
        self.stats: list = []

    def hold(self, index: int, block: nn.Module):
        """A context manager during which ``block`` (block ``index``) holds its weights."""
        return contextlib.nullcontext()

    def finished(self, index: int, layers: dict, stats: Optional[dict],
                 inputs: Optional[list]) -> None:
        """Block ``index`` is done: its quantized ``layers`` ``{name: (QuantizedLinear,
        seconds)}``, its ``stats`` (None for a block without planned layers) and the next
        block's ``inputs`` ``[(hidden_states, kwargs)]`` (None after the last block to train)."""
        self.layers.update(layers)
        if stats is not None:
            self.stats.append(stats)


def check_plan(plan: list, options: Union[SignRoundConfig, Mapping]) -> SignRoundConfig:
    """``options`` as a :class:`qformats.config.SignRoundConfig`, checked against ``plan``
    ``[(name, nn.Linear, format, params)]``.

    Raises:
        NotImplementedError: a planned layer that is neither int4 asymmetric nor mixed2bit
            without outliers.
        ValueError: ``iters`` < 0, or a bad option.
    """
    config = options if isinstance(options, SignRoundConfig) else SignRoundConfig(**options)
    for name, m, fmt, qp in plan:
        spec = format_spec(fmt)
        if spec.rounding is None or not spec.trainable(qp):
            raise NotImplementedError(
                f"method='signround' supports int4 asymmetric groups (bits=4) and mixed2bit "
                f"without outliers (bits=2, any ratio_4bit, outlier_ratio=0) only; layer {name} "
                f"asks for {fmt} {qp}")
    if int(config.iters) < 0:
        raise ValueError(f"iters must be >= 0, got {int(config.iters)}")
    return config


def block_plan(blocks: nn.ModuleList, plan: list) -> list:
    """For each block, ``[(name relative to the block, (layer name, format, params))]`` of the
    planned Linears inside it (``plan`` ``[(name, nn.Linear, format, params)]``)."""
    by_id = {id(m): (name, fmt, qp) for name, m, fmt, qp in plan}
    return [[(rel, by_id[id(sub)]) for rel, sub in block.named_modules() if id(sub) in by_id]
            for block in blocks]


def quantize_plan(model: nn.Module, plan: list, options: Union[SignRoundConfig, Mapping],
                  progress: bool = False) -> tuple:
    """Quantize ``plan`` ``[(name, nn.Linear, format, params)]`` of ``model`` with SignRound.

    Linears inside the model's transformer blocks (:func:`find_blocks`) are trained block by
    block (:func:`train_blocks`); any other planned Linear is rounded to nearest (as
    ``method="rtn"``). The model is not modified. Returns ``(new, stats)``: ``new``
    ``[(name, QuantizedLinear, seconds)]`` in plan order, ``stats`` ``{"blocks": [per-block
    train_block stats + "seconds", "layers"], "options": {...}}``.
    ``options`` is a :class:`qformats.config.SignRoundConfig` (or a dict of its fields).
    Layers whose format makes a calibrated choice (mixed2bit with ``ratio_4bit > 0``: its 4-bit
    groups, :func:`qformats.mixed2bit.rounding.select_4bit`) make it before training, by the
    calibrated sensitivity (``selection == "sensitivity"``, the default: mean squared inputs of
    the layer in its block's forward, ``** sensitivity_power``) or by range (``"range"``).

    Several processes: when ``torch.distributed`` is initialized with more than one rank,
    every rank calls this with the same model (on its own device: the rank's GPU under NCCL,
    the CPU under gloo), plan and options. The blocks' forwards over all samples and each
    step's samples are split over the ranks (:func:`train_block`), and every rank returns the
    layers one process returns, bit for bit (given the same kind of device and, on the CPU,
    the same number of threads, since those choose the products' summation order).

    Raises:
        NotImplementedError: a planned layer that is neither int4 asymmetric nor mixed2bit
            without outliers.
        ValueError: bad options (iters < 0, selection, sensitivity_power, calibration data);
            an NCCL process group with the model on the CPU.
    """
    config = check_plan(plan, options)
    samples = calibration_samples(config.calibration, config.tokenizer, config.nsamples, config.seqlen)
    _, blocks = find_blocks(model)
    device = next(iter(model.parameters()), torch.empty(0)).device  # where the blocks train
    ranks = _ranks_for(device)
    kept = KeptBlocks()
    if any(block_plan(blocks, plan)):
        inputs = capture_block_inputs(model, blocks[0], samples)
        train_blocks(blocks, plan, config, inputs, kept, device=device, ranks=ranks,
                     progress=progress)
    new = []
    for name, m, fmt, qp in plan:
        if name in kept.layers:
            q, secs = kept.layers[name]
        else:
            t1 = time.perf_counter()
            q = QuantizedLinear.from_linear(m, fmt, **qp)
            secs = time.perf_counter() - t1
        new.append((name, q, secs))
    return new, {"blocks": kept.stats, "options": config.options(data=False)}


def train_blocks(blocks: nn.ModuleList, plan: list, config: SignRoundConfig, inputs: list,
                 store: KeptBlocks, *, first: int = 0, device: torch.device,
                 ranks: Optional[Ranks] = None, progress: bool = False) -> None:
    """Train the planned Linears of ``blocks`` from block ``first`` on, one block after the
    other, each on the outputs of the blocks before it (already quantized).

    Args:
        blocks: the model's transformer blocks (:func:`find_blocks`).
        plan: ``[(name, nn.Linear, format, params)]``; the Linears outside ``blocks`` are
            not touched here.
        config: the options (:func:`check_plan`).
        inputs: block ``first``'s inputs ``[(hidden_states float32 [1, L, H], kwargs)]``
            (:func:`qformats.calibration.capture_block_inputs`).
        store: holds each block's weights while it is worked on (``store.hold(i, block)``)
            and takes its results (``store.finished(...)``; :class:`KeptBlocks`).
        first: the block to start from (an interrupted run going on); block ``i`` trains
            with seed ``config.seed + i`` whichever block the run started from.
        device: where the blocks are (and train).
        ranks: the processes sharing the work (:func:`quantize_plan`); None: one.
        progress: a progress bar over the blocks on stderr (rank 0).
    """
    layers_of = block_plan(blocks, plan)
    last = max((i for i, names in enumerate(layers_of) if names), default=-1)
    rank0 = ranks is None or ranks.rank == 0
    bar = progress_bar(list(enumerate(blocks))[first:last + 1], enabled=progress and rank0,
                       desc="signround", unit="block", leave=False)
    for bi, block in bar:
        names = layers_of[bi]
        layers: dict = {}
        st = None
        with store.hold(bi, block), _autocast(device, config.amp):  # (a no-op unless amp)
            t0 = time.perf_counter()
            fblock = copy.deepcopy(block).to(torch.float32)
            fblock.train(False)
            # layers whose format makes a calibrated choice (mixed2bit's 4-bit groups): their
            # inputs' second moments, from the same forward that computes the targets (the inputs
            # the training sees)
            mixed = {rel: fblock.get_submodule(rel) for rel, (_, fmt, qp) in names
                     if format_spec(fmt).calibrated(qp)}
            moments: dict = {}
            if mixed and config.selection == "sensitivity":
                def run():  # every rank over every sample: the moments' sums in one order
                    nonlocal targets
                    targets = _forward_all(fblock, inputs, config.batch_size)[0]
                targets = None
                moments = capture_second_moments(mixed, run)
            else:
                targets = _forward_all(fblock, inputs, config.batch_size, ranks=ranks)[0]
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
                st = train_block(fblock, linears, inputs, targets, int(config.iters), config.lr,
                                 config.batch_size, config.seed + bi, keep_outputs=True, ranks=ranks)
                outs = st.pop("outputs")
                secs = time.perf_counter() - t0
                for rel, (name, fmt, qp) in names:
                    orig = block.get_submodule(rel)
                    qt = linears[rel].export(str(orig.weight.dtype).removeprefix("torch."))
                    layers[name] = (QuantizedLinear.from_quantized(qt, orig.bias), secs / len(names))
                st["seconds"] = secs
                st["layers"] = [n for _, (n, _, _) in names]
            if outs is None:
                outs = _forward_all(fblock, inputs, config.batch_size, ranks=ranks)[0]
            fblock = linears = targets = None  # freed before the next block's copy is made
        inputs = [(y, kw) for y, (_, kw) in zip(outs, inputs)]
        store.finished(bi, layers, st, inputs if bi < last else None)
    bar.close()


def _autocast(device: torch.device, amp: bool):
    """bfloat16 autocast for a block's work when ``amp`` (on CUDA or the CPU), else nothing
    (:class:`qformats.config.SignRoundConfig`'s ``amp``)."""
    if not amp or device.type not in ("cuda", "cpu"):
        return contextlib.nullcontext()
    # No cast cache: it would keep every step's weight leaves (new tensors each step) and
    # their bfloat16 copies until the block ends; a cast per forward is a few ms per step.
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)


def _ranks_for(dev: torch.device) -> Ranks:
    """The ranks sharing the work (one process when torch.distributed is not initialized),
    with their collectives on the model's device ``dev`` under NCCL."""
    group = Ranks()  # the default group: collectives on a GPU under NCCL, else on the CPU
    if group.several and group.device.type == "cuda":
        if dev.type != "cuda":
            raise ValueError("signround over an NCCL process group needs the model on the rank's "
                             f"GPU; it is on {dev} (move it, or use a gloo group on the CPU)")
        return Ranks(device=dev)
    return Ranks(device=torch.device("cpu"))


def _replace(root: nn.Module, rel: str, new: nn.Module) -> None:
    parent_name, _, child = rel.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
