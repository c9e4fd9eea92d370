"""`qformats quantize` and `qformats eval` on the shared pydoc Llama (small --max-tokens),
and their one-line errors with exit status 2."""
from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")

from qformats import cli  # noqa: E402
from qformats.saving import CONFIG_NAME  # noqa: E402


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def quantized_dir(llama, tmp_path_factory):
    """`qformats quantize LLAMA --bits 4 --override '*.down_proj=8'` (run once)."""
    out = tmp_path_factory.mktemp("cli") / "llama-int4"
    rc = cli.main(["quantize", str(llama.path), "--bits", "4", "--override", "*.down_proj=8",
                   "--out", str(out), "--no-progress", "--threads", "2"])
    assert rc == 0
    return out


def test_quantize_writes_a_folder(quantized_dir):
    cfg = json.loads((quantized_dir / CONFIG_NAME).read_text())
    formats = [l["format"] for l in cfg["layers"].values()]
    assert formats.count("int4") == 36 and formats.count("int8") == 6
    assert (quantized_dir / "tokenizer.json").is_file() and (quantized_dir / "config.json").is_file()
    # --dtype auto: the unquantized tensors stay at the checkpoint's float16
    assert cfg["size"]["other_bytes"] == pytest.approx(12.59e6, rel=0.01)


def test_quantize_prints_a_summary(llama, tmp_path, capsys):
    rc, out, err = _run(capsys, "quantize", llama.path, "--format", "nf4:blocksize=128",
                        "--ignore", "lm_head", "*.o_proj", "--out", tmp_path / "nf4", "--no-progress")
    assert rc == 0, err
    assert "quantized 36 of 43 Linear layers (rtn): nf4 x36" in out
    assert "kept in float (ignored): model.layers.0.self_attn.o_proj" in out
    assert f"saved to {tmp_path / 'nf4'}" in out


def test_eval_quantized_and_plain(llama, quantized_dir, valid_path, capsys):
    text = str(valid_path)
    rc, out, err = _run(capsys, "eval", quantized_dir, "--text", text, "--max-tokens", 1024,
                        "--no-progress")
    assert rc == 0, err
    ppl_q = float(re.search(r"^perplexity: ([0-9.]+)$", out, re.M).group(1))
    assert re.search(r"^size: [0-9.]+ MB as stored \(quantized weights [0-9.]+ MB \+ other "
                     r"tensors 12\.59 MB", out, re.M), out
    assert re.search(r"^avg bits: 5\.139 per weight over 42 quantized layers \(int4 x36, int8 x6\)$",
                     out, re.M), out
    assert "2 of 496 windows of 512 tokens" in out
    rc, out, err = _run(capsys, "eval", llama.path, "--text", text, "--max-tokens", 1024,
                        "--no-progress")
    assert rc == 0, err
    ppl = float(re.search(r"^perplexity: ([0-9.]+)$", out, re.M).group(1))
    assert "size:" not in out and "avg bits" not in out
    assert abs(ppl_q / ppl - 1) < 0.05 and ppl_q != ppl


#: argparse's own usage errors print the usage line before the error line.
ARGPARSE = ("not allowed", "one of the arguments", "invalid choice")


@pytest.mark.parametrize("argv,match", [
    (["quantize", "{llama}", "--bits", "3", "--out", "{tmp}/x"], "bits must be one of"),
    (["quantize", "{llama}", "--format", "int5", "--out", "{tmp}/x"], "unknown format 'int5'"),
    (["quantize", "{llama}", "--format", "int4:group_size=12", "--out", "{tmp}/x"], "multiple of 8"),
    (["quantize", "{llama}", "--bits", "4", "--group-size", "2048", "--out", "{tmp}/x"],
     "no Linear layer could be quantized"),
    (["quantize", "{llama}", "--bits", "4", "--method", "signround", "--out", "{tmp}/x"],
     "needs --calibration"),
    (["quantize", "{llama}", "--bits", "4", "--method", "budget", "--out", "{tmp}/x"],
     "needs --calibration"),
    # no --bits needed with budget (bits=4 decides the eligible layers, as in the Python API)
    (["quantize", "{llama}", "--method", "budget", "--out", "{tmp}/x"], "needs --calibration"),
    (["quantize", "{llama}", "--bits", "4", "--method", "autoround", "--out", "{tmp}/x"],
     "invalid choice"),
    (["quantize", "{llama}", "--bits", "4", "--override", "nothing=8", "--out", "{tmp}/x"],
     "match no nn.Linear"),
    (["quantize", "{llama}", "--bits", "4", "--override", "oops", "--out", "{tmp}/x"],
     "PATTERN=SPEC"),
    (["quantize", "{tmp}/missing", "--bits", "4", "--out", "{tmp}/x"], "model folder not found"),
    (["quantize", "{llama}", "--bits", "4", "--format", "int4", "--out", "{tmp}/x"], "not allowed"),
    (["quantize", "{llama}", "--out", "{tmp}/x"], "one of the arguments"),
    (["eval", "{tmp}/missing", "--max-tokens", "512"], "model folder not found"),
    (["eval", "{tmp}/foreign", "--max-tokens", "512"], "not written by qformats"),
    (["eval", "{llama}", "--text", "{tmp}/no.txt"], "text file not found"),
])
def test_errors_one_line_exit_2(llama, tmp_path, capsys, argv, match):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / CONFIG_NAME).write_text('{"quant_method": "awq"}')
    argv = [a.format(llama=llama.path, tmp=tmp_path) for a in argv] + ["--no-progress"]
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    assert re.search(match, err), err
    if not any(a in match for a in ARGPARSE):
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith(f"qformats {argv[0]}: error: "), err
    assert not (tmp_path / "x").exists()


