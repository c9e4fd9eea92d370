"""qformats -> GGUF -> llama.cpp, checked against qformats on the same text.

Quantizes a Llama-family model folder to q4_0 (``qformats quantize``), writes it as GGUF
(``qformats export-gguf``), then compares:

- tokenization: llama.cpp's ``llama-tokenize`` of the text against the Hugging Face tokenizer
  (ids equal, or the first difference);
- perplexity: llama.cpp's ``llama-perplexity -c CTX`` (consecutive chunks of CTX tokens, the
  second half of each scored) against ``qformats eval FILE.gguf --seqlen CTX --score-from
  CTX/2`` (the same windows and scored tokens, the GGUF file read back with qformats.gguf.load);
- wall time of each.

llama.cpp is not a dependency: point ``--llama-bin`` at a folder holding ``llama-perplexity``
and ``llama-tokenize`` (a CPU build of any llama.cpp checkout, e.g. the one vendored in the
``llama-cpp-python`` source distribution: ``cmake -B build -DLLAMA_CURL=OFF && cmake --build
build --target llama-perplexity llama-tokenize``)::

    python benchmarks/llama_cpp_gguf.py --llama-bin ~/llama.cpp/build/bin \\
        --model ../shared/models/pydoc-llama-17m --text ../shared/data/pydoc/valid.txt
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(cmd: list) -> tuple:
    t0 = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-3000:]}")
    return r, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", required=True, type=Path, help="folder with llama-perplexity, llama-tokenize")
    ap.add_argument("--model", type=Path, default=Path("../shared/models/pydoc-llama-17m"))
    ap.add_argument("--text", type=Path, default=Path("../shared/data/pydoc/valid.txt"))
    ap.add_argument("--ctx", type=int, default=512, help="window / chunk size in tokens (default 512)")
    ap.add_argument("--chunks", type=int, default=0, help="only the first N windows (0: all)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, help="also write the results as JSON")
    args = ap.parse_args(argv)

    import torch
    from qformats import cli, gguf
    from qformats.evaluate import lm_windows, perplexity

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        qdir, gfile = Path(tmp) / "q4_0", Path(tmp) / "q4_0.gguf"
        t0 = time.perf_counter()
        if cli.main(["quantize", str(args.model), "--format", "q4_0", "--out", str(qdir), "--no-progress"]):
            return 1
        if cli.main(["export-gguf", str(qdir), str(gfile)]):
            return 1
        t_export = time.perf_counter() - t0

        text = args.text.read_text(encoding="utf-8")
        tok = gguf.load_tokenizer(gfile)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        r, _ = _run([args.llama_bin / "llama-tokenize", "-m", gfile, "-f", args.text, "--ids", "--log-disable",
                     "--no-escape"])  # the file as it is, as llama-perplexity reads it
        theirs = json.loads(r.stdout.strip().splitlines()[-1])
        same = ids == theirs
        first_diff = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b),
                          None if len(ids) == len(theirs) else min(len(ids), len(theirs)))

        cmd = [args.llama_bin / "llama-perplexity", "-m", gfile, "-f", args.text, "-c", args.ctx,
               "-t", args.threads]
        if args.chunks:
            cmd += ["--chunks", args.chunks]
        r, t_llama = _run(cmd)
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", r.stdout + r.stderr)
        ppl_llama, err_llama = float(m.group(1)), float(m.group(2))

        t0 = time.perf_counter()
        model = gguf.load(gfile)
        windows, info = lm_windows(tok, text, args.ctx)
        if args.chunks:
            windows = windows[: args.chunks]
        res = perplexity(model, windows, progress=False, score_from=args.ctx // 2)
        t_ours = time.perf_counter() - t0

    rel = ppl_llama / res["ppl"] - 1
    rows = {
        "model": str(args.model), "text": str(args.text), "ctx": args.ctx, "windows": int(windows.shape[0]),
        "tokens_scored": res["tokens"], "tokenization_equal": same, "text_tokens": len(ids),
        "first_token_difference": first_diff, "ppl_llama_cpp": ppl_llama, "ppl_llama_cpp_err": err_llama,
        "ppl_qformats": res["ppl"], "relative_difference": rel, "seconds_llama_cpp": t_llama,
        "seconds_qformats": t_ours, "seconds_quantize_export": t_export, "threads": args.threads,
    }
    print(f"tokenization: {'identical' if same else f'differs from token {first_diff}'} "
          f"({len(ids):,} tokens HF, {len(theirs):,} llama.cpp)")
    print(f"\n| {windows.shape[0]} windows of {args.ctx}, second halves scored | perplexity | seconds |")
    print("|---|---:|---:|")
    print(f"| llama.cpp llama-perplexity (GGUF Q4_0) | {ppl_llama:.4f} +/- {err_llama:.4f} | {t_llama:.1f} |")
    print(f"| qformats eval of the same file (q4_0, fp32) | {res['ppl']:.4f} | {t_ours:.1f} |")
    print(f"\nllama.cpp / qformats - 1 = {100 * rel:+.3f}%  (quantize + export: {t_export:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if abs(rel) < 0.01 and same else 1


if __name__ == "__main__":
    sys.exit(main())
