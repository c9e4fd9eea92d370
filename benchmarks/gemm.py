"""Quantized GEMV/GEMM on the GPU against cuBLAS fp16, torch._int_mm and bitsandbytes.

    python benchmarks/gemm.py [--shapes 4096x4096,14336x4096,4096x14336]
                              [--n 1,2,4,8,16,64,512,2048] [--iters 15] [--csv FILE]
                              [--json FILE] [--kernels "q4_0xq8_1,int8 fused,..."]
                              [--resident] [--calls 200] [--variants mixed2bit:layout=tiled]
                              [--dtype float16|bfloat16]

Y = X . W^T with W [M, K] and X [N, K] (fp16 activations; --dtype bfloat16: bf16 activations, the
float rows in bf16 and the ratio column x bf16 instead). Each time is the median over `iters`
calls timed with CUDA events; the weights (and activations) rotate through copies that together
exceed 4x the L2 cache, so weights come from DRAM, and a ~1 ms torch.cuda._sleep before each
start event keeps the GPU busy while Python issues the call (launch overhead is not counted; the
operation's own kernels and the gaps between them are; a warning is printed if the host time
comes near the sleep). Input checks that synchronize (the
NaN/Inf scan) are switched off with qformats.skip_finite_check(), as a model's forward does.

Columns: time in microseconds; TFLOP/s = 2 N M K / time; weight GB/s = stored weight bytes /
time; % copy = weight GB/s over the device-to-device copy bandwidth measured in the same run
(bytes read + written / time); x fp16 = cuBLAS fp16 time / this time.

--variants adds weight-only rows at other quantize parameters (default: mixed2bit's tiled layout,
row "mixed2bit-tiled"; FMT:KEY=VALUE;KEY=VALUE, comma-separated).

--kernels times only the named rows (the fp16 cuBLAS row, the ratios' base, always runs).

--resident: the mode of llama.cpp's `test-backend-ops perf`: one weight and one X, `--calls`
calls captured in one CUDA graph and replayed (median of 5 replays / calls), so the weight stays
in L2 where it fits (the 60 MB of an H100 / H200) and launches are back to back. Rows that cannot
be captured print as errors.

--json FILE writes every row with its weight bytes and the shape's copy bandwidth, plus the
run's metadata (date, GPU, versions, command line), for the documentation's plots
(docs/_ext/qf_results.py reads benchmarks/results/gemm_h200.json in this schema).

Rows (ours): every format with a weight-only gemm (``SPEC.gemm``), at its default parameters
(``SPEC.defaults``), in ``qformats.FORMATS`` order: q4_0 (weight-only), int4 (g128 asymmetric),
nf4 (blocksize 64), mixed2bit (g16, 10% 4-bit); q4_0xq8_1 (llama.cpp's pair: x quantized to
q8_1 by our kernel, then dp4a; the time includes both), int8 fused (int8_linear: int8 x int8
with the scale epilogue, fp16 out; x pre-quantized), int4xint4 (int4_matmul, int32 out; x
pre-quantized). A format's row is its own kernel at every N; its "+cuBLAS" row is our dequantize
to fp16 then cuBLAS. Where QuantizedLinear measures the crossover (qformats.crossover) it takes
the faster of the two. Peers: fp16 (F.linear, cuBLAS), torch._int_mm
(int8, N > 16), bnb-nf4 (bitsandbytes.matmul_4bit, blocksize 64), bnb-int8 (Linear8bitLt,
threshold 0), tinygemm-int4 (torch's aten._weight_int4pack_mm as torchao / gpt-fast pack it,
asymmetric groups of 128, bf16 activations: benchmarks/linear_call.py's TinyGemmInt4),
gemlite-a16w4 (gemlite's A16W4_HQQ_INT, asymmetric groups of 128, fp16; when gemlite is
installed; its Triton kernels autotune on the first call of each N).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import qformats
from qformats import int4, int8, q4_0
from qformats._core import format_spec

sys.path.insert(0, str(Path(__file__).parent))
import variants  # noqa: E402
from generate_hf import FLOAT_NAMES  # noqa: E402
from linear_call import TinyGemmInt4  # noqa: E402  (the tinygemm peer, as linear_call builds it)

L2_BYTES = 60 * 2**20


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


def time_resident_us(fn, arg_sets, calls: int, reps: int = 5) -> float:
    """Per-call time of `calls` calls of fn on arg_sets[0], captured in one CUDA graph."""
    args = arg_sets[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's graph notes ask
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del graph
    return 1000 * statistics.median(times) / calls


def gemlite_a16w4(w16: torch.Tensor, group_size: int = 128):
    """gemlite's A16W4 (HQQ-style asymmetric int4 groups: W = (q - zero) * scale) of an fp16 weight."""
    from gemlite.helper import A16W4_HQQ_INT

    m, k = w16.shape
    g = w16.float().reshape(m, k // group_size, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = ((g - lo) / scale).round().clamp(0, 15).to(torch.uint8).reshape(m, k)
    zero = (-lo / scale).reshape(m, -1)
    return A16W4_HQQ_INT(device=str(w16.device), dtype=torch.float16).from_weights(
        q, scale.reshape(m, -1).half(), zero.half())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--n", default="1,2,4,8,16,64,512,2048")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="also write every row and the run's metadata as JSON")
    ap.add_argument("--kernels", default=None, help="comma-separated row names to time (default: all)")
    ap.add_argument("--resident", action="store_true", help="llama.cpp's perf mode: one weight, calls in a CUDA graph")
    ap.add_argument("--calls", type=int, default=200, help="calls per graph with --resident")
    ap.add_argument("--variants", default=variants.DEFAULT, help=variants.HELP)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                    help="the activations' type (the float baseline and the +cuBLAS rows' too)")
    args = ap.parse_args(argv)
    dt = getattr(torch, args.dtype)
    base = FLOAT_NAMES[args.dtype]  # the float baseline's row and ratio name
    def timer(fn, arg_sets, iters):  # the mode's timer, for every row alike
        if not args.resident:
            return time_us(fn, arg_sets, iters)
        try:
            return time_resident_us(fn, arg_sets, args.calls)
        except Exception as e:  # (a row whose calls cannot be captured)
            print(f"not capturable: {type(e).__name__}: {e}"[:300], file=sys.stderr)
            torch.cuda.synchronize()
            return float("nan")
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
    wo_rows = variants.rows(weight_only, args.variants)
    try:
        import gemlite
    except Exception:
        gemlite = None
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  qformats {qformats.__version__}"
          f"  bitsandbytes {getattr(bnb, '__version__', 'absent')}  gemlite {getattr(gemlite, '__version__', 'absent')}"
          f"  mode {'resident (CUDA graph of %d calls)' % args.calls if args.resident else 'cold (weights from DRAM)'}")
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

        ws_float = ws16 if dt == torch.float16 else [w.to(dt) for w in ws16]
        ours = {}
        def quant_sets(fmt, fn, weight_of=lambda q: q):
            q0 = fn(w16)
            reps = rotations(nbytes_of(weight_of(q0)))
            return [q0] + [fn(w16 * (1 + 0.001 * i)) for i in range(1, reps)]
        for name, fmt, params in wo_rows:
            ours[name] = quant_sets(fmt, lambda w: format_spec(fmt).quantize(w, **params))
        w8 = [int8.quantize(w, "row") for w in ws16[: rotations(m * k)]]
        w4s = [int4.quantize(w, group_size=k, symmetric=True) for w in ws16[: rotations(m * k // 2)]]
        bnb_w = []
        if bnbf is not None:
            try:
                bnb_w = [bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4") for w in ws16]
            except Exception as e:
                print(f"bitsandbytes nf4 unavailable: {e}")
        tiny = [TinyGemmInt4(SimpleNamespace(weight=w, bias=None)) for w in ws16[: rotations(m * k // 2)]] \
            if want("tinygemm-int4") else []
        glite = []
        if gemlite is not None and want("gemlite-a16w4"):
            try:
                glite = [gemlite_a16w4(w) for w in ws16[: rotations(m * k // 2)]]
            except Exception as e:
                print(f"gemlite unavailable: {e}")
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
            xs = [torch.randn(n, k, device="cuda", dtype=dt, generator=g) for _ in range(4)]
            res = {}
            float_us = timer(lambda w, x: F.linear(x, w), [(w, xs[i % 4]) for i, w in enumerate(ws_float)], args.iters)
            res[f"{base} cuBLAS"] = (float_us, 2 * m * k)
            with qformats.skip_finite_check():
                for name, fmt, _ in wo_rows:
                    gemm = format_spec(fmt).gemm
                    qs = ours[name]
                    sets = [(q, xs[i % 4]) for i, q in enumerate(qs)]
                    if want(name):  # the format's own kernels at every N (GEMV, wgmma, prefill)
                        res[name] = (timer(lambda q, x: gemm(x, q), sets, args.iters), qs[0].nbytes)
                    if n >= 16 and want(f"{name}+cuBLAS"):
                        res[f"{name}+cuBLAS"] = (timer(lambda q, x: F.linear(x, q.dequantize(dtype=args.dtype)), sets,
                                                        args.iters), qs[0].nbytes)
                qs = ours[q4_0.FORMAT]  # q4_0.linear: the q4_0 weights with q8_1 activations
                if want("q4_0xq8_1"):
                    res["q4_0xq8_1"] = (timer(lambda q, x: q4_0.linear(x, q),
                                                [(q, xs[i % 4]) for i, q in enumerate(qs)], args.iters), qs[0].nbytes)
                xq = [int8.quantize(x, "row") for x in xs]
                sets = [(w, xq[i % 4]) for i, w in enumerate(w8)]
                if want("int8 fused"):
                    res["int8 fused"] = (timer(lambda w, x: int8.int8_linear(
                        x.buffers["q"], x.buffers["scale"], w.buffers["q"], w.buffers["scale"],
                        out_dtype="float16"), sets, args.iters), m * k + 4 * m)
                x4 = [int4.quantize(x, group_size=k, symmetric=True).buffers["qweight"] for x in xs]
                sets = [(w.buffers["qweight"], x4[i % 4]) for i, w in enumerate(w4s)]
                if want("int4xint4"):
                    res["int4xint4"] = (timer(lambda w, x: int4.int4_matmul(x, w), sets, args.iters), m * k // 2)
            if n > 16 and want("torch._int_mm"):
                sets = [(w.buffers["q"], xq[i % 4].buffers["q"]) for i, w in enumerate(w8)]
                res["torch._int_mm"] = (timer(lambda w, x: torch._int_mm(x, w.t()), sets, args.iters), m * k)
            if bnb_w and want("bnb-nf4"):
                sets = [(wq, st, xs[i % 4]) for i, (wq, st) in enumerate(bnb_w)]
                res["bnb-nf4"] = (timer(lambda wq, st, x: bnb.matmul_4bit(x, wq.t(), quant_state=st), sets,
                                          args.iters), nbytes_of(bnb_w[0][0]) + 4 * (m * k // 64))
            if tiny:
                xb = [x.to(torch.bfloat16) for x in xs]
                res["tinygemm-int4"] = (timer(lambda mod, x: mod(x), [(mod, xb[i % 4]) for i, mod in enumerate(tiny)],
                                                args.iters), nbytes_of(tiny[0].packed) + nbytes_of(tiny[0].sz))
            if glite:
                try:
                    res["gemlite-a16w4"] = (timer(lambda mod, x: mod(x), [(mod, xs[i % 4]) for i, mod in
                                                                           enumerate(glite)], args.iters),
                                            m * k // 2 + 4 * (m * k // 128))
                except Exception as e:
                    print(f"gemlite N = {n}: {type(e).__name__}: {e}"[:300])
            if bnb_l8 and want("bnb-int8"):
                sets = [(lin, xs[i % 4]) for i, lin in enumerate(bnb_l8)]
                res["bnb-int8"] = (timer(lambda lin, x: lin(x), sets, args.iters), m * k + 4 * m)
            for name, (us, wbytes) in res.items():
                tflops = 2 * n * m * k / us / 1e6
                gbs = wbytes / us / 1e3
                rows.append((f"{m}x{k}", n, name, us, tflops, gbs, 100 * gbs / copy_gbs, float_us / us))
                json_rows.append({"shape": f"{m}x{k}", "M": m, "K": k, "N": n, "kernel": name,
                                  "time_us": us, "tflops": tflops, "weight_bytes": int(wbytes),
                                  "weight_gbs": gbs, "pct_copy": 100 * gbs / copy_gbs,
                                  "x_fp16": float_us / us, "copy_gbs": copy_gbs})
            del xs
        del ours, w8, w4s, bnb_w, bnb_l8, ws16, ws_float, tiny, glite
        torch.cuda.empty_cache()

    hdr = (f"| M x K       |    N | kernel                 |   time us | TFLOP/s | weight GB/s | % copy | x {base} |\n"
           "|-------------|-----:|------------------------|----------:|--------:|------------:|-------:|-------:|")
    print("\n" + hdr)
    for shape, n, name, us, tf, gbs, pct, ratio in rows:
        print(f"| {shape:<11} | {n:4d} | {name:<22} | {us:9.1f} | {tf:7.1f} | {gbs:11.0f} | {pct:5.1f}% "
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
                "mode": "resident" if args.resident else "cold", "calls": args.calls if args.resident else None,
                "source": "benchmarks/gemm.py --json (measured in this run)"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": json_rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
