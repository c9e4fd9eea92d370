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

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence

from torch import nn

from ._core import format_spec
from .budget import quantize_budget
from .calibration import calibration_samples, context_length, model_second_moments, sensitivity_from_moments
from .config import BudgetConfig, RTNConfig, SignRoundConfig, check_method
from .nn import QuantizedLinear
from .plan import LayerReport, plan_layers, resolve_spec, set_submodule
from .progress import progress_bar
from .signround import quantize_plan
from .sizes import model_size

# Defined in qformats.plan, qformats.config (and above: resolve_spec, LayerReport, check_method,
# context_length, model_size), first defined here: still importable from here.
from .config import METHODS  # noqa: E402,F401
from .plan import BITS_FORMATS, DEFAULT_IGNORE, matches  # noqa: E402,F401

__all__ = ["quantize_model", "QuantizationReport", "CALIBRATION_OPTIONS"]


# -- the report --------------------------------------------------------------------------------

@dataclass
class QuantizationReport:
    """What :func:`quantize_model` did.

    Attributes:
        method: ``"rtn"``, ``"signround"`` or ``"budget"``.
        layers: a :class:`~qformats.plan.LayerReport` per ``nn.Linear`` found, in module order.
        calibration: with ``method="rtn"`` and ``calibration=``, what mixed2bit's
            sensitivities were measured on (``layers``, ``windows`` [count, max tokens],
            ``sensitivity_power``, ``seconds``), else None.
        budget: with ``method="budget"``, the outcome (:func:`qformats.budget.quantize_budget`:
            ``holds``, ``ppl``, ``ppl_reference``, ``ppl_increase_percent``, ``kl``,
            ``avg_bits``, per-layer ``choices``...), else None.
        warnings: messages for layers kept in float (also issued with ``warnings.warn``).
        size: :func:`~qformats.sizes.model_size` of the model afterwards.
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
        buffer at its dtype (see :func:`~qformats.sizes.model_size`)."""
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


# -- quantize_model ---------------------------------------------------------------------------

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
            scales; nf4 -> blocksize; q4_0 / q8_0 / q8_1 are fixed at 32).
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
            Each method's options are the fields of its config, with the defaults in one
            place: :class:`~qformats.config.RTNConfig`, :class:`~qformats.config.SignRoundConfig`,
            :class:`~qformats.config.BudgetConfig`.
            ``"autoround"`` raises NotImplementedError (``"signround"`` is that method).
        ignore: module-name patterns to keep in float (see :func:`qformats.plan.matches`); default
            :data:`qformats.plan.DEFAULT_IGNORE` (``lm_head``, embeddings) plus the model's
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
    # the method's options out of params (the rest are the format's), as its typed config
    check_method(method)
    config: Optional[Any] = None
    if method == "rtn" and "calibration" in params:
        config = RTNConfig.pop(params)
    if method == "budget":
        config = BudgetConfig.pop(params)
        if format is None and bits is None:
            bits = BudgetConfig.DEFAULT_BITS
    if method == "signround":  # trainable rounding: qformats.signround (int4 asym., plain 2-bit)
        config = SignRoundConfig.pop(params)
        config = config.replace(seqlen=context_length(model, config.seqlen))
        if config.calibration is None:
            raise ValueError(
                "method='signround' needs calibration data: pass calibration= token-id tensors, "
                "or a text with tokenizer=")
    glob = {"format": format, "bits": bits, "group_size": group_size, "params": dict(params)}
    resolve_spec(format, bits, group_size, **params)  # validate the global choice up front
    report = QuantizationReport(method=method)
    report.layers, plan, report.warnings = plan_layers(model, glob, ignore, overrides or {})

    new = []
    sr_stats = budget_stats = cal_stats = None
    sens: dict = {}
    if isinstance(config, RTNConfig):
        sens, cal_stats = _calibrated_sensitivities(model, plan, config)
    if isinstance(config, BudgetConfig):
        new, budget_stats = quantize_budget(model, plan, config, progress=progress)
        plan = []
    if isinstance(config, SignRoundConfig):
        new, sr_stats = quantize_plan(model, plan, config, progress=progress)
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
        set_submodule(model, name, q)
        report.layers[i] = LayerReport.of_quantized(name, q, secs)
    report.size = model_size(model)
    if "transformers" in sys.modules:  # a transformers model: save_pretrained keeps the layers
        from .hf import attach  # needs transformers (optional), imported by then

        attach(model)
    report.seconds = time.perf_counter() - t0
    if budget_stats is not None:
        report.budget = budget_stats  # the outcome: holds, ppl, avg_bits, per-layer choices
    if cal_stats is not None:
        report.calibration = cal_stats  # what the sensitivities were measured on
    if sr_stats is not None:
        report.signround = sr_stats  # per-block losses (see qformats.signround.quantize_plan)
    return report


#: quantize_model keyword arguments of calibrated round to nearest (method="rtn" with
#: calibration=): the fields of :class:`qformats.config.RTNConfig`.
CALIBRATION_OPTIONS = RTNConfig.names()


def _calibrated_sensitivities(model: nn.Module, plan: list, config: RTNConfig) -> tuple[dict, dict]:
    """``({layer name: float32 sensitivity [in]}, stats)`` for the planned layers whose format
    makes a calibrated choice (``SPEC.calibrated``: mixed2bit with 4-bit groups): the mean
    squared input per column over the calibration samples (forward hooks on the float model, a
    float64 ``[in]`` accumulator per layer), normalized and raised to ``sensitivity_power``
    (:func:`qformats.calibration.sensitivity_from_moments`).

    Raises:
        ValueError: no planned layer is mixed2bit with ``ratio_4bit > 0`` (calibration would
            change nothing), or calibration data that
            :func:`qformats.calibration.calibration_samples` rejects.
    """
    layers = {name: m for name, m, fmt, qp in plan if format_spec(fmt).calibrated(qp)}
    if not layers:
        raise ValueError("calibration= with method='rtn' only chooses mixed2bit's 4-bit groups "
                         "(format='mixed2bit' or bits=2 with ratio_4bit > 0); no planned layer is one")
    t0 = time.perf_counter()
    seqlen = context_length(model, config.seqlen)
    samples = calibration_samples(config.calibration, config.tokenizer, config.nsamples, seqlen)
    moments = model_second_moments(model, layers, samples, config.batch_size)
    sens = {n: sensitivity_from_moments(m, config.sensitivity_power) for n, m in moments.items()}
    stats = {"layers": len(sens), "windows": [len(samples), max(int(t.shape[1]) for t in samples)],
             "sensitivity_power": config.sensitivity_power, "seconds": time.perf_counter() - t0}
    return sens, stats
