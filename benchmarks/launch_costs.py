"""Where the time of one weight-only product goes on the GPU: the cold call's CUDA-event time beside
the device time of its kernels (torch.profiler), with and without the stream-K workspace.

    python benchmarks/launch_costs.py [--formats int4,q4_0,nf4]
                                      [--shapes 14336x4096:1024,11008x4096:300,...] [--iters 12]

Each shape is M x K : N (Y [N, M] = X [N, K] . W^T, fp16). The product runs through the format's
bound native kernel (``SPEC.make_linear``, what ``QuantizedLinear`` calls) twice: with the
workspace that ``gemm_workspace(N)`` asks for (where it is > 0, the prefill kernel may share its
last waves out by stream-K, src/gemm/prefill_plan.h) and without one. Before every call 256 MB
are zeroed (the weight leaves the L2) and the GPU sleeps ~1 ms, as in benchmarks/gemm.py's cold
protocol. Columns, medians over --iters calls: "event us" (start to end event around the call),
"kernel us" (the product's kernel, from the profiler), "memset us" (the stream-K flags'
cudaMemsetAsync, where there is one), "rest us" = event - kernel - memset (launch gaps).
"""
import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from qformats import int4, nf4, q4_0

FORMATS = {"int4": (int4, {"group_size": 128}), "q4_0": (q4_0, {}), "nf4": (nf4, {})}
SLEEP_CYCLES = 2_000_000
DEFAULT_SHAPES = "14336x4096:1024,11008x4096:300,14336x4096:512,11008x4096:2048,14336x4096:64"


def cold(call, flush):
    flush.zero_()
    torch.cuda._sleep(SLEEP_CYCLES)
    call()


def measure(call, flush, iters):
    """(event us, kernel us, memset us) of `call`, medians over `iters` cold calls."""
    events = []
    for _ in range(iters):
        flush.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        call()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            cold(call, flush)
        torch.cuda.synchronize()
    kernels, memsets = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name, us = ev.name, ev.device_time
        if "weight_only" in name or "wgmma" in name or "mma" in name.lower():
            kernels.append(us)
        elif "emset" in name and us < 50:  # the flags' memset (the flush's zero_ is a fill kernel)
            memsets.append(us)
    event_us = 1000 * statistics.median(s.elapsed_time(e) for s, e in events)
    return event_us, statistics.median(kernels) if kernels else 0.0, statistics.median(memsets) if memsets else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="int4,q4_0,nf4")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--iters", type=int, default=12)
    args = ap.parse_args(argv)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    print("| format | M x K, N | workspace | event us | kernel us | memset us | rest us |")
    print("|---|---|---|---:|---:|---:|---:|")
    for fmt in args.formats.split(","):
        mod, params = FORMATS[fmt]
        for spec in args.shapes.split(","):
            mk, n = spec.split(":")
            M, K = (int(v) for v in mk.split("x"))
            N = int(n)
            torch.manual_seed(0)
            run = mod.SPEC.make_linear(mod.quantize(torch.randn(M, K, dtype=torch.float16, device="cuda") * 0.02,
                                                    **params)).run
            x = torch.randn(N, K, dtype=torch.float16, device="cuda")
            out = torch.empty(N, M, dtype=torch.float16, device="cuda")
            nbytes = run.gemm_workspace(N)
            ws = torch.empty(nbytes, dtype=torch.uint8, device="cuda") if nbytes else None
            for w in ([ws, None] if ws is not None else [None]):
                def call(w=w):
                    run(x, out, None, stream, w)

                call()
                ev, kern, mset = measure(call, flush, args.iters)
                print(f"| {fmt} | {M}x{K}, {N} | {'yes' if w is not None else 'no'} | {ev:.1f} | {kern:.1f} | "
                      f"{mset:.2f} | {ev - kern - mset:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