def test_error_line_stands_alone_with_progress_bars(llama, tmp_path, capsys):
    rc, out, err = _run(capsys, "quantize", llama.path, "--bits", "4", "--group-size", "2048",
                        "--out", tmp_path / "x")
    assert rc == 2
    # tqdm erases its line ("\r", blanks, "\r"): on a terminal the message starts a clean line
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert last.startswith("qformats quantize: error: no Linear layer could be quantized"), err


def test_compare_still_parses():
    args = cli.build_parser().parse_args(["compare", "MODEL", "--formats", "q4_0"])
    assert args.func is cli._cmd_compare and args.formats == ["q4_0"]


def test_quantize_signround_then_eval(llama, valid_path, tmp_path, capsys):
    # Tiny settings: the CLI path (calibration text -> trained int4 -> saved folder -> eval).
    rc, out, err = _run(capsys, "quantize", llama.path, "--bits", "4", "--method", "signround",
                        "--calibration", valid_path, "--iters", 2, "--nsamples", 2, "--seqlen", 128,
                        "--out", tmp_path / "sr", "--no-progress")
    assert rc == 0, err
    assert "quantized 42 of 43 Linear layers (signround): int4 x42" in out
    rc, out, err = _run(capsys, "eval", tmp_path / "sr", "--text", valid_path, "--max-tokens", 512,
                        "--no-progress")
    assert rc == 0, err
    ppl = float(re.search(r"^perplexity: ([0-9.]+)$", out, re.M).group(1))
    assert 10 < ppl < 80, ppl  # one window of the tutorial text (fp32 there: ~19)


FAKE_LM_EVAL = {
    "__init__.py": '''
CALLS = []
def simple_evaluate(model, tasks, limit=None):
    import torch
    from qformats.nn import QuantizedLinear
    n = sum(isinstance(m, QuantizedLinear) for m in model.model.modules())
    with torch.no_grad():  # the loaded model runs: a real forward through its layers
        logits = model.model(input_ids=model.tokenizer("def f(x):", return_tensors="pt").input_ids).logits
    CALLS.append((tasks, limit))
    return {"tasks": tasks, "limit": limit, "quantized": n, "finite": bool(torch.isfinite(logits).all())}
''',
    "models/__init__.py": "",
    "models/huggingface.py": '''
class HFLM:
    def __init__(self, pretrained, tokenizer, batch_size):
        assert not isinstance(pretrained, str)  # the loaded model object, not a path
        self.model, self.tokenizer, self.batch_size = pretrained, tokenizer, batch_size
''',
    "utils.py": "def make_table(out):\n    return 'LM_EVAL ' + repr(sorted(out.items()))\n",
}


def test_eval_tasks_run_lm_eval_on_the_loaded_model(quantized_dir, valid_path, tmp_path, capsys,
                                                    monkeypatch):
    """--tasks hands the loaded quantized model to lm-evaluation-harness's HFLM (a stand-in
    package records the call: the real tasks download their datasets)."""
    for rel, text in FAKE_LM_EVAL.items():
        f = tmp_path / "fake" / "lm_eval" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    for k in [k for k in __import__("sys").modules if k == "lm_eval" or k.startswith("lm_eval.")]:
        monkeypatch.delitem(__import__("sys").modules, k)
    rc, out, err = _run(capsys, "eval", quantized_dir, "--text", valid_path, "--max-tokens", 512,
                        "--tasks", "hellaswag, arc_easy", "--limit", 5, "--no-progress")
    assert rc == 0, err
    assert "LM_EVAL [('finite', True), ('limit', 5), ('quantized', 42), ('tasks', ['hellaswag', 'arc_easy'])]" in out
    rc, out, err = _run(capsys, "eval", quantized_dir, "--text", valid_path, "--max-tokens", 512,
                        "--tasks", "mine", "--include-path", tmp_path / "nowhere", "--no-progress")
    assert rc == 2 and "--include-path" in err and "not a folder" in err


def test_eval_tasks_without_lm_eval_says_what_to_install(quantized_dir, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # find_spec -> None: absent
    rc, out, err = _run(capsys, "eval", quantized_dir, "--tasks", "hellaswag")
    assert rc == 2 and "pip install 'qformats[eval]'" in err and "perplexity" not in out


def test_eval_bitsandbytes_checkpoint_without_bitsandbytes(llama, valid_path, tmp_path, capsys):
    """A bitsandbytes nf4 folder (written by qformats.bnb.save_bnb, the transformers layout)
    is scored through qformats nf4 layers: the same perplexity as the model that wrote it."""
    import copy

    import qformats
    from qformats.bnb import save_bnb

    m = copy.deepcopy(llama.model)
    qformats.quantize_model(m, format="nf4", blocksize=64)
    save_bnb(m, tmp_path / "bnb", source=llama.path)
    rc, out, err = _run(capsys, "eval", tmp_path / "bnb", "--text", valid_path, "--max-tokens", 512,
                        "--no-progress")
    assert rc == 0, err
    from qformats.evaluate import lm_windows, perplexity

    w, _ = lm_windows(llama.tokenizer, valid_path.read_text(), 512, 512)
    assert f"perplexity: {perplexity(m, w, progress=False)['ppl']:.4f}" in out
