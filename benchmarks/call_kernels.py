"""Where one API call's device time goes: the kernels it launches and each one's mean time, from
``torch.profiler`` over back-to-back calls on one weight (so the weight is hot in L2 when it
fits, as in ``gemm.py --resident``).

    python benchmarks/call_kernels.py --fn q4_0.linear [--shapes 4096x14336] [--n 512,2048]
                                      [--calls 20] [--dtype float16]

``--fn`` names a function of a qformats format module called as ``fn(x, w)`` with ``w =
module.quantize(weight)`` at the format's defaults (``q4_0.linear``, ``q4_0.gemm``,
``int4.gemm``, ``nf4.gemm``, ``mixed2bit.gemm``, ...); W is ``[M, K]`` random normal, X ``[N, K]``.
Input checks that synchronize are off (``qformats.skip_finite_check``), as in a model's forward.
Each row: a CUDA kernel's name, its launches per call and its mean time per call in
microseconds, longest first; the last line sums them (gaps between kernels are not counted: see
``gemm.py`` for the call's own time).
"""
from __future__ import annotations

import argparse
import importlib

import torch
from torch.profiler import ProfilerActivity, profile

import qformats


def kernel_times(fn, w, x, calls: int) -> list[tuple[float, int, str]]:
    """(us per call, launches per call, name) of each CUDA kernel of ``calls`` calls fn(x, w)."""
    for _ in range(3):
        fn(x, w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x, w)
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.count and ev.device_time_total > 0:
            rows.append((ev.device_time_total / calls, ev.count // calls, ev.key))
    return sorted(rows, reverse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fn", required=True, help="format.function, e.g. q4_0.linear")
    ap.add_argument("--shapes", default="4096x14336")
    ap.add_argument("--n", default="512")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    args = ap.parse_args(argv)
    fmt, _, name = args.fn.partition(".")
    module = importlib.import_module(f"qformats.{fmt}")
    fn = getattr(module, name)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    with qformats.skip_finite_check(), torch.no_grad():
        for shape in args.shapes.split(","):
            m, k = (int(v) for v in shape.split("x"))
            w = module.quantize(torch.randn(m, k, generator=gen).to("cuda", dtype))
            for n in (int(v) for v in args.n.split(",")):
                x = torch.randn(n, k, generator=gen).to("cuda", dtype)
                rows = kernel_times(fn, w, x, args.calls)
                print(f"{args.fn}  M x K = {m}x{k}  N = {n}  ({args.dtype}, {args.calls} calls)")
                print(f"| {'us / call':>9} | {'per call':>8} | kernel |")
                print(f"|{'-' * 11}|{'-' * 10}|--------|")
                for us, count, key in rows:
                    print(f"| {us:9.1f} | {count:8d} | {key[:100]} |")
                print(f"| {sum(r[0] for r in rows):9.1f} | {'':8} | (sum) |\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
