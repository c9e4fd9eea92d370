"""Model-level quantization: replace a model's ``nn.Linear`` layers by
:class:`qformats.nn.QuantizedLinear`.

Use::

    import qformats
    report = qformats.quantize_model(model, bits=4)              # int4, groups of 128
    report = qformats.quantize_model(model, format="nf4", blocksize=64,
                                     overrides={"*.down_proj": {"bits": 8}})
    print(report)                   # per-format counts, average bits, size
    report.layers[0]                # LayerReport(name, status, format, params, ...)

``bits`` picks a format with the usual settings: 8 -> ``int8`` (one scale per output row;
with ``group_size``: per group), 4 -> ``int4`` (asymmetric, ``group_size`` 128 by default),
2 -> ``mixed2bit`` with ``ratio_4bit=0`` (plain 2-bit, ``group_size`` 16 by default).
``format=`` picks any format with its own parameters. Methods: round to nearest (``"rtn"``;
with ``calibration=``, mixed2bit's 4-bit groups are chosen by the activations' second moment),
trainable rounding (``"signround"``, :mod:`qformats.signround`) and budgeted per-layer formats
(``"budget"``, :mod:`qformats.budget`).
"""
from __future__ import annotations

import inspect
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from ._core import FORMATS, format_module, format_spec
from .nn import QuantizedLinear

__all__ = ["quantize_model", "resolve_spec", "check_method", "QuantizationReport", "LayerReport", "model_size",
           "DEFAULT_IGNORE", "BITS_FORMATS", "METHODS", "matches", "CALIBRATION_OPTIONS",
           "pop_calibration_options", "context_length"]

#: Module-name patterns left in float unless ``ignore=`` says otherwise: the output projection
#: and anything named like an embedding (``nn.Embedding`` is never touched anyway).
DEFAULT_IGNORE = ("lm_head", "embed_out", "*embed*", "*wte", "*wpe")

#: ``bits`` -> (format, default params): a policy of the model level (which format and settings
#: ``bits=`` means), not a fact of the formats; each format's own defaults are in its ``SPEC``.
BITS_FORMATS = {
    8: ("int8", {"granularity": "row"}),
    4: ("int4", {"group_size": 128, "symmetric": False}),
    2: ("mixed2bit", {"group_size": 16, "ratio_4bit": 0.0}),
}

#: Implemented methods; the others named here raise NotImplementedError.
METHODS = ("rtn", "signround", "budget")
_LATER_METHODS = ("autoround",)
_LATER_ISSUE = ("the model-level follow-up issue (trainable rounding: SignRound/AutoRound, and "
                "budgeted per-layer bits)")


# -- the per-layer specification ---------------------------------------------------------------

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


def _block(fmt: str, params: dict) -> int:
    """in_features must be a multiple of this for ``fmt`` with ``params`` (1: any): the
    format's own :attr:`~qformats._spec.FormatSpec.block`."""
    return int(format_spec(fmt).block(params))


def _apply_group_size(fmt: str, params: dict, group_size: Optional[int]) -> dict:
    """Fold a generic ``group_size`` into ``fmt``'s own parameter
    (:attr:`~qformats._spec.FormatSpec.with_group_size`; ValueError where the format cannot
    take it)."""
    if group_size is None:
        return params
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    return dict(format_spec(fmt).with_group_size(dict(params), group_size))


