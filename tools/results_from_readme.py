"""One-off: write benchmarks/results/{gemm_h200,quality}.json from the tables already published
in benchmarks/README.md and README.md, until the real result files are written by
``benchmarks/gemm.py --json`` (on the H200) and ``benchmarks/quality.py``.

    python tools/results_from_readme.py [--gemm] [--quality]     (default: both)

Not part of the docs build: the docs read the JSON files, whatever wrote them. Each file says
in ``meta.source`` that it was transcribed, and from where; every transcribed quality row also
has a ``source`` key (the docs mark those rows), so rows that ``benchmarks/quality.py`` merges
into the file later are told apart from them (``--no-merge`` writes a clean file).

GEMM: the "GEMV / GEMM on the GPU" table of benchmarks/README.md (measured 2026-11-21 on one
H200). The table has no weight-byte or copy-bandwidth column, so ``weight_bytes`` is computed
from the stored size of each kernel's weight (the sizes benchmarks/gemm.py counts; checked
against the table's GB/s x time to 1%) and ``copy_gbs`` per shape is derived from the table's
"weight GB/s" and "% copy" columns (median over the shape's rows with >= 10% of copy).

Quality: the RTN rows of README.md's ``qformats compare`` and ``qformats eval`` tables on
pydoc-llama-17m (96 evenly spaced 512-token windows of ../shared/data/pydoc/valid.txt, fp32
baseline 42.922), the MiniLM cosines of ``qformats compare`` (all-MiniLM-L6-v2), and the
trainable-rounding and budget results measured by the model-level work before
benchmarks/quality.py existed (listed in EARLIER below, with the bits of their formats computed
from the formats' stored sizes on the model's Linear shapes).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from qformats.mixed2bit import reference as m2ref  # noqa: E402  (pure numpy)

OUT = ROOT / "benchmarks" / "results"


# -- GEMM ---------------------------------------------------------------------------------------

def mixed2bit_bytes(rows: int, K: int, gs: int = 16, ratio: float = 0.1, sb: int = 16) -> int:
    ng = rows * (K // gs)
    n4 = m2ref.n4_count(ratio, ng)
    shapes = m2ref.buffer_shapes(rows, K, gs, sb, n4, 0)
    return sum(np.dtype(dt).itemsize * int(np.prod(s)) for dt, s in shapes.values())


def weight_bytes(kernel: str, M: int, K: int) -> int:
    """Stored weight bytes as benchmarks/gemm.py counts them for each row."""
    base = kernel.removesuffix("+cuBLAS")
    mk = M * K
    sizes = {
        "fp16 cuBLAS": 2 * mk,
        "nf4": mk // 2 + 4 * (mk // 64),                    # blocksize 64, float32 absmax
        "bnb-nf4": mk // 2 + 4 * (mk // 64),
        "int4": mk // 2 + 4 * (mk // 128) + mk // 128,      # g128 asymmetric: scales + zeros
        "q4_0": 18 * (mk // 32),
        "q4_0xq8_1": 18 * (mk // 32),
        "int8 fused": mk + 4 * M,
        "bnb-int8": mk + 4 * M,
        "int4xint4": mk // 2,
        "torch._int_mm": mk,
    }
    if base == "mixed2bit":
        return mixed2bit_bytes(M, K)
    return sizes[base]


ROW = re.compile(r"^\|\s*(\d+)x(\d+)\s*\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                 r"\s*([\d.]+)\s*\|\s*([\d.]+)%\s*\|\s*([\d.]+)x\s*\|$")


def gemm_rows() -> list[dict]:
    text = (ROOT / "benchmarks" / "README.md").read_text()
    section = text.split("## GEMV / GEMM on the GPU", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        mt = ROW.match(line.strip())
        if not mt:
            continue
        M, K, N = int(mt[1]), int(mt[2]), int(mt[3])
        kernel = mt[4]
        us, tf, gbs, pct, ratio = (float(mt[i]) for i in range(5, 10))
        wb = weight_bytes(kernel, M, K)
        if abs(wb / (us * 1e3) - gbs) > 0.01 * gbs + 1:
            raise SystemExit(f"weight bytes of {kernel} {M}x{K} disagree with the table: "
                             f"{wb / (us * 1e3):.0f} vs {gbs} GB/s")
        rows.append({"shape": f"{M}x{K}", "M": M, "K": K, "N": N, "kernel": kernel, "time_us": us,
                     "tflops": tf, "weight_bytes": wb, "weight_gbs": gbs, "pct_copy": pct,
                     "x_fp16": ratio})
    if not rows:
        raise SystemExit("no GEMM rows found in benchmarks/README.md")
    return rows


def write_gemm() -> Path:
    rows = gemm_rows()
    copy = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        est = [r["weight_gbs"] / (r["pct_copy"] / 100) for r in rows
               if r["shape"] == shape and r["pct_copy"] >= 10]
        copy[shape] = {"copy_us": None, "copy_gbs": round(statistics.median(est), 1)}
    for r in rows:
        r["copy_gbs"] = copy[r["shape"]]["copy_gbs"]
    meta = {
        "date": "2026-11-21",
        "gpu": "NVIDIA H200",
        "driver": "580.159.04",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "qformats": "0.1.0",
        "bitsandbytes": "0.50.2",
        "command": "python benchmarks/gemm.py --csv gemm.csv",
        "iters": 15,
        "copy": copy,
        "source": ("benchmarks/README.md table (transcribed by tools/results_from_readme.py; "
                   "weight_bytes computed from the formats' stored sizes, copy_gbs derived from "
                   "the table's GB/s and % copy columns); to be replaced by the output of "
                   "benchmarks/gemm.py --json"),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "gemm_h200.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return path


# -- quality ------------------------------------------------------------------------------------

FP32_PPL = 42.922
PYDOC_SHAPES = [(384, 384)] * 4 + [(1024, 384)] * 2 + [(384, 1024)]  # per layer, 6 layers

# Measured by the model-level work (qformats quantize --method signround / budget, then
# qformats eval on the same 96 windows) before benchmarks/quality.py existed.
EARLIER = [
    {"method": "signround", "format": "int4", "params": "group_size=128, symmetric=False", "ppl": 42.99,
     "bits_of": ("int4", 128)},
    {"method": "rtn", "format": "mixed2bit", "params": "group_size=32, ratio_4bit=0", "ppl": 54.07,
     "bits_of": ("mixed2bit", 32)},
    {"method": "signround", "format": "mixed2bit", "params": "group_size=32, ratio_4bit=0", "ppl": 46.51,
     "bits_of": ("mixed2bit", 32)},
    {"method": "budget", "format": "per layer", "params": "-", "ppl": 45.95,
     "bits": 3.197},
]
# `qformats compare --threads 1 --json FILE` (all-MiniLM-L6-v2, the default model and text), run
# on 2026-11-21 on the 2-core machine: bits/w and the mean cosine of each row.
MINILM = [("q4_0", "-", 4.5, 0.96390), ("q8_1", "-", 9.0, 0.99985),
          ("int8", "granularity=row", 8.063, 0.99954), ("int4", "group_size=128, symmetric=False", 4.312, 0.95051),
          ("nf4", "blocksize=64", 4.5, 0.96950), ("mixed2bit", "group_size=16, ratio_4bit=0.1", 2.938, 0.57829)]


def pydoc_bits(fmt: str, gs: int) -> float:
    n = sum(6 * a * b for a, b in PYDOC_SHAPES)
    if fmt == "mixed2bit":
        stored = sum(6 * mixed2bit_bytes(a, b, gs, 0.0) for a, b in PYDOC_SHAPES)
    elif fmt == "int4":
        stored = sum(6 * (a * b // 2 + 5 * (a * b // gs)) for a, b in PYDOC_SHAPES)
    else:
        raise ValueError(fmt)
    return 8 * stored / n


def readme_rtn_rows() -> list[dict]:
    text = (ROOT / "README.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # compare table: format | params | bits/w | size MB | NMSE | quant s | ppl | dppl
        if len(cells) == 8 and cells[0] in ("q4_0", "q8_1", "int8", "int4", "nf4", "mixed2bit"):
            rows.append({"method": "rtn", "format": cells[0], "params": cells[1],
                         "bits": float(cells[2]), "ppl": float(cells[6]),
                         "delta_pct": float(cells[7].rstrip("%")), "source": "README.md, qformats compare"})
        # eval table: the --bits 2 row (mixed2bit, ratio_4bit=0, groups of 16)
        if len(cells) == 7 and cells[0] == "`--bits 2`":
            rows.append({"method": "rtn", "format": "mixed2bit", "params": "group_size=16, ratio_4bit=0",
                         "bits": float(cells[2]), "ppl": float(cells[4]),
                         "delta_pct": float(cells[5].rstrip("%")), "source": "README.md, qformats eval"})
    if len(rows) != 7:
        raise SystemExit(f"expected 7 RTN rows in README.md, found {len(rows)}")
    return rows


def write_quality() -> Path:
    rows = readme_rtn_rows()
    for e in EARLIER:
        bits = e.get("bits")
        if bits is None:
            bits = round(pydoc_bits(*e["bits_of"]), 3)
        rows.append({"method": e["method"], "format": e["format"], "params": e["params"],
                     "bits": bits, "ppl": e["ppl"], "source": "earlier model-level measurement"})
    for r in rows:  # the README's own delta where it has one (from unrounded perplexities)
        r.setdefault("delta_pct", round(100 * (r["ppl"] / FP32_PPL - 1), 2))
    minilm = []
    for fmt, params, bits, cos in MINILM:
        minilm.append({"format": fmt, "params": params, "bits": bits, "cosine": cos,
                       "source": "qformats compare --threads 1, 2026-11-21"})
    meta = {
        "date": "2026-11-21",
        "machine": "2-core development machine (AMD EPYC Zen 5), torch 2.13.0+cpu",
        "command": ("qformats compare ../shared/models/pydoc-llama-17m --text ../shared/data/pydoc/valid.txt; "
                    "qformats quantize ... --method rtn|signround|budget, then qformats eval DIR "
                    "--text ../shared/data/pydoc/valid.txt"),
        "model": "../shared/models/pydoc-llama-17m",
        "text": "../shared/data/pydoc/valid.txt",
        "windows": "96 of 496 non-overlapping 512-token windows, evenly spaced",
        "fp32_ppl": FP32_PPL,
        "minilm_model": ("all-MiniLM-L6-v2, `qformats compare --threads 1` (256 paragraphs of "
                         "pydoc_data.topics, mean pooling; mean cosine to the fp32 model's embedding)"),
        "source": ("transcribed by tools/results_from_readme.py: RTN rows from README.md (qformats "
                   "compare / eval tables), MiniLM cosines from qformats compare, signround and "
                   "budget rows from the model-level work's earlier measurements (bits of the "
                   "2-bit g32 rows computed from mixed2bit's stored size on the model's shapes); to be "
                   "replaced by the output of benchmarks/quality.py"),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "quality.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows, "minilm": minilm}, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--quality", action="store_true")
    a = ap.parse_args(argv)
    both = not (a.gemm or a.quality)
    if a.gemm or both:
        print(write_gemm())
    if a.quality or both:
        print(write_quality())
    return 0


if __name__ == "__main__":
    sys.exit(main())
