"""Wall time of one eager linear-layer call as a model makes it: ``layer(x)`` in a Python loop,
the way Hugging Face ``generate()`` calls each projection at batch 1 (no CUDA graph, no
torch.compile). Where the GPU kernel is shorter than the host's work, this is the host's cost
per call: module call, checks, allocation, launch.

    python benchmarks/linear_call.py [--device cuda|cpu] [--shape 4096x4096] [--rows 1]
                                     [--dtype float16] [--calls 2000] [--repeats 7] [--bias 1]

Rows: ``torch.nn.Linear`` (the reference), ``qformats.nn.QuantizedLinear`` for each format with a
native linear kernel (``SPEC.make_linear``; at ``SPEC.defaults``), and the peers present in the
environment: bitsandbytes ``Linear4bit`` (nf4, blocksize 64, fp16 compute) and torch's tinygemm
int4 (``aten._weight_int4pack_mm``, group 128, bf16, the kernel behind torchao's int4 weight-only
layout). Each row: median over ``repeats``
loops of ``calls`` calls of (loop time / calls), under ``torch.no_grad()``, synchronized at
the end of each loop; the ratio column divides by ``nn.Linear``'s time in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn

import qformats
from qformats.nn import QuantizedLinear

#: The formats with a native linear kernel, each at its SPEC.defaults (int4: groups of 128).
FORMATS = [f for f in qformats.FORMATS if qformats.format_spec(f).make_linear is not None]


class TinyGemmInt4(nn.Module):
    """torch's tinygemm int4 weight-only linear (aten._weight_int4pack_mm, bf16 activations),
    packed as gpt-fast / torchao pack it: asymmetric groups of 128, scales and zeros in bf16."""

    def __init__(self, lin: nn.Linear, group_size: int = 128, inner_k_tiles: int = 8):
        super().__init__()
        w = lin.weight.detach().float()
        M, K = w.shape
        g = w.reshape(M, K // group_size, group_size)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-6)
        zero = lo + scale * 8
        q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(M, K)
        q = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # two codes a byte, even element high
        self.group_size = group_size
        # buffers, so that a model's buffers count these bytes (prefill.py's memory column)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(q, inner_k_tiles), persistent=False)
        sz = torch.stack([scale.reshape(M, -1), zero.reshape(M, -1)], -1)
        self.register_buffer("sz", sz.transpose(0, 1).contiguous().to(torch.bfloat16), persistent=False)
        self.bias = None if lin.bias is None else lin.bias.detach().to(torch.bfloat16)
        self.out_features = M

    def forward(self, x):
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, x.shape[-1]), self.packed, self.group_size, self.sz)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def bnb_linear4bit(lin: nn.Linear):
    import bitsandbytes as bnb

    m = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                          compute_dtype=torch.float16, quant_type="nf4", device="cpu")
    m.weight = bnb.nn.Params4bit(lin.weight.detach().cpu().half(), requires_grad=False, quant_type="nf4",
                                 blocksize=64)
    if lin.bias is not None:
        m.bias = nn.Parameter(lin.bias.detach().cpu().half(), requires_grad=False)
    return m.cuda()


def per_call_us(layer, x, calls: int, repeats: int, sync) -> float:
    times = []
    with torch.no_grad():
        for _ in range(3):
            layer(x)
        sync()
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                layer(x)
            sync()
            times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="4096x4096", help="out_features x in_features")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bias", type=int, default=1)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--operator", type=int, default=0,
                    help="1: also time each format through the qformats::linear operator (the path "
                         "torch.compile and autograd take, and eager calls above the kernel's rows before "
                         "the bound decode)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    M, K = (int(s) for s in args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    lin = nn.Linear(K, M, bias=bool(args.bias)).to(dev, dtype)
    x = torch.randn(args.rows, K, device=dev, dtype=dtype)
    rows = [("nn.Linear", args.dtype, per_call_us(lin, x, args.calls, args.repeats, sync))]
    for fmt in [f for f in args.formats.split(",") if f]:
        q = QuantizedLinear.from_linear(lin, fmt, **qformats.format_spec(fmt).defaults)
        rows.append((f"QuantizedLinear {fmt}", args.dtype, per_call_us(q, x, args.calls, args.repeats, sync)))
        if args.operator:
            rows.append((f"qformats::linear operator {fmt}", args.dtype,
                         per_call_us(q._operator, x, args.calls, args.repeats, sync)))
    if dev.type == "cuda":
        try:
            rows.append(("bitsandbytes Linear4bit nf4", "float16",
                         per_call_us(bnb_linear4bit(lin), x.half(), args.calls, args.repeats, sync)))
        except ImportError as e:
            print(f"bitsandbytes: not measured ({e})")
        try:
            tg = TinyGemmInt4(lin.to(torch.bfloat16))
            rows.append(("torch tinygemm int4 (torchao layout)", "bfloat16",
                         per_call_us(tg, x.to(torch.bfloat16), args.calls, args.repeats, sync)))
        except (RuntimeError, NotImplementedError) as e:
            print(f"tinygemm: not measured ({e})")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, qformats {qformats.__version__}: {M}x{K}, {args.rows} row(s), "
          f"bias={bool(args.bias)}, {args.calls} calls x {args.repeats} loops, no_grad")
    base = rows[0][2]
    bnb_t = next((t for n, _, t in rows if n.startswith("bitsandbytes")), None)
    print("| layer | x dtype | us/call | x nn.Linear | x bnb Linear4bit |")
    print("|---|---|---:|---:|---:|")
    for n, dt, t in rows:
        rb = f"{t / bnb_t:.2f}" if bnb_t else "-"
        print(f"| {n} | {dt} | {t:.1f} | {t / base:.2f} | {rb} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