def resolve_spec(format: Optional[str] = None, bits: Optional[int] = None,
                 group_size: Optional[int] = None, **params) -> tuple[str, dict]:
    """``(format, quantize params)`` for one layer from the user's choice, validated.

    Args:
        format: a qformats format name (any of ``qformats.FORMATS``).
        bits: 8, 4 or 2 (see :data:`BITS_FORMATS`); exactly one of ``format`` and ``bits``.
        group_size: values per group (int4, mixed2bit, int8 -> per-group scales, nf4 ->
            ``blocksize``; q4_0 / q8_1 only accept 32).
        **params: the format's ``quantize`` keyword arguments (override the defaults).
    Returns:
        the format name and the keyword arguments for its ``quantize``.
    Raises:
        ValueError: neither or both of format and bits, bits not in 8/4/2, an unknown format
            or parameter, a parameter value the format rejects (e.g. an int4 group_size that is
            not a multiple of 8), per-layer tensors (``sensitivity``).
    """
    if (format is None) == (bits is None):
        raise ValueError("give exactly one of format= (a qformats format) and bits= (8, 4 or 2)"
                         + (f"; got format={format!r} and bits={bits!r}" if format is not None else ""))
    if bits is not None:
        if isinstance(bits, bool) or bits not in BITS_FORMATS:
            raise ValueError(f"bits must be one of {sorted(BITS_FORMATS, reverse=True)} "
                             f"(8: int8, 4: int4, 2: mixed2bit), got {bits!r}")
        fmt, defaults = BITS_FORMATS[int(bits)]
        base = dict(defaults)
    else:
        if not isinstance(format, str) or format not in FORMATS:
            raise ValueError(f"unknown format {format!r}; known: {', '.join(FORMATS)}")
        fmt, base = format, {}
    base = _apply_group_size(fmt, base, group_size)
    base.update(params)
    if "sensitivity" in base:
        raise ValueError("sensitivity is a per-layer tensor from calibration data: pass "
                         "calibration= (token ids, or a text with tokenizer=) and quantize_model "
                         "measures it for each mixed2bit layer")
    mod = format_module(fmt)
    try:
        inspect.signature(mod.quantize).bind(None, **base)
    except TypeError as e:
        raise ValueError(f"{fmt}: bad parameters {base}: {e}") from e
    # Try the parameters on a tiny weight, so that a bad value fails before any layer changes.
    blk = _block(fmt, base)
    try:
        mod.quantize(torch.zeros((2, max(blk, 32) if blk > 1 else 32)), **base)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{fmt}: bad parameters {base}: {e}") from e
    return fmt, base


def check_method(method: str) -> None:
    """Raise NotImplementedError for the methods not implemented yet (``"autoround"``: use
    ``"signround"``), ValueError for an unknown one; nothing for ``"rtn"``, ``"signround"`` and
    ``"budget"``."""
    if method in _LATER_METHODS:
        raise NotImplementedError(f"method={method!r} is not implemented yet; it comes with "
                                  f"{_LATER_ISSUE}. Use method='rtn'.")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; implemented: {', '.join(METHODS)}")


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


# -- the report --------------------------------------------------------------------------------

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


