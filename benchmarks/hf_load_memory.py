"""Peak host memory of ``from_pretrained`` on a qformats folder, against what it must hold.

A random Llama (sizes below) is quantized (int4, groups of 128, the default plan: lm_head and
embeddings in float) and written with ``save_pretrained``; a fresh process then imports
torch, transformers and qformats, loads a tiny model once (so that lazy imports and first-call
allocations are done), and loads the folder while a thread samples its memory every 0.5 ms.

Printed (MB = 10^6 bytes): the packed weights, the unquantized tensors (embeddings, norms,
lm_head), and the loading's growth of
- anonymous memory (``RssAnon``: what the process allocated; peak of the samples), and
- resident memory (``VmRSS``: anonymous plus the pages of the memory-mapped safetensors files
  that were read, which the kernel can drop; peak of the samples), during the load and up to
  the end of a first one-token forward (which reads every weight page),
each as a ratio to packed + unquantized (the target: <= 1.2x).

Usage: python benchmarks/hf_load_memory.py [--hidden 1024] [--layers 8] [--vocab 2048] [--json]
Exit status 0; the check belongs to tests/model/test_hf.py (a smaller model, same code).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, threading, time
import torch, transformers, qformats
from transformers import AutoModelForCausalLM
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

def mem():
    # (anonymous, resident) bytes: RssAnon, and VmRSS = anonymous + file-backed + shared
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "VmRSS:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out["RssAnon"], out["VmRSS"]

AutoModelForCausalLM.from_pretrained(sys.argv[2], local_files_only=True)  # warm-up: a tiny model
base = mem()
peak, stop = list(base), threading.Event()
def sample():
    while not stop.is_set():
        now = mem()
        peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
        time.sleep(0.0005)
t = threading.Thread(target=sample, daemon=True)
t.start()
t0 = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True)
secs = time.perf_counter() - t0
loaded = list(peak)
with torch.inference_mode():  # touches every weight page: the model as it runs
    m(input_ids=torch.zeros(1, 1, dtype=torch.long))
stop.set(); t.join()
now = mem()
print(json.dumps({"anon_growth": max(loaded[0], now[0]) - base[0],
                  "rss_growth": loaded[1] - base[1],
                  "rss_growth_forward": max(peak[1], now[1]) - base[1], "seconds": secs,
                  "quantized_layers": sum(type(x).__name__ == "QuantizedLinear" for x in m.modules())}))
"""


def build(folder: str, hidden: int, layers: int, vocab: int, seed: int = 0) -> dict:
    """Write the quantized random Llama to ``folder``; return its byte counts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import qformats
    from qformats.nn import QuantizedLinear

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 128 * 128,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 64, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).eval()
    qformats.quantize_model(m, bits=4)
    m.save_pretrained(folder)
    packed = sum(getattr(q, b).numel() * getattr(q, b).element_size()
                 for q in m.modules() if isinstance(q, QuantizedLinear) for b in q.buffer_names)
    total = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    return {"packed": packed, "unquantized": total - packed}


def measure(hidden: int = 1024, layers: int = 8, vocab: int = 2048) -> dict:
    """Build, load in a fresh process, return sizes and growths (bytes) and ratios."""
    with tempfile.TemporaryDirectory() as d:
        sizes = build(d + "/model", hidden, layers, vocab)
        build(d + "/tiny", 128, 1, 256, seed=1)
        r = subprocess.run([sys.executable, "-c", CHILD, d + "/model", d + "/tiny"],
                           capture_output=True, text=True, check=True)
        out = json.loads(r.stdout.strip().splitlines()[-1])
    need = sizes["packed"] + sizes["unquantized"]
    return {**sizes, **out, "need": need, "anon_ratio": out["anon_growth"] / need,
            "rss_ratio": out["rss_growth"] / need,
            "rss_forward_ratio": out["rss_growth_forward"] / need}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = measure(a.hidden, a.layers, a.vocab)
    if a.json:
        print(json.dumps(r))
        return 0
    mb = 1e6
    print(f"from_pretrained of an int4 Llama (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}), "
          f"{r['quantized_layers']} QuantizedLinear, {r['seconds']:.2f} s")
    print("| packed MB | unquantized MB | need MB | anon growth MB | ratio | RSS growth MB | ratio "
          "| RSS growth + 1 forward MB | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {r['packed'] / mb:.1f} | {r['unquantized'] / mb:.1f} | {r['need'] / mb:.1f} | "
          f"{r['anon_growth'] / mb:.1f} | {r['anon_ratio']:.2f} | {r['rss_growth'] / mb:.1f} | "
          f"{r['rss_ratio']:.2f} | {r['rss_growth_forward'] / mb:.1f} | {r['rss_forward_ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
