"""Decode speed of a Llama-shaped model on the GPU: fp16 against each quantized format.

    python benchmarks/generate.py [--size 7b|1b] [--batch 1,16] [--formats fp16,nf4,int4,q4_0,mixed2bit]
                                  [--steps 64] [--layers L] [--variants mixed2bit:layout=tiled] [--compile]

The model is a plain-PyTorch Llama decoder (RMSNorm, rotary attention with grouped KV heads over
a static KV cache, SwiGLU MLP, untied lm_head) with random fp16 weights: speed does not depend
on the values. Each format replaces every nn.Linear except lm_head with
qformats.quantize_model(format=...) (RTN; int4 g128 asymmetric, nf4 blocksize 64, q4_0,
mixed2bit g16 with 10% 4-bit groups; and --variants, by default mixed2bit's tiled layout), so
the forward runs through qformats.ops.linear: the
register-decoding GEMV kernels for up to 16 rows. One decode step (one new token per sequence)
is captured in a CUDA graph, as inference servers do, so Python overhead is not measured; the
graph is replayed `steps` times and tokens/s = batch * steps / time. Model size counts the
stored weights; peak memory is torch.cuda.max_memory_allocated during the run. ``--compile``
runs the model through ``torch.compile`` (inductor, fullgraph, no CUDA graphs of its own) before
the step is captured, as servers such as vLLM do: the norms, rotary embedding and attention glue
become fused kernels instead of many small ones per layer, for every variant alike.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import qformats

sys.path.insert(0, str(Path(__file__).parent))
import variants  # noqa: E402

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "7b": (4096, 11008, 32, 32, 32, 32000),      # Llama-2-7B
    "8b": (4096, 14336, 32, 32, 8, 128256),      # Llama-3-8B
    "1b": (2048, 8192, 16, 32, 8, 128256),       # Llama-3.2-1B
}


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + 1e-5)).to(x.dtype) * self.weight


class Layer(nn.Module):
    def __init__(self, d, ff, heads, kv_heads):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)

    def forward(self, x, cos, sin, k_cache, v_cache, pos, mask):
        b = x.shape[0]
        h = self.norm1(x)
        q = self.q_proj(h).view(b, 1, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, 1, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, 1, self.kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v)
        a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=self.kv != self.h)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, 1, -1))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Llama(nn.Module):
    def __init__(self, d, ff, n_layers, heads, kv_heads, vocab):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, ff, heads, kv_heads) for _ in range(n_layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, cos, sin, caches, pos, mask):
        x = self.embed_tokens(ids)
        for layer, (kc, vc) in zip(self.layers, caches):
            x = layer(x, cos, sin, kc, vc, pos, mask)
        return self.lm_head(self.norm(x))


def weight_bytes(model) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, qformats.nn.QuantizedLinear):
            total += m.quantized_weight.nbytes
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            total += m.weight.numel() * m.weight.element_size()
    return total


def decode_tokens_per_s(model, cfg, batch, steps, max_len=512):
    d, ff, n_layers, heads, kv_heads, vocab = cfg
    hd = d // heads
    caches = [(torch.zeros(batch, kv_heads, max_len, hd, device="cuda", dtype=torch.float16),
               torch.zeros(batch, kv_heads, max_len, hd, device="cuda", dtype=torch.float16))
              for _ in range(n_layers)]
    ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    cos = torch.ones(1, 1, 1, hd // 2, device="cuda", dtype=torch.float16)
    sin = torch.zeros(1, 1, 1, hd // 2, device="cuda", dtype=torch.float16)
    mask = torch.zeros(1, 1, 1, max_len, device="cuda", dtype=torch.bool)
    inv = 1.0 / (10000 ** (torch.arange(0, hd // 2, device="cuda").float() / (hd // 2)))

    def set_pos(p):
        pos.fill_(p)
        ang = p * inv
        cos.copy_(ang.cos().view(1, 1, 1, -1))
        sin.copy_(ang.sin().view(1, 1, 1, -1))
        mask.zero_()
        mask[..., : p + 1] = True

    with torch.no_grad():
        set_pos(0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                model(ids, cos, sin, caches, pos, mask)  # warm-up (kernel caches, row indices)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(ids, cos, sin, caches, pos, mask)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p in range(steps):
            set_pos(p)
            graph.replay()
            ids.copy_(logits[:, -1:].argmax(-1))  # greedy: the next token feeds the next step
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    del graph
    return batch * steps / dt, dt / steps * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="7b", choices=sorted(SIZES))
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--formats", default="fp16,nf4,int4,q4_0,mixed2bit")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (0: the model's)")
    ap.add_argument("--variants", default=variants.DEFAULT, help=variants.HELP)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model before capturing the step")
    args = ap.parse_args(argv)
    if not qformats.cuda_available():
        print("no CUDA device or a CPU-only build: nothing to measure")
        return 1
    cfg = list(SIZES[args.size])
    if args.layers:
        cfg[2] = args.layers
    batches = [int(b) for b in args.batch.split(",")]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  qformats {qformats.__version__}")
    print(f"model: Llama-shaped {args.size} (hidden {cfg[0]}, ffn {cfg[1]}, {cfg[2]} layers, "
          f"{cfg[3]}/{cfg[4]} heads, vocab {cfg[5]}), random fp16 weights"
          + (", torch.compile'd" if args.compile else ""))
    rows = []
    base = {}
    names = [f for f in args.formats.split(",") if f]
    runs = ([("fp16", "fp16", {})] if "fp16" in names else []) + \
        variants.rows([f for f in names if f != "fp16"], args.variants)
    for fmt, base_fmt, params in runs:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Llama(*cfg).half()
        for p in model.parameters():
            p.requires_grad_(False)
            p.normal_(0, 0.02)
        if fmt != "fp16":
            qformats.quantize_model(model, format=base_fmt, **params)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        size_gb = weight_bytes(model) / 1e9
        step = torch.compile(model, fullgraph=True) if args.compile else model
        for b in batches:
            tps, ms = decode_tokens_per_s(step, cfg, b, args.steps)
            if fmt == "fp16":
                base[b] = tps
            peak = torch.cuda.max_memory_allocated() / 1e9
            rows.append((fmt, b, tps, ms, tps / base.get(b, math.nan), size_gb, peak))
            print(f"  {fmt:<15} batch {b:3d}: {tps:9.1f} tok/s  {ms:7.2f} ms/step", flush=True)
        del model, step  # the compiled wrapper holds the model too: both go before the next is built
        torch.cuda.empty_cache()
    print("\n| format          | batch | tokens/s | ms/step | x fp16 | weights GB | peak GB |")
    print("|-----------------|------:|---------:|--------:|-------:|-----------:|--------:|")
    for fmt, b, tps, ms, ratio, size_gb, peak in rows:
        print(f"| {fmt:<15} | {b:5d} | {tps:8.1f} | {ms:7.2f} | {ratio:5.2f}x | {size_gb:10.2f} | {peak:7.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
