"""Save and load whole quantized models.

A quantized model folder (what :func:`save_quantized` writes) is a Hugging Face folder that
``transformers.AutoModel*.from_pretrained`` loads once qformats is imported (see
:mod:`qformats.hf`)::

    model.safetensors            every tensor of model.state_dict(): the packed buffers of
    (or model-0000i-of-0000n.safetensors + model.safetensors.index.json, with max_shard_size)
                                 each QuantizedLinear ("<layer>.<buffer>") and every other
                                 parameter / persistent buffer at its dtype (tied ones once)
    config.json                  the Hugging Face config (when the model has one), with
                                 quantization_config = {"quant_method": "qformats", "layers": ...}
    quantization_config.json     {"quant_method": "qformats", "qformats_version", "config_version",
                                  "weights", "model_class", "layers": {name: {format, params,
                                  in_features, out_features, bias, weight_dtype, buffers}},
                                  "aliases": {tied name: stored name}, "size": {...}}
    tokenizer files, generation_config.json   copied from the model's source folder

:func:`load_quantized` rebuilds the model without materializing full-precision weights: the
skeleton is built from ``config.json`` with every parameter on the meta device (buffers that
the checkpoint does not hold, such as rotary frequencies, are computed as usual), the listed
Linears are swapped for empty :class:`~qformats.nn.QuantizedLinear` layers, and the stored
tensors are assigned. It also reads folders written by earlier qformats versions (weights in
``qformats_model.safetensors``, named by ``quantization_config.json``), and folders written by
``model.save_pretrained`` (through ``from_pretrained``).
"""
from __future__ import annotations

import json
import os
import sys
import shutil
import stat
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from . import __version__
from ._core import float_dtype
from ._files import check_output_dir, cleanup_on_sigterm, fix_mode, read_json
from .nn import QuantizedLinear
from .plan import set_submodule
from .sizes import model_size

__all__ = ["save_quantized", "load_quantized", "read_quantization_config", "is_quantized_dir",
           "check_output_dir",
           "empty_weights", "CONFIG_NAME", "WEIGHTS_NAME", "TOKENIZER_FILES"]

CONFIG_NAME = "quantization_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_OLD_WEIGHTS_NAME = "qformats_model.safetensors"  # earlier qformats' weights file (still read)
QUANT_METHOD = "qformats"
CONFIG_VERSION = 1

#: Files copied from the source model folder when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


# -- saving ------------------------------------------------------------------------------------

def _source_dir(model: nn.Module, source) -> Optional[Path]:
    if source is not None:
        return Path(source)
    cfg = getattr(model, "config", None)
    for cand in (getattr(cfg, "_name_or_path", None), getattr(model, "name_or_path", None)):
        if cand and Path(str(cand)).is_dir():
            return Path(str(cand))
    return None


def _dedup_state(model: nn.Module, *, meta: bool = False) -> tuple[dict, dict]:
    """``(tensors, aliases)``: CPU contiguous tensors of the state dict, each tied tensor
    stored once (``aliases[name] = stored name``); other overlapping views are copied.

    With ``meta=True`` the model may be a skeleton on the meta device (what
    :mod:`qformats.streaming` plans with): its tensors are returned as they are, and tied ones
    are found by identity (the same Parameter object under two names, as transformers ties
    them), since meta tensors have no storage to compare."""
    tensors: dict = {}
    aliases: dict = {}
    seen: dict = {}
    storages: set = set()
    for name, t in model.state_dict(keep_vars=meta).items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state dict entry {name!r} is not a tensor ({type(t).__name__}); "
                             "save_quantized stores tensors only")
        if meta:
            key: tuple = (id(t),)
        elif t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (no data); load the weights first")
        else:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                   tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        if meta:
            tensors[name] = t
            continue
        sptr = t.untyped_storage().data_ptr()
        t = t.detach().to("cpu")
        if not t.is_contiguous() or (t.numel() and sptr in storages):
            t = t.contiguous().clone()
        if t.numel():
            storages.add(sptr)
        tensors[name] = t
    return tensors, aliases


