"""Peak memory and time of streaming quantization (``qformats quantize --stream``) on a
checkpoint larger than the memory it may use, and its output against the in-memory path's.

Steps, each a separate process where memory is measured (peak RSS from ``os.wait4``, the
child's own ``ru_maxrss``: anonymous memory plus the pages of memory-mapped files it read):

1. A random Llama checkpoint (sizes below; default 2.07 B parameters = 4.13 GB in bfloat16,
   written as safetensors shards of at most ``--shard-mb``, one shard's tensors in memory at a
   time) with a tiny word-level tokenizer, in ``--dir``.
2. ``python -m qformats quantize CKPT --bits 4 --stream --out STREAM`` (int4, groups of 128).
3. The baseline: the same command on a 1-layer model of the same family (imports, config,
   tokenizer: what any run holds).
4. Unless ``--no-reference``: ``python -m qformats quantize CKPT --bits 4 --out REF`` (the
   model in memory), then STREAM and REF compared file by file (:func:`compare_folders`).

Prints a table (MB = 10^6 bytes) and with ``--json`` a last line of JSON. Exit status 1 when
the folders differ. Usage::

    python benchmarks/stream_quantize.py --dir /tmp/stream-bench        # 4.13 GB checkpoint
    python benchmarks/stream_quantize.py --dir D --hidden 1024 --intermediate 2048 --layers 8 \\
        --vocab 4096 --shard-mb 32 --json              # ~185 MB (the memory test's checkpoint)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_checkpoint(folder, *, hidden: int, intermediate: int, layers: int, vocab: int,
                     heads: int = 0, dtype: str = "bfloat16", shard_bytes: int = 1 << 30,
                     tie: bool = False, seed: int = 0) -> int:
    """Write a random LlamaForCausalLM checkpoint to ``folder``: config.json, safetensors shards
    of at most ``shard_bytes`` with model.safetensors.index.json (one file if it fits), and a
    word-level tokenizer. Only one shard's tensors are in memory at a time. Weights N(0, 0.02),
    norms 1. Returns the bytes of tensor data written."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    heads = heads or max(1, hidden // 128)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=512,
                      tie_word_embeddings=tie, dtype=dtype)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(folder)
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)),
                   (p + "post_attention_layernorm.weight", (hidden,))]
        shapes += [(p + f"self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (intermediate, hidden)),
                   (p + "mlp.up_proj.weight", (intermediate, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, intermediate))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not tie:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    dt = getattr(torch, dtype)
    size = dt.itemsize
    groups, cur, cur_bytes = [], [], 0
    for name, shape in shapes:
        nb = size * int(torch.Size(shape).numel())
        if cur and cur_bytes + nb > shard_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape))
        cur_bytes += nb
    groups.append(cur)
    gen = torch.Generator().manual_seed(seed)
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    wmap, total = {}, 0
    for fname, group in zip(names, groups):
        tensors = {}
        for name, shape in group:
            if len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=dt)
            else:
                tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(dt)
            wmap[name] = fname
            total += tensors[name].numel() * size
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": wmap}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    words = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(min(vocab, 64) - 1)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    return total


def compare_folders(a, b) -> list:
    """The differences between two model folders, as messages (empty: the same). Files
    other than safetensors must be byte-identical; a safetensors file must have the same
    length, the same header (parsed: safetensors writes the keys of ``__metadata__`` in a
    random order, so two saves of one model can differ there) and the same bytes after it.
    Reads 16 MB at a time."""
    a, b = Path(a), Path(b)
    fa, fb = sorted(p.name for p in a.iterdir()), sorted(p.name for p in b.iterdir())
    out = [] if fa == fb else [f"files differ: {sorted(set(fa) ^ set(fb))}"]
    for name in sorted(set(fa) & set(fb)):
        sa, sb = (a / name).stat().st_size, (b / name).stat().st_size
        if sa != sb:
            out.append(f"{name}: differs ({sa} vs {sb} bytes)")
            continue
        with open(a / name, "rb") as x, open(b / name, "rb") as y:
            if name.endswith(".safetensors"):
                (n,), (m,) = struct.unpack("<Q", x.read(8)), struct.unpack("<Q", y.read(8))
                if n != m or json.loads(x.read(n)) != json.loads(y.read(m)):
                    out.append(f"{name}: safetensors headers differ")
                    continue
            while True:
                cx, cy = x.read(1 << 24), y.read(1 << 24)
                if cx != cy:
                    out.append(f"{name}: {'tensor ' if name.endswith('.safetensors') else ''}"
                               "bytes differ")
                    break
                if not cx:
                    break
    return out


