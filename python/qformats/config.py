"""The quantization methods of :func:`qformats.quantize_model` and their options, one frozen
dataclass per method with its defaults in one place: :class:`RTNConfig` (round to nearest with
calibrated mixed2bit groups), :class:`SignRoundConfig` (:mod:`qformats.signround`) and
:class:`BudgetConfig` (:mod:`qformats.budget`).

``quantize_model`` takes the options as keyword arguments and turns them into a config here
(:meth:`~SignRoundConfig.pop`), so every check of an option is made once, before any layer
changes. This module imports neither torch nor any other module of the package, so the command
line reads the defaults from it without loading torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Optional

__all__ = ["METHODS", "SELECTIONS", "CANDIDATE_METHODS", "DEFAULT_CANDIDATES", "check_method",
           "check_selection", "RTNConfig", "SignRoundConfig", "BudgetConfig", "METHOD_CONFIGS"]

#: Implemented methods; the others named here raise NotImplementedError.
METHODS = ("rtn", "signround", "budget")
_LATER_METHODS = ("autoround",)
_LATER_ISSUE = ("the model-level follow-up issue (trainable rounding: SignRound/AutoRound, and "
                "budgeted per-layer bits)")
#: How mixed2bit's 4-bit groups are chosen: by the calibrated sensitivity, or by range.
SELECTIONS = ("sensitivity", "range")
#: How a budget candidate is quantized: round to nearest, or trained with :mod:`qformats.signround`.
CANDIDATE_METHODS = ("rtn", "signround")

#: (format, params) candidates of the budget method, any order (sorted by stored bits per
#: layer): a policy of the method (which formats it weighs by default), not a fact of the formats.
DEFAULT_CANDIDATES = (
    ("int8", {"granularity": "row"}),
    ("int4", {"group_size": 128, "symmetric": False}),
    ("mixed2bit", {"group_size": 16, "ratio_4bit": 0.1}),
    ("mixed2bit", {"group_size": 16, "ratio_4bit": 0.0}),
)


def check_method(method: str) -> None:
    """Raise NotImplementedError for the methods not implemented yet (``"autoround"``: use
    ``"signround"``), ValueError for an unknown one; nothing for ``"rtn"``, ``"signround"`` and
    ``"budget"``."""
    if method in _LATER_METHODS:
        raise NotImplementedError(f"method={method!r} is not implemented yet; it comes with "
                                  f"{_LATER_ISSUE}. Use method='rtn'.")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; implemented: {', '.join(METHODS)}")


def check_selection(selection: Any, power: Any) -> None:
    """Raise ValueError unless ``selection`` is one of :data:`SELECTIONS` and ``power`` a
    finite number > 0."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection: expected one of {SELECTIONS}, got {selection!r}")
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not (0 < power < math.inf):
        raise ValueError(f"sensitivity_power: expected a finite number > 0, got {power!r}")


def _check_counts(cfg: Any, names: tuple) -> None:
    for k in names:
        v = getattr(cfg, k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k}: expected an int >= 1, got {v!r}")


