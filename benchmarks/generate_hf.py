"""Decode speed as users run it: Hugging Face ``generate()`` on a Llama, float against every
qformats format and the peers, in one run.

    python benchmarks/generate_hf.py [--device cuda|cpu] [--size 7b|tinyllama4|PATH]
        [--modes eager,compile] [--batch 1,16] [--variants fp16,int4,nf4,q4_0,mixed2bit,bnb-nf4,tinygemm-int4]
        [--new-tokens 64] [--prompt 16] [--layers L] [--json FILE]

Model: ``transformers.LlamaForCausalLM`` from a config (random weights: speed does not depend on
the values; ``7b`` = Llama-2-7B's shapes, ``tinyllama4`` = TinyLlama-1.1B's layer shapes with 4
layers: hidden 2048, MLP 5632, 32 heads / 4 KV heads, vocab 32000) or a checkpoint folder
(e.g. ../shared/models/pydoc-llama-17m). The float baseline is fp16 on CUDA and fp32 on the
CPU. Variants: ``fp16`` / ``fp32`` (the float model), a qformats format name (every
``nn.Linear`` but lm_head quantized by ``qformats.quantize_model(format=..., **SPEC.defaults)``,
int4 groups of 128) or ``FMT:KEY=VALUE;...`` (over those defaults, e.g.
``mixed2bit:layout=tiled``), ``bnb-nf4`` (bitsandbytes ``Linear4bit`` nf4 blocksize 64, fp16 compute)
``tinygemm-int4`` (torch's ``aten._weight_int4pack_mm``, the kernel of torchao's int4
weight-only layout; bf16 model) and ``empty-linear``: every such Linear replaced by a module that
only returns an uninitialized output of the right shape, so that its tokens/s is the ceiling
that no linear-layer implementation can pass in that mode (the rest of the model and of
``generate()`` still runs).

Modes: ``eager`` (``generate()`` as it comes: dynamic cache, no compilation) and ``compile``
(``cache_implementation="static"`` with ``CompileConfig(fullgraph=True, mode="reduce-overhead")``:
``generate()`` compiles the decode step with torch.compile and replays it in CUDA graphs, the
way transformers documents it). Each measurement: a warm-up ``generate()`` (which also
compiles), then three greedy ``generate()`` calls of ``new_tokens`` tokens after a
``prompt``-token random prompt, each timed with synchronization; tokens/s = batch * new_tokens /
the median time (the prefill of the short prompt included). Peak memory:
``torch.cuda.max_memory_allocated`` on CUDA less the float model's allocation while another
variant runs (the float model stays on the GPU to copy the next variant from, so the figure is
the variant's own); the process's max RSS on the CPU (which includes the float model).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import qformats
from qformats._core import format_spec

sys.path.insert(0, str(Path(__file__).parent))
import variants  # noqa: E402
from linear_call import TinyGemmInt4, bnb_linear4bit  # noqa: E402  (the peers, as linear_call builds them)

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "7b": (4096, 11008, 32, 32, 32, 32000),
    "tinyllama4": (2048, 5632, 4, 32, 4, 32000),
}


def build_model(size: str, device: str, dtype: torch.dtype, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    if size in SIZES:
        d, ff, n, h, kv, vocab = SIZES[size]
        cfg = LlamaConfig(hidden_size=d, intermediate_size=ff, num_hidden_layers=layers or n,
                          num_attention_heads=h, num_key_value_heads=kv, vocab_size=vocab,
                          max_position_embeddings=2048)
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(cfg).to(dtype)
    else:
        model = LlamaForCausalLM.from_pretrained(size, torch_dtype=dtype).to(device)
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    return model


def replace_linears(model: nn.Module, make) -> None:
    for name, m in list(model.named_modules()):
        for cname, child in list(m.named_children()):
            full = f"{name}.{cname}" if name else cname
            if isinstance(child, nn.Linear) and not full.endswith("lm_head"):
                setattr(m, cname, make(child))


class EmptyLinear(nn.Module):
    """A stand-in for a Linear that does no work: the output tensor only."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.out_features = lin.out_features

    def forward(self, x):
        return x.new_empty((*x.shape[:-1], self.out_features))


# Variant names that are not qformats formats: the float models and the other libraries' kernels.
FLOAT_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}  # torch dtype -> variant name
FLOATS = tuple(FLOAT_NAMES.values())
PEERS = ("bnb-nf4", "tinygemm-int4")


