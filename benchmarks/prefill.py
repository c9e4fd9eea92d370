"""Prefill as users run it: one forward of a Hugging Face Llama over a prompt (what ``generate()``
does before its first new token), float against qformats formats, in one process.

    python benchmarks/prefill.py [--size 7b|tinyllama4|PATH] [--layers 16] [--prompt 256,1024]
                                 [--variants fp16,int4,nf4] [--rounds 5] [--calls 3] [--dequantize-only 1]
                                 [--dtype float16|bfloat16]

Model and variants as in ``generate_hf.py`` (random fp16 weights, every Linear but lm_head
quantized at the format's defaults). A variant's time is the median over ``rounds`` of the mean
of ``calls`` forwards (synchronized, wall clock, under ``torch.inference_mode``); the rounds
alternate over the variants, so a drift of the clocks or of the host reaches all of them alike.
Before timing, one forward per prompt length warms up (and lets ``QuantizedLinear`` make its
measured kernel-or-dequantize decisions, ``qformats.crossover``). Memory per variant: the model's
weights and buffers (GB), and the forward's peak above what was allocated before it (``peak
over``, MB: activations, workspaces, and a dequantized weight on the dequantizing path).
``--dequantize-only 1`` adds, for each qformats variant, the same model with ``QFORMATS_TUNE=0``:
above 16 rows every layer decodes its weight and calls cuBLAS (what a layer without a prefill
kernel does). The peers of ``generate_hf.py`` run too: ``bnb-nf4`` (bitsandbytes, fp16) and
``tinygemm-int4`` (torch's int4 kernel, a bf16 model). ``--dtype bfloat16`` builds the model in
bf16 (the float variant is then named ``bf16``); the ratio column is against the first variant.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from generate_hf import FLOAT_NAMES, FLOATS, PEERS, build_model, variant  # noqa: E402


def model_bytes(model) -> int:
    """Bytes of a model's parameters and buffers (packed codes and scales for quantized layers)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="7b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--prompt", default="256,1024")
    ap.add_argument("--variants", default="fp16,int4,nf4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--dequantize-only", type=int, default=1)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    args = ap.parse_args()
    own_float = FLOAT_NAMES[args.dtype]
    wrong = [v for v in args.variants.split(",") if v in FLOATS and v != own_float]
    if wrong:
        raise SystemExit(f"--dtype {args.dtype}: the float variant is {own_float!r}, not {wrong[0]!r}")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 1
    base = build_model(args.size, "cuda", getattr(torch, args.dtype), args.layers)
    vocab = base.config.vocab_size
    models = {}
    for name in args.variants.split(","):
        models[name] = (variant(base, name, "cuda"), "1")
        if args.dequantize_only and name not in (*FLOATS, *PEERS):
            models[f"{name}, QFORMATS_TUNE=0"] = (models[name][0], "0")
    prompts = [int(p) for p in args.prompt.split(",")]
    g = torch.Generator().manual_seed(1)
    ids = {p: torch.randint(3, vocab, (1, p), generator=g).cuda() for p in prompts}
    times = {(p, name): [] for p in prompts for name in models}
    over = {(p, name): 0 for p in prompts for name in models}

    def forward(model, p, tune):
        os.environ["QFORMATS_TUNE"] = tune
        model(ids[p], use_cache=False)

    with torch.inference_mode():
        for p in prompts:
            for name, (model, tune) in models.items():
                forward(model, p, tune)
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                forward(model, p, tune)
                torch.cuda.synchronize()
                over[(p, name)] = torch.cuda.max_memory_allocated() - before
        for _ in range(args.rounds):
            for p in prompts:
                for name, (model, tune) in models.items():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        forward(model, p, tune)
                    torch.cuda.synchronize()
                    times[(p, name)].append((time.perf_counter() - t0) / args.calls * 1e3)
    os.environ.pop("QFORMATS_TUNE", None)
    print(f"\n{args.size}, {args.layers or 'all'} layers, batch 1, {torch.cuda.get_device_name()}")
    first = next(iter(models))
    print(f"| prompt | variant | ms | prompt tokens/s | x {first} | min-max ms | weights GB | peak over MB |")
    print("|---:|---|---:|---:|---:|---|---:|---:|")
    for p in prompts:
        ref = statistics.median(times[(p, next(iter(models)))])
        for name in models:
            t = times[(p, name)]
            ms = statistics.median(t)
            print(f"| {p} | {name} | {ms:.2f} | {p / ms * 1e3:.0f} | {ref / ms:.2f} | {min(t):.2f}-{max(t):.2f} "
                  f"| {model_bytes(models[name][0]) / 1e9:.2f} | {over[(p, name)] / 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