@dataclass
class QuantizationReport:
    """What :func:`quantize_model` did.

    Attributes:
        method: ``"rtn"``, ``"signround"`` or ``"budget"``.
        layers: a :class:`LayerReport` per ``nn.Linear`` found, in module order.
        calibration: with ``method="rtn"`` and ``calibration=``, what mixed2bit's
            sensitivities were measured on (``layers``, ``windows`` [count, max tokens],
            ``sensitivity_power``, ``seconds``), else None.
        budget: with ``method="budget"``, the outcome (:func:`qformats.budget.quantize_budget`:
            ``holds``, ``ppl``, ``ppl_reference``, ``ppl_increase_percent``, ``kl``,
            ``avg_bits``, per-layer ``choices``...), else None.
        warnings: messages for layers kept in float (also issued with ``warnings.warn``).
        size: :func:`model_size` of the model afterwards.
        seconds: total wall time.
    """

    method: str
    layers: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    size: dict = field(default_factory=dict)
    seconds: float = 0.0
    budget: Optional[dict] = None
    calibration: Optional[dict] = None

    @property
    def quantized(self) -> list:
        """The LayerReports of the quantized layers."""
        return [l for l in self.layers if l.status == "quantized"]

    @property
    def skipped(self) -> list:
        """Layers kept in float although no ignore pattern named them."""
        return [l for l in self.layers if l.status == "skipped"]

    @property
    def ignored(self) -> list:
        """The LayerReports of the layers an ignore pattern kept in float."""
        return [l for l in self.layers if l.status == "ignored"]

    @property
    def formats(self) -> dict:
        """``{format: number of layers}`` over the quantized layers."""
        out: dict = {}
        for l in self.quantized:
            out[l.format] = out.get(l.format, 0) + 1
        return out

    @property
    def avg_bits(self) -> float:
        """Stored bits per value over the quantized layers' weights (NaN if none)."""
        q = self.quantized
        n = sum(l.in_features * l.out_features for l in q)
        return 8.0 * sum(l.nbytes for l in q) / n if n else math.nan

    @property
    def total_bytes(self) -> int:
        """The model's stored bytes: packed weights + every other parameter and persistent
        buffer at its dtype (see :func:`model_size`)."""
        return int(self.size.get("total_bytes", 0))

    def to_dict(self) -> dict:
        """JSON-ready dict (NaN -> None)."""
        d = {"method": self.method, "layers": [asdict(l) for l in self.layers],
             "warnings": list(self.warnings), "size": dict(self.size), "seconds": self.seconds,
             "formats": self.formats, "avg_bits": self.avg_bits}
        if self.budget is not None:
            d["budget"] = self.budget
        if self.calibration is not None:
            d["calibration"] = self.calibration
        return _nan_to_none(d)

    def summary(self) -> str:
        """A few lines: counts per format, average bits, skipped layers, size."""
        fm = ", ".join(f"{k} x{v}" for k, v in self.formats.items()) or "none"
        lines = [f"quantized {len(self.quantized)} of {len(self.layers)} Linear layers "
                 f"({self.method}): {fm}; {self.avg_bits:.3f} bits/weight on average"]
        if self.ignored:
            lines.append(f"kept in float (ignored): {', '.join(l.name for l in self.ignored[:6])}"
                         + (" ..." if len(self.ignored) > 6 else ""))
        by_reason: dict = {}
        for l in self.skipped:
            by_reason.setdefault(l.reason, []).append(l.name)
        for reason, names in by_reason.items():
            lines.append(f"kept in float ({reason}): {len(names)} layer(s): "
                         + ", ".join(names[:4]) + (" ..." if len(names) > 4 else ""))
        b = self.budget
        if b is not None:
            lines.append(f"budget: perplexity {b['ppl']:.3f} vs {b['ppl_reference']:.3f} "
                         f"({b['ppl_increase_percent']:+.2f}%)"
                         + (f", KL {b['kl']:.4f}" if b.get("kl") is not None else "")
                         + f" on the calibration windows: {'holds' if b['holds'] else 'NOT met'}")
        s = self.size
        if s:
            lines.append(f"size: {s['total_bytes'] / 1e6:.2f} MB = quantized weights "
                         f"{s['quantized_bytes'] / 1e6:.2f} MB + other tensors {s['other_bytes'] / 1e6:.2f} MB "
                         f"(1 MB = 10^6 bytes)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _nan_to_none(v):
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _nan_to_none(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_nan_to_none(x) for x in v]
    return v


def model_size(model: nn.Module) -> dict:
    """Stored size of a model: what :func:`qformats.save_quantized` writes.

    Counts every tensor of ``model.state_dict()`` once (tied parameters once): the packed
    buffers of :class:`~qformats.nn.QuantizedLinear` layers as "quantized", everything else
    (float Linears, embeddings, norms, biases, persistent buffers) as "other", at its current
    dtype.

    Returns:
        dict with ``quantized_bytes``, ``other_bytes``, ``total_bytes`` (bytes),
        ``quantized_layers`` (count), ``quantized_values`` (weight values they hold),
        ``avg_bits`` (8 * quantized_bytes / quantized_values; NaN when none) and
        ``size_mb`` (total_bytes / 10^6).
    """
    qnames = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            for b in m.buffer_names:
                qnames[f"{name}.{b}" if name else b] = m
    seen: set = set()
    qbytes = obytes = qvalues = 0
    layers = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        nb = t.numel() * t.element_size()
        if key in qnames:
            qbytes += nb
            m = qnames[key]
            if id(m) not in layers:
                layers.add(id(m))
                qvalues += m.in_features * m.out_features
        else:
            obytes += nb
    return {"quantized_bytes": qbytes, "other_bytes": obytes, "total_bytes": qbytes + obytes,
            "quantized_layers": len(layers), "quantized_values": qvalues,
            "avg_bits": 8.0 * qbytes / qvalues if qvalues else math.nan,
            "size_mb": (qbytes + obytes) / 1e6}


# -- quantize_model ---------------------------------------------------------------------------

def _output_embedding(model: nn.Module):
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            return get()
        except (AttributeError, NotImplementedError, TypeError):
            return None
    return None


def quantize_model(model: nn.Module, format: Optional[str] = None, bits: Optional[int] = None,
                   group_size: Optional[int] = None, method: str = "rtn",
                   ignore: Optional[Sequence[str]] = None,
                   overrides: Optional[Mapping[str, Mapping[str, Any]]] = None,
                   progress: bool = False, **params) -> QuantizationReport:
    """Replace the model's ``nn.Linear`` layers by :class:`~qformats.nn.QuantizedLinear`, in place.

    Every ``nn.Linear`` whose name matches no ``ignore`` pattern is quantized from its current
    weight (on its device, from its dtype) with round to nearest. Layers whose in_features is
    not a multiple of the chosen format's block stay in float; so do the ``out_proj`` layers
    of ``nn.MultiheadAttention`` (it reads their weight directly). Each is reported with a
    warning. All layers are quantized before any is replaced, so an error leaves the model
    unchanged.

    Args:
        model: any ``torch.nn.Module`` (e.g. a Hugging Face model); modified in place.
        format: a qformats format name; or
        bits: 8 (int8, per-row scales), 4 (int4 asymmetric, group_size 128) or 2 (mixed2bit,
            ratio_4bit=0, group_size 16). Exactly one of format / bits.
        group_size: values per group along in_features (int4, mixed2bit; int8 -> per-group
            scales; nf4 -> blocksize; q4_0 / q8_1 are fixed at 32).
        method: ``"rtn"`` (round to nearest; with ``calibration=`` in ``**params``, the
            mixed2bit layers with ``ratio_4bit > 0`` choose their 4-bit groups by the mean
            squared input per column (the diagonal of ``X^T X`` over the calibration tokens,
            normalized, ``** sensitivity_power``) passed as mixed2bit's ``sensitivity``;
            options ``calibration`` (token-id tensors, or a text with ``tokenizer``),
            ``nsamples=128``, ``seqlen=2048`` (capped at the model's
            ``max_position_embeddings``), ``batch_size=8``, ``sensitivity_power=1.0``; what
            was measured in ``report.calibration``); or ``"signround"`` (trainable rounding
            for int4 asymmetric and mixed2bit without outliers, 4-bit groups chosen by the
            calibrated sensitivity first: :mod:`qformats.signround`; its options go in
            ``**params``:
            ``calibration`` (token-id tensors, or a text with ``tokenizer``), ``iters=200``,
            ``nsamples=128``, ``seqlen=2048``, ``lr=None`` (1 / iters), ``batch_size=8``,
            ``seed=0``, ``selection="sensitivity"`` (or ``"range"``),
            ``sensitivity_power=1.0``; per-block losses in ``report.signround``); or ``"budget"``
            (per-layer formats chosen to meet a quality budget with the fewest bits:
            :mod:`qformats.budget`; options in ``**params``: ``calibration`` (+ ``tokenizer``),
            ``max_perplexity_increase`` (percent) and/or ``max_per_token_kl_divergence``,
            ``candidates`` (default :data:`qformats.budget.DEFAULT_CANDIDATES`),
            ``nsamples=16``, ``seqlen=512``, ``batch_size=8``, ``selection``,
            ``sensitivity_power``, ``signround`` (options of signround candidates); format /
            bits only decide which layers are eligible (default bits=4); the outcome is in
            ``report.budget``).
            ``"autoround"`` raises NotImplementedError (``"signround"`` is that method).
        ignore: module-name patterns to keep in float (see :func:`matches`); default
            :data:`DEFAULT_IGNORE` (``lm_head``, embeddings) plus the model's
            ``get_output_embeddings()``. A list replaces the default: ``ignore=[]`` quantizes
            every Linear, lm_head included.
        overrides: ``{pattern: {"format" or "bits", "group_size", params...}}`` per layer. Every
            matching pattern applies, in order; one that names ``format`` or ``bits`` starts
            from that format's defaults, one with only parameters updates the layer's.
            ``{"pattern": {"skip": True}}`` keeps the matches in float.
        progress: tqdm progress bar on stderr.
        **params: the format's ``quantize`` arguments (``symmetric=True``, ``ratio_4bit=0.1``, ...).
    Returns:
        a :class:`QuantizationReport` (per-layer status, formats, average bits, size). The
        model itself is changed in place (the same object, now holding QuantizedLinears).
    Raises:
        ValueError: a bad format / bits / group_size / parameter (globally or in an override),
            an override pattern that matches no Linear, or no layer could be quantized although
            some were eligible (the group size divides none of their in_features);
            ``calibration=`` with ``method="rtn"`` when no planned layer is mixed2bit with
            ``ratio_4bit > 0``, or bad calibration options.
        NotImplementedError: ``method`` is one of the later methods.
        TypeError: model is not an nn.Module.
    """
    t0 = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    params = dict(params)
    sr_options = budget_options = cal_options = None
    if method == "rtn" and "calibration" in params:
        cal_options = pop_calibration_options(params)
    if method == "budget":
        from .budget import pop_options as budget_pop
        budget_options = budget_pop(params)
        if format is None and bits is None:
            bits = 4
    if method == "signround":  # trainable rounding: qformats.signround (int4 asym., plain 2-bit)
        from .signround import pop_options
        sr_options = pop_options(params)
        sr_options["seqlen"] = context_length(model, sr_options["seqlen"])
        if sr_options["calibration"] is None:
            raise ValueError(
                "method='signround' needs calibration data: pass calibration= token-id tensors, "
                "or a text with tokenizer=")
    else:
        check_method(method)
    glob = {"format": format, "bits": bits, "group_size": group_size, "params": dict(params)}
    resolve_spec(format, bits, group_size, **params)  # validate the global choice up front
    overrides = dict(overrides or {})
    for pat, ov in overrides.items():
        if not isinstance(pat, str) or not isinstance(ov, Mapping):
            raise ValueError(f"overrides: expected {{pattern: {{format/bits/params}}}}, got "
                             f"{pat!r}: {ov!r}")
    if ignore is None:
        ignore_pats = list(DEFAULT_IGNORE)
        head = _output_embedding(model)
    else:
        if isinstance(ignore, str):
            ignore = [ignore]
        ignore_pats, head = list(ignore), None

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if linears and linears[0][0] == "":
        raise ValueError("model is a bare nn.Linear; use qformats.nn.QuantizedLinear.from_linear "
                         "or wrap it in a container")
    mha_out = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    report = QuantizationReport(method=method)
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
            report.layers.append(LayerReport(name, "ignored", None, {}, in_f, out_f, w_bytes, w_bits,
                                             reason=why))
            continue
        if spec["params"].get("skip"):
            report.layers.append(LayerReport(name, "ignored", None, {}, in_f, out_f, w_bytes, w_bits,
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
        blk = _block(fmt, qparams)
        reason = ""
        if id(m) in mha_out:
            reason = "out_proj of nn.MultiheadAttention, which reads its weight directly"
        elif in_f % blk:
            reason = f"in_features={in_f} is not a multiple of the {fmt} block of {blk}"
        elif m.weight.ndim != 2:
            reason = f"{fmt} needs a 2-D weight [out, in] (QuantizedLinear), got {m.weight.ndim}-D"
        if reason:
            msg = f"{name}: kept in float: {reason}"
            report.warnings.append(msg)
            warnings.warn(f"qformats.quantize_model: {msg}", stacklevel=2)
            report.layers.append(LayerReport(name, "skipped", fmt, qparams, in_f, out_f, w_bytes,
                                             w_bits, reason=reason))
            continue
        plan.append((name, m, fmt, qparams))
        report.layers.append(None)  # filled below, keeps module order
    unused = [p for p in overrides if p not in used_overrides]
    if unused:
        raise ValueError(f"overrides: pattern(s) {unused} match no nn.Linear of the model")
    if not plan and report.skipped:
        raise ValueError(f"no Linear layer could be quantized: {report.skipped[0].reason} "
                         f"(and {len(report.skipped) - 1} more like it)")

    from .evaluate import progress_bar

    new = []
    sr_stats = budget_stats = cal_stats = None
    sens: dict = {}
    if cal_options is not None:
        sens, cal_stats = _calibrated_sensitivities(model, plan, cal_options)
    if budget_options is not None:
        from .budget import quantize_budget
        new, budget_stats = quantize_budget(model, plan, budget_options, progress=progress)
        plan = []
    if sr_options is not None:
        from .signround import quantize_plan
        new, sr_stats = quantize_plan(model, plan, sr_options, progress=progress)
        plan = []
    bar = progress_bar(plan, enabled=progress, desc=f"quantize ({method})", unit="layer", leave=False)
    for name, m, fmt, qparams in bar:
        t1 = time.perf_counter()
        extra = {"sensitivity": sens[name]} if name in sens else {}
        try:
            q = QuantizedLinear.from_linear(m, fmt, **qparams, **extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"layer {name}: {fmt} {qparams}: {e}") from e
        new.append((name, q, time.perf_counter() - t1))
    bar.close()

    it = iter(new)
    for i, l in enumerate(report.layers):
        if l is not None:
            continue
        name, q, secs = next(it)
        _set_submodule(model, name, q)
        report.layers[i] = LayerReport(name, "quantized", q.format, dict(q.params), q.in_features,
                                       q.out_features, q.nbytes, q.avg_bits, seconds=secs)
    report.size = model_size(model)
    report.seconds = time.perf_counter() - t0
    if budget_stats is not None:
        report.budget = budget_stats  # the outcome: holds, ppl, avg_bits, per-layer choices
    if cal_stats is not None:
        report.calibration = cal_stats  # what the sensitivities were measured on
    if sr_stats is not None:
        report.signround = sr_stats  # per-block losses (see qformats.signround.quantize_plan)
    return report


#: quantize_model keyword arguments of calibrated round to nearest (method="rtn" with
#: calibration=): mixed2bit's 4-bit groups chosen by the activations' second moment.
CALIBRATION_OPTIONS = ("calibration", "tokenizer", "nsamples", "seqlen", "batch_size",
                       "sensitivity_power")
CALIBRATION_DEFAULTS = {"calibration": None, "tokenizer": None, "nsamples": 128, "seqlen": 2048,
                        "batch_size": 8, "sensitivity_power": 1.0}


def pop_calibration_options(params: dict) -> dict:
    """Remove the calibration options (:data:`CALIBRATION_OPTIONS`) of ``method="rtn"`` from
    ``params`` (in place) and return them with :data:`CALIBRATION_DEFAULTS` filled in.

    Raises:
        ValueError: ``sensitivity_power`` not a finite number > 0, ``nsamples`` / ``seqlen`` /
            ``batch_size`` not ints >= 1.
    """
    from .signround import check_selection

    out = dict(CALIBRATION_DEFAULTS)
    for k in CALIBRATION_OPTIONS:
        if k in params:
            out[k] = params.pop(k)
    check_selection("sensitivity", out["sensitivity_power"])
    for k in ("nsamples", "seqlen", "batch_size"):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k}: expected an int >= 1, got {v!r}")
    return out


def context_length(model: nn.Module, seqlen: int) -> int:
    """``seqlen`` capped at the model's ``config.max_position_embeddings`` (when it has one)."""
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(int(seqlen), int(ctx)) if isinstance(ctx, int) and ctx > 0 else int(seqlen)


def _calibrated_sensitivities(model: nn.Module, plan: list, options: dict) -> tuple[dict, dict]:
    """``({layer name: float32 sensitivity [in]}, stats)`` for the planned mixed2bit layers with
    4-bit groups: the mean squared input per column over the calibration samples (forward
    hooks on the float model, a float64 ``[in]`` accumulator per layer), normalized and raised
    to ``sensitivity_power`` (:func:`qformats.signround.sensitivity_from_moments`).

    Raises:
        ValueError: no planned layer is mixed2bit with ``ratio_4bit > 0`` (calibration would
            change nothing), or calibration data that
            :func:`qformats.signround.calibration_samples` rejects.
    """
    from .signround import calibration_samples, model_second_moments, sensitivity_from_moments

    layers = {name: m for name, m, fmt, qp in plan if format_spec(fmt).calibrated(qp)}
    if not layers:
        raise ValueError("calibration= with method='rtn' only chooses mixed2bit's 4-bit groups "
                         "(format='mixed2bit' or bits=2 with ratio_4bit > 0); no planned layer is one")
    t0 = time.perf_counter()
    seqlen = context_length(model, options["seqlen"])
    samples = calibration_samples(options["calibration"], options["tokenizer"], options["nsamples"], seqlen)
    moments = model_second_moments(model, layers, samples, options["batch_size"])
    sens = {n: sensitivity_from_moments(m, options["sensitivity_power"]) for n, m in moments.items()}
    stats = {"layers": len(sens), "windows": [len(samples), max(int(t.shape[1]) for t in samples)],
             "sensitivity_power": options["sensitivity_power"], "seconds": time.perf_counter() - t0}
    return sens, stats


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted ``name`` (``""`` is not allowed)."""
    if not name:
        raise ValueError("cannot replace the model itself; wrap a bare nn.Linear in a container")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
