"""The layer plan of :func:`qformats.quantize_model`: which format and parameters each
``nn.Linear`` gets: the global choice (:func:`qformats.choice.resolve_spec`), per-layer
overrides, ignore patterns (:data:`DEFAULT_IGNORE`, :func:`matches`) and the layers kept in
float (:class:`LayerReport`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Iterable, Mapping, Optional, Sequence

from torch import nn

# The format choice itself (torch-free, qformats.choice), used here per layer and imported
# from here by the model level.
from .choice import BITS_FORMATS, block, fits, resolve_spec, row_block  # noqa: F401

__all__ = ["DEFAULT_IGNORE", "matches", "LayerReport", "plan_layers", "set_submodule"]

#: Module-name patterns left in float unless ``ignore=`` says otherwise: the output projection
#: and anything named like an embedding (``nn.Embedding`` is never touched anyway).
DEFAULT_IGNORE = ("lm_head", "embed_out", "*embed*", "*wte", "*wpe")


# -- one layer's format and parameters ----------------------------------------------------------

def matches(name: str, patterns: Iterable[str]) -> Optional[str]:
    """The first of ``patterns`` that matches module name ``name`` (or None).

    A pattern matches with ``fnmatch`` rules (``*``, ``?``, ``[...]``, case-sensitive) either
    the whole dotted name (``model.layers.0.mlp.down_proj``) or a dotted suffix of it: ``down_proj``
    and ``mlp.down_proj`` both match that layer, ``layers.1.*`` matches every layer of block 1.
    """
    for pat in patterns:
        if fnmatchcase(name, pat) or fnmatchcase(name, "*." + pat):
            return pat
    return None


def _layer_spec(name: str, glob: dict, overrides: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """The spec dict of layer ``name``: the global one updated by each matching override in
    order; an override naming ``format`` or ``bits`` starts from that format's defaults."""
    spec, hit = dict(glob), []
    for pat, ov in overrides.items():
        if matches(name, [pat]) is None:
            continue
        hit.append(pat)
        if "format" in ov or "bits" in ov:
            spec = {"format": ov.get("format"), "bits": ov.get("bits"), "group_size": None, "params": {}}
        rest = {k: v for k, v in ov.items() if k not in ("format", "bits")}
        if "group_size" in rest:
            spec["group_size"] = rest.pop("group_size")
        spec["params"] = {**spec["params"], **rest}
    return spec, hit


# -- the model's layers ------------------------------------------------------------------------

@dataclass
class LayerReport:
    """One ``nn.Linear`` of the model as :func:`quantize_model` left it.

    Attributes:
        name: dotted module name.
        status: ``"quantized"``, ``"ignored"`` (matched an ignore pattern: ``reason`` names
            it) or ``"skipped"`` (kept in float: in_features not a multiple of the format's
            block, or a Linear that its parent reads directly).
        format: format name (None unless quantized).
        params: the QuantizedTensor params (quantized) or the requested ones (skipped).
        in_features, out_features: the weight is ``[out_features, in_features]``.
        nbytes: stored bytes of the weight: packed size, or float size at its dtype.
        bits: stored bits per weight value (8 * nbytes / values).
        seconds: wall time of the quantize call.
        reason: why it is not quantized ("" when it is).
    """

    name: str
    status: str
    format: Optional[str]
    params: dict
    in_features: int
    out_features: int
    nbytes: int
    bits: float
    seconds: float = 0.0
    reason: str = ""

    @classmethod
    def of_quantized(cls, name: str, layer: Any, seconds: float = 0.0) -> "LayerReport":
        """The report of a quantized layer: ``layer`` a :class:`~qformats.nn.QuantizedLinear`
        (its buffers may be on the meta device: only their shapes and dtypes are read)."""
        return cls(name, "quantized", layer.format, dict(layer.params), layer.in_features,
                   layer.out_features, layer.nbytes, layer.avg_bits, seconds=seconds)


