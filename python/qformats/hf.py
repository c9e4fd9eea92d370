"""Hugging Face transformers integration: ``from_pretrained`` / ``save_pretrained`` of
qformats models, through transformers' own hooks for third-party quantizers
(``register_quantization_config`` / ``register_quantizer``, transformers >= 5.0).

``import qformats`` registers it (when transformers is imported, not before: ``import
qformats`` stays torch-free), so that::

    import qformats
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32,
                                                 quantization_config=qformats.QFormatsConfig(bits=4))
    model.save_pretrained(out_dir)                      # config.json + model*.safetensors
    model = AutoModelForCausalLM.from_pretrained(out_dir)   # the same packed bytes

A folder's ``config.json`` carries ``quantization_config`` = :class:`QFormatsConfig`
(``quant_method: "qformats"``, and ``layers``: every QuantizedLinear's format, params and
buffer shapes); the weights are standard, shardable ``model*.safetensors`` files holding each
QuantizedLinear's packed buffers under ``<layer>.<buffer>`` and every other tensor as it is.
Loading builds the model on the meta device, swaps the listed Linears for empty
QuantizedLinears (never materializing a float weight for them) and lets transformers fill the
buffers; any buffer the files do not hold, or hold with another dtype or shape, raises
ValueError naming it (never a randomly initialized weight).

``from_pretrained(float_dir, quantization_config=QFormatsConfig(...))`` quantizes a float
checkpoint while it loads, one Linear at a time as transformers reads its weight (round to
nearest; the same bytes as :func:`qformats.quantize_model` with the same arguments on the
float model loaded in the same dtype). Calibrated methods (signround, budget, calibrated
mixed2bit) need the whole float model: load it, call :func:`qformats.quantize_model`, then
``save_pretrained``.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          register_quantization_config, register_quantizer)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from . import __version__
from ._core import format_module
from .choice import resolve_spec
from .nn import QuantizedLinear
from .plan import plan_layers, set_submodule

__all__ = ["QUANT_METHOD", "QFormatsConfig", "QFormatsHfQuantizer", "attach", "register",
           "layer_configs"]

QUANT_METHOD = "qformats"
#: Version of the ``layers`` record this qformats writes (and the newest it reads).
CONFIG_VERSION = 1


def layer_configs(model: nn.Module) -> dict:
    """``{module name: QuantizedLinear.config()}`` of every QuantizedLinear of ``model``."""
    return {name: m.config() for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


class QFormatsConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a qformats model (``quant_method: "qformats"``).

    Two uses:

    * quantize on load: ``from_pretrained(float_dir, quantization_config=QFormatsConfig(bits=4))``
      (the arguments of :func:`qformats.quantize_model` with ``method="rtn"``: ``format`` or
      ``bits``, ``group_size``, the format's parameters, ``ignore``, ``overrides``);
    * describing a quantized model: ``layers`` ``{module name: layer config}`` (what
      :meth:`qformats.nn.QuantizedLinear.config` writes: format, params, in/out features, bias,
      weight dtype, buffers ``{name: [dtype, shape]}``). ``save_pretrained`` writes it into
      ``config.json``; ``from_pretrained`` rebuilds exactly those layers.

    Args:
        format: a qformats format name; or
        bits: 8, 4 or 2 (see :data:`qformats.choice.BITS_FORMATS`); at most one of the two.
        group_size: values per group along in_features (see :func:`qformats.quantize_model`).
        params: the format's ``quantize`` arguments (dict); keyword arguments not named here are
            added to it (``QFormatsConfig(format="nf4", blocksize=64)``).
        ignore: module-name patterns kept in float (None: ``lm_head``, embeddings and the
            model's output embedding, as in :func:`qformats.quantize_model`).
        overrides: per-layer ``{pattern: {format or bits, params..., or skip}}``.
        layers: the per-layer record of a quantized model (set by qformats, not by hand).
    Raises:
        ValueError: a bad format / bits / parameter (checked at once, before any weight is
            read), neither a choice nor ``layers``, or a malformed ``layers`` record.
    """

    def __init__(self, format: Optional[str] = None, bits: Optional[int] = None,
                 group_size: Optional[int] = None, params: Optional[Mapping[str, Any]] = None,
                 ignore: Optional[Sequence[str]] = None,
                 overrides: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 layers: Optional[Mapping[str, Mapping[str, Any]]] = None, **kwargs):
        # keys that to_dict() writes and from_dict() passes back: not format parameters
        kwargs.pop("quant_method", None)
        version = kwargs.pop("config_version", CONFIG_VERSION)
        self.qformats_version = kwargs.pop("qformats_version", __version__)
        self.quant_method = QUANT_METHOD
        self.format, self.bits, self.group_size = format, bits, group_size
        self.params = {**dict(params or {}), **kwargs}
        self.ignore = None if ignore is None else ([ignore] if isinstance(ignore, str) else list(ignore))
        self.overrides = {k: dict(v) for k, v in (overrides or {}).items()}
        self.layers = None if layers is None else {k: dict(v) for k, v in layers.items()}
        if not isinstance(version, int) or isinstance(version, bool) or version > CONFIG_VERSION:
            raise ValueError(f"quantization_config: config_version {version!r} is not one this "
                             f"qformats reads (<= {CONFIG_VERSION}); upgrade qformats")
        self.config_version = version
        if self.layers is None:
            if format is None and bits is None:
                raise ValueError("QFormatsConfig: give format= or bits= (what to quantize to), "
                                 "e.g. QFormatsConfig(bits=4)")
            resolve_spec(format, bits, group_size, **self.params)  # fails now, not mid-load
        else:
            for name, lcfg in self.layers.items():
                try:
                    QuantizedLinear.from_config(lcfg, device="meta")
                except ValueError as e:
                    raise ValueError(f"quantization_config: layer {name!r}: {e}") from e

    @property
    def is_quantized(self) -> bool:
        """True when the config describes quantized layers (a pre-quantized checkpoint)."""
        return self.layers is not None

    def to_dict(self) -> dict:
        """JSON-ready dict (what ``config.json``'s ``quantization_config`` holds)."""
        d = {"quant_method": QUANT_METHOD, "qformats_version": self.qformats_version,
             "config_version": self.config_version}
        for k in ("format", "bits", "group_size", "params", "ignore", "overrides", "layers"):
            d[k] = json.loads(json.dumps(getattr(self, k)))  # deep copy, JSON types only
        return d

    def to_diff_dict(self) -> dict:
        return self.to_dict()


