"""Old against new: ``qformats quantize`` (signround or budget) run from two source trees back to
back, on the same machine in the same run, timed, the outputs compared byte for byte and scored.

    python benchmarks/signround_speed.py --old ../wt-sr-base --calibration calib.txt
    python benchmarks/signround_speed.py --old ../wt-sr-base --calibration calib.txt --rounds 2 \\
        --eval ../shared/data/pydoc/valid.txt
    python benchmarks/signround_speed.py --old ../wt-sr-base --calibration calib.txt \\
        --args "--method budget --max-perplexity-increase 5 --nsamples 4 --seqlen 256"
    python benchmarks/signround_speed.py --old ../wt-sr-base --calibration calib.txt --new-args=--amp

Each tree's ``python/`` is put first on ``PYTHONPATH`` (its native extensions built in place),
and the command ``qformats quantize MODEL ARGS --out DIR`` runs in a fresh process; ``--rounds``
alternates new, old, new, old, ... so that a change of the machine's load hits both. The load
average (``/proc/loadavg``) is printed before each run. With ``--eval TEXT`` each output is
scored with ``qformats eval DIR --text TEXT`` (96 windows of 512 tokens, the standard protocol).
Prints a markdown table: wall and CPU seconds per run, the old / new ratio of the medians, and
whether the saved tensors are byte-identical (SHA-256 of every tensor's bytes). ``--new-args``
adds arguments to the new tree's command only (an option the old code does not have).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "models" / "pydoc-llama-17m"
DEFAULT_ARGS = "--bits 2 --method signround --iters 20 --nsamples 16 --seqlen 512"
CLI = "import sys; from qformats.cli import main; sys.exit(main())"


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run(tree: Path, argv: list) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stdout + stderr) of ``qformats ARGV`` with tree's sources."""
    env = dict(os.environ, PYTHONPATH=str(tree / "python"))
    r0 = os.times()
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CLI, *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = os.times()
    if p.returncode:
        raise SystemExit(f"{tree}: qformats {' '.join(argv)} failed:\n{p.stdout}\n{p.stderr}")
    return wall, (r1.children_user - r0.children_user) + (r1.children_system - r0.children_system), p.stdout + p.stderr


def digest(folder: Path) -> str:
    """SHA-256 of the saved tensors (names, dtypes, shapes and bytes, by name; the files'
    header metadata left out: its key order varies from run to run)."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in sorted(st.keys()):
                t = st.get_tensor(k)
                h.update(f"{k} {t.dtype} {tuple(t.shape)}".encode())
                h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, type=Path, help="the baseline source tree (a git worktree)")
    ap.add_argument("--new", default=ROOT, type=Path, help="the tree under test (default: this one)")
    ap.add_argument("--model", default=MODEL, type=Path)
    ap.add_argument("--calibration", required=True, help="calibration text file")
    ap.add_argument("--args", default=DEFAULT_ARGS, help=f"quantize arguments (default: {DEFAULT_ARGS!r})")
    ap.add_argument("--new-args", default="", help="further quantize arguments for the new tree only")
    ap.add_argument("--rounds", type=int, default=1, help="new/old pairs, alternating")
    ap.add_argument("--eval", metavar="TEXT", help="score each output: qformats eval DIR --text TEXT")
    ap.add_argument("--work", type=Path, help="folder for the outputs (default: a temporary one)")
    a = ap.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="sr-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(a.rounds):
        for name, tree in (("new", a.new), ("old", a.old)):
            out = work / f"{name}-{r}"
            extra = shlex.split(a.new_args) if name == "new" else []
            cmd = ["quantize", str(a.model), *shlex.split(a.args), *extra, "--calibration", a.calibration,
                   "--out", str(out), "--overwrite", "--no-progress"]
            before = load()
            wall, cpu, _ = run(tree.resolve(), cmd)
            row = {"run": f"{name} {r + 1}", "name": name, "wall": wall, "cpu": cpu, "load": before,
                   "sha": digest(out), "ppl": None}
            if a.eval:
                _, _, text = run(tree.resolve(), ["eval", str(out), "--text", a.eval])
                m = re.search(r"perplexity:\s+([0-9.]+)", text)
                row["ppl"] = float(m.group(1)) if m else None
            rows.append(row)
            print(f"{row['run']}: {wall:.1f} s wall, {cpu:.1f} s CPU, load before {before}, "
                  f"sha {row['sha']}, ppl {row['ppl']}", flush=True)
    print(f"\n`qformats quantize {a.model.name} {a.args}` (new: + {a.new_args!r}), {a.rounds} round(s), "
          f"load after {load()}\n")
    print("| run | wall s | CPU s | load (1, 5, 15 min) before | tensors sha256 | perplexity |")
    print("| --- | ---: | ---: | --- | --- | ---: |")
    for row in rows:
        ppl = f"{row['ppl']:.4f}" if row["ppl"] is not None else "-"
        print(f"| {row['run']} | {row['wall']:.1f} | {row['cpu']:.1f} | {row['load']} | {row['sha']} | {ppl} |")
    med = {n: statistics.median(r["wall"] for r in rows if r["name"] == n) for n in ("new", "old")}
    same = len({r["sha"] for r in rows}) == 1
    print(f"\nmedian wall: old {med['old']:.1f} s, new {med['new']:.1f} s: {med['old'] / med['new']:.2f}x; "
          f"outputs {'byte-identical' if same else 'differ'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
