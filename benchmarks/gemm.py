"""Quantized GEMV/GEMM on the GPU against cuBLAS fp16, torch._int_mm and bitsandbytes.

    python benchmarks/gemm.py [--shapes 4096x4096,14336x4096,4096x14336]
                              [--n 1,2,4,8,16,64,512,2048] [--iters 15] [--csv FILE]
                              [--json FILE] [--kernels "q4_0xq8_1,int8 fused,..."]

Y = X . W^T with W [M, K] and X [N, K] (fp16 activations). Each time is the median over `iters`
calls timed with CUDA events; the weights (and activations) rotate through copies that together
exceed 4x the L2 cache, so weights come from DRAM, and a ~1 ms torch.cuda._sleep before each
start event keeps the GPU busy while Python issues the call (launch overhead is not counted; the
operation's own kernels and the gaps between them are; a warning is printed if the host time
comes near the sleep). Input checks that synchronize (the
NaN/Inf scan) are switched off with qformats.skip_finite_check(), as a model's forward does.

Columns: time in microseconds; TFLOP/s = 2 N M K / time; weight GB/s = stored weight bytes /
time; % copy = weight GB/s over the device-to-device copy bandwidth measured in the same run
(bytes read + written / time); x fp16 = cuBLAS fp16 time / this time.

--kernels times only the named rows (the fp16 cuBLAS row, the ratios' base, always runs).

--json FILE writes every row with its weight bytes and the shape's copy bandwidth, plus the
run's metadata (date, GPU, versions, command line), for the documentation's plots
(docs/_ext/qf_results.py reads benchmarks/results/gemm_h200.json in this schema).

Rows (ours): every format with a weight-only gemm (``SPEC.gemm``), at its default parameters
(``SPEC.defaults``), in ``qformats.FORMATS`` order: q4_0 (weight-only), int4 (g128 asymmetric),
nf4 (blocksize 64), mixed2bit (g16, 10% 4-bit); q4_0xq8_1 (llama.cpp's pair: x quantized to
q8_1 by our kernel, then dp4a; the time includes both), int8 fused (int8_linear: int8 x int8
with the scale epilogue, fp16 out; x pre-quantized), int4xint4 (int4_matmul, int32 out; x
pre-quantized). "+cuBLAS" rows: our dequantize to fp16 then cuBLAS, the large-N path of
QuantizedLinear. Peers: fp16 (F.linear, cuBLAS), torch._int_mm
(int8, N > 16), bnb-nf4 (bitsandbytes.matmul_4bit, blocksize 64), bnb-int8 (Linear8bitLt,
threshold 0).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import qformats
from qformats import int4, int8, q4_0
from qformats._core import format_spec

L2_BYTES = 60 * 2**20
DIRECT_MAX_N = 64  # the register-decoding weight-only kernels are timed up to this N


def nbytes_of(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return obj.nbytes  # QuantizedTensor


def rotations(nbytes: int) -> int:
    return max(2, -(-4 * L2_BYTES // max(nbytes, 1)))


SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU work queued before each timed call (at ~2 GHz)


def time_us(fn, arg_sets, iters: int, warmup: int = 2) -> float:
    # Every rotated weight is used once before timing: per-weight setup that a model pays once
    # (mixed2bit's chunk index, cached on the weight) must not land in the timed calls.
    for i in range(max(warmup, len(arg_sets))):
        fn(*arg_sets[i % len(arg_sets)])
    torch.cuda.synchronize()
    events, host = [], []
    for i in range(iters):
        # The GPU sleeps while Python issues the call, so the events time the kernels alone. The
        # sleep must outlast the call's host time (up to ~150 us for mixed2bit's checks): a
        # shorter one (0.1 ms, earlier tables) let host time leak into the fastest rows.
        torch.cuda._sleep(SLEEP_CYCLES)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        fn(*arg_sets[i % len(arg_sets)])
        e.record()
        host.append(time.perf_counter() - t0)
        events.append((s, e))
    torch.cuda.synchronize()
    if statistics.median(host) > 0.5e-3:
        print(f"warning: {1e6 * statistics.median(host):.0f} us of host time per call, near the GPU sleep:"
              " the time may include it", file=sys.stderr)
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in events)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--n", default="1,2,4,8,16,64,512,2048")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="also write every row and the run's metadata as JSON")
    ap.add_argument("--kernels", default=None, help="comma-separated row names to time (default: all)")
    args = ap.parse_args(argv)
    picked = None if args.kernels is None else {v.strip() for v in args.kernels.split(",")}

    def want(name: str) -> bool:
        return picked is None or name in picked
    if not qformats.cuda_available():
        print("no CUDA device or a CPU-only build: nothing to measure")
        return 1
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf
    except Exception:
        bnb = bnbf = None
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ns = [int(v) for v in args.n.split(",")]
    # x fp16 . W^T: every format whose weight-only gemm has a CUDA kernel (linear_rows names the devices)
    weight_only = [f for f in qformats.FORMATS
                   if format_spec(f).gemm is not None and format_spec(f).linear_rows.get("cuda")]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  qformats {qformats.__version__}"
          f"  bitsandbytes {getattr(bnb, '__version__', 'absent')}")
    rows = []
    json_rows, copy_by_shape = [], {}  # --json: rows with weight bytes, copy GB/s per shape
    for (m, k) in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        w16 = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g) * 0.02
        # copy bandwidth of this weight's fp16 bytes
        r16 = rotations(nbytes_of(w16))
        ws16 = [w16 * (1 + 0.001 * i) for i in range(r16)]
        dst = [torch.empty_like(w16) for _ in ws16]
        copy_us = time_us(lambda a, b: b.copy_(a), list(zip(ws16, dst)), args.iters)
        copy_gbs = 2 * nbytes_of(w16) / copy_us / 1e3
        del dst
        print(f"\n{m}x{k}: d2d copy {copy_us:.1f} us = {copy_gbs:.0f} GB/s")
        copy_by_shape[f"{m}x{k}"] = {"copy_us": copy_us, "copy_gbs": copy_gbs}

        ours = {}
        def quant_sets(fmt, fn, weight_of=lambda q: q):
            q0 = fn(w16)
            reps = rotations(nbytes_of(weight_of(q0)))
            return [q0] + [fn(w16 * (1 + 0.001 * i)) for i in range(1, reps)]
        for fmt in weight_only:
            spec = format_spec(fmt)
            ours[fmt] = quant_sets(fmt, lambda w: spec.quantize(w, **spec.defaults))
        w8 = [int8.quantize(w, "row") for w in ws16[: rotations(m * k)]]
        w4s = [int4.quantize(w, group_size=k, symmetric=True) for w in ws16[: rotations(m * k // 2)]]
        bnb_w = []
        if bnbf is not None:
            try:
                bnb_w = [bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4") for w in ws16]
            except Exception as e:
                print(f"bitsandbytes nf4 unavailable: {e}")
        bnb_l8 = []
        if bnb is not None:
            try:
                for w in ws16[: rotations(m * k)]:
                    lin = bnb.nn.Linear8bitLt(k, m, bias=False, has_fp16_weights=False, threshold=0.0)
                    lin.weight = bnb.nn.Int8Params(w.cpu(), requires_grad=False, has_fp16_weights=False)
                    bnb_l8.append(lin.cuda())
            except Exception as e:
                print(f"bitsandbytes Linear8bitLt unavailable: {e}")
                bnb_l8 = []
        for n in ns:
            xs = [torch.randn(n, k, device="cuda", dtype=torch.float16, generator=g) for _ in range(4)]
            res = {}
            fp16_us = time_us(lambda w, x: F.linear(x, w), [(w, xs[i % 4]) for i, w in enumerate(ws16)], args.iters)
            res["fp16 cuBLAS"] = (fp16_us, 2 * m * k)
            with qformats.skip_finite_check():
                for fmt in weight_only:
                    gemm = format_spec(fmt).gemm
                    qs = ours[fmt]
                    sets = [(q, xs[i % 4]) for i, q in enumerate(qs)]
                    if n <= DIRECT_MAX_N and want(fmt):
                        res[fmt] = (time_us(lambda q, x: gemm(x, q), sets, args.iters), qs[0].nbytes)
                    if n >= 16 and want(f"{fmt}+cuBLAS"):
                        res[f"{fmt}+cuBLAS"] = (time_us(lambda q, x: F.linear(x, q.dequantize(dtype="float16")), sets,
                                                        args.iters), qs[0].nbytes)
                qs = ours[q4_0.FORMAT]  # q4_0.linear: the q4_0 weights with q8_1 activations
                if want("q4_0xq8_1"):
                    res["q4_0xq8_1"] = (time_us(lambda q, x: q4_0.linear(x, q),
                                                [(q, xs[i % 4]) for i, q in enumerate(qs)], args.iters), qs[0].nbytes)
                xq = [int8.quantize(x, "row") for x in xs]
                sets = [(w, xq[i % 4]) for i, w in enumerate(w8)]
                if want("int8 fused"):
                    res["int8 fused"] = (time_us(lambda w, x: int8.int8_linear(
                        x.buffers["q"], x.buffers["scale"], w.buffers["q"], w.buffers["scale"],
                        out_dtype="float16"), sets, args.iters), m * k + 4 * m)
                x4 = [int4.quantize(x, group_size=k, symmetric=True).buffers["qweight"] for x in xs]
                sets = [(w.buffers["qweight"], x4[i % 4]) for i, w in enumerate(w4s)]
                if want("int4xint4"):
                    res["int4xint4"] = (time_us(lambda w, x: int4.int4_matmul(x, w), sets, args.iters), m * k // 2)
            if n > 16 and want("torch._int_mm"):
                sets = [(w.buffers["q"], xq[i % 4].buffers["q"]) for i, w in enumerate(w8)]
                res["torch._int_mm"] = (time_us(lambda w, x: torch._int_mm(x, w.t()), sets, args.iters), m * k)
            if bnb_w and want("bnb-nf4"):
                sets = [(wq, st, xs[i % 4]) for i, (wq, st) in enumerate(bnb_w)]
                res["bnb-nf4"] = (time_us(lambda wq, st, x: bnb.matmul_4bit(x, wq.t(), quant_state=st), sets,
                                          args.iters), nbytes_of(bnb_w[0][0]) + 4 * (m * k // 64))
            if bnb_l8 and want("bnb-int8"):
                sets = [(lin, xs[i % 4]) for i, lin in enumerate(bnb_l8)]
                res["bnb-int8"] = (time_us(lambda lin, x: lin(x), sets, args.iters), m * k + 4 * m)
            for name, (us, wbytes) in res.items():
                tflops = 2 * n * m * k / us / 1e6
                gbs = wbytes / us / 1e3
                rows.append((f"{m}x{k}", n, name, us, tflops, gbs, 100 * gbs / copy_gbs, fp16_us / us))
                json_rows.append({"shape": f"{m}x{k}", "M": m, "K": k, "N": n, "kernel": name,
                                  "time_us": us, "tflops": tflops, "weight_bytes": int(wbytes),
                                  "weight_gbs": gbs, "pct_copy": 100 * gbs / copy_gbs,
                                  "x_fp16": fp16_us / us, "copy_gbs": copy_gbs})
            del xs
        del ours, w8, w4s, bnb_w, bnb_l8, ws16
        torch.cuda.empty_cache()

    hdr = ("| M x K       |    N | kernel          |   time us | TFLOP/s | weight GB/s | % copy | x fp16 |\n"
           "|-------------|-----:|-----------------|----------:|--------:|------------:|-------:|-------:|")
    print("\n" + hdr)
    for shape, n, name, us, tf, gbs, pct, ratio in rows:
        print(f"| {shape:<11} | {n:4d} | {name:<15} | {us:9.1f} | {tf:7.1f} | {gbs:11.0f} | {pct:5.1f}% "
              f"| {ratio:5.2f}x |")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("shape,N,kernel,time_us,tflops,weight_gbs,pct_copy,x_fp16\n")
            for r in rows:
                f.write(",".join(str(v) for v in r) + "\n")
    if args.json:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "qformats": qformats.__version__,
                "bitsandbytes": getattr(bnb, "__version__", None),
                "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
                "iters": args.iters, "copy": copy_by_shape,
                "source": "benchmarks/gemm.py --json (measured in this run)"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": json_rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