class _QuantizeOnLoad(ConversionOps):
    """transformers' conversion op for one float Linear weight as it is read: quantize it to
    the planned format and swap the Linear for a QuantizedLinear (so that the float weight is
    dropped at once)."""

    def __init__(self, hf_quantizer: "QFormatsHfQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, full_layer_name=None, model=None, missing_keys=None, **kwargs):
        (key, value), = input_dict.items()
        value = value[0] if isinstance(value, list) else value
        name = key.rpartition(".")[0]
        fmt, params = self.hf_quantizer._plan[name]
        try:
            qt = format_module(fmt).quantize(value.detach().contiguous(), **params)
            old = model.get_submodule(name)
            new = QuantizedLinear.from_quantized(qt)
            if old.bias is not None:  # the Linear's bias, loaded or still to load (on meta)
                new.bias = old.bias
            set_submodule(model, name, new)
        except Exception as e:  # transformers logs conversion errors and goes on: keep it
            self.hf_quantizer._errors[name] = f"{fmt} {params}: {type(e).__name__}: {e}"
            raise
        if missing_keys is not None:
            missing_keys.discard(key)
        return {}


class QFormatsHfQuantizer(HfQuantizer):
    """transformers' quantizer for ``quant_method: "qformats"`` (see the module docstring).
    transformers builds it in ``from_pretrained``; :func:`attach` builds one for a model
    quantized in memory, so that its ``save_pretrained`` writes the quantization config."""

    requires_calibration = False

    @property
    def is_compileable(self) -> bool:
        """True: ``QuantizedLinear`` traces under ``torch.compile(fullgraph=True)`` and its
        kernels replay in CUDA graphs. transformers' ``generate()`` compiles its decode step
        (``cache_implementation="static"``, a ``compile_config``) only when a model's quantizer
        says so, and otherwise runs it eager with only a log line."""
        return True

    def __init__(self, quantization_config: QFormatsConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._plan: dict = {}     # quantize on load: {layer: (format, params)}
        self._errors: dict = {}   # {layer: why its quantization failed}
        if self.pre_quantized and not quantization_config.is_quantized:
            raise ValueError("this checkpoint's quantization_config (quant_method 'qformats') "
                             "lists no quantized layers ('layers'); it was not written by "
                             "qformats' save_pretrained / save_quantized")

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("qformats models cannot be offloaded to disk (device_map has 'disk'); "
                             "their packed buffers are small: use a CPU or GPU device map")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        cfg = self.quantization_config
        if self.pre_quantized:
            for name, lcfg in cfg.layers.items():
                old = _submodule(model, name)
                if not isinstance(old, nn.Linear):
                    raise ValueError(f"quantization_config: layer {name!r} is not a Linear of the "
                                     f"{type(model).__name__} model")
                bias_dtype = old.bias.dtype if old.bias is not None else None
                new = QuantizedLinear.from_config(lcfg, device="meta", dtype=bias_dtype)
                if (old.in_features, old.out_features) != (new.in_features, new.out_features):
                    raise ValueError(f"quantization_config: layer {name!r} is [{new.out_features}, "
                                     f"{new.in_features}] but the model's is [{old.out_features}, "
                                     f"{old.in_features}]")
                set_submodule(model, name, new)
            _check_headers(checkpoint_files or [], cfg.layers)
        else:
            glob = {"format": cfg.format, "bits": cfg.bits, "group_size": cfg.group_size,
                    "params": dict(cfg.params)}
            _, plan, _ = plan_layers(model, glob, cfg.ignore, cfg.overrides)
            self._plan = {name: (fmt, dict(qparams)) for name, _, fmt, qparams in plan}
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        name, _, leaf = param_name.rpartition(".")
        return not self.pre_quantized and leaf == "weight" and name in self._plan

    def get_quantize_ops(self):
        return _QuantizeOnLoad(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        if self.pre_quantized:
            missing = []
            for name in cfg.layers:
                m = model.get_submodule(name)
                for b in m.buffer_names:
                    # transformers flags every tensor it loaded from the files; one it made
                    # up for a missing key (torch.empty) has no flag
                    if not getattr(m._buffers[b], "_is_hf_initialized", False):
                        missing.append(f"{name}.{b}")
            if missing:
                raise ValueError(f"the checkpoint does not hold the packed weight tensor(s) "
                                 f"{_few(missing)} that its quantization_config lists; the "
                                 "files are incomplete or belong to another model")
        else:
            left = [n for n in self._plan if not isinstance(model.get_submodule(n), QuantizedLinear)]
            if left:
                why = "; ".join(f"{n}: {self._errors[n]}" for n in left if n in self._errors)
                raise ValueError(f"quantize on load: layer(s) {_few(left)} were not quantized"
                                 + (f" ({why})" if why else " (their weights are not in the checkpoint)"))
            # from now on the config describes the quantized model (save_pretrained writes it)
            cfg.layers = layer_configs(model)
        for _, m in model.named_modules():
            if isinstance(m, QuantizedLinear) and m._buffers[m.buffer_names[0]].device.type != "meta":
                m.prepare()
        return model

    def _dequantize(self, model, dtype=None):
        for name, m in list(model.named_modules()):
            if isinstance(m, QuantizedLinear):
                lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                                device=m.bias.device if m.bias is not None else None, dtype=dtype)
                with torch.no_grad():
                    lin.weight.copy_(m.dequantize_weight(dtype or m.weight_dtype))
                    if m.bias is not None:
                        lin.bias.copy_(m.bias)
                set_submodule(model, name, lin.to(m._buffers[m.buffer_names[0]].device))
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        # adapters (PEFT LoRA) train on top of frozen QuantizedLinears: see qformats.lora
        return True


def attach(model: nn.Module) -> bool:
    """Record ``model``'s QuantizedLinear layers as its Hugging Face quantization config, so
    that ``model.save_pretrained(dir)`` writes them into ``config.json`` (and
    ``from_pretrained(dir)`` rebuilds them) instead of a config that transformers would load
    as a float model with missing weights. :func:`qformats.quantize_model` and
    :func:`qformats.load_quantized` call it; call it again after changing layers by hand.

    Returns:
        True when ``model`` is a transformers ``PreTrainedModel`` with QuantizedLinear layers
        (the config was attached), False otherwise (nothing changed).
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return False
    layers = layer_configs(model)
    if not layers:
        return False
    cfg = QFormatsConfig(layers=layers)
    model.config.quantization_config = cfg
    model.hf_quantizer = QFormatsHfQuantizer(cfg, pre_quantized=True)
    # not model.is_quantized: transformers would then refuse .half() / .float(), which
    # QuantizedLinear supports (they cast the bias, never the packed bytes)
    model.quantization_method = QUANT_METHOD
    return True


def _attaching(save_pretrained):
    """``PreTrainedModel.save_pretrained`` that first records the model's QuantizedLinear
    layers (:func:`attach`), so that a model whose layers were swapped by hand, or changed after
    :func:`qformats.quantize_model`, is never written as a float model without its weights."""
    @functools.wraps(save_pretrained)
    def wrapper(self, *args, **kwargs):
        if isinstance(getattr(self, "hf_quantizer", None), (QFormatsHfQuantizer, type(None))):
            attach(self)  # another tool's quantizer (bitsandbytes...) is left in charge
        return save_pretrained(self, *args, **kwargs)

    wrapper._qformats_attaching = True
    return wrapper


def register() -> None:
    """Register :class:`QFormatsConfig` and :class:`QFormatsHfQuantizer` with transformers
    (idempotent). ``import qformats`` does it as soon as transformers' quantizers are imported.
    It also makes ``PreTrainedModel.save_pretrained`` call :func:`attach` first (a wrapper:
    transformers has no hook for it), so that no model holding QuantizedLinear layers is saved
    with a config that would load it as a float model with missing weights."""
    from transformers import PreTrainedModel

    if not getattr(PreTrainedModel.save_pretrained, "_qformats_attaching", False):
        PreTrainedModel.save_pretrained = _attaching(PreTrainedModel.save_pretrained)
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not QFormatsConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        register_quantization_config(QUANT_METHOD)(QFormatsConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not QFormatsHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(QFormatsHfQuantizer)


# -- helpers -------------------------------------------------------------------------------------

def _submodule(model: nn.Module, name: str):
    try:
        return model.get_submodule(name) if name else None
    except AttributeError:
        return None


def _check_headers(files: Sequence[str], layers: Mapping[str, Mapping]) -> None:
    """ValueError for a packed buffer that a checkpoint file stores with another dtype or shape
    than ``layers`` records (read from the safetensors headers: nothing is loaded). Buffers
    absent from the files are reported after loading."""
    from safetensors import safe_open

    want = {f"{name}.{b}": (rec[0], list(rec[1])) for name, lcfg in layers.items()
            for b, rec in lcfg["buffers"].items()}
    for f in files:
        if not str(f).endswith(".safetensors") or not os.path.isfile(f):
            continue
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k not in want:
                    continue
                sl = st.get_slice(k)
                got = (_ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()), list(sl.get_shape()))
                if got != want[k]:
                    raise ValueError(f"{os.path.basename(f)}: tensor {k!r} is {got[0]} {got[1]}, "
                                     f"but the quantization_config records {want[k][0]} {want[k][1]}")


_ST_DTYPES = {"U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
              "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
              "BOOL": "bool", "U16": "uint16", "U32": "uint32"}


def _few(names: list, n: int = 4) -> str:
    s = ", ".join(repr(x) for x in names[:n])
    return s + (f" and {len(names) - n} more" if len(names) > n else "")
