"""qformats.streaming: quantize_checkpoint and ``qformats quantize --stream`` write the folder
that quantize_model + save_quantized write (compared file by file, safetensors by header and
tensor bytes), resume after being killed, share the work under torchrun (and so does
``--method signround``), keep memory at about one tensor, and refuse bad input with clear
ValueErrors; streamed signround writes what in-memory signround writes, with one block's
weights real at a time, and resumes after its last finished block, also under torchrun, where
the processes share each block's training (the CUDA variants skip without GPUs). Random
checkpoints written by benchmarks/stream_quantize.py's write_checkpoint (a few MB, 3+ shards);
no ../shared needed."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qformats  # noqa: E402
from qformats.cli import main  # noqa: E402
from qformats.streaming import KILL_AFTER_ENV, STAGE_DIR, quantize_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# Children import the qformats this process imports: the installed package in CI (the source
# tree has no native modules there), python/ in an in-place build.
PACKAGE_PARENT = str(Path(qformats.__file__).resolve().parents[1])
_spec = importlib.util.spec_from_file_location("stream_quantize", REPO / "benchmarks" / "stream_quantize.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

SMALL = dict(hidden=256, intermediate=512, layers=2, vocab=1024, heads=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """fp16, untied lm_head, 4 shards of at most 1 MB."""
    d = tmp_path_factory.mktemp("ckpt")
    bench.write_checkpoint(d, dtype="float16", shard_bytes=1 << 20, **SMALL)
    assert len(list(d.glob("*.safetensors"))) >= 3
    return d


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """bfloat16, lm_head tied to the embeddings (the checkpoint holds it once)."""
    d = tmp_path_factory.mktemp("tied")
    bench.write_checkpoint(d, dtype="bfloat16", shard_bytes=1 << 20, tie=True, seed=1, **SMALL)
    assert "lm_head.weight" not in json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    return d


def _in_memory(src, out, dtype="auto", max_shard_size=None, device="cpu", **choice):
    """What quantize_checkpoint must equal: the model loaded as `qformats quantize` loads it
    (from_pretrained in the checkpoint's dtype, then .to(dtype), then to ``device``),
    quantize_model, save_quantized."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
    if dtype != "auto":
        m = m.to(getattr(torch, dtype))
    m = m.to(device)
    report = qformats.quantize_model(m, **choice)
    qformats.save_quantized(m, out, source=src, max_shard_size=max_shard_size)
    return m, report


def _layers(report):
    return [(l.name, l.status, l.format, l.params, l.nbytes) for l in report.layers]


CASES = {
    "int4": ("ckpt", dict(bits=4), "auto", None),
    "nf4-float32-sharded": ("ckpt", dict(format="nf4"), "float32", "300KB"),
    "int4-tied": ("tied", dict(bits=4), "auto", None),
    "mixed2bit-overrides-lm_head": ("tied", dict(bits=2, ratio_4bit=0.1, ignore=[],
                                                  overrides={"*.down_proj": {"bits": 8}}),
                                    "float16", "500KB"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stream_equals_in_memory(case, request, tmp_path):
    which, choice, dtype, shard = CASES[case]
    src = request.getfixturevalue(which)
    ref, ref_report = _in_memory(src, tmp_path / "ref", dtype, shard, **choice)
    report = quantize_checkpoint(src, tmp_path / "stream", dtype=dtype, max_shard_size=shard, **choice)
    assert bench.compare_folders(tmp_path / "ref", tmp_path / "stream") == []
    assert not (tmp_path / "stream" / STAGE_DIR).exists()
    if shard is not None:
        assert len(list((tmp_path / "stream").glob("model-*.safetensors"))) >= 2
    assert _layers(report) == _layers(ref_report) and report.size == ref_report.size
    back = qformats.load_quantized(tmp_path / "stream")
    ids = torch.randint(0, SMALL["vocab"], (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(back(input_ids=ids, use_cache=False).logits,
                           ref(input_ids=ids, use_cache=False).logits)


def test_cli_stream_equals_cli_in_memory(ckpt, tmp_path, capsys):
    assert main(["quantize", str(ckpt), "--bits", "4", "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    assert main(["quantize", str(ckpt), "--bits", "4", "--stream", "--out", str(tmp_path / "b"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "quantized 14 of 15 Linear layers (rtn): int4 x14" in out
    assert bench.compare_folders(tmp_path / "a", tmp_path / "b") == []
    assert (tmp_path / "b" / "tokenizer.json").is_file()


def _cli(args, env=None, timeout=120):
    e = dict(os.environ, PYTHONPATH=PACKAGE_PARENT, HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "qformats", "quantize", *map(str, args)],
                          env=e, capture_output=True, text=True, timeout=timeout)


def test_resume_after_kill(ckpt, tmp_path):
    """Killed (SIGKILL) after 3 units, then after 2 more: the unit files stay and are not
    redone; a leftover *.part is not taken for a unit; the third run finishes and the folder
    equals an uninterrupted run's."""
    out = tmp_path / "out"
    args = [ckpt, "--bits", "4", "--stream", "--out", out, "--no-progress"]
    r = _cli(args, {KILL_AFTER_ENV: "3"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    units = out / STAGE_DIR / "units"
    first = {p.name: p.stat().st_mtime_ns for p in units.glob("*.safetensors")}
    assert len(first) == 3 and not (out / "quantization_config.json").exists()
    total = len(json.loads((out / STAGE_DIR / "manifest.json").read_text())["units"])
    # a unit written halfway (what a kill during save_file leaves): ignored and rewritten
    todo = sorted(f"u{i:05d}.safetensors" for i in range(total) if f"u{i:05d}.safetensors" not in first)
    (units / (todo[0] + ".part")).write_bytes(b"\x10\x00 half a file")
    with pytest.raises(ValueError, match="interrupted run with other settings"):
        quantize_checkpoint(ckpt, out, bits=8)
    r = _cli(args, {KILL_AFTER_ENV: "2"})
    assert r.returncode == -signal.SIGKILL
    now = {p.name: p.stat().st_mtime_ns for p in units.glob("*.safetensors")}
    assert len(now) == 5 and all(now[k] == v for k, v in first.items())
    assert main(["quantize", *map(str, args)]) == 0  # the same command, finishing here
    assert not (out / STAGE_DIR).exists()
    assert main(["quantize", str(ckpt), "--bits", "4", "--stream", "--out", str(tmp_path / "once"),
                 "--no-progress"]) == 0
    assert bench.compare_folders(out, tmp_path / "once") == []


def _torchrun(args, env=None, program=("-m", "qformats"), timeout=300):
    """``torchrun --nproc-per-node 2 PROGRAM quantize ARGS`` (one OpenMP thread per process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    e = dict(os.environ, PYTHONPATH=PACKAGE_PARENT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
             **(env or {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *map(str, program), "quantize", *map(str, args)],
                          env=e, capture_output=True, text=True, timeout=timeout)


def _skip_without_two_gpus(device):
    import torch.distributed as dist

    if device == "cuda" and (torch.cuda.device_count() < 2 or not dist.is_nccl_available()):
        pytest.skip("needs two CUDA GPUs and NCCL")


def test_torchrun_two_processes_same_bytes(ckpt, tmp_path):
    r = _torchrun([ckpt, "--bits", "4", "--stream", "--out", tmp_path / "two"], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("quantized 14 of 15 Linear layers") == 1  # rank 0 only
    assert "quantize (stream)" in r.stderr  # rank 0's progress bar
    assert main(["quantize", str(ckpt), "--bits", "4", "--stream", "--out", str(tmp_path / "one"),
                 "--no-progress"]) == 0
    assert bench.compare_folders(tmp_path / "two", tmp_path / "one") == []


def _sr_args(ckpt, tmp_path, device):
    """`qformats quantize` arguments of a small signround (one thread: the thread count
    chooses the CPU products' summation order, so every run compared uses one)."""
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 97} and {i}" for i in range(400)), encoding="utf-8")
    return [str(ckpt), "--bits", "4", "--method", "signround", "--calibration", str(text),
            "--iters", "10", "--nsamples", "5", "--seqlen", "24", "--device", device, "--threads", "1"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchrun_signround_two_processes_same_bytes(ckpt, tmp_path, device):
    """--method signround under torchrun (gloo on the CPU, NCCL on two GPUs): the two processes
    share the training and write the folder one process writes, bit for bit (on the CPU one
    thread per process in both runs: the thread count chooses the products' summation order)."""
    _skip_without_two_gpus(device)
    args = _sr_args(ckpt, tmp_path, device)
    r = _torchrun([*args, "--out", tmp_path / "two"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("quantized 14 of 15 Linear layers (signround)") == 1  # rank 0 only
    assert main(["quantize", *args, "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    assert bench.compare_folders(tmp_path / "two", tmp_path / "one") == []
    rtn = tmp_path / "rtn"
    assert main(["quantize", str(ckpt), "--bits", "4", "--out", str(rtn), "--no-progress"]) == 0
    assert bench.compare_folders(tmp_path / "one", rtn) != []  # the training changed the codes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_memory_stays_near_one_tensor(tmp_path):
    """A 185 MB checkpoint (largest tensor 8 MB): the quantizing process's peak resident memory
    grows by less than a third of the checkpoint over its peak on a tiny one (imports, native
    code, a first quantization done). The growth measured is in benchmarks/README.md."""
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    nbytes = bench.write_checkpoint(big, hidden=1024, intermediate=2048, layers=8, vocab=4096,
                                    shard_bytes=32 << 20)
    bench.write_checkpoint(tiny, hidden=256, intermediate=256, layers=1, vocab=256)
    code = (
        "import sys\nfrom qformats.streaming import quantize_checkpoint\n"
        "def hwm():\n"
        "    # VmHWM: this process's peak RSS (its own memory map, unlike ru_maxrss after a fork)\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024\n"
        "quantize_checkpoint(sys.argv[1], sys.argv[3], bits=4)\n"
        "base = hwm()\n"
        "quantize_checkpoint(sys.argv[2], sys.argv[4], bits=4)\n"
        "print(base, hwm())\n")
    e = dict(os.environ, PYTHONPATH=PACKAGE_PARENT, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code, tiny, big, tmp_path / "o1", tmp_path / "o2"],
                       env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    base, peak = map(int, r.stdout.split())
    assert nbytes > 180e6
    assert peak - base < nbytes / 3, (peak - base, nbytes)
    print(f"peak growth {(peak - base) / 1e6:.1f} MB for a {nbytes / 1e6:.1f} MB checkpoint")


@pytest.mark.parametrize("make,kwargs,match", [
    (lambda d: d / "nope", {}, "not a folder"),
    (lambda d: d, {}, "no config.json"),
])
def test_bad_source(tmp_path, make, kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_checkpoint(make(tmp_path), tmp_path / "out", bits=4, **kwargs)


def test_bad_input(ckpt, tmp_path):
    from transformers import LlamaConfig

    bare = tmp_path / "bare"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1).save_pretrained(bare)
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        quantize_checkpoint(bare, tmp_path / "o", bits=4)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        quantize_checkpoint(ckpt, full, bits=4)
    with pytest.raises(ValueError, match="exists and is not a folder"):
        quantize_checkpoint(ckpt, full / "x.txt", bits=4)
    with pytest.raises(ValueError, match="source folder"):
        quantize_checkpoint(ckpt, ckpt, bits=4)
    with pytest.raises(ValueError, match="round to nearest only"):
        quantize_checkpoint(ckpt, tmp_path / "o", bits=4, calibration=[torch.zeros(1, 8, dtype=torch.long)])
    with pytest.raises(ValueError, match="dtype"):
        quantize_checkpoint(ckpt, tmp_path / "o", bits=4, dtype="int8")
    with pytest.raises(ValueError, match="max_shard_size"):
        quantize_checkpoint(ckpt, tmp_path / "o", bits=4, max_shard_size="lots")
    with pytest.raises(ValueError, match="bits"):
        quantize_checkpoint(ckpt, tmp_path / "o", bits=3)
    # a shard the index names but that is missing
    broken = tmp_path / "broken"
    bench.write_checkpoint(broken, shard_bytes=1 << 20, **SMALL)
    next(broken.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="is missing"):
        quantize_checkpoint(broken, tmp_path / "o", bits=4)
    assert not (tmp_path / "o").exists()  # nothing written before the checks


def test_cli_stream_errors(ckpt, tmp_path, capsys):
    assert main(["quantize", str(ckpt), "--bits", "4", "--stream", "--method", "budget",
                 "--calibration", str(ckpt / "config.json"), "--max-kl", "0.1",
                 "--out", str(tmp_path / "o")]) == 2
    assert "--stream quantizes with --method signround, or rtn without --calibration" in capsys.readouterr().err
    assert main(["quantize", str(ckpt), "--bits", "4", "--stream", "--calibration",
                 str(ckpt / "config.json"), "--out", str(tmp_path / "o")]) == 2
    assert "--stream quantizes with --method signround, or rtn without --calibration" in capsys.readouterr().err
    assert main(["quantize", str(ckpt), "--bits", "4", "--stream", "--device", "cuda",
                 "--out", str(tmp_path / "o")]) == 2
    assert "--stream rounds to nearest on the CPU" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["quantize", str(ckpt), "--bits", "4", "--stream", "--out", str(tmp_path / "full"),
                 "--no-progress"]) == 2
    assert "not empty" in capsys.readouterr().err


# -- signround, streamed --------------------------------------------------------------------------

SR = dict(method="signround", iters=10, nsamples=4, seqlen=16)
SR_IDS = [torch.randint(0, SMALL["vocab"], (24,), generator=torch.Generator().manual_seed(i))
          for i in range(5)]

SR_CASES = {  # int4 with lm_head planned (rounded to nearest) from the tied embeddings; mixed2bit
    # with 4-bit groups (chosen by the blocks' second moments), converted to float32, sharded
    "int4-tied-lm_head": ("tied", dict(bits=4, ignore=[]), "auto", None),
    "mixed2bit-ratio-float32": ("ckpt", dict(bits=2, ratio_4bit=0.25), "float32", "400KB"),
}


@pytest.mark.parametrize("case", list(SR_CASES))
def test_stream_signround_equals_in_memory(case, request, tmp_path):
    which, choice, dtype, shard = SR_CASES[case]
    src = request.getfixturevalue(which)
    ref, ref_report = _in_memory(src, tmp_path / "ref", dtype, shard, calibration=SR_IDS, **SR, **choice)
    report = quantize_checkpoint(src, tmp_path / "stream", dtype=dtype, max_shard_size=shard,
                                 calibration=SR_IDS, **SR, **choice)
    assert bench.compare_folders(tmp_path / "ref", tmp_path / "stream") == []
    assert not (tmp_path / "stream" / STAGE_DIR).exists()
    assert report.method == "signround" and _layers(report) == _layers(ref_report)
    assert report.size == ref_report.size
    drop = ("seconds",)
    assert [{k: v for k, v in b.items() if k not in drop} for b in report.signround["blocks"]] == \
        [{k: v for k, v in b.items() if k not in drop} for b in ref_report.signround["blocks"]]
    assert report.signround["options"] == ref_report.signround["options"]
    assert len(report.signround["blocks"]) == SMALL["layers"]
    # the training changed the codes (each block kept parameters of a later step than the
    # first): round to nearest writes other bytes
    assert all(b["best_iter"] > 0 for b in report.signround["blocks"])
    quantize_checkpoint(src, tmp_path / "rtn", dtype=dtype, max_shard_size=shard, **choice)
    assert bench.compare_folders(tmp_path / "rtn", tmp_path / "stream") != []


def test_stream_signround_holds_one_block_at_a_time(ckpt, tmp_path, monkeypatch):
    """While a block trains, it is the only block whose weights are off the meta device, and
    the embedding (read for the first block's inputs) and lm_head are on it; afterwards every
    block is back on it."""
    import qformats.signround as sr
    import qformats.streaming as st

    seen, trained = {}, []
    skeleton, train_block = st._skeleton, sr.train_block

    def keep(*a, **k):
        seen["model"] = skeleton(*a, **k)
        return seen["model"]

    def real(module):
        return [n for n, t in module.named_parameters() if t.device.type != "meta"]

    def check(block, *a, **k):
        m = seen["model"]
        held = [i for i, b in enumerate(m.model.layers) if real(b)]
        assert held == [len(trained)], held
        assert len(real(m.model.layers[held[0]])) == 9  # its 7 Linears and 2 norms
        assert real(m) == [f"model.layers.{held[0]}.{n}" for n in real(m.model.layers[held[0]])]
        trained.append(held[0])
        return train_block(block, *a, **k)

    monkeypatch.setattr(st, "_skeleton", keep)
    monkeypatch.setattr(sr, "train_block", check)
    quantize_checkpoint(ckpt, tmp_path / "o", bits=4, calibration=SR_IDS, **SR)
    assert trained == [0, 1]
    assert real(seen["model"]) == []


def _next_block(out):
    return torch.load(out / STAGE_DIR / "next-block.pt", weights_only=True)["block"]


def test_stream_signround_resumes_after_its_last_finished_block(ckpt, tmp_path):
    """Killed (SIGKILL) once block 0 is written; its inputs file removed (what a kill between a
    block's unit files and that file leaves): block 0 again, killed after it; then block 1,
    killed after it, block 0's files untouched; the last run assembles the folder, which equals
    an uninterrupted run's. Other settings refuse the folder."""
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 97} and {i}" for i in range(300)), encoding="utf-8")
    out = tmp_path / "out"
    args = [ckpt, "--bits", "4", "--method", "signround", "--calibration", text, "--iters", "4",
            "--nsamples", "4", "--seqlen", "16", "--stream", "--out", out, "--no-progress"]
    units = out / STAGE_DIR / "units"

    def block_files(i):  # the unit files of block i's 7 Linears (units in state-dict order)
        names = [u[0] for u in json.loads((out / STAGE_DIR / "manifest.json").read_text())["units"]]
        return [units / f"u{k:05d}.safetensors" for k, n in enumerate(names)
                if n.startswith(f"model.layers.{i}.") and not n.endswith("norm.weight")]

    r = _cli(args, {KILL_AFTER_ENV: "8"})  # 7 tensors rounded to nearest, then block 0
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert _next_block(out) == 1 and all(f.is_file() for f in block_files(0))
    assert not any(f.is_file() for f in block_files(1))
    first = {f: f.stat().st_mtime_ns for f in block_files(0)}
    (out / STAGE_DIR / "next-block.pt").unlink()
    r = _cli(args, {KILL_AFTER_ENV: "1"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert _next_block(out) == 1 and all(f.stat().st_mtime_ns != t for f, t in first.items())
    again = {f: f.stat().st_mtime_ns for f in block_files(0)}
    r = _cli(args, {KILL_AFTER_ENV: "1"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert _next_block(out) == 2 and all(f.is_file() for f in block_files(1))
    assert all(f.stat().st_mtime_ns == t for f, t in again.items())
    with pytest.raises(ValueError, match="interrupted run with other settings"):
        quantize_checkpoint(ckpt, out, bits=4, calibration=SR_IDS, **SR)
    assert main(["quantize", *map(str, args)]) == 0
    assert not (out / STAGE_DIR).exists()
    assert main(["quantize", *map(str, args[:-3]), "--out", str(tmp_path / "once"), "--no-progress"]) == 0
    assert bench.compare_folders(out, tmp_path / "once") == []


def test_cli_stream_signround_equals_cli_in_memory(ckpt, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 97} and {i}" for i in range(300)), encoding="utf-8")
    args = [str(ckpt), "--format", "mixed2bit:ratio_4bit=0.1", "--method", "signround",
            "--calibration", str(text), "--iters", "10", "--nsamples", "3", "--seqlen", "16",
            "--no-progress"]
    assert main(["quantize", *args, "--out", str(tmp_path / "a")]) == 0
    assert main(["quantize", *args, "--stream", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.count("quantized 14 of 15 Linear layers (signround): mixed2bit x14") == 2
    assert bench.compare_folders(tmp_path / "a", tmp_path / "b") == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stream_signround_cuda_equals_in_memory(ckpt, tmp_path, monkeypatch):
    """device="cuda": the blocks train on the GPU (block 0's inputs computed there too, as
    in memory), and the folder is the in-memory run's with the model on that GPU."""
    import qformats.signround as sr

    choice = dict(bits=2, ratio_4bit=0.25, calibration=SR_IDS, **SR)
    _in_memory(ckpt, tmp_path / "ref", device="cuda", **choice)
    seen, train_block = [], sr.train_block

    def spy(block, linears, inputs, *a, **k):
        seen.append((next(iter(linears.values())).weight.device.type, inputs[0][0].device.type))
        return train_block(block, linears, inputs, *a, **k)

    monkeypatch.setattr(sr, "train_block", spy)
    quantize_checkpoint(ckpt, tmp_path / "stream", device="cuda", **choice)
    assert seen == [("cuda", "cuda")] * SMALL["layers"]
    assert bench.compare_folders(tmp_path / "ref", tmp_path / "stream") == []


# Under torchrun: `qformats quantize` with train_block reporting on stderr the ranks it shares
# each block's training with and the device of the block's inputs.
_SPY = """\
import sys

import qformats.signround as sr
from qformats.cli import main

train_block = sr.train_block


def spy(block, linears, inputs, *a, ranks=None, **k):
    print(f"train_block: {ranks.world if ranks else 1} ranks, {inputs[0][0].device.type}",
          file=sys.stderr)
    return train_block(block, linears, inputs, *a, ranks=ranks, **k)


sr.train_block = spy
sys.exit(main(sys.argv[1:]))
"""


def _spy(tmp_path):
    path = tmp_path / "spy.py"
    path.write_text(_SPY, encoding="utf-8")
    return [path]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchrun_stream_signround_same_bytes(ckpt, tmp_path, device):
    """--stream --method signround under torchrun (gloo on the CPU, NCCL on two GPUs): both
    processes train every block, each its share, and the folder is one process's streamed
    run's and the in-memory run's, bit for bit."""
    _skip_without_two_gpus(device)
    args = _sr_args(ckpt, tmp_path, device)
    r = _torchrun([*args, "--stream", "--out", tmp_path / "two"], program=_spy(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("quantized 14 of 15 Linear layers (signround)") == 1  # rank 0 only
    assert r.stderr.count(f"train_block: 2 ranks, {device}") == 2 * SMALL["layers"]
    assert main(["quantize", *args, "--stream", "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    assert main(["quantize", *args, "--out", str(tmp_path / "memory"), "--no-progress"]) == 0
    assert bench.compare_folders(tmp_path / "two", tmp_path / "one") == []
    assert bench.compare_folders(tmp_path / "one", tmp_path / "memory") == []


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchrun_stream_signround_resumes(ckpt, tmp_path, device):
    """Rank 0 killed (SIGKILL) once block 0 is written (its 4 round-to-nearest units, then
    block 0's 7 layers: its 8th file; rank 1 writes 3 units and no block's): torchrun ends
    rank 1, the stage goes on from block 1; run again, both ranks train block 1 only and the
    folder is one process's."""
    _skip_without_two_gpus(device)
    out = tmp_path / "out"
    args = [*_sr_args(ckpt, tmp_path, device), "--stream", "--no-progress"]
    r = _torchrun([*args, "--out", out], {KILL_AFTER_ENV: "8"})
    assert r.returncode != 0 and "SIGKILL" in r.stderr, r.stderr[-3000:]
    assert _next_block(out) == 1 and not (out / "quantization_config.json").exists()
    r = _torchrun([*args, "--out", out], program=_spy(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count(f"train_block: 2 ranks, {device}") == 2  # block 1 on each rank
    assert not (out / STAGE_DIR).exists()
    assert main(["quantize", *args, "--out", str(tmp_path / "one")]) == 0
    assert bench.compare_folders(out, tmp_path / "one") == []


def test_stream_signround_errors(ckpt, tmp_path, monkeypatch):
    o = tmp_path / "o"
    with pytest.raises(ValueError, match="needs calibration"):
        quantize_checkpoint(ckpt, o, bits=4, method="signround")
    with pytest.raises(ValueError, match="pass tokenizer= as well"):
        quantize_checkpoint(ckpt, o, bits=4, method="signround", calibration="some text")
    with pytest.raises(NotImplementedError, match="int4 asymmetric"):
        quantize_checkpoint(ckpt, o, bits=8, calibration=SR_IDS, **SR)
    with pytest.raises(ValueError, match="selection"):
        quantize_checkpoint(ckpt, o, bits=2, calibration=SR_IDS, selection="best", **SR)
    with pytest.raises(ValueError, match="'rtn' or 'signround'"):
        quantize_checkpoint(ckpt, o, bits=4, method="budget", calibration=SR_IDS)
    with pytest.raises(ValueError, match="streamed round to nearest runs on the CPU"):
        quantize_checkpoint(ckpt, o, bits=4, device="cuda")
    with pytest.raises(ValueError, match="expected 'cpu', or a CUDA device"):
        quantize_checkpoint(ckpt, o, bits=4, calibration=SR_IDS, device="tpu0", **SR)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            quantize_checkpoint(ckpt, o, bits=4, calibration=SR_IDS, device="cuda", **SR)
    assert not o.exists()  # nothing written before the checks
    # a forward that reads a weight before block 0 outside its module's forward (here: the
    # embedding's, which streaming then does not read)
    import qformats.streaming as st

    load = st._Weights.load
    monkeypatch.setattr(st._Weights, "load",
                        lambda self, m, recurse=True, **kw: load(self, m, **kw) if recurse else [])
    with pytest.raises(ValueError, match="uses weights outside the forward"):
        quantize_checkpoint(ckpt, tmp_path / "o2", bits=4, calibration=SR_IDS, **SR)