def _non_persistent_dtypes(model: nn.Module) -> dict:
    """``{name: dtype}`` of the floating-point buffers the state dict leaves out (e.g. rotary
    frequencies): the model recomputes them when it is built, and the loader casts them back
    to the dtype they had (after a ``model.half()``, say), so the logits stay identical.
    Integer ones (position ids, a layer's kernel index such as mixed2bit's CUDA
    ``chunk_index``) are left out: a dtype cast never touches them, and the layer rebuilds
    its own on loading."""
    out = {}
    for mname, m in model.named_modules():
        for b in sorted(m._non_persistent_buffers_set):
            t = m._buffers.get(b)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                out[f"{mname}.{b}" if mname else b] = str(t.dtype).removeprefix("torch.")
    return out


def _copy_source_file(src: Path, fname: str, dest: Path) -> None:
    """Copy ``src/fname`` to ``dest`` when it is a regular file, or a symlink whose target is a
    regular file inside ``src``; anything else (a link leading out of the folder, a FIFO, a
    device, a folder) is skipped with a warning. The contents are read from the resolved
    target opened with O_NOFOLLOW, so a link swapped in after the check is not followed."""
    p = src / fname
    if not os.path.lexists(p):
        return
    root = src.resolve()
    target = p.resolve()
    if p.is_symlink() and not target.is_relative_to(root):
        warnings.warn(f"{p} is a symlink to {target}, outside the source folder: not copied "
                      "(save_quantized copies only files inside the model's folder)", stacklevel=3)
        return
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        warnings.warn(f"{p}: cannot read it ({e.strerror}): not copied", stacklevel=3)
        return
    with os.fdopen(fd, "rb") as fin:
        if not stat.S_ISREG(os.fstat(fin.fileno()).st_mode):
            warnings.warn(f"{p} is not a regular file: not copied", stacklevel=3)
            return
        with open(dest, "wb") as fout:
            shutil.copyfileobj(fin, fout)


def save_quantized(model: nn.Module, directory: Union[str, os.PathLike], *, tokenizer: Any = None,
                   source: Union[str, os.PathLike, None] = None,
                   max_shard_size: Union[int, str, None] = None) -> Path:
    """Write a (quantized) model to a folder that :func:`load_quantized` reads back and, for a
    Hugging Face model, ``transformers.AutoModel*.from_pretrained`` too (with qformats
    imported; ``config.json`` carries the :class:`~qformats.hf.QFormatsConfig`).

    Every file is first written to a temporary folder inside ``directory`` and then renamed
    into place, ``config.json`` and then ``quantization_config.json`` last (older ones, and
    older weight files, are removed first): an interrupted save leaves either the previous
    model's files or a folder without those two, which :func:`load_quantized` and
    ``from_pretrained`` refuse with a clear error; never a mix that loads. An exception, Ctrl-C
    or SIGTERM (in the main thread, while SIGTERM has its default action) also removes the
    temporaries; SIGKILL cannot be caught and leaves a hidden ``.qformats-save-*`` folder,
    which loading ignores.

    Files copied from ``source``: only regular files, and symlinks whose target is a regular
    file inside ``source`` (copied as a regular file). A symlink that leads out of the source
    folder (to any file on the machine) is never followed: it is skipped with a
    :class:`UserWarning`, so nothing outside the model's folder ends up in the output.

    Args:
        model: a module, typically after :func:`qformats.quantize_model`; its QuantizedLinear
            layers are stored packed, every other tensor as it is (dtype and values).
        directory: the output folder (created; files of the same names are replaced); not
            ``""``. It may be the folder the model was loaded from (nothing is then copied).
        tokenizer: a Hugging Face tokenizer to save with it (``save_pretrained``); else the
            tokenizer files (and ``generation_config.json``) of ``source`` are copied.
        source: the model's original folder; default: ``model.config._name_or_path`` when it
            is a folder (transformers sets it in ``from_pretrained``).
        max_shard_size: None (one ``model.safetensors``), or the largest shard in bytes (an
            int, or a string such as ``"5GB"``): ``model-0000i-of-0000n.safetensors`` plus
            ``model.safetensors.index.json``, as ``save_pretrained`` writes them
            (``huggingface_hub.split_torch_state_dict_into_shards``).
    Returns:
        the folder's Path.
    Raises:
        ValueError: tensors on the meta device or non-tensor state; ``directory`` empty or
            an existing file; a bad ``max_shard_size``.
        TypeError: model is not an nn.Module.
        OSError: the folder cannot be written.
    """
    from safetensors.torch import save_file

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    src = _source_dir(model, source)
    out = check_output_dir(directory)
    if src is not None and src.resolve() == out.resolve():
        src = None  # re-saving a loaded model into its folder: nothing to copy onto itself
    tensors, aliases = _dedup_state(model)
    shards = _shards(tensors, max_shard_size)
    out.mkdir(parents=True, exist_ok=True)
    with cleanup_on_sigterm():
        stage = Path(tempfile.mkdtemp(prefix=".qformats-save-", dir=out))
        try:
            for fname, names in shards.items():
                save_file({k: tensors[k] for k in names}, str(stage / fname), metadata=WEIGHTS_METADATA)
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            finish_save(model, out, stage, shards, total, aliases, src=src, tokenizer=tokenizer)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return out


