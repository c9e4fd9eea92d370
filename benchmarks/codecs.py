"""Codec throughput on the GPU: quantize and dequantize of every format on fp16 weights.

    python benchmarks/codecs.py [--shapes 4096x4096,14336x4096,4096x14336] [--iters 50]

Each timing is the median of CUDA-event-timed calls over rotated input buffers (together
several times the L2 size, so the data comes from DRAM). GB/s counts the bytes read plus
the bytes written by the operation (input + all output buffers for quantize; buffers +
fp16 output for dequantize); "% copy" compares with a device-to-device copy of the weight
measured in the same run. "quantize" is the public call (input validated, including the
NaN/Inf scan); "quantize*" runs it inside qformats.skip_finite_check(). bitsandbytes'
quantize_4bit / dequantize_4bit (nf4, blocksize 64) are measured alongside when installed.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import qformats

FORMAT_PARAMS = {
    "q4_0": {},
    "q8_1": {},
    "int8": {"granularity": "row"},
    "int4": {"group_size": 128},
    "nf4": {"blocksize": 64},
    "mixed2bit": {},
}
L2_BYTES = 60 * 2**20  # H200: 60 MB


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def time_ms(fn, args_sets, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn(*args) with CUDA events, rotating through args_sets."""
    for i in range(warmup):
        fn(*args_sets[i % len(args_sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        a = args_sets[i % len(args_sets)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def n_rotations(bytes_per_set: int) -> int:
    return max(2, -(-4 * L2_BYTES // max(bytes_per_set, 1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--formats", default=",".join(FORMAT_PARAMS))
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    if not qformats.cuda_available():
        print("no CUDA device or a CPU-only build: nothing to measure")
        return 1
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    try:
        import bitsandbytes.functional as bnbf
    except Exception:  # absent or without CUDA support
        bnbf = None

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  qformats {qformats.__version__}")
    rows = []
    for (m, k) in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w0 = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        sets = [(w0 * (1 + 0.01 * i),) for i in range(n_rotations(nbytes(w0)))]
        dst = [torch.empty_like(w0) for _ in sets]
        copy_ms = time_ms(lambda s, d: d.copy_(s), [(s[0], d) for s, d in zip(sets, dst)], args.iters)
        copy_gbs = 2 * nbytes(w0) / copy_ms / 1e6
        rows.append((f"{m}x{k}", "copy", "d2d", copy_ms, copy_gbs, 100.0))
        del dst
        for fmt in formats:
            mod = getattr(qformats, fmt)
            params = FORMAT_PARAMS.get(fmt, {})
            try:
                qts = [mod.quantize(s[0], **params) for s in sets]
            except Exception as e:  # a format without CUDA kernels in this build
                rows.append((f"{m}x{k}", fmt, f"n/a: {type(e).__name__}: {str(e)[:60]}", float("nan"), 0.0, 0.0))
                continue
            qbytes = qts[0].nbytes
            q_ms = time_ms(lambda x: mod.quantize(x, **params), sets, args.iters)
            with qformats.skip_finite_check():
                qs_ms = time_ms(lambda x: mod.quantize(x, **params), sets, args.iters)
            d_ms = time_ms(lambda q: q.dequantize(dtype="float16"), [(q,) for q in qts], args.iters)
            moved_q = nbytes(w0) + qbytes
            moved_d = qbytes + nbytes(w0)
            for op, ms, moved in (("quantize", q_ms, moved_q), ("quantize*", qs_ms, moved_q),
                                  ("dequantize", d_ms, moved_d)):
                gbs = moved / ms / 1e6
                rows.append((f"{m}x{k}", fmt, op, ms, gbs, 100 * gbs / copy_gbs))
            del qts
        if bnbf is not None:
            try:
                q_ms = time_ms(lambda x: bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4"), sets, args.iters)
                packs = [bnbf.quantize_4bit(s[0], blocksize=64, quant_type="nf4") for s in sets]
                d_ms = time_ms(lambda p, st: bnbf.dequantize_4bit(p, st), packs, args.iters)
                qb = nbytes(packs[0][0]) + nbytes(packs[0][1].absmax)
                for op, ms in (("quantize", q_ms), ("dequantize", d_ms)):
                    gbs = (nbytes(w0) + qb) / ms / 1e6
                    rows.append((f"{m}x{k}", "bnb-nf4", op, ms, gbs, 100 * gbs / copy_gbs))
            except Exception as e:
                rows.append((f"{m}x{k}", "bnb-nf4", f"n/a: {type(e).__name__}", float("nan"), 0.0, 0.0))
        del sets

    print()
    print(f"| {'shape':<11} | {'format':<9} | {'op':<11} | {'time (us)':>10} | {'GB/s':>8} | {'% copy':>7} |")
    print(f"|{'-' * 13}|{'-' * 11}|{'-' * 13}|{'-' * 12}|{'-' * 10}|{'-' * 9}|")
    for shape, fmt, op, ms, gbs, pct in rows:
        if op.startswith("n/a"):
            print(f"| {shape:<11} | {fmt:<9} | {op[:60]}")
            continue
        print(f"| {shape:<11} | {fmt:<9} | {op:<11} | {ms * 1000:>10.1f} | {gbs:>8.0f} | {pct:>6.1f}% |")
    print("\nquantize* = inside qformats.skip_finite_check() (no NaN/Inf scan of the input)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
