"""Quantize and dequantize of one format on the GPU, a few calls each, for a profiler to attach to:

    ncu --clock-control none -k regex:tiled --launch-skip 2 --launch-count 2 \\
        python tools/profile_codec.py mixed2bit 4096 14336 --params layout=tiled

Arguments: format, M, K; --dtype float16 | bfloat16 | float32; --params KEY=VALUE[;KEY=VALUE] over
the format's defaults (``SPEC.defaults``). Runs --calls quantize calls of a random [M, K] weight,
then --calls dequantize calls of the result, each inside qformats.skip_finite_check(), and prints
the median CUDA-event time of each (the profiler's own timings replace these when it runs).
"""
from __future__ import annotations

import argparse
import statistics

import torch

import qformats
from qformats._core import format_spec


def _time(fn, calls: int) -> float:
    out = []
    for _ in range(calls):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        out.append((s, e))
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fmt", choices=sorted(qformats.FORMATS))
    ap.add_argument("M", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--params", default="", help="KEY=VALUE[;KEY=VALUE] over the format's defaults (layout=tiled)")
    a = ap.parse_args()
    spec = format_spec(a.fmt)
    params = {**spec.defaults, **dict(kv.split("=", 1) for kv in a.params.split(";") if kv)}
    w = torch.randn(a.M, a.K, device="cuda", dtype=getattr(torch, a.dtype)) * 0.02
    with qformats.skip_finite_check():
        q = spec.quantize(w, **params)
        tq = _time(lambda: spec.quantize(w, **params), a.calls)
        td = _time(lambda: q.dequantize(), a.calls)
    print(f"{a.fmt} {params} {a.M}x{a.K} {a.dtype}: quantize {tq:.1f} us, dequantize {td:.1f} us (API, median)")


if __name__ == "__main__":
    main()