def variant(base, name: str, device: str):
    """A copy of the float model as variant ``name`` (the base is left as it is)."""
    if name in FLOATS:
        return base
    if name == "empty-linear":
        model = copy.deepcopy(base)
        replace_linears(model, EmptyLinear)
        return model
    model = copy.deepcopy(base)
    if name == "bnb-nf4":
        replace_linears(model, bnb_linear4bit)
        return model
    if name == "tinygemm-int4":
        model = model.to(torch.bfloat16)
        replace_linears(model, TinyGemmInt4)
        return model
    # a format at its defaults, or FMT:KEY=VALUE;... over them (benchmarks/variants.py)
    _, fmt, params = variants.rows([], name)[0] if ":" in name else (name, name, format_spec(name).defaults)
    qformats.quantize_model(model, format=fmt, **params)
    return model


def peak_bytes(device: str, held: int = 0) -> int:
    """Peak memory of the run just measured, less ``held`` bytes that belong to another model."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() - held
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tokens_per_s(model, vocab: int, batch: int, prompt: int, new_tokens: int, mode: str, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(device)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    if mode == "compile":
        from transformers import CompileConfig

        kw["cache_implementation"] = "static"
        kw["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
    with torch.inference_mode():
        model.generate(ids, **kw)  # warm-up (and compilation)
        if mode == "compile":
            model.generate(ids, **kw)
        times = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            sync()
            times.append(time.perf_counter() - t0)
    assert out.shape[1] == prompt + new_tokens
    return batch * new_tokens / sorted(times)[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="7b")
    ap.add_argument("--modes", default="eager")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--variants", default="", help="default: the float model, every format with a "
                    "native kernel on the device, the peers and empty-linear (CUDA)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU: torch's threads (0: as set); qformats' kernels take QFORMATS_NUM_THREADS")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    dev = args.device
    if args.threads:
        torch.set_num_threads(args.threads)  # qformats' CPU kernels: QFORMATS_NUM_THREADS
    fdtype = torch.float16 if dev == "cuda" else torch.float32
    base_name = "fp16" if dev == "cuda" else "fp32"
    kernels = [f for f in qformats.FORMATS if format_spec(f).linear_rows.get(dev)]
    default_variants = [base_name, *kernels] + ([*PEERS, "empty-linear"] if dev == "cuda" else [])
    variants = [v for v in (args.variants.split(",") if args.variants else default_variants) if v]
    modes = [m for m in args.modes.split(",") if m]
    batches = [int(b) for b in args.batch.split(",")]
    base = build_model(args.size, dev, fdtype, args.layers)
    base_bytes = torch.cuda.memory_allocated() if dev == "cuda" else 0
    vocab = base.config.vocab_size
    cfg = base.config
    where = torch.cuda.get_device_name() if dev == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"{where}; torch {torch.__version__}; qformats {qformats.__version__}; model {args.size}: hidden "
          f"{cfg.hidden_size}, MLP {cfg.intermediate_size}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, vocab {vocab}; prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, greedy", flush=True)
    rows = []
    for v in variants:
        try:
            model = variant(base, v, dev)
        except Exception as e:  # a peer that is not installed, or a format that does not apply
            print(f"  {v}: not measured ({type(e).__name__}: {e})", flush=True)
            continue
        for mode in modes:
            m = model
            if mode == "compile":
                torch._dynamo.reset()
            for b in batches:
                if dev == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                try:
                    tps = tokens_per_s(m, vocab, b, args.prompt, args.new_tokens, mode, dev)
                    err = ""
                except Exception as e:  # reported in the table, not hidden
                    tps, err = math.nan, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                rows.append({"variant": v, "mode": mode, "batch": b, "tokens_per_s": tps,
                             "peak_gb": peak_bytes(dev, 0 if model is base else base_bytes) / 1e9,
                             "error": err})
                print(f"  {v:<14} {mode:<8} batch {b:3d}: {tps:8.2f} tok/s {err}", flush=True)
        if model is not base:
            del model
        if dev == "cuda":
            torch.cuda.empty_cache()
    ref = {(r["mode"], r["batch"]): r["tokens_per_s"] for r in rows if r["variant"] == base_name}
    peers = {(r["mode"], r["batch"], r["variant"]): r["tokens_per_s"] for r in rows
             if r["variant"] in PEERS}
    print(f"\n| variant | mode | batch | tokens/s | x {base_name} | x bnb-nf4 | x tinygemm-int4 | peak GB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        k = (r["mode"], r["batch"])
        x = r["tokens_per_s"] / ref.get(k, math.nan)
        xb = r["tokens_per_s"] / peers.get((*k, "bnb-nf4"), math.nan)
        xt = r["tokens_per_s"] / peers.get((*k, "tinygemm-int4"), math.nan)
        note = f" ({r['error']})" if r["error"] else ""
        print(f"| {r['variant']}{note} | {r['mode']} | {r['batch']} | {r['tokens_per_s']:.1f} | {x:.2f} | "
              f"{xb:.2f} | {xt:.2f} | {r['peak_gb']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "size": args.size,
                                               "layers": cfg.num_hidden_layers, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
