"""Codec throughput on the GPU: quantize and dequantize of every format on fp16 weights.

    python benchmarks/codecs.py [--shapes 4096x4096,14336x4096,4096x14336] [--iters 50]

Each timing is the median of CUDA-event-timed calls over rotated input buffers (together
several times the L2 size, so the data comes from DRAM). GB/s counts the bytes read plus
the bytes written by the operation (input + all output buffers for quantize; buffers +
fp16 output for dequantize); "% copy" compares with a device-to-device copy of the weight
measured in the same run. "quantize" is the public call (input validated, including the
NaN/Inf scan); "quantize*" runs it inside qformats.skip_finite_check(). bitsandbytes'
quantize_4bit / dequantize_4bit (nf4, blocksize 64) are measured alongside when installed.
Every format runs at its default parameters (``qformats.<fmt>.SPEC.defaults``), plus the rows of
--variants (default: mixed2bit's tiled layout, row "mixed2bit-tiled").
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import qformats
from qformats._core import format_spec

sys.path.insert(0, str(Path(__file__).parent))
import variants  # noqa: E402

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


def kernel_ms(fn, args_sets, iters: int, match) -> float:
    """Device time per call (ms) of the CUDA kernels whose name satisfies `match`, from the
    torch profiler: the kernels alone, without the host overhead between them."""
    from torch.profiler import ProfilerActivity, profile

    for a in args_sets[:2]:
        fn(*a)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(*args_sets[i % len(args_sets)])
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if match(e.key))
    return total_us / iters / 1000


def ours(name: str) -> bool:
    return "qf::" in name or "_ZN2qf" in name


def n_rotations(bytes_per_set: int) -> int:
    return max(2, -(-4 * L2_BYTES // max(bytes_per_set, 1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--formats", default=",".join(qformats.FORMATS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--variants", default=variants.DEFAULT, help=variants.HELP)
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
        rows.append((f"{m}x{k}", "copy", "d2d", copy_ms, copy_gbs, 100.0, (copy_ms,)))
        del dst
        for fmt, base, params in variants.rows(formats, args.variants):
            try:
                spec = format_spec(base)
                qts = [spec.quantize(s[0], **params) for s in sets]
            except Exception as e:  # a format without CUDA kernels in this build
                rows.append((f"{m}x{k}", fmt, f"n/a: {type(e).__name__}: {str(e)[:60]}", 0, 0, 0, ()))
                continue
            qbytes = qts[0].nbytes
            quant = lambda x: spec.quantize(x, **params)  # noqa: E731
            deq = lambda q: q.dequantize(dtype="float16")  # noqa: E731
            qsets = [(q,) for q in qts]
            api_q = time_ms(quant, sets, args.iters)
            with qformats.skip_finite_check():
                api_qs = time_ms(quant, sets, args.iters)
                kern_q = kernel_ms(quant, sets, args.iters, ours)
            api_d = time_ms(deq, qsets, args.iters)
            kern_d = kernel_ms(deq, qsets, args.iters, ours)
            moved = nbytes(w0) + qbytes  # read + written, both directions
            for op, kern, api in (("quantize", kern_q, (api_q, api_qs)), ("dequantize", kern_d, (api_d,))):
                gbs = moved / kern / 1e6
                rows.append((f"{m}x{k}", fmt, op, kern, gbs, 100 * gbs / copy_gbs, api))
            del qts
        if bnbf is not None:
            try:
                bq = lambda x: bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4")  # noqa: E731
                bd = lambda p, st: bnbf.dequantize_4bit(p, st)  # noqa: E731
                packs = [bq(s[0]) for s in sets]
                every = lambda name: True  # noqa: E731  (bitsandbytes' own kernels only run here)
                qb = nbytes(packs[0][0]) + nbytes(packs[0][1].absmax)
                for op, fn, a in (("quantize", bq, sets), ("dequantize", bd, packs)):
                    kern, api = kernel_ms(fn, a, args.iters, every), time_ms(fn, a, args.iters)
                    gbs = (nbytes(w0) + qb) / kern / 1e6
                    rows.append((f"{m}x{k}", "bnb-nf4", op, kern, gbs, 100 * gbs / copy_gbs, (api,)))
            except Exception as e:
                rows.append((f"{m}x{k}", "bnb-nf4", f"n/a: {type(e).__name__}: {str(e)[:60]}", 0, 0, 0, ()))
        del sets

    print()
    print(f"| {'shape':<11} | {'format':<15} | {'op':<10} | {'kernel us':>9} | {'GB/s':>6} | {'% copy':>7} "
          f"| {'API us':>17} |")
    print(f"|{'-' * 13}|{'-' * 17}|{'-' * 12}|{'-' * 11}|{'-' * 8}|{'-' * 9}|{'-' * 19}|")
    for shape, fmt, op, ms, gbs, pct, api in rows:
        if op.startswith("n/a"):
            print(f"| {shape:<11} | {fmt:<15} | {op[:70]}")
            continue
        api_s = " / ".join(f"{a * 1000:.0f}" for a in api)
        print(f"| {shape:<11} | {fmt:<15} | {op:<10} | {ms * 1000:>9.1f} | {gbs:>6.0f} | {pct:>6.1f}% | {api_s:>17} |")
    print("\nkernel us: device time of the library's own kernels per call (torch profiler); GB/s and"
          "\n% copy from it (bytes read + written). API us: CUDA-event time of the whole Python call;"
          "\nfor quantize 'checked / unchecked', unchecked = inside qformats.skip_finite_check().")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