def plan_layers(model: nn.Module, glob: dict, ignore: Optional[Sequence[str]],
                overrides: Mapping[str, Mapping[str, Any]]) -> tuple[list, list, list]:
    """The plan of ``model``'s ``nn.Linear`` layers (see :func:`qformats.quantize_model`'s
    ``ignore`` and ``overrides``).

    Args:
        model: the model.
        glob: the global choice ``{"format", "bits", "group_size", "params"}``.
        ignore: module-name patterns to keep in float; None: :data:`DEFAULT_IGNORE` and the
            model's output embedding.
        overrides: ``{pattern: {format or bits, group_size, params..., or skip}}``.
    Returns:
        ``(layers, plan, warnings)``: ``layers`` a :class:`LayerReport` per Linear in module
        order, None for each one to quantize; ``plan`` ``[(name, module, format, params)]`` of
        those, in order; ``warnings`` the messages of the layers kept in float (also issued
        with ``warnings.warn``).
    Raises:
        ValueError: a malformed override, a bad choice in one (naming the layer), an override
            that matches no Linear, a bare ``nn.Linear`` model, or no layer could be quantized
            although some were eligible.
    """
    overrides = dict(overrides or {})
    for pat, ov in overrides.items():
        if not isinstance(pat, str) or not isinstance(ov, Mapping):
            raise ValueError(f"overrides: expected {{pattern: {{format/bits/params}}}}, got "
                             f"{pat!r}: {ov!r}")
    if ignore is None:
        ignore_pats = list(DEFAULT_IGNORE)
        head = output_embedding(model)
    else:
        if isinstance(ignore, str):
            ignore = [ignore]
        ignore_pats, head = list(ignore), None

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if linears and linears[0][0] == "":
        raise ValueError("model is a bare nn.Linear; use qformats.nn.QuantizedLinear.from_linear "
                         "or wrap it in a container")
    mha_out = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    layers: list = []
    messages: list = []
    used_overrides: set = set()
    plan = []  # (name, module, fmt, params)
    resolved: dict = {}
    for name, m in linears:
        in_f, out_f = m.in_features, m.out_features
        w_bytes = m.weight.numel() * m.weight.element_size()
        w_bits = 8.0 * m.weight.element_size()
        spec, hit = _layer_spec(name, glob, overrides)
        used_overrides.update(hit)
        pat = matches(name, ignore_pats)
        if pat is not None or (head is not None and m is head):
            why = f"matches ignore pattern {pat!r}" if pat else "the model's output embedding"
            layers.append(LayerReport(name, "ignored", None, {}, in_f, out_f, w_bytes, w_bits, reason=why))
            continue
        if spec["params"].get("skip"):
            layers.append(LayerReport(name, "ignored", None, {}, in_f, out_f, w_bytes, w_bits,
                                      reason=f"override {hit} says skip"))
            continue
        key = repr((spec["format"], spec["bits"], spec["group_size"], sorted(spec["params"].items())))
        if key not in resolved:
            try:
                resolved[key] = resolve_spec(spec["format"], spec["bits"], spec["group_size"],
                                             **spec["params"])
            except ValueError as e:
                raise ValueError(f"layer {name} (overrides {hit}): {e}" if hit else str(e)) from e
        fmt, qparams = resolved[key]
        blk = block(fmt, qparams)
        reason = ""
        if id(m) in mha_out:
            reason = "out_proj of nn.MultiheadAttention, which reads its weight directly"
        elif in_f % blk:
            reason = f"in_features={in_f} is not a multiple of the {fmt} block of {blk}"
        elif m.weight.ndim != 2:
            reason = f"{fmt} needs a 2-D weight [out, in] (QuantizedLinear), got {m.weight.ndim}-D"
        elif out_f % row_block(fmt, qparams):
            reason = f"out_features={out_f} is not a multiple of the {fmt} row block of {row_block(fmt, qparams)}"
        if reason:
            msg = f"{name}: kept in float: {reason}"
            messages.append(msg)
            # stacklevel 3: the warning points at the caller of quantize_model
            warnings.warn(f"qformats.quantize_model: {msg}", stacklevel=3)
            layers.append(LayerReport(name, "skipped", fmt, qparams, in_f, out_f, w_bytes, w_bits,
                                      reason=reason))
            continue
        plan.append((name, m, fmt, qparams))
        layers.append(None)  # filled by the caller, keeps module order
    unused = [p for p in overrides if p not in used_overrides]
    if unused:
        raise ValueError(f"overrides: pattern(s) {unused} match no nn.Linear of the model")
    skipped = [l for l in layers if l is not None and l.status == "skipped"]
    if not plan and skipped:
        raise ValueError(f"no Linear layer could be quantized: {skipped[0].reason} "
                         f"(and {len(skipped) - 1} more like it)")
    return layers, plan, messages


def output_embedding(model: nn.Module):
    """The model's ``get_output_embeddings()`` (the output projection), or None."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            return get()
        except (AttributeError, NotImplementedError, TypeError):
            return None
    return None


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted ``name`` (``""`` is not allowed)."""
    if not name:
        raise ValueError("cannot replace the model itself; wrap a bare nn.Linear in a container")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
