"""signround on one process against several (torch.distributed): wall time and the bytes.

    python benchmarks/signround_ranks.py --out r1.json                           # one process
    torchrun --nproc-per-node 2 benchmarks/signround_ranks.py --out r2.json      # two (NCCL)
    python benchmarks/signround_ranks.py --compare r1.json r2.json               # the table

The model is a random Llama of Llama-2-7B's shapes (hidden 4096, intermediate 11008, 32 heads,
vocab 32000) with ``--layers`` blocks, made from a fixed seed on each process's device (CUDA:
the rank's GPU; ``--device cpu`` with gloo for a small check), in float16; the calibration is
random token ids from a fixed seed. Every process runs ``qformats.quantize_model(model, bits=4,
method="signround", ...)`` in the same process group; the time is that call's wall time (CUDA
synchronized, after every rank reached it). Rank 0 writes ``--out``: the settings, the seconds
and the SHA-256 of every quantized layer's tensors. ``--compare`` prints one markdown row per
file, the speed-up over the first file, and whether every layer's bytes equal the first's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

SHAPES = {"7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
          "small": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,  # a CPU check
                        num_key_value_heads=4, vocab_size=1024, max_position_embeddings=4096)}


def digest(model) -> dict:
    """SHA-256 of each QuantizedLinear's state (name -> hex), tensors in key order."""
    import torch

    from qformats.nn import QuantizedLinear

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            h = hashlib.sha256()
            for k, t in sorted(m.state_dict().items()):
                h.update(k.encode())
                h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            out[name] = h.hexdigest()
    return out


def run(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import qformats

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    cfg = LlamaConfig(num_hidden_layers=args.layers, **SHAPES[args.shapes])
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.float16).eval()
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, cfg.vocab_size, (args.nsamples, args.seqlen), generator=g)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    sync()
    t0 = time.perf_counter()
    rep = qformats.quantize_model(model, bits=4, group_size=128, method="signround",
                                  calibration=calib, iters=args.iters, nsamples=args.nsamples,
                                  seqlen=args.seqlen, batch_size=args.batch_size, amp=args.amp)
    sync()
    secs = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None
    if rank == 0:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        res = {"world": world, "device": name, "shapes": args.shapes, "layers": args.layers,
               "amp": args.amp, "iters": args.iters,
               "nsamples": args.nsamples, "seqlen": args.seqlen, "batch_size": args.batch_size,
               "seconds": secs, "peak_gb": peak,
               "losses": [[b["rtn_loss"], b["loss"]] for b in rep.signround["blocks"]],
               "digest": digest(model)}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"world {world}: {secs:.1f} s, peak {peak} GB, losses {res['losses']}")
    if world > 1:
        dist.destroy_process_group()


def compare(files: list) -> None:
    rs = [json.loads(Path(f).read_text()) for f in files]
    base = rs[0]
    print(f"{base['device']}; {base['layers']} blocks of shapes {base['shapes']}, int4 g128, iters "
          f"{base['iters']}, nsamples {base['nsamples']}, seqlen {base['seqlen']}, batch "
          f"{base['batch_size']}\n")
    print("| processes | amp | seconds | x first | peak GB (rank 0) | losses (rtn -> trained) "
          "| layers' bytes = first file's |")
    print("|---:|---|---:|---:|---:|---|---|")
    for r in rs:
        same = r["digest"] == base["digest"]
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        losses = ", ".join(f"{a:.4g} -> {b:.4g}" for a, b in r["losses"])
        print(f"| {r['world']} | {'bf16' if r.get('amp') else 'no'} | {r['seconds']:.1f} | "
              f"{base['seconds'] / r['seconds']:.2f} | {peak} | {losses} | "
              f"{'yes' if same else 'NO'} ({len(r['digest'])} layers) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--amp", action="store_true", help="signround's bfloat16 autocast")
    ap.add_argument("--out", default="signround_ranks.json")
    ap.add_argument("--compare", nargs="+", metavar="JSON")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
    else:
        run(args)


if __name__ == "__main__":
    sys.exit(main())
