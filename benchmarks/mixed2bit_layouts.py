"""What mixed2bit's tiled layout costs in quality against the global one, at the same rules (RTN).

Every nn.Linear of the model except lm_head is quantized with mixed2bit (defaults: groups of 16,
ratio_4bit 0.1, 4-bit groups selected by range) in each layout, decoded back into the float
model, and the perplexity measured on the whole text (non-overlapping windows, as `qformats
eval`). Prints a table: layout, bits per weight, mean weight NMSE, perplexity, change against
the global layout.

    PYTHONPATH=python python benchmarks/mixed2bit_layouts.py \
        --model ../shared/models/pydoc-llama-17m --text ../shared/data/pydoc/valid.txt
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qformats import evaluate, mixed2bit


def quantized_copy(model_dir: str, layout: str | None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bits = elems = 0
    errs = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head") and layout is not None:
            w = mod.weight.detach().contiguous()
            q = mixed2bit.quantize(w, layout=layout)
            errs.append(mixed2bit.nmse(w, q))
            bits += q.avg_bits * w.numel()
            elems += w.numel()
            mod.weight.data = torch.as_tensor(q.dequantize("float32"))
    return model, (bits / elems if elems else 16.0), (float(np.mean(errs)) if errs else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="../shared/models/pydoc-llama-17m")
    ap.add_argument("--text", default="../shared/data/pydoc/valid.txt")
    ap.add_argument("--seqlen", type=int, default=512)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    text = open(args.text, encoding="utf-8").read()
    rows = []
    for layout in (None, "global", "tiled"):
        model, bpw, err = quantized_copy(args.model, layout)
        ppl = evaluate.perplexity(model, tok, text, seqlen=args.seqlen, progress=False)["ppl"]
        rows.append((layout or "float", bpw, err, ppl))
    base = rows[1][3]
    print("| layout | bits/w | mean NMSE | ppl | vs global |\n|---|---:|---:|---:|---:|")
    for layout, bpw, err, ppl in rows:
        print(f"| {layout} | {bpw:.3f} | {err:.4f} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% |")


if __name__ == "__main__":
    main()