def measure(cmd: list) -> dict:
    """Run ``cmd``; its wall seconds and peak RSS (bytes, its own ``ru_maxrss``). A child's
    ru_maxrss starts from the RSS of the process it was forked from (Linux keeps the larger of
    the two across exec), so the measuring process stays small: it never imports torch, and the
    checkpoint is written by a child of its own."""
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'python'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(p.pid, 0)
    secs = time.perf_counter() - t0
    text = p.stdout.read().decode(errors="replace")
    p.stdout.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{text[-3000:]}")
    return {"seconds": secs, "peak_rss": usage.ru_maxrss * 1024, "output": text}


def folder_bytes(d) -> int:
    return sum(p.stat().st_size for p in Path(d).iterdir() if p.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="work folder (checkpoint and outputs)")
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--intermediate", type=int, default=6912)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--shard-mb", type=int, default=1000, help="input shard size, MB (default 1000)")
    ap.add_argument("--keep", action="store_true", help="reuse the checkpoint in --dir if there")
    ap.add_argument("--no-reference", action="store_true", help="skip the in-memory run")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON last")
    ap.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    work = Path(args.dir)
    ckpt, stream, ref, tiny = work / "ckpt", work / "stream", work / "ref", work / "tiny"
    dims = dict(hidden=args.hidden, intermediate=args.intermediate, vocab=args.vocab,
                dtype=args.dtype)
    if args.write_only:  # in a child process: this one must not grow (see measure)
        if not (args.keep and (ckpt / "config.json").is_file()):
            shutil.rmtree(ckpt, ignore_errors=True)
            write_checkpoint(ckpt, layers=args.layers, shard_bytes=args.shard_mb * 10**6, **dims)
        shutil.rmtree(tiny, ignore_errors=True)
        write_checkpoint(tiny, layers=1, hidden=256, intermediate=256, vocab=256, dtype=args.dtype)
        return 0
    write = measure([sys.executable, __file__, "--write-only", *(argv if argv is not None else sys.argv[1:])])
    write_secs = write["seconds"]
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    shards = len(list(ckpt.glob("*.safetensors")))

    quantize = [sys.executable, "-m", "qformats", "quantize", "--bits", "4", "--no-progress"]
    rows = {}
    for out in (stream, ref, work / "tiny-out"):
        shutil.rmtree(out, ignore_errors=True)
    rows["stream"] = measure(quantize + [str(ckpt), "--stream", "--out", str(stream)])
    rows["baseline"] = measure(quantize + [str(tiny), "--stream", "--out", str(work / "tiny-out")])
    diffs = None
    if not args.no_reference:
        rows["in-memory"] = measure(quantize + [str(ckpt), "--out", str(ref)])
        diffs = compare_folders(stream, ref)

    mb = 1e6
    print(f"checkpoint: {ckpt_bytes / mb:.0f} MB in {shards} shard(s) ({args.dtype}; hidden "
          f"{args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab "
          f"{args.vocab}; written in {write_secs:.0f} s); output {folder_bytes(stream) / mb:.0f} MB")
    print("| run | seconds | peak RSS MB | peak RSS / checkpoint |\n|---|---:|---:|---:|")
    for k, r in rows.items():
        print(f"| {k} | {r['seconds']:.1f} | {r['peak_rss'] / mb:.0f} | "
              f"{r['peak_rss'] / ckpt_bytes:.2f} |")
    growth = rows["stream"]["peak_rss"] - rows["baseline"]["peak_rss"]
    print(f"streaming peak RSS above the baseline: {growth / mb:.0f} MB")
    if diffs is not None:
        print("stream == in-memory: " + ("yes (every file; safetensors: header and tensor bytes)"
                                         if not diffs else "NO: " + "; ".join(diffs)))
    if args.json:
        print(json.dumps({"checkpoint_bytes": ckpt_bytes, "shards": shards,
                          "output_bytes": folder_bytes(stream), "growth": growth,
                          "same": None if diffs is None else not diffs,
                          **{f"{k}_{m}": r[m] for k, r in rows.items()
                             for m in ("seconds", "peak_rss")}}))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
