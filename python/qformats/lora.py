"""LoRA fine-tuning of quantized models with PEFT (QLoRA-style).

The packed weight of each :class:`~qformats.nn.QuantizedLinear` stays frozen; PEFT adds float
low-rank adapters beside it, ``y = base(x) + (dropout(x) @ A^T) @ B^T * scaling``, and the
gradients reach ``A`` and ``B`` (and the earlier layers) through the backward of
:func:`qformats.ops.linear_packed` (``grad_x = grad_y @ dequantize(W)``), as in QLoRA
(Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv 2305.14314), where
the frozen base is NF4 and the adapters are trained in a higher precision.

Use (``import qformats`` calls :func:`register` once peft is imported; importing qformats or
this module does not import peft)::

    import peft, qformats
    model = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"]))

:func:`register` makes every ``LoraConfig`` map :class:`~qformats.nn.QuantizedLinear` to
:class:`QuantizedLoraLinear` (also configs read by ``PeftModel.from_pretrained``); it has to
patch two private methods of PEFT's ``LoraModel`` (its docstring says which and why).

Merging is refused: adding ``B @ A * scaling`` to a quantized weight would mean quantizing it
again: the sum is rounded to the format's grid (a delta below half a step is mostly lost, and
the groups' scales may change), and ``unmerge`` could not restore the original bytes.
``merge`` / ``merge_and_unload`` raise NotImplementedError; ``unload()`` (no merge) gives the
QuantizedLinear layers back unchanged.
To deploy a merged float model, add :meth:`QuantizedLoraLinear.get_delta_weight` to
``base_layer.dequantize_weight()`` yourself (and quantize the result again if you want).

Written against PEFT 0.21 (``peft.tuners.lora``: the layer follows ``bnb.Linear4bit`` and
``hqq.HqqLoraLinear``); the layer API it relies on (``LoraLayer.update_layer(..., config=...)``)
exists since PEFT 0.19.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import nn

from .nn import QuantizedLinear

# QuantizedLoraLinear subclasses peft's LoraLayer, so it is made on first access (__getattr__).
__all__ = ["register", "QuantizedLoraLinear", "MIN_PEFT"]  # noqa: F822

#: The oldest PEFT this module works with (``LoraLayer.update_layer`` takes ``config`` since 0.19).
MIN_PEFT = "0.19"

#: ``init_lora_weights`` values that need no float base weight (the others, e.g. ``"pissa"``,
#: ``"olora"``, ``"loftq"``, ``"corda"``, decompose ``base_layer.weight``, which a
#: QuantizedLinear does not have).
_INITS = (True, False, "gaussian")

#: LoraConfig fields that select a LoRA variant (DoRA, aLoRA, ...). Variants need code of their
#: own in the layer (DoRA reads the base weight's norms, aLoRA takes extra forward arguments),
#: which this layer does not have: only plain LoRA is supported.
_VARIANT_FIELDS = ("use_dora", "use_qalora", "alora_invocation_tokens", "arrow_config", "velora_config")

_MERGE_ERROR = (
    "qformats: merging a LoRA adapter into a {fmt} QuantizedLinear is not supported: it would "
    "quantize the weight again (lossy, and unmerge could not restore it). Keep the adapter "
    "unmerged (peft_model.unload() returns the QuantizedLinear layers unchanged), or merge into "
    "a float copy: base_layer.dequantize_weight(torch.float32) + layer.get_delta_weight(adapter)."
)


def _import_peft():
    """The ``peft`` module, checked to be new enough.

    Raises:
        ImportError: peft is not installed, or older than :data:`MIN_PEFT`.
    """
    try:
        import peft
    except ImportError as e:
        raise ImportError("qformats.lora needs peft: pip install 'qformats[lora]' "
                          f"(peft>={MIN_PEFT})") from e
    from packaging.version import Version

    if Version(peft.__version__) < Version(MIN_PEFT):
        raise ImportError(f"qformats.lora needs peft>={MIN_PEFT}, found {peft.__version__}")
    return peft


@functools.lru_cache(maxsize=None)
def _lora_class() -> type:
    """Build :class:`QuantizedLoraLinear` (once): its bases come from peft, which
    ``import qformats.lora`` must not import."""
    _import_peft()
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class QuantizedLoraLinear(nn.Module, LoraLayer):
        """PEFT LoRA layer around a :class:`~qformats.nn.QuantizedLinear` (frozen packed weight,
        float adapters ``lora_A[name]``: ``nn.Linear(in_features, r)``, ``lora_B[name]``:
        ``nn.Linear(r, out_features)``).

        Built by PEFT's dispatch (``peft.get_peft_model`` after :func:`register`), as
        ``QuantizedLoraLinear(base_layer, adapter_name, config=LoraConfig, r=, lora_alpha=)``.

        Forward: x ``[..., in_features]`` float32 / float16 / bfloat16 on the layer's device ->
        ``base_layer(x) + sum over active adapters of lora_B(lora_A(dropout(x))) * scaling``,
        ``[..., out_features]`` in x's dtype. As PEFT's bnb ``Linear4bit``: outside autocast, x is
        cast to the adapter's dtype for the adapter and its output back to the base output's
        dtype. Adapters are created in the base layer's ``weight_dtype`` on its device; PEFT's
        ``get_peft_model(..., autocast_adapter_dtype=True)`` (default) then makes float16 /
        bfloat16 adapters float32. Several adapters, ``disable_adapter()``, ``set_adapter``,
        ``adapter_names=`` (mixed batches), dropout, rsLoRA and ``lora_bias`` work as for
        ``torch.nn.Linear``.

        Raises:
            TypeError: (at construction) the base layer is not a QuantizedLinear.
            ValueError: (at construction) a LoRA variant (DoRA, aLoRA, QALoRA, Arrow, VeLoRA) or an
                ``init_lora_weights`` that reads the float base weight (PiSSA, OLoRA, LoftQ,
                CorDA, EVA, ...): only ``True``, ``False`` and ``"gaussian"`` are supported.

        ``merge`` raises NotImplementedError (see the module docstring).
        """

        def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0,
                     lora_alpha: int = 1, **kwargs) -> None:
            super().__init__()
            LoraLayer.__init__(self, base_layer)
            base = self.get_base_layer()
            if not isinstance(base, QuantizedLinear):
                raise TypeError(f"QuantizedLoraLinear wraps a qformats QuantizedLinear, got {type(base).__name__}")
            init = config.init_lora_weights
            if not any(init is v or (isinstance(v, str) and init == v) for v in _INITS):
                raise ValueError(f"init_lora_weights={init!r} needs the float base weight; a quantized "
                                 f"layer supports {list(_INITS)}")
            self.fan_in_fan_out = False
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        # -- what PEFT reads from the base layer -------------------------------------------
        def _get_in_out_features(self, module):
            # PEFT's generic lookup warns "Unsupported layer type" for a custom layer.
            return module.in_features, module.out_features

        def _get_base_layer_device_and_dtype(self, base_layer):
            # PEFT looks for .weight / .qweight (an int4 buffer would give an int dtype): the
            # adapters go to the packed buffers' device, in the dtype the weight was quantized from.
            dev = base_layer._buffers[base_layer.buffer_names[0]].device
            return dev, getattr(torch, base_layer.weight_dtype)

        def resolve_lora_variant(self, *, config, **kwargs):
            used = [f for f in _VARIANT_FIELDS if getattr(config, f, None) not in (None, False)]
            if used:
                raise ValueError(f"{type(self).__name__} supports plain LoRA only; the config sets {used}")
            return None

        # -- merging: refused ----------------------------------------------------------------
        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            """Raises NotImplementedError when there is an adapter to merge (see the module
            docstring); nothing to merge: no-op, as PEFT's layers."""
            if check_adapters_to_merge(self, adapter_names):
                raise NotImplementedError(_MERGE_ERROR.format(fmt=self.get_base_layer().format))

        def unmerge(self) -> None:
            """Nothing is ever merged: warns, as PEFT's layers do when there is nothing to unmerge."""
            warnings.warn("Already unmerged. Nothing to do.")

        def get_delta_weight(self, adapter: str) -> torch.Tensor:
            """``lora_B.weight @ lora_A.weight * scaling``: ``[out_features, in_features]`` in the
            adapter's dtype and device (what merging would add to the dequantized weight)."""
            return self.lora_B[adapter].weight @ self.lora_A[adapter].weight * self.scaling[adapter]

        # -- forward ---------------------------------------------------------------------------
        def _adapter_out(self, name: str, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            if not torch.is_autocast_enabled():  # as bnb.Linear4bit: adapter in its own dtype
                x = self._cast_input_dtype(x, lora_A.weight.dtype)
            out = lora_B(lora_A(self.lora_dropout[name](x))) * self.scaling[name]
            return out.to(out_dtype)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            """``base_layer(x)`` plus the active adapters' outputs (see the class docstring).
            ``adapter_names=[name per row of x]`` (``"__base__"``: no adapter) mixes adapters in
            one batch. Raises ValueError for an adapter_names of another length than x, and as
            ``QuantizedLinear.forward`` for a bad x."""
            self._check_forward_args(x, *args, **kwargs)
            adapter_names = kwargs.pop("adapter_names", None)
            # The operator returns a new tensor (no view of a buffer), so unlike bnb's layer no
            # defensive clone is needed before adding to it.
            result = self.base_layer(x, *args, **kwargs)
            if self.disable_adapters:
                return result
            if adapter_names is not None:
                rows: dict[str, list[int]] = {}
                for i, name in enumerate(adapter_names):
                    rows.setdefault(name, []).append(i)
                for name, idx in rows.items():
                    if name in self.lora_A:
                        result[idx] += self._adapter_out(name, x[idx], result.dtype)
                return result
            for name in self.active_adapters:
                if name in self.lora_A:
                    result = result + self._adapter_out(name, x, result.dtype)
            return result

        def __repr__(self) -> str:
            return "lora." + super().__repr__()

    # Pickle finds the class as qformats.lora.QuantizedLoraLinear (the module's __getattr__).
    QuantizedLoraLinear.__module__ = __name__
    QuantizedLoraLinear.__qualname__ = "QuantizedLoraLinear"
    return QuantizedLoraLinear


def __getattr__(name: str):
    if name == "QuantizedLoraLinear":
        return _lora_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + ["QuantizedLoraLinear"])


