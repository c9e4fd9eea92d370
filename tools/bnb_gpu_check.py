#!/usr/bin/env python
"""bitsandbytes 4-bit checkpoints on a CUDA GPU, both directions (qformats.bnb):

  1. import: MODEL quantized by transformers + bitsandbytes on cuda (BitsAndBytesConfig nf4,
     double quant off and on), save_pretrained, qformats.bnb.load_bnb onto cuda; packed bytes,
     absmax (and nested absmax / offset) compared with bitsandbytes' own model (==), decoded
     weights compared with bitsandbytes.functional.dequantize_4bit in float32 (==), logits
     compared within a tolerance; also reported (not a failure): whether qformats' own
     nf4.quantize of the float16 weights reproduces bitsandbytes' CUDA bytes.
  2. export: MODEL quantized by qformats nf4 (blocksize 64, compress_statistics off and on),
     qformats.bnb.save_bnb, transformers from_pretrained with bitsandbytes on cuda; bytes (==)
     and logits compared.

Usage:  python tools/bnb_gpu_check.py /path/to/pydoc-llama-17m [device]
(device: default "cuda"; "cpu" runs the same checks on bitsandbytes' CPU backend, a smoke test)
Needs: torch with CUDA, a CUDA build of qformats, transformers, accelerate, bitsandbytes, safetensors.
Prints a table; exits 1 on any mismatch, 2 when it cannot run (no CUDA, missing package).
"""
from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

#: logits tolerance (float16 logits of |x| ~ 10: an ulp is 0.0078; bitsandbytes' CUDA matmul and
#: qformats' kernel sum in different orders and precisions)
MAX_ABS = 0.25
MEAN_ABS = 0.01
ARGMAX_AGREE = 0.97


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__)
        return 2
    model_dir = Path(argv[1])
    dev = argv[2] if len(argv) == 3 else "cuda"
    try:
        import torch
        import bitsandbytes  # noqa: F401
        import bitsandbytes.functional as F
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        import qformats
        from qformats import nf4
        from qformats.bnb import load_bnb, save_bnb
        from qformats.nn import quantized_linears
    except ImportError as e:
        print(f"cannot run: {e}")
        return 2
    if dev != "cpu" and (not torch.cuda.is_available() or not qformats.cuda_available()):
        print("cannot run: no CUDA device, or qformats built without CUDA")
        return 2
    rows: list[tuple] = []
    failed = False

    def eq(a, b) -> bool:
        a, b = a.detach().contiguous().cpu(), b.detach().contiguous().cpu()
        return a.shape == b.shape and a.dtype == b.dtype and bytes(a.view(torch.uint8).numpy()) == \
            bytes(b.view(torch.uint8).numpy())

    def logits(m, ids):
        with torch.no_grad():
            return m(ids).logits.float()

    def compare_logits(a, b):
        d = (a - b).abs()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        ok = d.max().item() <= MAX_ABS and d.mean().item() <= MEAN_ABS and agree >= ARGMAX_AGREE
        return ok, f"max {d.max().item():.2e} mean {d.mean().item():.2e} argmax {agree:.3f}"

    ids = torch.randint(0, 8000, (2, 64), generator=torch.Generator().manual_seed(0)).to(dev)
    orig = AutoModelForCausalLM.from_pretrained(model_dir)  # float16 weights, CPU
    with tempfile.TemporaryDirectory() as tmp:
        for dq in (False, True):
            cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                     bnb_4bit_use_double_quant=dq, bnb_4bit_compute_dtype=torch.float16)
            ref = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=cfg, device_map=dev)
            d = Path(tmp) / f"bnb_dq{int(dq)}"
            ref.save_pretrained(d)
            ours = load_bnb(d, device=dev)
            q = dict(quantized_linears(ours))
            lin4 = {n: m for n, m in ref.named_modules() if isinstance(m, bitsandbytes.nn.Linear4bit)}
            same_bytes = sorted(q) == sorted(lin4)
            same_decode = same_bytes
            own_quant = True
            for name, lin in lin4.items():
                if name not in q:
                    continue
                s, mine = lin.weight.quant_state, q[name]
                same_bytes &= eq(mine.packed, lin.weight.data.reshape(-1)) and eq(mine.absmax, s.absmax)
                if dq:
                    same_bytes &= eq(mine.absmax2, s.state2.absmax) and eq(mine.offset, s.offset.reshape(1))
                s32 = copy.copy(s)
                s32.dtype = torch.float32
                same_decode &= eq(nf4.dequantize(mine.quantized_weight, dtype="float32"),
                                  F.dequantize_4bit(lin.weight.data, s32))
                w = orig.get_submodule(name).weight.detach().to(dev)
                qt = nf4.quantize(w, blocksize=64, compress_statistics=dq)
                own_quant &= all(eq(v, getattr(mine, k)) for k, v in qt.buffers.items())
            ok_l, txt = compare_logits(logits(ours, ids), logits(ref, ids))
            ok = same_bytes and same_decode and ok_l
            failed |= not ok
            rows.append((f"import bnb dq={dq}", same_bytes, same_decode, txt,
                         f"qformats.quantize same bytes: {own_quant}", "ok" if ok else "MISMATCH"))
            del ref, ours

        for cs in (False, True):
            m = copy.deepcopy(orig).to(dev)
            qformats.quantize_model(m, format="nf4", blocksize=64, compress_statistics=cs)
            d = Path(tmp) / f"qf_cs{int(cs)}"
            save_bnb(m, d)
            ref = AutoModelForCausalLM.from_pretrained(d, device_map=dev)
            q = dict(quantized_linears(m))
            lin4 = {n: l for n, l in ref.named_modules() if isinstance(l, bitsandbytes.nn.Linear4bit)}
            same_bytes = sorted(q) == sorted(lin4) and all(
                eq(q[n].packed, l.weight.data.reshape(-1)) and eq(q[n].absmax, l.weight.quant_state.absmax)
                for n, l in lin4.items() if n in q)
            back = load_bnb(d, device=dev)
            same_back = all(eq(getattr(a, b), getattr(dict(quantized_linears(back))[n], b))
                            for n, a in q.items() for b in a.buffer_names)
            ok_l, txt = compare_logits(logits(m, ids), logits(ref, ids))
            same_rt = torch.equal(logits(back, ids), logits(m, ids))
            ok = same_bytes and same_back and ok_l and same_rt
            failed |= not ok
            rows.append((f"export qformats cs={cs}", same_bytes, same_back, txt,
                         f"load_bnb logits identical: {same_rt}", "ok" if ok else "MISMATCH"))
            del ref, m, back

    head = ("case", "bytes ==", "decode/back ==", "logits vs bitsandbytes", "note", "result")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(x) for x in r))
    print(f"torch {torch.__version__}, bitsandbytes {bitsandbytes.__version__}, "
          f"device {torch.cuda.get_device_name() if dev != 'cpu' else 'cpu'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
