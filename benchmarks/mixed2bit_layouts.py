"""What mixed2bit's tiled layout costs in quality against the global one, at the same rules.

Every nn.Linear of the model except lm_head is quantized with mixed2bit (defaults: groups of 16,
ratio_4bit 0.1) in each layout, by each method of --methods:

- ``rtn``: round to nearest, 4-bit groups selected by range (``mixed2bit.quantize``, decoded back
  into the float model);
- ``calibrated``: round to nearest, 4-bit groups selected by the calibrated sensitivity
  (``quantize_model(method="rtn", calibration=text)``);
- ``signround``: trainable rounding (``quantize_model(method="signround")``, --iters,
  --nsamples, --cal-seqlen: the CLI's settings of the issue's timing, 20 / 16 / 512).

and the perplexity measured on the text (non-overlapping 512-token windows; --max-tokens as
`qformats eval`: 0 scores the whole text). Prints a table: method, layout, bits per weight,
perplexity, change against the global layout of the same method.

    PYTHONPATH=python python benchmarks/mixed2bit_layouts.py --methods rtn,signround \\
        --model ../shared/models/pydoc-llama-17m --text ../shared/data/pydoc/valid.txt --max-tokens 0
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import qformats
from qformats import evaluate, mixed2bit

METHODS = ("rtn", "calibrated", "signround")


def load(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def rtn_copy(model_dir: str, layout: str):
    """The model with every Linear but lm_head replaced by its mixed2bit RTN decode; bits/weight."""
    model = load(model_dir)
    bits = elems = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            w = mod.weight.detach().contiguous()
            q = mixed2bit.quantize(w, layout=layout)
            bits += q.avg_bits * w.numel()
            elems += w.numel()
            mod.weight.data = torch.as_tensor(q.dequantize("float32"))
    return model, bits / elems


def quantized_model(model_dir: str, layout: str, method: str, tok, text: str, args):
    """quantize_model's model (QuantizedLinear layers) and its bits/weight."""
    model = load(model_dir)
    opts = {"calibration": text, "tokenizer": tok, "nsamples": args.nsamples, "seqlen": args.cal_seqlen}
    if method == "signround":
        opts.update(iters=args.iters)
    rep = qformats.quantize_model(model, format="mixed2bit", layout=layout,
                                  method="signround" if method == "signround" else "rtn", **opts)
    return model, rep.avg_bits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="../shared/models/pydoc-llama-17m")
    ap.add_argument("--text", default="../shared/data/pydoc/valid.txt")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=96 * 512, help="as `qformats eval`; 0: the whole text")
    ap.add_argument("--methods", default="rtn", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--cal-seqlen", type=int, default=512)
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    bad = set(methods) - set(METHODS)
    if bad:
        ap.error(f"--methods: unknown {sorted(bad)}")
    tok = AutoTokenizer.from_pretrained(args.model)
    text = open(args.text, encoding="utf-8").read()
    windows, _ = evaluate.lm_windows(tok, text, args.seqlen, args.max_tokens or None)

    def ppl(model) -> float:
        with torch.inference_mode():
            return evaluate.perplexity(model, windows, progress=False)["ppl"]

    rows = [("float", "-", 16.0, ppl(load(args.model)), 0.0)]
    for method in methods:
        for layout in ("global", "tiled"):
            t0 = time.perf_counter()
            if method == "rtn":
                model, bpw = rtn_copy(args.model, layout)
            else:
                model, bpw = quantized_model(args.model, layout, method, tok, text, args)
            secs = time.perf_counter() - t0
            rows.append((method, layout, bpw, ppl(model), secs))
    print(f"{windows.shape[0]} windows of {args.seqlen} tokens; signround: iters {args.iters}, nsamples "
          f"{args.nsamples}, seqlen {args.cal_seqlen}\n")
    print("| method | layout | bits/w | ppl | vs global | quantize s |\n|---|---|---:|---:|---:|---:|")
    base = {}
    for method, layout, bpw, p, secs in rows:
        if layout == "global":
            base[method] = p
        vs = f"{100 * (p / base[method] - 1):+.2f}%" if layout == "tiled" else ""
        print(f"| {method} | {layout} | {bpw:.3f} | {p:.3f} | {vs} | {secs:.0f} |")


if __name__ == "__main__":
    main()
