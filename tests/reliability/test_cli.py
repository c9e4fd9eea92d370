"""The CLI on user errors: one line on stderr, exit code 2, no traceback, nothing written;
flags and paths checked before the model is loaded."""
from __future__ import annotations

import json
import pickle

import pytest
from reliability.reliability_helpers import run_capped, run_cli

pytest.importorskip("torch")
pytest.importorskip("transformers")

from qformats.saving import CONFIG_NAME  # noqa: E402


def _user_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_out_empty_source_nonempty_unwritable(llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # what --out "" used to overwrite
    _user_error(run_cli("quantize", str(llama_dir), "--bits", "4", "--out", ""), "empty path")
    _user_error(run_cli("quantize", str(llama_dir), "--bits", "4", "--out", str(llama_dir)),
                "source folder")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    _user_error(run_cli("quantize", str(llama_dir), "--bits", "4", "--out", str(full)), "not empty")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    _user_error(run_cli("quantize", str(llama_dir), "--bits", "4", "--out", str(blocker / "sub")),
                "not a folder")
    assert (tmp_path / "config.json").read_text() == "{}"
    assert (full / "keep.txt").read_text() == "mine" and len(list(full.iterdir())) == 1


def test_huge_group_size_refused_before_allocating(llama_dir, tmp_path):
    r = run_cli("quantize", str(llama_dir), "--bits", "4", "--group-size", "268435456",
                "--out", str(tmp_path / "o"), mem_mb=2432, timeout=60)
    _user_error(r, "group")
    assert not (tmp_path / "o").exists()


def test_compare_bad_format_params(tmp_path):
    _user_error(run_cli("compare", "--formats", "nf4:blocksize=7", "--no-progress"), "blocksize")
    _user_error(run_cli("compare", "--formats", "int4:nope=1", "--no-progress"), "nope")


def test_eval_layer_config_without_buffers(tiny_saved):
    _, d = tiny_saved
    cfg = json.loads((d / CONFIG_NAME).read_text())
    next(iter(cfg["layers"].values())).pop("buffers")
    (d / CONFIG_NAME).write_text(json.dumps(cfg))
    _user_error(run_cli("eval", str(d), "--no-progress"), "buffers")


def test_eval_deep_json(tiny_saved):
    _, d = tiny_saved
    (d / CONFIG_NAME).write_text('{"quant_method": "qformats", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _user_error(run_cli("eval", str(d), "--no-progress"), "nested")


def test_eval_huge_safetensors_header(tiny_saved):
    _, d = tiny_saved
    w = d / "model.safetensors"
    w.write_bytes((2**63).to_bytes(8, "little") + w.read_bytes()[8:])
    _user_error(run_cli("eval", str(d), "--no-progress"))


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_quantize_pickle_checkpoint(tmp_path):
    from transformers import LlamaConfig

    d = tmp_path / "m"
    d.mkdir()
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2,
                architectures=["LlamaForCausalLM"]).to_json_file(str(d / "config.json"))
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": _Evil()}, f)
    r = run_cli("quantize", str(d), "--bits", "8", "--out", str(tmp_path / "o"), "--no-progress")
    _user_error(r)
    assert "pwned" not in r.stdout


@pytest.mark.parametrize("args", [
    ("--bits", "3"), ("--format", "int5"), ("--format", "int4:group_size=12"),
    ("--bits", "4", "--group-size", "268435456"), ("--bits", "4", "--method", "signround"),
    ("--method", "budget"), ("--bits", "4", "--override", "oops"),
    ("--bits", "4", "--max-shard-size", "5XB"),
])
def test_flag_errors_found_before_torch_is_imported(llama_dir, tmp_path, args):
    """Usage errors of `qformats quantize` take a fraction of a second: found before torch
    (seconds to import) is loaded."""
    r = run_capped("import sys; from qformats.cli import main; rc = main(sys.argv[1:]); "
                   "print('torch' in sys.modules); sys.exit(rc)",
                   args=("quantize", str(llama_dir), *args, "--out", str(tmp_path / "o")))
    assert r.returncode == 2, r.stderr
    assert r.stdout.strip() == "False", "torch was imported before the error"
    assert r.stderr.startswith("qformats quantize: error: "), r.stderr
