"""Quantization of a Hugging Face checkpoint without loading the model, from its safetensors
files, resumable: round to nearest tensor by tensor (optionally over several processes), and
trainable rounding (``method="signround"``) one transformer block at a time.

Use::

    from qformats.streaming import quantize_checkpoint
    report = quantize_checkpoint("Llama-3-8B", "llama-int4", bits=4, max_shard_size="2GB")
    report = quantize_checkpoint("Llama-3-8B", "llama-int4-sr", bits=4, method="signround",
                                 calibration=text, tokenizer=tok, iters=200)

or ``qformats quantize MODEL --bits 4 --stream --out DIR`` (``torchrun --nproc-per-node N -m
qformats quantize ... --stream`` splits the work over N processes), or
``qformats quantize MODEL --bits 4 --method signround --calibration C.txt --stream --out DIR``
(``--device cuda``: the blocks train on the GPU, under torchrun each process's own).

The output folder is the one :func:`qformats.quantize_model` + :func:`qformats.save_quantized`
write for the same model and options (same tensors, same bytes; only the order of the two
keys of each safetensors file's ``__metadata__``, which safetensors itself writes in a random
order, may differ), so :func:`qformats.load_quantized` and ``qformats eval`` read it. How:

1. The model is built on the meta device from ``config.json`` (no weights); the layer plan is
   :func:`qformats.plan.plan_layers`' on that skeleton, the one ``quantize_model`` makes.
2. The work is one unit per planned Linear (its weight, and bias) and one per other stored
   tensor. A unit reads its tensors from the checkpoint (a memory map, opened per tensor, so
   the pages read are given back when the unit ends), converts them to the model's dtype,
   quantizes the weight (:meth:`qformats.nn.QuantizedLinear.from_weight`) and writes the
   result to ``OUT/.qformats-stream/units/uNNNNN.safetensors`` (first as ``*.part``, then
   renamed). Memory: about one tensor at a time, plus the codec's temporaries.
3. When every unit is there, the weight files are assembled from the unit files by copying
   byte ranges (``os.copy_file_range``: the data does not pass through the process), sharded
   as ``save_quantized`` shards, and the folder is completed by the code that completes
   ``save_quantized`` (index, ``config.json``, tokenizer, ``quantization_config.json`` last).

Trainable rounding (``method="signround"``, :mod:`qformats.signround`) makes the same units,
but the planned Linears inside the transformer blocks are trained, block by block, by the loop
the in-memory path runs (:func:`qformats.signround.train_blocks`), so the bytes are the same:

* block 0's inputs are captured from the skeleton's own forward, each module it runs before
  block 0 (the embedding) read from the checkpoint when it is called and put back on the meta
  device afterwards;
* each block's parameters are read from the checkpoint when its turn comes (memory-map views,
  or copies converted to the model's dtype; copies on ``device`` when it is a GPU) and put back
  on the meta device when it is done; its layers go to their unit files, then the next block's
  inputs (float32 hidden states) and the blocks' stats to
  ``OUT/.qformats-stream/next-block.pt``;
* planned Linears outside the blocks (lm_head with ``ignore=[]``) are rounded to nearest, and
  the other tensors copied, as units of the round-to-nearest path.

Memory: the tensors used before block 0 (the embedding, while capturing); one block, in the
model's dtype and as the training's float32 copy with its parameters and their gradients (a
few times the block's float32 weights: the weight, the offsets ``V``, their best values and
gradients, the step's fake-quantized weight and its gradient); and the calibration
activations: the samples' hidden states three times (the block's inputs, its targets, its
outputs), ``nsamples * seqlen * hidden_size * 4`` bytes each, plus one sample's forward and
backward. Under several processes each rank holds as much; with a CUDA ``device`` the block
and the activations are in GPU memory.

Resume: a run that is killed leaves ``OUT/.qformats-stream`` with a manifest of its settings
and the finished unit files; the same call (or command) again skips those and goes on
(signround: after the last block whose ``next-block.pt`` was written; a block killed halfway
is trained again, to the same bytes). A run with other settings (options, calibration
samples of other tokens, or signround on the other kind of device) refuses the folder unless
``overwrite=True``.

Device: signround trains each block on ``device`` (``"cuda"``: the block's weights read
onto the GPU, block 0's inputs computed there, as in memory with the model on that GPU;
``amp`` applies there); round to nearest runs on the CPU.

Several processes: under ``torchrun`` (``WORLD_SIZE`` > 1), or in a process group the caller
initialized, the round-to-nearest units are split among the ranks (largest first, round
robin); each rank writes its own unit files, and rank 0 assembles the folder after a barrier.
Those bytes go through the shared output folder (the ranks must share it, as on one machine),
so this group only synchronizes: a gloo group on the CPU (made from torchrun's environment when
none is initialized). Signround splits each block's training over the ranks as the in-memory
path does (:func:`qformats.signround.train_block`: each step's samples and the forwards over
all samples; the gradients gathered and added in one order, so the bytes are one process's):
every rank reads the block from the checkpoint (its memory maps: one machine) and trains it,
and rank 0 alone writes the block's unit files and ``next-block.pt`` while the others wait at
a barrier, so a killed run leaves a stage that every rank of the next run reads alike. The
training's gathers go over a gloo group on the CPU, an NCCL group on CUDA (each rank on its
``LOCAL_RANK``'s GPU); on the CPU every rank needs the same number of threads as the run it is
compared with, since that chooses the products' summation order.

Not streamed: the budget (``method="budget"``) and calibrated round to nearest
(``calibration=`` with ``method="rtn"``), which need the whole model's activations.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ._dist import Ranks, rank_device
from ._files import check_output_dir, read_json, read_safetensors_header
from .calibration import calibration_samples, capture_block_inputs, context_length
from .choice import resolve_spec
from .config import RTNConfig, SignRoundConfig
from .evaluate import _dtype_key, _is_causal
from .model import QuantizationReport
from .nn import QuantizedLinear
from .plan import LayerReport, plan_layers, set_submodule
from .progress import progress_bar
from .saving import (INDEX_NAME, WEIGHTS_METADATA, WEIGHTS_NAME, _dedup_state, _shards,
                     empty_weights, finish_save)
from .signround import KeptBlocks, block_plan, check_plan, find_blocks, train_blocks
from .sizes import model_size

__all__ = ["quantize_checkpoint", "STAGE_DIR", "KILL_AFTER_ENV"]

#: The folder inside the output folder that holds an unfinished run (manifest, unit files).
STAGE_DIR = ".qformats-stream"
_MANIFEST = "manifest.json"
#: Test aid: a process that has written this many unit files kills itself with SIGKILL (to
#: test resuming after a crash at a known point). Unset in normal use.
KILL_AFTER_ENV = "QFORMATS_STREAM_KILL_AFTER"
_DTYPES = ("auto", "float32", "float16", "bfloat16")


# -- the checkpoint ---------------------------------------------------------------------------

@dataclass
class _Checkpoint:
    """A Hugging Face folder's safetensors weights, from their headers only."""

    folder: Path
    files: list                       # the weight files, in index order
    where: dict = field(default_factory=dict)   # tensor name -> file Path
    info: dict = field(default_factory=dict)    # tensor name -> {"dtype", "shape", ...}

    @classmethod
    def open(cls, folder: Path) -> "_Checkpoint":
        index, single = folder / INDEX_NAME, folder / WEIGHTS_NAME
        if index.is_file():
            wmap = read_json(index, INDEX_NAME).get("weight_map")
            if not isinstance(wmap, dict) or not all(
                    isinstance(v, str) and v and Path(v).name == v for v in wmap.values()):
                raise ValueError(f"{index}: expected {{'weight_map': {{tensor: shard file name}}}}")
            files = list(dict.fromkeys(folder / v for v in wmap.values()))
        elif single.is_file():
            wmap, files = None, [single]
        else:
            raise ValueError(f"{folder}: no {WEIGHTS_NAME} or {INDEX_NAME}; streaming reads "
                             "safetensors checkpoints only (convert pytorch_model.bin first)")
        ck = cls(folder, files)
        for f in files:
            if not f.is_file():
                raise ValueError(f"{folder}: the weights file {f.name} is missing")
            for name, info in read_safetensors_header(f).items():
                if name == "__metadata__":
                    continue
                if wmap is not None and wmap.get(name) != f.name:
                    raise ValueError(f"{f}: holds {name!r}, which {INDEX_NAME} places elsewhere")
                ck.where[name], ck.info[name] = f, info
        if wmap is not None and set(wmap) - set(ck.where):
            missing = sorted(set(wmap) - set(ck.where))
            raise ValueError(f"{index}: names tensors that no shard holds: {missing[:4]}")
        return ck

    def dtype(self) -> torch.dtype:
        """The dtype transformers picks with ``dtype="auto"`` when config.json names none:
        the first floating-point tensor's (``get_state_dict_dtype``), float32 if none."""
        from transformers.modeling_utils import str_to_torch_dtype

        names = sorted(n for n, f in self.where.items() if f == self.files[0])
        for n in names:
            dt = str_to_torch_dtype.get(self.info[n].get("dtype"))
            if dt is not None and dt.is_floating_point and "float8" not in str(dt):
                return dt
        return torch.float32

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` in ``dtype`` (a copy when the stored dtype differs, else a view of
        the file's memory map that lives as long as the tensor)."""
        from safetensors import safe_open

        with safe_open(str(self.where[name]), framework="pt") as f:
            t = f.get_tensor(name)
        return t.to(dtype) if t.is_floating_point() else t

    def signature(self) -> dict:
        """What identifies the inputs in the manifest: each file's size and mtime."""
        return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in self.files}


def _skeleton(folder: Path, ck: _Checkpoint, dtype: str) -> nn.Module:
    """The model of ``config.json`` with its parameters on the meta device and its computed
    buffers real, in the dtypes ``qformats.evaluate.load_model(folder, dtype)`` gives it: built
    in the checkpoint's dtype (``dtype="auto"``, as ``from_pretrained``), then ``.to(dtype)``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{folder}/config.json: cannot read it: {str(e).splitlines()[0]}") from e
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{folder}: encoder-decoder models ({config.model_type}) are not supported")
    auto = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or ck.dtype()
    if isinstance(auto, str):
        auto = getattr(torch, auto)
    cls = AutoModelForCausalLM if _is_causal(config) else AutoModel
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with empty_weights():
            model = cls.from_config(config, **{_dtype_key(): auto})
    finally:
        transformers.logging.set_verbosity(verbosity)
    if dtype != "auto":
        model.to(getattr(torch, dtype))
    return model.eval()


# -- the work units ----------------------------------------------------------------------------

@dataclass
class _Unit:
    """One file of work: a planned Linear (``layer`` set) or one other stored tensor."""

    index: int
    name: str                # the layer's or the tensor's name
    reads: dict              # {role ("weight", "bias" or the tensor's name): (checkpoint name, dtype)}
    nbytes: int = 0          # bytes read from the checkpoint (progress)
    layer: Optional[tuple] = None   # (format, params) of a planned Linear

    @property
    def file(self) -> str:
        return f"u{self.index:05d}.safetensors"


def _stored_names(aliases: dict, ck: _Checkpoint):
    """``name -> the name the checkpoint holds tensor name under``: itself, or for a tied
    tensor (``aliases`` ``{alias: target}`` of :func:`qformats.saving._dedup_state`) the other
    name when the checkpoint lacks this one."""
    ties: dict = {}
    for alias, target in aliases.items():
        ties.setdefault(alias, target)
        ties.setdefault(target, alias)
    return lambda name: name if name in ck.where or name not in ties else ties[name]


def _units(model: nn.Module, plan: list, ck: _Checkpoint) -> list:
    """The units of the skeleton's stored tensors, in state-dict order; ValueError naming the
    tensors the checkpoint lacks. A tied tensor (lm_head.weight of tied embeddings) is read
    under whichever of its names the checkpoint holds."""
    tensors, aliases = _dedup_state(model, meta=True)
    stored = _stored_names(aliases, ck)
    planned = {f"{name}.weight": (name, m, fmt, qp) for name, m, fmt, qp in plan}
    biases = {f"{name}.bias" for name, m, _, _ in plan if m.bias is not None}
    units: list = []
    for tname, t in model.state_dict(keep_vars=True).items():
        if tname in planned:
            lname, m, fmt, qp = planned[tname]
            reads = {"weight": (stored(tname), m.weight.dtype)}
            if m.bias is not None:
                reads["bias"] = (stored(f"{lname}.bias"), m.bias.dtype)
            units.append(_Unit(len(units), lname, reads, layer=(fmt, qp)))
        elif tname in tensors and tname not in biases:
            if stored(tname) in ck.where or t.device.type == "meta":
                reads = {tname: (stored(tname), t.dtype)}
            else:  # a persistent buffer the model computes and the checkpoint does not hold
                reads = {}
            units.append(_Unit(len(units), tname, reads))
    missing = [n for u in units for n, _ in u.reads.values() if n not in ck.where]
    if missing:
        raise ValueError(f"{ck.folder}: the checkpoint lacks tensor(s) {missing[:4]}"
                         f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''} that the "
                         f"{type(model).__name__} model of config.json has (a checkpoint whose "
                         "names transformers converts on loading? quantize it in memory)")
    for u in units:
        u.nbytes = sum(math.prod(ck.info[n]["shape"]) * dt.itemsize for n, dt in u.reads.values()) or 1
    return units


def _run_unit(unit: _Unit, ck: _Checkpoint, model: nn.Module, path: Path) -> None:
    """Quantize or convert one unit and write it to ``path`` (via ``path.part``)."""
    t0 = time.perf_counter()
    if unit.layer is not None:
        fmt, qp = unit.layer
        w = ck.read(*unit.reads["weight"])
        b = ck.read(*unit.reads["bias"]) if "bias" in unit.reads else None
        try:
            q = QuantizedLinear.from_weight(w, b, fmt, **qp)
        except (TypeError, ValueError) as e:
            raise ValueError(f"layer {unit.name}: {fmt} {qp}: {e}") from e
        del w, b
        _write_layer(path, unit.name, q, time.perf_counter() - t0)
        return
    if unit.reads:
        tensors = {unit.name: ck.read(*unit.reads[unit.name]).contiguous()}
    else:
        owner, _, b = unit.name.rpartition(".")
        tensors = {unit.name: (model.get_submodule(owner) if owner else model)._buffers[b].contiguous()}
    _save(path, tensors, dict(WEIGHTS_METADATA))


def _write_layer(path: Path, name: str, q: QuantizedLinear, seconds: float) -> None:
    """The unit file of layer ``name`` quantized as ``q``, which took ``seconds``: its
    tensors, and in the metadata what :func:`_quantized_skeleton` rebuilds it from."""
    tensors = {f"{name}.{k}": v.contiguous().cpu() for k, v in q.state_dict().items()}
    derived = {n: [str(q._buffers[n].dtype).removeprefix("torch."), list(q._buffers[n].shape)]
               for n in q.derived_names}
    meta = dict(WEIGHTS_METADATA, layer=json.dumps({"config": q.config(), "derived": derived,
                                                    "seconds": seconds}))
    _save(path, tensors, meta)


def _save(path: Path, tensors: dict, metadata: dict) -> None:
    """``safetensors.torch.save_file`` to ``path``, through ``path.part`` (a killed run leaves
    no partial file under the final name)."""
    from safetensors.torch import save_file

    part = path.with_name(path.name + ".part")
    save_file(tensors, str(part), metadata=metadata)
    os.replace(part, path)


# -- the output files --------------------------------------------------------------------------

def _write_safetensors(path: Path, tensors: dict, sources: dict, metadata: dict) -> None:
    """Write ``tensors`` (``{name: tensor}``, only dtype and shape read: meta tensors) as the
    safetensors file ``safetensors.torch.save_file`` writes for them, taking each tensor's
    bytes from ``sources[name] = (file, byte offset, byte length)``.

    safetensors writes a file from tensors held in memory; this writes the same file from byte
    ranges on disk. The layout is safetensors' own: the order of the tensors (by dtype, then
    name) and of the metadata keys comes from ``safetensors.torch.save`` of zero-size tensors
    of the same names and dtypes; the header is its compact JSON, padded with spaces to a
    multiple of 8 bytes; then each tensor's bytes in that order."""
    from safetensors.torch import save

    probe = save({n: torch.empty(0, dtype=t.dtype) for n, t in tensors.items()}, metadata=metadata)
    (n,) = struct.unpack("<Q", probe[:8])
    order = json.loads(probe[8:8 + n])
    header: dict = {"__metadata__": order.pop("__metadata__")}
    offset = 0
    for name, entry in order.items():
        size = sources[name][2]
        header[name] = {"dtype": entry["dtype"], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        out.flush()
        for name in order:
            src, start, size = sources[name]
            with open(src, "rb") as f:
                _copy_range(f.fileno(), out.fileno(), start, size)
    os.replace(part, path)


def _copy_range(src: int, dst: int, start: int, size: int) -> None:
    """Append ``size`` bytes of ``src`` from ``start`` to ``dst`` (at its current position)."""
    done = 0
    while done < size:
        n = 0
        if hasattr(os, "copy_file_range"):
            try:
                n = os.copy_file_range(src, dst, size - done, start + done)
            except OSError:  # a file system that does not do it: copy through memory
                n = 0
        if n <= 0:
            chunk = os.pread(src, min(size - done, 1 << 24), start + done)
            if not chunk:
                raise ValueError(f"unit file ended {size - done} bytes early (truncated?)")
            os.write(dst, chunk)
            n = len(chunk)
        done += n


def _unit_sources(units_dir: Path, units: list) -> tuple[dict, dict]:
    """``(sources, layers)`` from the unit files' headers: ``sources[tensor] = (file, byte
    offset, byte length)``; ``layers[layer name]`` the metadata a Linear unit recorded."""
    sources: dict = {}
    layers: dict = {}
    for u in units:
        f = units_dir / u.file
        header = read_safetensors_header(f, "unit file")
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        meta = header.pop("__metadata__", {}) or {}
        for name, info in header.items():
            a, b = info["data_offsets"]
            sources[name] = (f, 8 + n + a, b - a)
        if u.layer is not None:
            layers[u.name] = json.loads(meta["layer"])
    return sources, layers


def _quantized_skeleton(model: nn.Module, layers: dict) -> None:
    """Swap the skeleton's planned Linears for QuantizedLinears on the meta device, as the
    units recorded them (config, and the tensors the layer derives on loading, which
    ``quantization_config.json`` lists among the computed buffers)."""
    for name, rec in layers.items():
        old = model.get_submodule(name)
        q = QuantizedLinear.from_config(rec["config"], device="meta",
                                        dtype=old.bias.dtype if old.bias is not None else None)
        for n, (dt, shape) in rec["derived"].items():
            q.register_buffer(n, torch.empty(shape, dtype=getattr(torch, dt), device="meta"),
                              persistent=False)
        set_submodule(model, name, q)


# -- signround: one block at a time ------------------------------------------------------------

#: In the stage folder, rewritten after each trained block: the next block's inputs (float32
#: hidden states ``[1, L, H]``, one per calibration sample) and the stats of the blocks so far.
_NEXT = "next-block.pt"


class _Weights:
    """Tensors of the skeleton made real from the checkpoint for a while (a block's, the
    embedding's) and put back on the meta device afterwards: the same tensor objects, so the
    skeleton's ties still hold."""

    def __init__(self, model: nn.Module, ck: _Checkpoint):
        self.ck = ck
        self.stored = _stored_names(_dedup_state(model, meta=True)[1], ck)
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def load(self, module: nn.Module, recurse: bool = True,
             device: torch.device = torch.device("cpu")) -> list:
        """Put ``module``'s parameters and buffers (and its submodules' with ``recurse``) on
        ``device``: those on the meta device read from the checkpoint, in their dtypes (on
        the CPU: views of its memory map when the dtype is the stored one), the real ones
        (buffers the model computed) copied. Returns what :meth:`release` puts back."""
        put = []
        base = self.names[id(module)]
        for prefix, mod in (module.named_modules(prefix=base) if recurse else [(base, module)]):
            for store in (mod._parameters, mod._buffers):
                for k, t in list(store.items()):
                    if t is None or t.device == device:
                        continue
                    if t.device.type == "meta":
                        real = self.ck.read(self.stored(f"{prefix}.{k}" if prefix else k), t.dtype)
                    else:
                        real = t.detach()
                    real = real.to(device)
                    store[k] = nn.Parameter(real, t.requires_grad) if isinstance(t, nn.Parameter) else real
                    put.append((store, k, t))
        return put

    @staticmethod
    def release(put: list) -> None:
        for store, k, t in reversed(put):
            store[k] = t

    @contextlib.contextmanager
    def held(self, module: nn.Module, device: torch.device):
        """``module``'s weights real on ``device`` inside, where they were (the meta device)
        again after."""
        put = self.load(module, device=device)
        try:
            yield
        finally:
            self.release(put)


class _StreamedBlocks(KeptBlocks):
    """The blocks of the skeleton for :func:`qformats.signround.train_blocks`: each read from
    the checkpoint onto ``device`` when its turn comes and put back on the meta device after;
    each finished block's layers written as unit files, then :data:`_NEXT` (what a resumed run
    goes on from), by rank 0 of ``group`` while the other ranks (which trained the same layers)
    wait."""

    def __init__(self, weights: _Weights, device: torch.device, files: dict, stage: Path,
                 stats: list, group: Ranks, kill: "_Kill"):
        super().__init__()
        self.weights, self.device, self.files, self.stage = weights, device, files, stage
        self.group, self.kill = group, kill
        self.stats = stats  # those of the blocks an interrupted run finished, then these

    def hold(self, index: int, block: nn.Module):
        return self.weights.held(block, self.device)

    def finished(self, index: int, layers: dict, stats: Optional[dict],
                 inputs: Optional[list]) -> None:
        if stats is not None:
            self.stats.append(stats)
        if self.group.rank == 0:
            for name, (q, secs) in layers.items():
                _write_layer(self.files[name], name, q, secs)
            # torch.save, not safetensors: the hidden states are views of their batch's
            # output, which torch.save writes once (safetensors refuses tensors that share
            # memory)
            part = self.stage / (_NEXT + ".part")
            torch.save({"block": index + 1, "stats": json.dumps(self.stats),
                        "hidden": [x.cpu() for x, _ in inputs or []]}, part)
            os.replace(part, self.stage / _NEXT)
            self.kill.wrote(len(layers))
        # no rank goes on to the next block (and, after the last, to assembling) before the
        # stage holds this one: a killed run resumes from a stage every rank agrees on
        self.group.barrier()


def _tensors(v: Any):
    """The tensors in ``v`` (nested tuples, lists, dicts)."""
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _tensors(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _tensors(x)


def _block_inputs(model: nn.Module, blocks: nn.ModuleList, samples: list, weights: _Weights,
                  device: torch.device) -> list:
    """:func:`qformats.calibration.capture_block_inputs` of the skeleton on ``device``: each
    module outside the blocks that the forward calls before block 0 (the embedding, the
    rotary embedding, ...) has its tensors put on ``device`` when it is called (read from the
    checkpoint, or copied), and back where they were when the capture ends. So block 0's inputs
    are computed on the device the blocks train on, as in memory (``--device cuda``: the
    positions' cos and sin are CUDA's)."""
    inside = {id(m) for m in blocks.modules()}
    put: list = []

    def load(mod, args):
        put.extend(weights.load(mod, recurse=False, device=device))

    hooks = [m.register_forward_pre_hook(load) for m in model.modules()
             if id(m) not in inside and any(t is not None and t.device != device
                                            for t in (*m._parameters.values(), *m._buffers.values()))]
    try:
        got = capture_block_inputs(model, blocks[0], samples, device=device)
    except (RuntimeError, NotImplementedError) as e:
        if "meta" not in str(e):
            raise
        got = None
    finally:
        for h in hooks:
            h.remove()
        weights.release(put)
    if got is None or any(t.device.type == "meta" for t in _tensors(got)):
        raise ValueError(f"{type(model).__name__}: its forward up to the first block uses weights "
                         "outside the forward of the modules that hold them, which streaming "
                         "does not read; quantize it in memory (quantize_model)")
    return got


def _signround(model: nn.Module, plan: list, config: SignRoundConfig, samples: list, units: list,
               ck: _Checkpoint, stage: Path, group: Ranks, device: torch.device, kill: "_Kill",
               progress: bool) -> list:
    """Train the planned Linears of the blocks (:func:`qformats.signround.train_blocks`) on
    ``device``, each block read from the checkpoint when its turn comes; after each block its
    layers' unit files, then :data:`_NEXT`. An interrupted run goes on after its last finished
    block. With several ranks in ``group`` (every rank calls this alike) the ranks split each
    block's training (over an NCCL group on CUDA, gloo on the CPU) and rank 0 writes the files.
    Returns the per-block stats (as ``quantize_plan``'s ``stats["blocks"]``)."""
    _, blocks = find_blocks(model)
    first, hidden, stats = _resume_point(stage, group)
    if not any(names for names in block_plan(blocks, plan)[first:]):
        return stats
    weights = _Weights(model, ck)
    inputs = _block_inputs(model, blocks, samples, weights, device)
    if first > 0:  # the kwargs (mask, positions, ...) of the capture, the saved hidden states
        if len(hidden) != len(inputs):
            raise ValueError(f"{stage / _NEXT}: holds {len(hidden)} samples, not "
                             f"{len(inputs)}; remove {stage} and run again")
        inputs = [(x.to(device), kw) for x, (_, kw) in zip(hidden, inputs)]
    files = {u.name: stage / "units" / u.file for u in units if u.layer is not None}
    store = _StreamedBlocks(weights, device, files, stage, stats, group, kill)
    ranks = group.with_backend("nccl" if device.type == "cuda" else "gloo", device)
    try:
        # CUDA's current device: where torch.distributed puts the object gathers' tensors
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            train_blocks(blocks, plan, config, inputs, store, first=first, device=device,
                         ranks=ranks, progress=progress)
    finally:
        ranks.close()
    return store.stats


def _resume_point(stage: Path, group: Ranks) -> tuple:
    """``(first block, its inputs' hidden states (CPU), the finished blocks' stats)`` of the
    stage's :data:`_NEXT` (``(0, None, [])`` without one), the same on every rank: each reads
    the file, and all raise the same ValueError when any rank's reading failed or the ranks
    read different blocks (a file replaced meanwhile)."""
    first, hidden, stats, error = 0, None, [], None
    if (stage / _NEXT).is_file():
        try:
            saved = torch.load(stage / _NEXT, weights_only=True)
            first, hidden, stats = int(saved["block"]), saved["hidden"], json.loads(saved["stats"])
        except Exception as e:  # noqa: BLE001 - any damage: the same advice
            error = f"{stage / _NEXT}: unreadable ({e}); remove {stage} and run again"
    seen = group.gather_objects((first, error))
    error = next((err for _, err in seen if err is not None), None)
    if error is None and len({b for b, _ in seen}) > 1:
        error = (f"{stage / _NEXT}: the ranks read blocks {[b for b, _ in seen]}; run again "
                 "(one process writes that file)")
    if error is not None:
        raise ValueError(error)
    return first, hidden, stats


# -- the entry point ---------------------------------------------------------------------------

def quantize_checkpoint(source: Union[str, os.PathLike], out: Union[str, os.PathLike],
                        format: Optional[str] = None, bits: Optional[int] = None,
                        group_size: Optional[int] = None, *, method: str = "rtn",
                        ignore: Optional[Sequence[str]] = None,
                        overrides: Optional[Mapping[str, Mapping[str, Any]]] = None,
                        dtype: str = "auto", max_shard_size: Union[int, str, None] = None,
                        tokenizer: Any = None, device: Union[str, torch.device] = "cpu",
                        overwrite: bool = False, progress: bool = False,
                        **params) -> Optional[QuantizationReport]:
    """Quantize the Linear layers of a Hugging Face safetensors checkpoint without loading
    the model, and write the quantized model folder: with round to nearest, tensor by tensor;
    with ``method="signround"``, one transformer block at a time.

    The folder equals what ``m = load_model(source, dtype).model; quantize_model(m, format,
    bits, group_size, method=method, ignore=ignore, overrides=overrides, **params);
    save_quantized(m, out, tokenizer=tokenizer, source=source, max_shard_size=max_shard_size)``
    writes (for signround with ``tokenizer=tokenizer`` among the options too): the same files,
    with the same tensors and bytes (see the module's description for the one header detail
    that safetensors itself varies). Memory, whatever the model's size: round to nearest about
    one tensor of the checkpoint plus its quantized form; signround one block (in the model's
    dtype, its float32 copy and the training's parameters) plus the calibration activations
    (the module's description has the sum). Interrupted, the same call resumes (signround:
    after its last finished block); under ``torchrun`` (or in an initialized process group)
    the ranks share the work (round to nearest: the tensors; signround: each block's training,
    with the bytes of one process).

    Args:
        source: a Hugging Face model folder: ``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` with its shards.
        out: the output folder: new, empty, or holding an interrupted run of this call.
        format, bits, group_size, ignore, overrides, ``**params``: as
            :func:`qformats.quantize_model`.
        method: ``"rtn"`` (round to nearest, no calibration) or ``"signround"`` (trainable
            rounding of the Linears inside the transformer blocks, int4 asymmetric and mixed2bit
            without outliers; the other planned Linears rounded to nearest). signround's
            options go in ``**params``: the fields of
            :class:`~qformats.config.SignRoundConfig` (``calibration`` needed: int64 token-id
            tensors, or a text tokenized with ``tokenizer``; ``iters``, ``nsamples``,
            ``seqlen`` (capped at the model's ``max_position_embeddings``), ``lr``,
            ``batch_size``, ``seed``, ``selection``, ``sensitivity_power``; ``amp``: bfloat16
            autocast of the blocks' products).
        dtype: ``"auto"`` (the checkpoint's dtype, as ``qformats quantize`` loads it),
            ``"float32"``, ``"float16"`` or ``"bfloat16"``: the dtype the weights are converted
            to before quantizing, and the tensors that stay in float are stored in.
        max_shard_size: None (one ``model.safetensors``) or the largest output shard (bytes,
            or a string such as ``"2GB"``), as :func:`qformats.save_quantized`.
        tokenizer: a tokenizer to save with the model (``save_pretrained``; None copies the
            tokenizer files of ``source``), and the one signround tokenizes a text
            ``calibration`` with.
        device: where signround trains the blocks: ``"cpu"`` (with torch's threads) or a
            CUDA device (``"cuda"``: under several processes each rank's ``LOCAL_RANK`` GPU,
            else the current one); one block's float32 copy, its training's parameters and the
            calibration activations live there. Round to nearest runs on the CPU.
        overwrite: allow ``out`` to hold other files, or an interrupted run with other
            settings (discarded).
        progress: a progress bar over the checkpoint's bytes, with ETA, on stderr (rank 0:
            the work of every rank); signround adds one over the blocks.
    Returns:
        the :class:`~qformats.model.QuantizationReport` (per-layer formats and sizes, the
        seconds each layer took in its process (signround: its block's time shared out among
        the block's layers), the total wall time; signround: ``report.signround`` as
        ``quantize_model``'s, the blocks' seconds those of the run that trained them) on rank 0;
        None on the other ranks.
    Raises:
        ValueError: ``source`` is not a folder, has no ``config.json`` or safetensors weights,
            or lacks tensors the model needs; ``out`` is a file, the source folder, or a folder
            with other content (without ``overwrite``); a bad format, parameter, override or
            dtype; a method other than ``"rtn"`` and ``"signround"``, or ``calibration=`` with
            ``"rtn"``; signround without ``calibration``, with a text and no ``tokenizer``,
            or with bad options; a ``device`` other than the CPU and CUDA, CUDA with
            ``"rtn"``, or CUDA where torch sees no GPU; a model whose forward before its first
            block uses weights outside the forward of the modules holding them (signround);
            a unit file or ``next-block.pt`` of the resumed run that is unreadable, or that
            the ranks read differently.
        NotImplementedError: signround with a planned layer that is neither int4 asymmetric
            nor mixed2bit without outliers (as ``quantize_model``).
        OSError: the folder cannot be written.
    """
    t0 = time.perf_counter()
    src = Path(source)
    if not src.is_dir():
        raise ValueError(f"{source}: not a folder (expected a Hugging Face model folder)")
    if not (src / "config.json").is_file():
        raise ValueError(f"{source}: no config.json; not a Hugging Face model folder")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {_DTYPES}, got {dtype!r}")
    config = None
    if method == "signround":
        config = SignRoundConfig.pop(params)  # the rest of params: the format's
        if config.calibration is None:
            raise ValueError("method='signround' needs calibration data: pass calibration= "
                             "token-id tensors, or a text with tokenizer=")
    elif method == "rtn":
        for k in RTNConfig.names():
            if k in params:
                raise ValueError(f"{k}=: with method='rtn' streaming quantizes with plain round "
                                 "to nearest only; calibrated round to nearest needs the model in "
                                 "memory (quantize_model)")
    else:
        raise ValueError(f"method={method!r}: streaming quantizes with 'rtn' or 'signround'; "
                         "other methods need the model in memory (quantize_model)")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda") or (method == "rtn" and kind != "cpu"):
        raise ValueError(f"device={str(device)!r}: expected 'cpu', or a CUDA device with "
                         "method='signround' (streamed round to nearest runs on the CPU)")
    dev = rank_device(device)  # under several processes, plain "cuda" is LOCAL_RANK's GPU
    if max_shard_size is not None:
        _shards({}, max_shard_size)  # a bad size fails here, before any work
    outp = check_output_dir(out, src)
    resolve_spec(format, bits, group_size, **params)  # the global choice, checked up front
    ck = _Checkpoint.open(src)
    model = _skeleton(src, ck, dtype)
    glob = {"format": format, "bits": bits, "group_size": group_size, "params": dict(params)}
    report = QuantizationReport(method=method)
    # layers kept in float: warned about (as quantize_model does) and in report.warnings
    report.layers, plan, report.warnings = plan_layers(model, glob, ignore, overrides or {})
    units = _units(model, plan, ck)
    trained: set = set()  # the layers signround trains (in the blocks); the others: rtn
    settings = None
    if config is not None:
        config = check_plan(plan, config.replace(tokenizer=tokenizer,
                                                 seqlen=context_length(model, config.seqlen)))
        samples = calibration_samples(config.calibration, config.tokenizer, config.nsamples,
                                      config.seqlen)
        trained = {name for names in block_plan(find_blocks(model)[1], plan) for _, (name, _, _) in names}
        # the device type too: a GPU's products round otherwise than the CPU's, so a run
        # resumed on the other one would mix blocks of two different results
        settings = dict(config.options(data=False), calibration=_digest(samples),
                        device=dev.type)
    manifest = json.loads(json.dumps({
        "source": str(src.resolve()), "inputs": ck.signature(), "dtype": dtype,
        "choice": glob, "ignore": None if ignore is None else list(ignore),
        "overrides": overrides or {}, "max_shard_size": max_shard_size, "method": method,
        "signround": settings, "units": [[u.name, u.layer] for u in units]}, default=str))

    # the ranks synchronize the file work (gloo); signround's training gathers over a group
    # on its device (_signround)
    group = Ranks(init_from_env=True)
    try:
        stage = outp / STAGE_DIR
        restart = _check_stage(outp, stage, manifest, overwrite)  # every rank raises alike
        group.barrier()
        if group.rank == 0:
            if restart:
                shutil.rmtree(stage, ignore_errors=True)
            (stage / "units").mkdir(parents=True, exist_ok=True)
            tmp = stage / (_MANIFEST + ".part")
            tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, stage / _MANIFEST)
        group.barrier()
        kill = _Kill()
        _work([u for u in units if u.name not in trained], ck, model, stage / "units", group,
              progress, kill)
        if config is not None:
            report.signround = {"blocks": _signround(model, plan, config, samples, units, ck, stage,
                                                     group, dev, kill, progress),
                                "options": config.options(data=False)}
        if group.rank != 0:
            group.barrier()
            return None
        layers = _assemble(model, units, stage, outp, src, tokenizer, max_shard_size)
        group.barrier()
    finally:
        group.close()
    names = iter(name for name, *_ in plan)
    for i, l in enumerate(report.layers):
        if l is None:
            name = next(names)
            report.layers[i] = LayerReport.of_quantized(name, model.get_submodule(name),
                                                        layers[name]["seconds"])
    report.size = model_size(model)
    report.seconds = time.perf_counter() - t0
    return report


def _digest(samples: list) -> str:
    """What identifies the calibration samples (int64 token ids) in the manifest."""
    h = hashlib.sha256()
    for t in samples:
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _check_stage(out: Path, stage: Path, manifest: dict, overwrite: bool) -> bool:
    """Whether to start over (True) or go on with ``stage`` (False); ValueError when ``out``
    holds something else and ``overwrite`` is False."""
    mfile = stage / _MANIFEST
    if mfile.is_file():
        if read_json(mfile, _MANIFEST) == manifest:
            return False
        if not overwrite:
            raise ValueError(f"{out}: holds an interrupted run with other settings or inputs "
                             f"({mfile}); run the same command to finish it, or allow "
                             "overwriting to start over")
        return True
    if out.is_dir() and not overwrite and any(e.name != STAGE_DIR for e in out.iterdir()):
        raise ValueError(f"{out}: folder exists and is not empty (use a new folder, or allow "
                         "overwriting)")
    return True


class _Kill:
    """The test aid of :data:`KILL_AFTER_ENV`: counts the unit files this process writes and
    kills it (SIGKILL) once they reach the number the variable gives."""

    def __init__(self):
        self.after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)
        self.written = 0

    def wrote(self, n: int = 1) -> None:
        self.written += n
        if self.after and self.written >= self.after:
            os.kill(os.getpid(), signal.SIGKILL)


def _work(units: list, ck: _Checkpoint, model: nn.Module, units_dir: Path, group: Ranks,
          progress: bool, kill: _Kill) -> None:
    """This rank's share of the units (largest first, round robin over the ranks), skipping
    those already written; then wait for the other ranks, rank 0 showing everyone's progress."""
    mine = sorted(units, key=lambda u: -u.nbytes)[group.rank::group.world]
    total = sum(u.nbytes for u in units)
    show = progress and group.rank == 0
    bar = progress_bar(total=total, enabled=show, desc="quantize (stream)", unit="B",
                       unit_scale=True, unit_divisor=1024)
    size = {u.file: u.nbytes for u in units}

    def refresh():  # every rank's finished units, from the shared folder
        if show:  # update(), not refresh(): tqdm's mininterval keeps a log file short
            bar.update(sum(size.get(f.name, 0) for f in units_dir.iterdir()) - bar.n)

    try:
        refresh()
        for u in mine:
            path = units_dir / u.file
            if path.is_file():
                continue
            if show:
                bar.set_postfix_str(u.name, refresh=False)
            _run_unit(u, ck, model, path)
            kill.wrote()
            refresh()
        group.barrier(wait=refresh if show else None)
        refresh()
    finally:
        bar.close()


def _assemble(model: nn.Module, units: list, stage: Path, out: Path, src: Path, tokenizer: Any,
              max_shard_size) -> dict:
    """Rank 0, every unit written: the weight files from the unit files, then the rest of the
    folder (:func:`qformats.saving.finish_save`), then the stage removed. Returns what the
    Linear units recorded, by layer name (``config``, ``derived``, ``seconds``)."""
    missing = [u.file for u in units if not (stage / "units" / u.file).is_file()]
    if missing:
        raise RuntimeError(f"{stage}: unit files {missing[:4]} missing after every rank finished")
    sources, layers = _unit_sources(stage / "units", units)
    _quantized_skeleton(model, layers)
    tensors, aliases = _dedup_state(model, meta=True)
    if set(tensors) != set(sources):
        odd = sorted(set(tensors) ^ set(sources))
        raise ValueError(f"{stage}: the unit files hold other tensors than the model stores "
                         f"(e.g. {odd[:4]}); remove the folder and run again")
    shards = _shards(tensors, max_shard_size)
    final = stage / "final"
    shutil.rmtree(final, ignore_errors=True)
    final.mkdir()
    for fname, names in shards.items():
        _write_safetensors(final / fname, {k: tensors[k] for k in names}, sources,
                           WEIGHTS_METADATA)
    total = sum(sources[k][2] for k in tensors)
    finish_save(model, out, final, shards, total, aliases, src=src, tokenizer=tokenizer)
    shutil.rmtree(stage, ignore_errors=True)
    return layers