#: The safetensors metadata of every weights file save_quantized writes.
WEIGHTS_METADATA = {"format": "pt", "qformats": str(CONFIG_VERSION)}


def finish_save(model: nn.Module, out: Path, stage: Path, shards: dict, total_size: int,
                aliases: dict, *, src: Optional[Path], tokenizer: Any) -> None:
    """Complete a save whose weight files are already in ``stage`` (a folder inside ``out``):
    write the shard index, ``config.json``, the tokenizer files and ``quantization_config.json``
    there, then move everything into ``out``, the configs last (see :func:`save_quantized`).

    ``model`` supplies the layer configs, sizes, computed-buffer dtypes and Hugging Face config;
    it may be a skeleton on the meta device (:mod:`qformats.streaming`). ``shards`` is
    ``{file name: [tensor names]}`` (:func:`_shards`), ``total_size`` their bytes together."""
    layers = {name: m.config() for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    _attach_hf(model)  # config.json gets the quantization_config
    cls = type(model)
    cfg = {
        "quant_method": QUANT_METHOD,
        "qformats_version": __version__,
        "config_version": CONFIG_VERSION,
        "weights": WEIGHTS_NAME if len(shards) == 1 else INDEX_NAME,
        "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "layers": layers,
        "aliases": aliases,
        "computed_buffers": _non_persistent_dtypes(model),
        "size": {k: (None if isinstance(v, float) and v != v else v)
                 for k, v in model_size(model).items()},
    }
    last = ("config.json", CONFIG_NAME)  # moved into place in this order, after everything else
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size},
                 "weight_map": {k: f for f, names in shards.items() for k in names}}
        (stage / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    hf_config = getattr(model, "config", None)
    if hf_config is not None and callable(getattr(hf_config, "to_json_file", None)):
        # what from_pretrained builds, and in which dtype (as save_pretrained records them)
        if hasattr(hf_config, "architectures"):
            hf_config.architectures = [cls.__name__]
        if isinstance(getattr(model, "dtype", None), torch.dtype) and hasattr(hf_config, "dtype"):
            hf_config.dtype = str(model.dtype).removeprefix("torch.")
        hf_config.to_json_file(str(stage / "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(stage))
    if src is not None:
        copy = TOKENIZER_FILES if tokenizer is None else ("generation_config.json",)
        for fname in copy:
            if not (stage / fname).exists():
                _copy_source_file(src, fname, stage / fname)
    with open(stage / CONFIG_NAME, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=False)
        f.write("\n")
    # into place: the old configs and weights go first and the new configs come last,
    # so that a folder interrupted in between has neither config (both loaders refuse it)
    for name in last:
        (out / name).unlink(missing_ok=True)
    for old in _weight_files(out):
        old.unlink()
    for entry in sorted(stage.iterdir(), key=lambda e: last.index(e.name) if e.name in last else -1):
        dest = out / entry.name
        if entry.is_file():
            fix_mode(entry)
        if entry.is_dir() and dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(entry, dest)


def _weight_files(directory: Path) -> list:
    """The weight files a save replaces: ``model*.safetensors``, the shard index and the weights
    file of earlier qformats versions."""
    return [p for p in directory.iterdir() if p.is_file() and (
        (p.name.startswith("model") and p.name.endswith(".safetensors")) or p.name == INDEX_NAME
        or p.name == _OLD_WEIGHTS_NAME)]


def _shards(tensors: dict, max_shard_size) -> dict:
    """``{file name: [tensor names]}``: one ``model.safetensors``, or shards of at most
    ``max_shard_size`` bytes named as transformers names them.

    The tensors are passed to huggingface_hub as meta tensors: they are stored once each
    already (ties are aliases), and on the CPU every empty tensor has the same null storage,
    which huggingface_hub would take for one shared storage and move next to the first empty
    one. So the plan depends only on the names, order, shapes and dtypes (what a streaming
    writer knows before it has the data)."""
    if max_shard_size is None:
        return {WEIGHTS_NAME: list(tensors)}
    from huggingface_hub import split_torch_state_dict_into_shards

    tensors = {k: t.to("meta") for k, t in tensors.items()}
    try:
        split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    except (ValueError, TypeError) as e:
        raise ValueError(f"max_shard_size={max_shard_size!r}: {e}") from e
    return {f: list(names) for f, names in split.filename_to_tensors.items()}


def _attach_hf(model: nn.Module) -> None:
    """:func:`qformats.hf.attach` for a transformers model (whose class means transformers is
    imported); other modules are left alone without importing transformers."""
    if "transformers" in sys.modules:
        from .hf import attach  # needs transformers (optional), imported by then

        attach(model)


# -- loading -----------------------------------------------------------------------------------

def is_quantized_dir(directory: Union[str, os.PathLike]) -> bool:
    """True when ``directory`` holds a ``quantization_config.json`` written by qformats."""
    try:
        return read_quantization_config(directory)["quant_method"] == QUANT_METHOD
    except (ValueError, OSError):
        return False


def read_quantization_config(directory: Union[str, os.PathLike]) -> dict:
    """The parsed ``quantization_config.json`` of a folder written by :func:`save_quantized`.

    Raises:
        ValueError: the file is missing, not JSON, written by another tool (its
            ``quant_method`` is not ``"qformats"``), of a newer config version, or malformed.
    """
    p = Path(directory)
    if not p.is_dir():
        raise ValueError(f"{directory}: not a folder")
    f = p / CONFIG_NAME
    if not f.is_file():
        raise ValueError(f"{directory}: no {CONFIG_NAME}; not a qformats quantized model folder")
    cfg = read_json(f, CONFIG_NAME)  # a regular file, <= 64 MiB, <= 64 levels deep
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(cfg).__name__}")
    method = cfg.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"{f}: not written by qformats (quant_method={method!r}; expected "
                         f"{QUANT_METHOD!r}); a model of another quantization tool?")
    ver = cfg.get("config_version")
    if not isinstance(ver, int) or ver > CONFIG_VERSION:
        raise ValueError(f"{f}: config_version {ver!r} is not one this qformats reads "
                         f"(<= {CONFIG_VERSION}); upgrade qformats")
    if not isinstance(cfg.get("layers"), dict):
        raise ValueError(f"{f}: 'layers' must be an object {{name: layer config}}")
    if not isinstance(cfg.get("aliases", {}), dict):
        raise ValueError(f"{f}: 'aliases' must be an object")
    for name, layer in cfg["layers"].items():
        _check_layer_config(f, name, layer)
    for k, v in cfg.get("aliases", {}).items():
        if not isinstance(v, str):
            raise ValueError(f"{f}: alias {k!r} must name a stored tensor, got {v!r}")
    computed = cfg.get("computed_buffers", {})
    if not isinstance(computed, dict) or not all(
            isinstance(v, str) and v in _COMPUTED_DTYPES for v in computed.values()):
        raise ValueError(f"{f}: 'computed_buffers' must be an object {{buffer name: dtype}} with "
                         f"dtypes among {sorted(_COMPUTED_DTYPES)}, got {computed!r}"[:300])
    w = cfg.get("weights", WEIGHTS_NAME)
    if not isinstance(w, str) or not w or Path(w).name != w:
        raise ValueError(f"{f}: 'weights' must be a file name in the folder, got {w!r}")
    return cfg


_COMPUTED_DTYPES = {"float32", "float16", "bfloat16", "float64"}
_LAYER_KEYS = {"format": str, "params": dict, "in_features": int, "out_features": int,
               "bias": bool, "buffers": dict}


def _check_layer_config(f: Path, name: Any, layer: Any) -> None:
    """ValueError naming the file and the layer unless ``layer`` has every key that
    :meth:`QuantizedLinear.config` writes, each of the type it writes (sizes positive ints)."""
    if not isinstance(layer, dict):
        raise ValueError(f"{f}: layer {name!r}: expected an object, got {type(layer).__name__}")
    for k, typ in _LAYER_KEYS.items():
        if k not in layer:
            raise ValueError(f"{f}: layer {name!r}: missing key {k!r}")
        v = layer[k]
        if not isinstance(v, typ) or (typ is int and (isinstance(v, bool) or v < 1)):
            raise ValueError(f"{f}: layer {name!r}: {k!r} must be "
                             f"{'a positive int' if typ is int else 'a ' + typ.__name__}, got {v!r}"[:300])
    for b, rec in layer["buffers"].items():
        if not (isinstance(rec, list) and len(rec) == 2 and isinstance(rec[0], str)
                and isinstance(rec[1], list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in rec[1])):
            raise ValueError(f"{f}: layer {name!r}: buffer {b!r} must be [dtype, [sizes]], "
                             f"got {rec!r}"[:300])


@contextmanager
def empty_weights():
    """Context manager: every ``nn.Parameter`` registered inside it is moved to the meta
    device at registration (its initialization then costs nothing), while buffers are built
    normally (non-persistent ones, e.g. rotary frequencies, keep their computed values).
    The same idea as accelerate's ``init_empty_weights(include_buffers=False)``."""
    old = nn.Module.register_parameter

    def register(module, name, param):
        old(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            kwargs = dict(p.__dict__)
            kwargs["requires_grad"] = p.requires_grad
            module._parameters[name] = type(p)(p.to("meta"), **kwargs)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = old


def _hf_class(directory: Path, cfg: dict):
    """``(model class, config)`` of the Hugging Face model of ``config.json``."""
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory}: no config.json to rebuild the model from; pass "
                         "model= (a module or a function that builds one)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
        from transformers import AutoConfig
    except ImportError as e:
        raise ValueError(f"{directory}: rebuilding a Hugging Face model needs transformers "
                         "(`pip install 'qformats[demo]'`), or pass model=") from e
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{directory}/config.json: cannot read it: {str(e).splitlines()[0]}") from e
    names = [str(cfg.get("model_class", "")).rsplit(".", 1)[-1]]
    names += list(getattr(config, "architectures", None) or [])
    cls = None
    for n in names:
        c = getattr(transformers, n, None) if n else None
        if isinstance(c, type) and issubclass(c, nn.Module):
            cls = c
            break
    if cls is None:
        raise ValueError(f"{directory}: cannot find the model class ({names}) in transformers "
                         f"{transformers.__version__}; pass model=")
    return cls, config


def _hf_skeleton(directory: Path, cfg: dict) -> nn.Module:
    """The Hugging Face model of ``config.json``, parameters on the meta device."""
    import transformers

    cls, config = _hf_class(directory, cfg)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with empty_weights():
            model = cls(config)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model


def load_quantized(directory: Union[str, os.PathLike], device: Any = "cpu", dtype: Any = None,
                   model: Union[nn.Module, Callable[[], nn.Module], None] = None) -> nn.Module:
    """Rebuild a model written by :func:`save_quantized`, without its full-precision weights.

    Args:
        directory: the folder.
        device: where the model goes (``"cpu"``, ``"cuda:0"``, a torch.device).
        dtype: None keeps every tensor's stored dtype (the same logits as before saving, bit
            for bit); a float dtype (``torch.float32`` / ``"float32"`` ...) converts the float
            parameters and buffers that are not packed weights (embeddings, norms, biases);
            QuantizedLinear layers compute in their input's dtype.
        model: the skeleton instead of ``config.json``: a module (its Linear layers at the
            saved names are replaced; parameters may be on the meta device) or a function
            returning one (called under :func:`empty_weights`). Needed for models that are not
            Hugging Face models.
    Returns:
        the model in eval mode on ``device``.
    Raises:
        ValueError: no / malformed / foreign ``quantization_config.json``, an unknown format
            or bad params in it, a layer name that is not a Linear of the model, a missing,
            unexpected or wrongly shaped (or typed) tensor, a truncated or unreadable
            safetensors file, a missing ``config.json`` (without ``model=``), tensors that
            the file does not provide left on the meta device.
    """
    directory = Path(directory)
    if model is None and not (directory / CONFIG_NAME).is_file() and _hf_quantized(directory):
        return _from_pretrained(directory, device, dtype)
    cfg = read_quantization_config(directory)
    wfile = directory / cfg.get("weights", WEIGHTS_NAME)
    if not wfile.is_file():
        raise ValueError(f"{directory}: the weights file {wfile.name} is missing")
    if dtype is not None:
        try:
            dtype = getattr(torch, float_dtype(dtype))
        except TypeError as e:
            raise ValueError(str(e)) from e

    # 1. the skeleton
    if model is None:
        model = _hf_skeleton(directory, cfg)
    elif not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(f"model: expected an nn.Module or a function, got {type(model).__name__}")
        with empty_weights():
            model = model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model(): expected an nn.Module, got {type(model).__name__}")

    # 2. the QuantizedLinear layers, empty, on the meta device
    for name, lcfg in cfg["layers"].items():
        try:
            old = model.get_submodule(name) if name else None
        except AttributeError:
            old = None
        if not isinstance(old, (nn.Linear, QuantizedLinear)):
            raise ValueError(f"{CONFIG_NAME}: layer {name!r} is not a Linear of the "
                             f"{type(model).__name__} model")
        try:
            new = QuantizedLinear.from_config(lcfg, device="meta")
        except ValueError as e:
            raise ValueError(f"{CONFIG_NAME}: layer {name!r}: {e}") from e
        if (old.in_features, old.out_features) != (new.in_features, new.out_features):
            raise ValueError(f"{CONFIG_NAME}: layer {name!r} is [{new.out_features}, "
                             f"{new.in_features}] but the model's is [{old.out_features}, "
                             f"{old.in_features}]")
        set_submodule(model, name, new)

    # 3. the tensors
    aliases = cfg.get("aliases", {})
    expected = model.state_dict(keep_vars=True)
    state = _read_weights(wfile)
    for alias, target in aliases.items():
        if target not in state:
            raise ValueError(f"{CONFIG_NAME}: alias {alias!r} -> {target!r}, which the weights "
                             "file does not hold")
        state[alias] = state[target]
    _assign_state(model, state, expected, wfile.name, directory)
    _restore_computed(model, cfg.get("computed_buffers", {}), state)
    if dtype is not None:
        model.to(dtype)  # QuantizedLinear keeps its packed buffers' dtypes
    model.to(device)
    _attach_hf(model)  # so that model.save_pretrained keeps the quantized layers
    return model.eval()


def _hf_quantized(directory: Path) -> bool:
    """Whether ``config.json`` names a qformats quantization_config (a ``save_pretrained``
    folder of a qformats model)."""
    try:
        qc = read_json(directory / "config.json", "config.json").get("quantization_config")
    except (ValueError, OSError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def _from_pretrained(directory: Path, device: Any, dtype: Any) -> nn.Module:
    """A ``save_pretrained`` folder of a qformats model, through transformers (which reaches
    :mod:`qformats.hf`): the class of ``config.json``'s ``architectures``."""
    cls, _ = _hf_class(directory, {})
    kwargs = {"dtype": getattr(torch, float_dtype(dtype))} if dtype is not None else {}
    return cls.from_pretrained(str(directory), local_files_only=True, device_map=device,
                                 **kwargs).eval()


def _read_weights(wfile: Path) -> dict:
    """Every tensor of a safetensors file, or of the shards a ``model.safetensors.index.json``
    names (each shard a file in the same folder, each tensor in the shard the index says)."""
    from safetensors import safe_open

    files = {wfile: None}
    if wfile.name == INDEX_NAME:
        index = read_json(wfile, INDEX_NAME)
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(
                isinstance(v, str) and v and Path(v).name == v for v in wmap.values()):
            raise ValueError(f"{wfile}: expected {{'weight_map': {{tensor: shard file name}}}}")
        files = {}
        for k, v in wmap.items():
            files.setdefault(wfile.parent / v, set()).add(k)
    state: dict = {}
    for path, names in files.items():
        if not path.is_file():
            raise ValueError(f"{wfile.parent}: the weights file {path.name} is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                part = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types for truncated files
            if isinstance(e, (MemoryError, KeyboardInterrupt)):
                raise
            raise ValueError(f"{path}: cannot read it as safetensors (truncated or corrupt?): "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        if names is not None and set(part) != names:
            raise ValueError(f"{path.name} holds other tensors than {INDEX_NAME} lists "
                             f"(e.g. {_few(sorted(set(part) ^ names))})")
        state.update(part)
    return state


def _restore_computed(model: nn.Module, computed: dict, state: dict) -> None:
    """Cast the buffers the model computed itself (rotary frequencies...) to the dtypes they
    had when saved. The record is checked against the model first: its names must be exactly
    the model's non-persistent floating buffers, and each dtype either the one the model
    computes it in or one of the stored floating tensors' dtypes (what ``model.half()`` /
    ``.to(dtype)`` would have given it). ValueError otherwise: a tampered or foreign entry
    would silently change every output."""
    mine = _non_persistent_dtypes(model)
    if set(computed) != set(mine):
        extra, missing = sorted(set(computed) - set(mine)), sorted(set(mine) - set(computed))
        raise ValueError(f"{CONFIG_NAME}: 'computed_buffers' does not match the model's computed "
                         f"buffers (not in the model: {_few(extra) or 'none'}; not recorded: "
                         f"{_few(missing) or 'none'})")
    stored = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    for name, dt in computed.items():
        if dt != mine[name] and dt not in stored:
            raise ValueError(f"{CONFIG_NAME}: computed buffer {name!r} is recorded as {dt}, but the "
                             f"model computes it in {mine[name]} and stores no {dt} tensor; "
                             "tampered or written for another model")
    for name, dt in computed.items():
        owner, _, b = name.rpartition(".")
        m = model.get_submodule(owner) if owner else model
        t = m._buffers[b]
        if t.dtype != getattr(torch, dt):
            m._buffers[b] = t.to(getattr(torch, dt))


def _assign_state(model: nn.Module, state: dict, expected: dict, where: str, directory: Any) -> None:
    """Load ``state`` into a model built on the meta device (``load_state_dict(assign=True)``),
    after checking it against ``expected`` (the model's ``state_dict(keep_vars=True)``): every
    expected tensor present, none extra, the same shapes; then that no parameter or buffer is
    left on the meta device. ValueError naming the tensors (prefixed with ``where``, the file,
    or ``directory`` for what is left)."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing:
        raise ValueError(f"{where}: missing tensor(s) {_few(missing)} that the model needs")
    if unexpected:
        raise ValueError(f"{where}: tensor(s) {_few(unexpected)} that the {type(model).__name__} model "
                         "does not have (written for another model or configuration?)")
    for k, t in state.items():
        e = expected[k]
        if tuple(t.shape) != tuple(e.shape):
            raise ValueError(f"{where}: tensor {k!r} has shape {list(t.shape)}, the model "
                             f"expects {list(e.shape)}")
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{where}: {str(e).strip().splitlines()[-1].strip()}") from e
    # nothing may be left without data
    left = [n for n, t in list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False)) if t.device.type == "meta"]
    if left:
        raise ValueError(f"{directory}: the model has tensors the checkpoint does not provide "
                         f"(still on the meta device): {_few(left)}")


def _few(names: list, n: int = 4) -> str:
    s = ", ".join(repr(x) for x in names[:n])
    return s + (f" and {len(names) - n} more" if len(names) > n else "")