def register() -> None:
    """Make PEFT's LoRA wrap :class:`~qformats.nn.QuantizedLinear` layers in
    :class:`QuantizedLoraLinear`: after it, ``peft.get_peft_model(model, LoraConfig(...))`` and
    ``PeftModel.from_pretrained`` work on a model quantized by :func:`qformats.quantize_model`.
    Idempotent; imports peft.

    PEFT has no global registry for custom layers, so this wraps two methods of
    ``peft.tuners.lora.model.LoraModel``:

    - ``_create_new_module`` (its dispatch): PEFT's registration for custom layers,
      ``LoraConfig._register_custom_module``, is per config object, and configs that PEFT makes
      itself (``PeftModel.from_pretrained``) never get it. For a QuantizedLinear target the
      wrapper registers the mapping on that config (unless the config already maps
      QuantizedLinear to a class of the user's own) and calls PEFT's dispatch, which then
      builds the layer.
    - ``_replace_module``: after building the layer PEFT moves the adapters to the device of
      the old layer's ``.weight`` / ``.qweight`` or else its first parameter; a QuantizedLinear
      without bias has neither (StopIteration). For such a layer the wrapper only puts the new
      module in place: the adapters were already made on the packed buffers' device.

    Raises:
        ImportError: peft missing or older than :data:`MIN_PEFT`.
        RuntimeError: this PEFT's ``LoraModel`` / ``LoraConfig`` lack those methods.
    """
    cls = _lora_class()
    from peft import LoraConfig
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    create = LoraModel.__dict__.get("_create_new_module")
    if isinstance(create, staticmethod) and getattr(create.__func__, "_qformats_lora", False):
        return
    replace = LoraModel.__dict__.get("_replace_module")
    if not isinstance(create, staticmethod) or not callable(replace) \
            or not hasattr(LoraConfig, "_register_custom_module"):
        raise RuntimeError("qformats.lora.register: this peft's LoraModel has no static _create_new_module / "
                           "_replace_module, or LoraConfig no _register_custom_module")
    original_create = create.__func__

    @functools.wraps(original_create)
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, QuantizedLinear):
            custom = getattr(lora_config, "_custom_modules", None) or {}
            if not any(isinstance(base, k) for k in custom):
                lora_config._register_custom_module({QuantizedLinear: cls})
        return original_create(lora_config, adapter_name, target, **kwargs)

    @functools.wraps(replace)
    def _replace_module(self, parent, child_name, new_module, child):
        base = child.base_layer if hasattr(child, "base_layer") else child
        if isinstance(base, QuantizedLinear) and next(base.parameters(), None) is None:
            setattr(parent, child_name, new_module)
            return None
        return replace(self, parent, child_name, new_module, child)

    _create_new_module._qformats_lora = True
    LoraModel._replace_module = _replace_module
    LoraModel._create_new_module = staticmethod(_create_new_module)
