"""Runs one weight-only GEMM a few times on the GPU, for a profiler to look at:

    ncu -k regex:weight_only --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python tools/profile_gemv.py int4 14336 4096 1

Arguments: format (one with a weight-only gemm: ``SPEC.gemm``; q4_0, int4, nf4, mixed2bit), M, K,
N; --dtype float16 | bfloat16. The weight is quantized at the format's defaults (``SPEC.defaults``),
with --params' string values over them (``--params layout=tiled`` for mixed2bit's tiled layout).
Prints the median time of --iters single calls (CUDA events, each after a GPU sleep so that
launch gaps do not count) and the mean time per call back to back; weights rotated past L2.
"""
from __future__ import annotations

import argparse

import torch

import qformats
from qformats._core import format_spec

#: The formats with a weight-only product x . W^T on CUDA (linear_rows names the kernels' devices).
GEMM_FORMATS = [f for f in qformats.FORMATS
                if format_spec(f).gemm is not None and format_spec(f).linear_rows.get("cuda")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fmt", choices=sorted(GEMM_FORMATS))
    ap.add_argument("M", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("N", type=int)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--params", default="", help="KEY=VALUE[;KEY=VALUE] over the format's defaults (layout=tiled)")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    w = torch.randn(a.M, a.K, device="cuda", dtype=dt) * 0.02
    spec = format_spec(a.fmt)
    params = {**spec.defaults, **dict(kv.split("=", 1) for kv in a.params.split(";") if kv)}
    ws = [spec.quantize(w * (1 + 0.001 * i), **params) for i in range(8)]  # 8 x >= 30 MB: past the 60 MB L2
    x = torch.randn(a.N, a.K, device="cuda", dtype=dt)
    gemm = spec.gemm
    times = []
    with qformats.skip_finite_check():
        for i in range(a.iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(100_000)
            s.record()
            gemm(x, ws[i % len(ws)])
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) * 1000 for s, e in times[len(ws):])
    # and back to back: the mean of rounds of 10 x len(ws) calls, the best of 5 rounds
    rounds = []
    with qformats.skip_finite_check():
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for i in range(10 * len(ws)):
                gemm(x, ws[i % len(ws)])
            e.record()
            torch.cuda.synchronize()
            rounds.append(s.elapsed_time(e) * 1000 / (10 * len(ws)))
    print(f"{a.fmt} {a.M}x{a.K} N={a.N} {a.dtype}: median {t[len(t) // 2]:.1f} us, back to back {min(rounds):.1f} us")


if __name__ == "__main__":
    main()
