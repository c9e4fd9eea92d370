"""Markdown table of a ``tools/gpu_ab.sh`` run of ``benchmarks/gemm.py``: base -> head per cell.

    python tools/gpu_ab_table.py DIR [--kernels fp16 cuBLAS,int4,q4_0,nf4]

DIR holds ``ab-base.txt`` and ``ab-head.txt`` (what gpu_ab.sh leaves in $OUT). Each cell is the
range of the rounds' times in us (one figure where the rounds agree to 0.05 us), base -> head; the
first kernel listed is shown once, from the base runs (the reference of the ratios gemm.py
prints).
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

ROW = re.compile(r"\|\s*(\d+x\d+)\s*\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|\s*([\d.]+)\s*\|")


def read(path: Path) -> dict[tuple[str, int, str], list[float]]:
    """Times of every (shape, N, kernel) row of gemm.py's table in the file, over all rounds."""
    times: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for line in path.read_text().splitlines():
        m = ROW.match(line)
        if m:
            times[(m[1], int(m[2]), m[3])].append(float(m[4]))
    return times


def cell(v: list[float]) -> str:
    """One table cell from a kernel's times over the rounds (us): "lo-hi", one figure where they
    agree to 0.05 us, "-" where the kernel is missing."""
    if not v:
        return "-"
    lo, hi = min(v), max(v)
    return f"{lo:.1f}" if hi - lo < 0.05 else f"{lo:.1f}-{hi:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--kernels", default="fp16 cuBLAS,int4,q4_0,nf4")
    a = ap.parse_args()
    base, head = read(a.dir / "ab-base.txt"), read(a.dir / "ab-head.txt")
    ref, *kernels = a.kernels.split(",")
    print(f"| shape, N | {ref} | " + " | ".join(kernels) + " |")
    print("|---|" + "---:|" * (1 + len(kernels)))
    for shape, n in sorted({(s, n) for s, n, _ in base}, key=lambda k: (k[0], k[1])):
        cells = [cell(base[(shape, n, ref)])]
        cells += [f"{cell(base[(shape, n, k)])} -> {cell(head[(shape, n, k)])}" for k in kernels]
        print(f"| {shape}, {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
