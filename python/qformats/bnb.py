"""bitsandbytes 4-bit (NF4) checkpoints as transformers saves them, read and written without
re-quantizing and without bitsandbytes.

Written against bitsandbytes 0.50.2 (``bitsandbytes/functional.py``: ``QuantState.as_dict(packed=
True)`` / ``QuantState.from_dict``; ``bitsandbytes/nn/modules.py``: ``Params4bit.from_prequantized``,
``Linear4bit._save_to_state_dict``; ``bitsandbytes/utils.py``: ``pack_dict_to_tensor``) and
transformers 5.23 (``quantizers/quantizer_bnb_4bit.py``, ``integrations/bitsandbytes.py``,
``BitsAndBytesConfig.to_dict()``).

The folder (``model.save_pretrained(dir)`` of a model loaded with ``BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4", ...)``)::

    config.json                   the model config plus "quantization_config":
                                  {"quant_method": "bitsandbytes", "load_in_4bit": true,
                                   "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": ...,
                                   "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": ...}
    model.safetensors             or model-0000k-of-0000n.safetensors + model.safetensors.index.json
      <layer>.weight                      packed codes, uint8 [ceil(n/2), 1] (n = out * in)
      <layer>.weight.absmax               float32 [n_blocks]; double quant: uint8 [n_blocks]
      <layer>.weight.quant_map            float32 [16], the NF4 levels
      <layer>.weight.nested_absmax        double quant only: float32 [ceil(n_blocks / 256)]
      <layer>.weight.nested_quant_map     double quant only: float32 [256], the dynamic map
      <layer>.weight.quant_state.bitsandbytes__nf4   uint8 [len]: UTF-8 JSON {"quant_type",
                                  "blocksize", "dtype", "shape", and with double quant
                                  "nested_blocksize": 256, "nested_dtype", "nested_offset"}
      <layer>.bias, every other parameter / persistent buffer   as stored

qformats' ``nf4`` format holds the same information: ``packed`` = the weight bytes (the first
value of the row-major flattened [out, in] weight in the high nibble, as bitsandbytes),
``absmax`` = absmax, and with ``compress_statistics=True`` (bitsandbytes' double quantization)
``absmax`` (uint8 codes), ``absmax2`` = nested_absmax and ``offset`` = float32(nested_offset).
So every conversion here is a byte copy; nothing is quantized again.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Union

__all__ = ["from_bnb_state", "to_bnb_state", "bnb_weight_dtype", "load_bnb", "save_bnb", "is_bnb_dir",
           "bnb_quantization_config", "BNB_BLOCKSIZES", "QUANT_STATE_PREFIX"]

#: The ``blocksize`` values bitsandbytes 0.50 accepts (``bitsandbytes/_ops.py``); the same set
#: as qformats' nf4.
BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: Key (under ``<layer>.weight.``) of the JSON blob; the quant type follows it.
QUANT_STATE_PREFIX = "quant_state.bitsandbytes__"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_NESTED_BLOCK = 256
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# the storage dtypes bitsandbytes' quant_storage may be: the packed bytes viewed as that type
_STORAGE = ("uint8", "int8", "float16", "bfloat16", "float32", "int16", "int32", "float64", "int64")
_WEIGHT_KEYS = ("weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax",
                "weight.nested_quant_map")


# -- tensor level ------------------------------------------------------------------------------

def _quant_state_json(tensors: dict) -> tuple[str, dict]:
    """(key, parsed JSON) of the single ``weight.quant_state.bitsandbytes__*`` entry."""
    keys = [k for k in tensors if k.startswith("weight." + QUANT_STATE_PREFIX)]
    if len(keys) != 1:
        raise ValueError(f"expected exactly one 'weight.{QUANT_STATE_PREFIX}<type>' tensor, got "
                         f"{sorted(keys) or 'none'}")
    key = keys[0]
    qtype = key[len("weight." + QUANT_STATE_PREFIX):]
    if qtype != "nf4":
        raise ValueError(f"{key}: bitsandbytes quant type {qtype!r} is not supported: qformats has "
                         "the nf4 format only (no fp4); quantize with bnb_4bit_quant_type='nf4'")
    blob = tensors[key]
    import torch

    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.ndim != 1:
        raise ValueError(f"{key}: expected a 1-D uint8 tensor (UTF-8 JSON), got "
                         f"{getattr(blob, 'dtype', type(blob).__name__)} {list(getattr(blob, 'shape', []))}")
    from ._files import loads_json

    try:
        d = loads_json(bytes(blob.cpu().numpy()), key)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{key}: not UTF-8 JSON: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{key}: expected a JSON object, got {type(d).__name__}")
    return key, d


def _check_tensor(t: Any, name: str, dtype: Any, shape: tuple) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected {str(dtype).removeprefix('torch.')} {list(shape)}, "
                         f"got {str(t.dtype).removeprefix('torch.')} {list(t.shape)}")


def _same_map(t: Any, want: Any, name: str) -> None:
    import numpy as np

    got = t.detach().cpu().contiguous().numpy()
    if got.tobytes() != np.ascontiguousarray(want, dtype=np.float32).tobytes():
        raise ValueError(f"{name}: differs from bitsandbytes' standard map; qformats' nf4 decodes "
                         "with the standard map only (a custom quant_map cannot be represented)")


def bnb_weight_dtype(tensors: dict) -> str:
    """The dtype the weight was quantized from (``"float32"``, ``"float16"`` or
    ``"bfloat16"``), read from the ``weight.quant_state.bitsandbytes__nf4`` JSON of a layer's
    tensors (keys as :func:`from_bnb_state` takes them). Raises ValueError as it does."""
    key, d = _quant_state_json(tensors)
    dt = d.get("dtype")
    if dt not in _FLOAT_DTYPES:
        raise ValueError(f"{key}: 'dtype' must be one of {_FLOAT_DTYPES}, got {dt!r}")
    return dt


def from_bnb_state(tensors: dict, shape) -> tuple[dict, dict]:
    """qformats nf4 buffers and params from one bitsandbytes 4-bit layer's serialized tensors.

    Args:
        tensors: the layer's entries of a transformers bitsandbytes checkpoint with the
            ``<layer>.`` prefix removed: ``"weight"`` (the packed codes, uint8 ``[ceil(n/2), 1]``,
            or the same bytes viewed as the ``bnb_4bit_quant_storage`` dtype), ``"weight.absmax"``,
            ``"weight.quant_map"``, ``"weight.quant_state.bitsandbytes__nf4"`` and with double
            quantization ``"weight.nested_absmax"``, ``"weight.nested_quant_map"`` (torch tensors,
            any device; see the module docstring for dtypes and shapes). A ``"bias"`` entry is
            ignored.
        shape: the weight's logical shape ``(out_features, in_features)``; must equal the
            JSON's ``shape``.
    Returns:
        ``(buffers, params)``: params ``{"blocksize", "quant_type": "nf4",
        "compress_statistics": <double quant>}`` and buffers as
        :func:`qformats.nf4.expected_buffers`: ``packed`` uint8 ``[ceil(n/2)]`` (the weight's
        bytes), ``absmax`` (float32, or uint8 codes with double quant), and with double quant
        ``absmax2`` float32 ``[ceil(n_blocks/256)]`` (nested_absmax) and ``offset`` float32
        ``[1]`` (``nested_offset``, rounded to float32 as ``QuantState.from_dict`` does; it was
        written from a float32, so exactly). Buffers are views of / copies from the inputs on
        their device. The original dtype is :func:`bnb_weight_dtype`.

    Byte-identical: the packed codes, absmax (float32, or the uint8 codes and the float32
    nested_absmax with double quantization) and the offset. So :func:`qformats.nf4.dequantize`
    of the result equals bitsandbytes 0.50 ``dequantize_4bit`` (float32 ``CODE[code] *
    absmax``, with double quant absmax ``= fl32(fl32(DYNAMIC_MAP[q] * nested_absmax) +
    offset)``) bit for bit on the CPU (``tests/nf4/test_nf4_bitsandbytes.py``,
    ``tests/model/test_bnb_interop.py``).

    Raises:
        ValueError: an fp4 (or other non-nf4) quant type, no or several quant_state entries,
            malformed JSON, a shape that differs from ``shape``, a blocksize bitsandbytes does
            not accept, a nested blocksize other than 256, a quant_map / nested_quant_map other
            than the standard NF4 / dynamic maps, a missing, extra or wrongly typed/shaped
            tensor, a storage dtype whose byte count does not match.
    """
    import numpy as np
    import torch

    from . import nf4

    key, d = _quant_state_json(tensors)
    shape = tuple(int(s) for s in shape)
    if d.get("quant_type") != "nf4":
        raise ValueError(f"{key}: quant_type {d.get('quant_type')!r} is not 'nf4'")
    if list(d.get("shape") or []) != list(shape):
        raise ValueError(f"{key}: the checkpoint's weight shape {d.get('shape')} differs from the "
                         f"layer's {list(shape)}")
    bs = d.get("blocksize")
    if isinstance(bs, bool) or not isinstance(bs, int) or bs not in BNB_BLOCKSIZES:
        raise ValueError(f"{key}: blocksize must be one of {BNB_BLOCKSIZES}, got {bs!r}")
    bnb_weight_dtype(tensors)
    nested = "nested_offset" in d or "nested_blocksize" in d
    allowed = {key, *_WEIGHT_KEYS, "bias"}
    if not nested:
        allowed -= {"weight.nested_absmax", "weight.nested_quant_map"}
    extra = sorted(set(tensors) - allowed)
    missing = sorted(k for k in allowed - {"bias"} if k not in tensors)
    if extra or missing:
        raise ValueError(f"bitsandbytes layer tensors: missing {missing or 'none'}, unexpected "
                         f"{extra or 'none'} (double quant: {nested})")
    n = math.prod(shape)
    nb = -(-n // bs)
    w = tensors["weight"]
    if not isinstance(w, torch.Tensor) or str(w.dtype).removeprefix("torch.") not in _STORAGE:
        raise ValueError(f"weight: expected a tensor of a storage dtype {_STORAGE}, got "
                         f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.ndim != 2 or w.shape[1] != 1 or w.numel() * w.element_size() != (n + 1) // 2:
        raise ValueError(f"weight: expected [{(n + 1) // 2 // w.element_size()}, 1] of "
                         f"{str(w.dtype).removeprefix('torch.')} ({(n + 1) // 2} bytes of packed codes for "
                         f"{list(shape)}), got {list(w.shape)}")
    packed = w.contiguous().reshape(-1).view(torch.uint8)
    _check_tensor(tensors["weight.quant_map"], "weight.quant_map", torch.float32, (16,))
    _same_map(tensors["weight.quant_map"], nf4.CODE, "weight.quant_map")
    params = {"blocksize": bs, "quant_type": "nf4", "compress_statistics": nested}
    if not nested:
        _check_tensor(tensors["weight.absmax"], "weight.absmax", torch.float32, (nb,))
        return {"packed": packed, "absmax": tensors["weight.absmax"].contiguous()}, params
    if d.get("nested_blocksize") != _NESTED_BLOCK:
        raise ValueError(f"{key}: nested_blocksize must be {_NESTED_BLOCK} (what bitsandbytes "
                         f"writes and its 4-bit matmul needs), got {d.get('nested_blocksize')!r}")
    if d.get("nested_dtype") != "float32":
        raise ValueError(f"{key}: nested_dtype must be 'float32', got {d.get('nested_dtype')!r}")
    off = d.get("nested_offset")
    if isinstance(off, bool) or not isinstance(off, (int, float)) or not math.isfinite(off):
        raise ValueError(f"{key}: nested_offset must be a finite number, got {off!r}")
    _check_tensor(tensors["weight.absmax"], "weight.absmax", torch.uint8, (nb,))
    _check_tensor(tensors["weight.nested_absmax"], "weight.nested_absmax", torch.float32,
                  (-(-nb // _NESTED_BLOCK),))
    _check_tensor(tensors["weight.nested_quant_map"], "weight.nested_quant_map", torch.float32, (256,))
    _same_map(tensors["weight.nested_quant_map"], nf4.DYNAMIC_MAP, "weight.nested_quant_map")
    offset = torch.from_numpy(np.array([off], dtype=np.float32)).to(packed.device)
    return {"packed": packed, "absmax": tensors["weight.absmax"].contiguous(),
            "absmax2": tensors["weight.nested_absmax"].contiguous(), "offset": offset}, params


def to_bnb_state(qlinear: Any, quant_storage: str = "uint8") -> dict:
    """The bitsandbytes 4-bit serialized tensors of a qformats nf4 layer, exactly as
    bitsandbytes 0.50 ``Linear4bit._save_to_state_dict`` writes them (``QuantState.as_dict(
    packed=True)``), keys relative to the layer: ``"weight"`` uint8 ``[ceil(n/2), 1]`` (the
    ``packed`` bytes), ``"weight.absmax"``, ``"weight.quant_map"`` float32 [16] (NF4 levels),
    ``"weight.quant_state.bitsandbytes__nf4"`` (uint8 UTF-8 JSON, the same keys, order and
    ``json.dumps`` spacing as bitsandbytes: ``{"quant_type", "blocksize", "dtype", "shape"}``
    plus, with ``compress_statistics``, ``"nested_blocksize": 256, "nested_dtype": "float32",
    "nested_offset"``) and with compress_statistics ``"weight.nested_absmax"`` (``absmax2``),
    ``"weight.nested_quant_map"`` float32 [256]. The bias is not included. Every tensor is a
    new contiguous CPU tensor (none shares memory, as safetensors requires).

    Args:
        qlinear: a :class:`qformats.nn.QuantizedLinear` of format ``"nf4"``.
        quant_storage: the dtype the packed bytes are viewed as (bitsandbytes'
            ``bnb_4bit_quant_storage``); default ``"uint8"``; another storage dtype needs the
            byte count to be a multiple of its size.
    Raises:
        ValueError: not an nf4 QuantizedLinear, a blocksize bitsandbytes does not accept, an
            unknown storage dtype or one that does not divide the byte count.
    """
    import numpy as np
    import torch

    from . import nf4
    from .nn import QuantizedLinear

    if not isinstance(qlinear, QuantizedLinear) or qlinear.format != "nf4":
        raise ValueError(f"expected an nf4 QuantizedLinear, got "
                         f"{getattr(qlinear, 'format', type(qlinear).__name__)!r}")
    if quant_storage not in _STORAGE:
        raise ValueError(f"quant_storage must be one of {_STORAGE}, got {quant_storage!r}")
    bs = qlinear.params.get("blocksize", 64)
    cs = qlinear.params.get("compress_statistics", False)
    if bs not in BNB_BLOCKSIZES:
        raise ValueError(f"blocksize {bs} is not one bitsandbytes accepts {BNB_BLOCKSIZES}")
    q = qlinear.quantized_weight
    buf = {k: v.detach().to("cpu").contiguous().clone() for k, v in q.buffers.items()}
    packed = buf["packed"]
    st = getattr(torch, quant_storage)
    size = torch.empty((), dtype=st).element_size()
    if packed.numel() % size:
        raise ValueError(f"{packed.numel()} bytes of packed codes are not a whole number of "
                         f"{quant_storage} values")
    qs = {"quant_type": "nf4", "blocksize": int(bs), "dtype": qlinear.weight_dtype,
          "shape": [qlinear.out_features, qlinear.in_features]}
    out = {"weight": packed.view(st).reshape(-1, 1), "weight.absmax": buf["absmax"],
           "weight.quant_map": torch.from_numpy(np.array(nf4.CODE, dtype=np.float32))}
    if cs:
        out["weight.nested_absmax"] = buf["absmax2"]
        out["weight.nested_quant_map"] = torch.from_numpy(np.array(nf4.DYNAMIC_MAP, dtype=np.float32))
        qs.update(nested_blocksize=_NESTED_BLOCK, nested_dtype="float32",
                  nested_offset=float(buf["offset"].reshape(-1)[0].item()))
    blob = json.dumps(qs).encode("utf-8")  # bitsandbytes' pack_dict_to_tensor
    out["weight." + QUANT_STATE_PREFIX + "nf4"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return out


# -- config ------------------------------------------------------------------------------------

def bnb_quantization_config(double_quant: bool = False, compute_dtype: str = "float32",
                            skip_modules: Any = None, quant_storage: str = "uint8") -> dict:
    """The ``quantization_config`` block transformers 5.23 writes into config.json for
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", ...)``
    (``BitsAndBytesConfig.to_dict()``: the same keys and defaults)."""
    return {"_load_in_4bit": True, "_load_in_8bit": False, "bnb_4bit_compute_dtype": compute_dtype,
            "bnb_4bit_quant_storage": quant_storage, "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": bool(double_quant), "llm_int8_enable_fp32_cpu_offload": False,
            "llm_int8_has_fp16_weight": False, "llm_int8_skip_modules": skip_modules,
            "llm_int8_threshold": 6.0, "load_in_4bit": True, "load_in_8bit": False,
            "quant_method": "bitsandbytes"}


def _read_bnb_config(directory: Path) -> dict:
    from ._files import read_json

    f = directory / "config.json"
    if not f.is_file():
        raise ValueError(f"{directory}: no config.json; not a transformers model folder")
    cfg = read_json(f, "config.json")
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(qc, dict) or qc.get("quant_method") != "bitsandbytes":
        raise ValueError(f"{f}: no bitsandbytes quantization_config (quant_method "
                         f"{(qc or {}).get('quant_method') if isinstance(qc, dict) else None!r})")
    if not qc.get("load_in_4bit", qc.get("_load_in_4bit")):
        what = "8-bit (load_in_8bit)" if qc.get("load_in_8bit", qc.get("_load_in_8bit")) else "not 4-bit"
        raise ValueError(f"{f}: the bitsandbytes checkpoint is {what}; load_bnb reads 4-bit nf4 only")
    qt = qc.get("bnb_4bit_quant_type", "fp4")  # BitsAndBytesConfig's default is fp4
    if qt != "nf4":
        raise ValueError(f"{f}: bnb_4bit_quant_type {qt!r} is not supported: qformats has the nf4 "
                         "format only (no fp4)")
    return cfg


def is_bnb_dir(directory: Union[str, os.PathLike]) -> bool:
    """True when ``directory/config.json`` has a bitsandbytes 4-bit nf4 ``quantization_config``."""
    try:
        _read_bnb_config(Path(directory))
        return True
    except (ValueError, OSError):
        return False


def _weight_files(directory: Path) -> list[Path]:
    from ._files import read_json

    idx = directory / INDEX_NAME
    if idx.is_file():
        wm = read_json(idx, INDEX_NAME).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) and Path(v).name == v for v in wm.values()):
            raise ValueError(f"{idx}: 'weight_map' must map tensor names to file names in the folder")
        files = [directory / n for n in sorted(set(wm.values()))]
    elif (directory / WEIGHTS_NAME).is_file():
        files = [directory / WEIGHTS_NAME]
    else:
        raise ValueError(f"{directory}: neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    for p in files:
        if not p.is_file():
            raise ValueError(f"{directory}: the weights file {p.name} is missing")
    return files


def _read_tensors(files: list[Path]) -> dict:
    from safetensors import safe_open

    state: dict = {}
    for p in files:
        try:
            with safe_open(str(p), framework="pt") as f:
                for k in f.keys():
                    if k in state:
                        raise ValueError(f"{p.name}: tensor {k!r} is stored twice")
                    state[k] = f.get_tensor(k)
        except ValueError:
            raise
        except Exception as e:  # safetensors' own error types for truncated files
            if isinstance(e, (MemoryError, KeyboardInterrupt)):
                raise
            raise ValueError(f"{p}: cannot read it as safetensors (truncated or corrupt?): "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return state


# -- model level -------------------------------------------------------------------------------

def load_bnb(directory: Union[str, os.PathLike], device: Any = "cpu", dtype: Any = None):
    """Load a transformers bitsandbytes 4-bit nf4 folder into a transformers model whose
    quantized Linears are :class:`qformats.nn.QuantizedLinear` nf4 layers holding the same
    bytes (no bitsandbytes needed, nothing re-quantized, no float weights made for them).

    Reads ``config.json`` (its ``quantization_config``: quant_method ``"bitsandbytes"``,
    ``load_in_4bit``, ``bnb_4bit_quant_type`` ``"nf4"``) and ``model.safetensors`` or the
    shards of ``model.safetensors.index.json``. The model is built from ``config.json`` (its
    ``architectures`` class in transformers) with parameters on the meta device; every Linear
    with a ``<name>.weight.quant_state.bitsandbytes__nf4`` tensor becomes a QuantizedLinear
    (:func:`from_bnb_state`; double-quantized layers keep their compressed absmax,
    ``compress_statistics=True``; ``weight_dtype`` from the JSON ``dtype``); every other tensor
    is assigned as stored (dtype included). Parameters tied in the model (e.g. lm_head to the
    embedding) that the checkpoint stores once share that tensor. ``bnb_4bit_compute_dtype`` is
    not used: QuantizedLinear computes in its input's dtype (float32 accumulation on the CPU).
    The ``quantization_config`` attribute is removed from the returned model's config (the
    model is no longer a bitsandbytes model).

    Args:
        directory: the folder.
        device: where the model goes.
        dtype: None keeps each stored tensor's dtype; a float dtype converts the float
            parameters and buffers that are not packed weights (embeddings, norms, biases).
    Returns:
        the model in eval mode on ``device``.
    Raises:
        ValueError: no config.json or no bitsandbytes 4-bit nf4 quantization_config (fp4 and
            8-bit named), missing weight files, unreadable safetensors, a quantized tensor
            group that :func:`from_bnb_state` refuses (fp4, shapes, maps, blocksize), a
            quantized layer that is not an ``nn.Linear`` of the model, missing tensors (the
            model would otherwise keep uninitialized weights), tensors the model does not have,
            wrongly shaped tensors.
    """
    import torch
    from torch import nn

    from ._core import float_dtype
    from .nn import QuantizedLinear
    from .plan import set_submodule
    from .saving import _assign_state, _hf_skeleton

    directory = Path(directory)
    _read_bnb_config(directory)
    if dtype is not None:
        try:
            dtype = getattr(torch, float_dtype(dtype))
        except TypeError as e:
            raise ValueError(str(e)) from e
    state = _read_tensors(_weight_files(directory))

    # quantized layers: the groups with a quant_state blob
    layers: dict = {}
    for k in state:
        i = k.find(".weight." + QUANT_STATE_PREFIX)
        if i > 0:
            layers.setdefault(k[:i], []).append(k)
        elif k.startswith("weight." + QUANT_STATE_PREFIX):
            raise ValueError(f"{k}: a quantized weight at the model's top level is not supported")
    model = _hf_skeleton(directory, {"model_class": ""})
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    ties: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    tie_groups = [names for names in ties.values() if len(names) > 1]
    for name in sorted(layers):
        try:
            old = model.get_submodule(name)
        except AttributeError:
            old = None
        if type(old) is not nn.Linear:
            raise ValueError(f"{directory}: quantized tensor group {name!r} is not an nn.Linear of "
                             f"the {type(model).__name__} model ({type(old).__name__})")
        pre = name + "."
        group = {k[len(pre):]: state.pop(k) for k in list(state)
                 if k.startswith(pre + "weight.") or k == pre + "weight"}
        shape = (old.out_features, old.in_features)
        try:
            bufs, params = from_bnb_state(group, shape)
            wdt = bnb_weight_dtype(group)
        except ValueError as e:
            raise ValueError(f"{directory}: layer {name!r}: {e}") from e
        bias = state.get(pre + "bias")
        new = QuantizedLinear(old.in_features, old.out_features, old.bias is not None, format="nf4",
                              params=params, weight_dtype=wdt, device="meta",
                              dtype=bias.dtype if bias is not None else None)
        set_submodule(model, name, new)
        for b, t in bufs.items():
            state[pre + b] = t
    expected = model.state_dict(keep_vars=True)
    for names in tie_groups:
        have = [n for n in names if n in state]
        if have:
            for n in names:
                if n in expected:
                    state.setdefault(n, state[have[0]])
    _assign_state(model, state, expected, directory, directory)
    if dtype is not None:
        model.to(dtype)
    model.to(device)
    return model.eval()


def save_bnb(model: Any, directory: Union[str, os.PathLike], *, compute_dtype: str = "float32",
             tokenizer: Any = None, source: Union[str, os.PathLike, None] = None) -> Path:
    """Write a transformers model whose quantized Linears are qformats nf4 QuantizedLinear
    layers as a transformers bitsandbytes 4-bit checkpoint (what ``save_pretrained`` of a
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` model writes), so that
    ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` with bitsandbytes loads it
    and :func:`load_bnb` reads it back. No re-quantization: the bytes are copied
    (:func:`to_bnb_state`).

    Files: ``model.safetensors`` (metadata ``{"format": "pt"}``; every tensor of the state dict,
    each nf4 layer's buffers replaced by its bitsandbytes tensors, tied tensors once),
    ``config.json`` (the model's config plus :func:`bnb_quantization_config`:
    ``bnb_4bit_use_double_quant`` true when every nf4 layer has ``compress_statistics``,
    ``llm_int8_skip_modules`` listing the ``nn.Linear`` layers kept in float, so transformers
    leaves exactly those unconverted), and the tokenizer files / generation_config.json of
    ``source`` (as :func:`qformats.saving.save_quantized`). Written into a temporary folder
    inside ``directory`` and renamed into place, config.json last.

    Args:
        model: an ``nn.Module`` with a Hugging Face ``config`` (``to_json_string``).
        directory: the output folder (created; files of the same names are replaced).
        compute_dtype: ``bnb_4bit_compute_dtype`` for bitsandbytes ("float32", "float16",
            "bfloat16"); qformats ignores it.
        tokenizer: a tokenizer to ``save_pretrained`` into the folder; else ``source``'s files.
        source: the model's source folder (default: ``model.config._name_or_path`` when a folder).
    Returns:
        the folder's Path.
    Raises:
        ValueError: QuantizedLinear layers of another format (named), an nf4 blocksize
            bitsandbytes does not accept, no nf4 layer, no Hugging Face config, tensors on the
            meta device, a bad compute_dtype, ``directory`` empty or an existing file.
        TypeError: model is not an nn.Module.
    """
    import torch  # noqa: F401
    from safetensors.torch import save_file
    from torch import nn

    from ._files import check_output_dir, cleanup_on_sigterm, fix_mode
    from .nn import QuantizedLinear
    from .saving import TOKENIZER_FILES, _copy_source_file, _dedup_state, _source_dir

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if compute_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"compute_dtype must be one of {_FLOAT_DTYPES}, got {compute_dtype!r}")
    hf_config = getattr(model, "config", None)
    if hf_config is None or not callable(getattr(hf_config, "to_json_string", None)):
        raise ValueError("model has no Hugging Face config (model.config); a bitsandbytes "
                         "checkpoint needs config.json")
    qlayers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    other = [f"{n} ({m.format})" for n, m in qlayers.items() if m.format != "nf4"]
    if other:
        raise ValueError(f"bitsandbytes checkpoints hold nf4 layers only; these are in other "
                         f"formats: {', '.join(other)}")
    if not qlayers:
        raise ValueError("the model has no nf4 QuantizedLinear layer (quantize it with "
                         "qformats.quantize_model(model, format='nf4') first)")
    floats = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    src = _source_dir(model, source)
    out = check_output_dir(directory)
    if src is not None and src.resolve() == out.resolve():
        src = None
    tensors, _aliases = _dedup_state(model)
    for name, m in qlayers.items():
        try:
            bnb_t = to_bnb_state(m)
        except ValueError as e:
            raise ValueError(f"layer {name!r}: {e}") from e
        for b in m.buffer_names:
            tensors.pop(f"{name}.{b}", None)
        for k, t in bnb_t.items():
            tensors[f"{name}.{k}"] = t
    cfg = json.loads(hf_config.to_json_string(use_diff=True))
    cfg["architectures"] = [type(model).__name__]  # as save_pretrained
    floats_dt = [p.dtype for p in model.parameters() if p.is_floating_point() and p.device.type != "meta"]
    if floats_dt:  # as save_pretrained: the dtype the float tensors are stored in
        cfg["dtype"] = str(floats_dt[0]).removeprefix("torch.")
    cfg["quantization_config"] = bnb_quantization_config(
        double_quant=all(m.params.get("compress_statistics", False) for m in qlayers.values()),
        compute_dtype=compute_dtype, skip_modules=floats)
    out.mkdir(parents=True, exist_ok=True)
    with cleanup_on_sigterm():
        stage = Path(tempfile.mkdtemp(prefix=".qformats-save-", dir=out))
        try:
            save_file(tensors, str(stage / WEIGHTS_NAME), metadata={"format": "pt"})
            if tokenizer is not None:
                tokenizer.save_pretrained(str(stage))
            if src is not None:
                copy = TOKENIZER_FILES if tokenizer is None else ("generation_config.json",)
                for fname in copy:
                    if not (stage / fname).exists():
                        _copy_source_file(src, fname, stage / fname)
            with open(stage / "config.json", "w", encoding="utf-8") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
                f.write("\n")
            (out / "config.json").unlink(missing_ok=True)
            (out / INDEX_NAME).unlink(missing_ok=True)  # a stale index would win over model.safetensors
            for entry in sorted(stage.iterdir(), key=lambda e: e.name == "config.json"):
                dest = out / entry.name
                if entry.is_file():
                    fix_mode(entry)
                if entry.is_dir() and dest.is_dir() and not dest.is_symlink():
                    shutil.rmtree(dest)
                os.replace(entry, dest)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return out