class _Options:
    """What the method configs share: taking their options out of ``quantize_model``'s
    keyword arguments, and listing them."""

    @classmethod
    def names(cls) -> tuple:
        """The option names (the dataclass fields), in order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def defaults(cls) -> dict:
        """``{option: default}``."""
        return {f.name: f.default for f in fields(cls)}

    @classmethod
    def pop(cls, params: dict):
        """The config of the options in ``params`` (removed from it, in place; the others are
        the format's parameters), defaults for the rest. ValueError for a bad value."""
        return cls(**{k: params.pop(k) for k in cls.names() if k in params})

    def options(self, *, data: bool = True) -> dict:
        """``{option: value}``; without ``calibration`` and ``tokenizer`` when ``data`` is False."""
        return {k: getattr(self, k) for k in self.names()
                if data or k not in ("calibration", "tokenizer")}

    def replace(self, **changes):
        """A copy with ``changes`` applied (checked again)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class RTNConfig(_Options):
    """``method="rtn"`` with ``calibration=``: mixed2bit's 4-bit groups chosen by the
    activations' second moment (the mean squared input per column over the calibration
    samples, ``** sensitivity_power``).

    Attributes:
        calibration: token-id tensors, or a text (with ``tokenizer``); see
            :func:`qformats.calibration.calibration_samples`.
        tokenizer: turns a text ``calibration`` into token ids.
        nsamples, seqlen: at most ``nsamples`` windows of ``seqlen`` tokens (capped at the
            model's ``max_position_embeddings``).
        batch_size: windows per forward pass.
        sensitivity_power: the exponent of the normalized second moment.
    Raises:
        ValueError: ``sensitivity_power`` not a finite number > 0, ``nsamples`` / ``seqlen`` /
            ``batch_size`` not ints >= 1.
    """

    calibration: Any = None
    tokenizer: Any = None
    nsamples: int = 128
    seqlen: int = 2048
    batch_size: int = 8
    sensitivity_power: float = 1.0

    def __post_init__(self):
        check_selection("sensitivity", self.sensitivity_power)
        _check_counts(self, ("nsamples", "seqlen", "batch_size"))


@dataclass(frozen=True)
class SignRoundConfig(_Options):
    """``method="signround"``: trainable rounding (:mod:`qformats.signround`).

    Attributes:
        calibration, tokenizer: the calibration data (needed; see :class:`RTNConfig`).
        iters: SignSGD steps per block (>= 0; 0 keeps round to nearest).
        nsamples, seqlen: calibration windows and their length in tokens.
        lr: the learning rate (None: ``1 / iters``), decaying linearly to 0.
        batch_size: windows per step.
        seed: the seed of the batches' sampling (block ``i`` uses ``seed + i``).
        selection: how mixed2bit's 4-bit groups are chosen before training:
            ``"sensitivity"`` (calibrated) or ``"range"``.
        sensitivity_power: the exponent of the normalized second moment.
        amp: run the blocks' matrix products (targets, steps, outputs) under
            ``torch.autocast`` in bfloat16, as AutoRound's ``amp`` does; the fake
            quantization, the losses and the parameters stay float32. On a GPU, and on a CPU
            with native bfloat16 products (AVX-512 BF16, AMX); elsewhere the CPU emulates
            them, slower than float32 (benchmarks/README.md, "Trainable rounding and the
            budget on the CPU").
    Raises:
        ValueError: ``selection`` not in :data:`SELECTIONS`, or ``sensitivity_power`` not a
            finite number > 0.
    """

    calibration: Any = None
    tokenizer: Any = None
    iters: int = 200
    nsamples: int = 128
    seqlen: int = 2048
    lr: Optional[float] = None
    batch_size: int = 8
    seed: int = 0
    selection: str = "sensitivity"
    sensitivity_power: float = 1.0
    amp: bool = False

    def __post_init__(self):
        check_selection(self.selection, self.sensitivity_power)


@dataclass(frozen=True)
class BudgetConfig(_Options):
    """``method="budget"``: per-layer formats chosen to meet a quality budget with the fewest
    bits (:mod:`qformats.budget`).

    Attributes:
        calibration, tokenizer: the windows the budget is measured on (needed).
        max_perplexity_increase: percent, and/or
        max_per_token_kl_divergence: nats per predicted token (at least one of the two).
        candidates: ``(format, params)`` or ``(format, params, method)`` with method in
            :data:`CANDIDATE_METHODS`; kept as ``(format, params, method)`` triples.
        nsamples, seqlen, batch_size: the calibration windows and windows per forward.
        selection, sensitivity_power: calibrated mixed2bit (as :class:`SignRoundConfig`).
        signround: options of the signround candidates (:class:`SignRoundConfig` fields);
            by default they train on the budget's own windows.
    Raises:
        ValueError: neither budget given, a budget that is not a finite number >= 0, no
            calibration, an empty candidate list, a malformed candidate, a bad ``selection`` /
            ``sensitivity_power``, or unknown ``signround`` options.
    """

    #: The eligibility rule when neither ``format`` nor ``bits`` is given: ``bits=4``.
    DEFAULT_BITS: ClassVar[int] = 4

    calibration: Any = None
    tokenizer: Any = None
    max_perplexity_increase: Optional[float] = None
    max_per_token_kl_divergence: Optional[float] = None
    candidates: Any = DEFAULT_CANDIDATES
    nsamples: int = 16
    seqlen: int = 512
    batch_size: int = 8
    selection: str = "sensitivity"
    sensitivity_power: float = 1.0
    signround: Optional[dict] = None

    def __post_init__(self):
        p, kl = self.max_perplexity_increase, self.max_per_token_kl_divergence
        if p is None and kl is None:
            raise ValueError("method='budget' needs max_perplexity_increase= (percent) and/or "
                             "max_per_token_kl_divergence= (nats per token)")
        for name, v in (("max_perplexity_increase", p), ("max_per_token_kl_divergence", kl)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0
                                  or not math.isfinite(v)):
                raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
        if self.calibration is None:
            raise ValueError("method='budget' needs calibration data to evaluate on: calibration= "
                             "token-id windows, or a text with tokenizer=")
        cands = list(self.candidates)
        if not cands:
            raise ValueError("candidates: expected at least one (format, params) pair")
        norm = []
        for c in cands:
            if not isinstance(c, (tuple, list)) or len(c) not in (2, 3) or not isinstance(c[1], dict):
                raise ValueError(f"candidates: expected (format, params) or (format, params, method) "
                                 f"with params a dict, got {c!r}")
            meth = c[2] if len(c) == 3 else "rtn"
            if meth not in CANDIDATE_METHODS:
                raise ValueError(f"candidates: method must be one of {CANDIDATE_METHODS}, got {meth!r} in {c!r}")
            norm.append((c[0], dict(c[1]), meth))
        object.__setattr__(self, "candidates", norm)
        check_selection(self.selection, self.sensitivity_power)
        sro = self.signround
        if sro is not None and not isinstance(sro, dict):
            raise ValueError(f"signround: expected a dict of signround options, got {sro!r}")
        if sro:
            bad = sorted(set(sro) - set(SignRoundConfig.names()))
            if bad:
                raise ValueError(f"signround: unknown option(s) {bad}; known: {sorted(SignRoundConfig.names())}")


#: ``method`` -> its config class.
METHOD_CONFIGS = {"rtn": RTNConfig, "signround": SignRoundConfig, "budget": BudgetConfig}
