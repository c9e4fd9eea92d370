"""CPU GEMM throughput of every qformats kernel against torch's float32 / bfloat16 matmul.

    QFORMATS_NUM_THREADS is set from --threads before qformats loads; torch.set_num_threads too.
    python benchmarks/gemm_cpu.py [--shapes 4096x4096,4096x14336] [--n 1,8,64] [--repeats 30]
                                  [--threads 2] [--json out.json]

Shapes are M x K: weights W [M, K] (M outputs), activations X [N, K], Y = X . W^T [N, M].
Each timing is the median of `repeats` single calls (time.perf_counter around the public Python
call, so argument checks and output allocation are included). The calls are spread over
`passes` passes over all kernels, so that load from other processes on a shared machine falls
on all of them alike; within a pass a kernel's calls run back to back after a 20 ms pause and
one untimed call (torch's OpenMP workers keep spinning for a while after a matmul). Each call
uses the next of several copies of its weights, together at least twice the L3 cache, so the
weights stream from DRAM as in a model whose layers do not fit in cache ("--hot" reuses one
copy). "min ms" is the fastest call: what the kernel does on an idle machine.

Columns: ms (median), GB/s = bytes of the weight operand (every buffer: codes, scales, zero
points, maps, outliers) / time, "x fp32" and "x bf16" = torch time / kernel time (> 1: faster
than torch). Kernels:
  torch fp32 / bf16      x @ W.T with W float32 / bfloat16 (torch's own CPU kernels)
  q4_0.linear            llama.cpp's pair: x quantized to q8_1 in the call, integer q4_0 x q8_1
  q4_0 x q8_1 (gemm)     gemm_q4_0_q8_1 on already-quantized activations (W . A^T)
  <fmt>.gemm             weight-only, float32 activations: every format with one (SPEC.gemm),
                         at its default parameters (SPEC.defaults), in qformats.FORMATS order;
                         then the rows of --variants (default: mixed2bit-tiled.gemm, mixed2bit's
                         tiled layout; benchmarks/variants.py)
  int4.gemm sym          int4.gemm on symmetric groups of 128
  int8_matmul            int8 x int8 -> int32 on already-quantized activations
  int8_linear (fp16)     the fused form: int32 product, scales, bias, float16 out
  int4_matmul            int4 x int4 -> int32 on packed symmetric codes
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def l3_bytes() -> int:
    try:
        v = os.sysconf("SC_LEVEL3_CACHE_SIZE")
        if v > 0:
            return v
    except (ValueError, OSError):
        pass
    return 32 * 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096", help="M x K list, e.g. 4096x4096,4096x14336")
    ap.add_argument("--n", default="1,8,64", help="activation rows N")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3, help="passes over all kernels (repeats split among them)")
    ap.add_argument("--hot", action="store_true", help="reuse one copy of each weight (cache-resident)")
    ap.add_argument("--only", default="", help="comma-separated kernel names to run (default: all)")
    ap.add_argument("--json", default="", help="write the rows to this file")
    ap.add_argument("--variants", default=None,
                    help="extra rows at other quantize parameters, as benchmarks/gemm.py's --variants "
                         "(default: mixed2bit's tiled layout)")
    args = ap.parse_args(argv)

    os.environ["QFORMATS_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    import qformats
    from qformats import int4, int8, q4_0, q8_1
    from qformats._core import format_spec

    sys.path.insert(0, str(Path(__file__).parent))
    import variants  # (imports qformats: after the thread count is set)
    if args.variants is None:
        args.variants = variants.DEFAULT

    gemm_formats = [f for f in qformats.FORMATS if format_spec(f).gemm is not None]

    isa = q4_0._native.gemm_isa()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs visible), GEMM ISA: {isa}, "
          f"threads: {args.threads} (torch {torch.__version__}, {torch.get_num_threads()} threads), "
          f"weights {'hot (one copy)' if args.hot else 'rotated over >= 2x L3 = %d MiB' % (2 * l3_bytes() >> 20)}")
    rows = []
    only = set(filter(None, args.only.split(",")))
    for shape in args.shapes.split(","):
        M, K = (int(v) for v in shape.lower().split("x"))
        rng = np.random.default_rng(0)
        w = (rng.standard_normal((M, K)) * 0.02).astype(np.float32)
        wt = torch.from_numpy(w)
        # Weight operands, quantized once; copies are made per kernel below. Every format with a
        # weight-only gemm at its defaults; then the operands of the format-specific kernels.
        weights = {"torch fp32": wt, "torch bf16": wt.to(torch.bfloat16)}
        wo_rows = variants.rows(gemm_formats, args.variants)
        for name, f, params in wo_rows:
            weights[name] = format_spec(f).quantize(w, **params)
        weights["int4 sym"] = int4.quantize(w, 128, symmetric=True)
        weights["int8 row"] = int8.quantize(w, "row")
        w_q4_0 = weights[q4_0.FORMAT] if q4_0.FORMAT in weights else q4_0.quantize(w)
        del w

        def nbytes(obj) -> int:
            if isinstance(obj, torch.Tensor):
                return obj.numel() * obj.element_size()
            if isinstance(obj, np.ndarray):
                return obj.nbytes
            if isinstance(obj, tuple):
                return sum(nbytes(o) for o in obj)
            return obj.nbytes  # QuantizedTensor: every buffer

        def copies(obj, n):
            def one(o):
                if isinstance(o, torch.Tensor):
                    return o.clone()
                if isinstance(o, np.ndarray):
                    return o.copy()
                if isinstance(o, tuple):
                    return tuple(one(v) for v in o)
                return type(o)(o.format, o.shape, o.dtype, dict(o.params), {k: one(v) for k, v in o.buffers.items()})
            return [obj] + [one(obj) for _ in range(n - 1)]

        for N in (int(v) for v in args.n.split(",")):
            x = rng.standard_normal((N, K)).astype(np.float32)
            xt = torch.from_numpy(x)
            xb = xt.to(torch.bfloat16)
            aq = q8_1.quantize_q8_1(x)
            xq = int8.quantize(x, "row")
            xi4 = int4.quantize(x, 128, symmetric=True).buffers["qweight"]
            bias = torch.zeros(M, dtype=torch.float16).numpy()
            # name -> (weight operand, fn(weight) -> result)
            w8 = weights["int8 row"]
            kernels = {
                "torch fp32": (weights["torch fp32"], lambda W: xt @ W.T),
                "torch bf16": (weights["torch bf16"], lambda W: xb @ W.T),
                "q4_0.linear": (w_q4_0, lambda W: q4_0.linear(x, W)),
                "q4_0 x q8_1 (gemm)": (w_q4_0.buffers["blocks"],
                                       lambda W: q4_0.gemm_q4_0_q8_1(W, aq, M, N, K)),
            }
            for name, f, _ in wo_rows:
                kernels[f"{name}.gemm"] = (weights[name], lambda W, gemm=format_spec(f).gemm: gemm(x, W))
            kernels.update({
                "int4.gemm sym": (weights["int4 sym"], lambda W: int4.gemm(x, W)),
                "int8_matmul": ((w8.buffers["q"], w8.buffers["scale"]),
                                lambda W: int8.int8_matmul(xq.buffers["q"], W[0])),
                "int8_linear (fp16)": ((w8.buffers["q"], w8.buffers["scale"]),
                                       lambda W: int8.int8_linear(xq.buffers["q"], xq.buffers["scale"], W[0], W[1],
                                                                  bias=bias, out_dtype="float16")),
                "int4_matmul": (weights["int4 sym"].buffers["qweight"], lambda W: int4.int4_matmul(xi4, W)),
            })
            if only:
                kernels = {k: v for k, v in kernels.items() if k in only or k.startswith("torch")}
            sets, times = {}, {}
            for name, (wop, fn) in kernels.items():
                b = nbytes(wop)
                n_copies = 1 if args.hot else max(2, -(-2 * l3_bytes() // b))
                sets[name] = (copies(wop, n_copies), fn, b)
                times[name] = []
                for i in range(2):  # warm-up: first-touch, thread start, caches
                    fn(sets[name][0][i % n_copies])
            # Passes over all kernels; within a pass each kernel runs its calls back to back after a
            # pause and one untimed call: torch's OpenMP workers spin for a while after a matmul,
            # and a kernel timed right behind them would compete with that spinning for the cores.
            passes = min(args.passes, args.repeats)
            for p in range(passes):
                for name, (ws, fn, _) in sets.items():
                    time.sleep(0.02)
                    fn(ws[0])
                    for r in range(p, args.repeats, passes):
                        W = ws[r % len(ws)]
                        t0 = time.perf_counter()
                        fn(W)
                        times[name].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"\nM x K = {M} x {K}, N = {N}")
            print(f"  {'kernel':<20} {'ms':>9} {'min ms':>9} {'GB/s':>8} {'x fp32':>8} {'x bf16':>8}  "
                  f"{'weight MiB':>10}")
            for name, t in med.items():
                b = sets[name][2]
                row = {"M": M, "K": K, "N": N, "kernel": name, "ms": t * 1e3, "min_ms": min(times[name]) * 1e3,
                       "gbps": b / t / 1e9,
                       "vs_fp32": med["torch fp32"] / t, "vs_bf16": med["torch bf16"] / t,
                       "weight_bytes": b, "repeats": args.repeats, "threads": args.threads, "isa": isa}
                rows.append(row)
                print(f"  {name:<20} {row['ms']:>9.3f} {row['min_ms']:>9.3f} {row['gbps']:>8.2f} "
                      f"{row['vs_fp32']:>8.2f} "
                      f"{row['vs_bf16']:>8.2f}  {b / 2**20:>10.2f}")
            del sets
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "isa": isa, "threads": args.threads, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
