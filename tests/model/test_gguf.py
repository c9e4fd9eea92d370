"""qformats.gguf: GGUF files for llama.cpp (export, load, load_tokenizer) and the CLI's
``export-gguf`` / ``eval FILE.gguf``.

Without ../shared: a tiny random Llama (grouped-query attention, so the q and k row orders
differ) with a byte-level BPE vocabulary trained here, some layers q4_0, one int4, one left
float: export -> load gives the same logits and the same q4_0 bytes; load -> export gives the
same file tensors; GGUFReader's read-only memory maps go into the codecs without a copy;
unsupported models, types and tokenizers raise GGUFError. With ../shared: the pydoc Llama
through the CLI (same perplexity from the folder and from the GGUF file, same tokenization),
and, where llama.cpp's tools are found (``LLAMA_CPP_BIN`` or PATH): llama.cpp's perplexity of
the exported file against ``qformats eval --score-from`` on the same windows, and a file that
llama.cpp's ``llama-quantize`` made, loaded into the same q4_0 bytes qformats makes.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf_pkg = pytest.importorskip("gguf")

from qformats import QuantizedTensor, cli, q4_0  # noqa: E402
from qformats import gguf as qgguf  # noqa: E402
from qformats.nn import QuantizedLinear, quantized_linears  # noqa: E402
from conftest import SHARED  # noqa: E402  (tests/conftest.py: ../shared beside the repository)

LLAMA = SHARED / "models" / "pydoc-llama-17m"
VALID = SHARED / "data" / "pydoc" / "valid.txt"

needs_llama = pytest.mark.skipif(not (LLAMA / "config.json").is_file() or not VALID.is_file(),
                                 reason="shared test model or text not found")

TEXT = ("def load(path):\n    return open(path).read()  # the file's text\n"
        "Return the sum of a and b. Raise ValueError if either is negative.\n") * 20


def train_tokenizer(d):
    """A byte-level BPE tokenizer (GPT-2 pre-tokenizer, <|endoftext|> special) trained on TEXT
    and saved in folder ``d`` as a Hugging Face fast tokenizer; returns ``d``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator([TEXT], trainer)
    PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            unk_token="<|endoftext|>").save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def _model(seed=0, vocab=320):
    """A tiny Llama: q4_0 attention and up/gate projections, q8_0 v_proj of layer 1, down_proj
    of layer 1 in int4, down_proj of layer 0 left float."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so that a misplaced norm shows
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    for name, mod in list(m.named_modules()):
        for child, lin in list(mod.named_children()):
            if not isinstance(lin, torch.nn.Linear) or child == "lm_head":
                continue
            full = f"{name}.{child}"
            if full == "model.layers.0.mlp.down_proj":
                continue
            fmt = {"model.layers.1.mlp.down_proj": ("int4", {"group_size": 32}),
                   "model.layers.1.self_attn.v_proj": ("q8_0", {})}.get(full, ("q4_0", {}))
            setattr(mod, child, QuantizedLinear.from_linear(lin, fmt[0], **fmt[1]))
    return m


def _logits(m, seed=1):
    ids = torch.randint(0, m.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return m(input_ids=ids).logits


def _tensors(path):
    r = gguf_pkg.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in r.tensors}


def test_export_load_round_trip(tok_dir, tmp_path):
    m = _model()
    f = tmp_path / "tiny.gguf"
    written = qgguf.export(m, f, tokenizer=tok_dir)
    how = {t.source: (t.ggml_type, t.how, t.exact) for t in written}
    assert how["model.layers.0.self_attn.q_proj.weight"] == ("Q4_0", "bytes", True)
    assert how["model.layers.1.self_attn.v_proj.weight"] == ("Q8_0", "bytes", True)
    assert how["model.layers.1.mlp.down_proj.weight"][1:] == ("dequantized", True)
    assert how["model.layers.0.mlp.down_proj.weight"][1:] == ("float", True)
    assert how["model.norm.weight"] == ("F32", "float", True)

    m2 = qgguf.load(f)
    assert torch.equal(_logits(m), _logits(m2))
    # the q4_0 layers hold the very bytes, q and k rows back in Hugging Face order
    q_before = dict(quantized_linears(m))
    q_after = dict(quantized_linears(m2))
    for name, layer in q_before.items():
        if layer.format not in ("q4_0", "q8_0"):
            continue
        assert q_after[name].format == layer.format
        assert torch.equal(q_after[name].blocks, layer.blocks), name
    # and llama.cpp's row order in the file: q_proj permuted per head as convert_hf_to_gguf.py does
    r = gguf_pkg.GGUFReader(str(f))
    kq = {t.name: t for t in r.tensors}["blk.0.attn_k.weight"]
    theirs = np.asarray(kq.data).reshape(32, 2, 18)  # 2 kv heads of 16 rows
    mine = q_before["model.layers.0.self_attn.k_proj"].blocks.numpy()
    perm = mine.reshape(2, 2, 8, 2, 18).swapaxes(1, 2).reshape(32, 2, 18)
    assert np.array_equal(theirs, perm) and not np.array_equal(theirs, mine)

    # load -> export: the same tensors, byte for byte
    g = tmp_path / "again.gguf"
    qgguf.export(m2, g, tokenizer=tok_dir)
    assert _tensors(f) == _tensors(g)


def test_vocabulary_matches_the_tokenizer(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    f = tmp_path / "tiny.gguf"
    qgguf.export(_model(), f, tokenizer=tok_dir)
    r = gguf_pkg.GGUFReader(str(f))
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert r.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert r.fields["tokenizer.ggml.add_bos_token"].contents() is False
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 320 and tokens[-1] == "[PAD319]"
    hf = AutoTokenizer.from_pretrained(tok_dir)
    back = qgguf.load_tokenizer(f)
    sample = TEXT[:300] + " Unseen wörds, ünïcode 123."
    assert back(sample)["input_ids"] == hf(sample)["input_ids"]


def test_other_requantizes(tok_dir, tmp_path):
    m = _model()
    f = tmp_path / "rq.gguf"
    written = qgguf.export(m, f, tokenizer=tok_dir, other="q4_0")
    t = {w.source: w for w in written}["model.layers.1.mlp.down_proj.weight"]
    assert (t.ggml_type, t.how, t.exact) == ("Q4_0", "requantized", False)
    layer = dict(quantized_linears(m))["model.layers.1.mlp.down_proj"]
    expect = q4_0.quantize_q4_0(layer.dequantize_weight(torch.float32).numpy())
    assert _tensors(f)["blk.1.ffn_down.weight"][1] == np.asarray(expect).tobytes()


def test_float16_model_and_bias(tok_dir, tmp_path):
    """float16 weights go out as F16 and come back exactly; Linear biases (attention_bias)
    follow their layer's row order."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_()
    m.model.layers[0].self_attn.q_proj = QuantizedLinear.from_linear(m.model.layers[0].self_attn.q_proj, "q4_0")
    rope = m.model.rotary_emb.inv_freq.clone()
    m = m.half()
    m.model.rotary_emb.inv_freq = rope  # .half() rounds the rotary frequencies; load() does not
    f = tmp_path / "h.gguf"
    written = {t.source: t.ggml_type for t in qgguf.export(m, f, tokenizer=tok_dir)}
    assert written["model.layers.0.self_attn.k_proj.weight"] == "F16"
    assert written["model.layers.0.self_attn.q_proj.bias"] == "F32"
    m2 = qgguf.load(f, dtype=torch.float16)
    for (n, a), (n2, b) in zip(sorted(m.state_dict().items()), sorted(m2.state_dict().items())):
        assert n == n2 and torch.equal(a, b), n
    assert torch.equal(_logits(m.float()), _logits(m2.float()))


def test_reader_memory_maps_go_in_without_a_copy(tok_dir, tmp_path):
    """GGUFReader hands out read-only numpy views of its memory map; the codecs take them as
    they are, and a weight bound to one reads the file's pages (a change written to the file
    through another mapping shows in its next product, which a copy would not)."""
    from qformats.q4_0 import _native

    f = tmp_path / "tiny.gguf"
    qgguf.export(_model(), f, tokenizer=tok_dir)
    ts = {t.name: t for t in gguf_pkg.GGUFReader(str(f)).tensors}
    t, other = ts["blk.0.ffn_up.weight"], ts["blk.1.ffn_up.weight"]
    blocks = np.asarray(t.data).reshape(128, 2, 18)
    assert not blocks.flags.writeable
    other_blocks = np.array(other.data).reshape(128, 2, 18)
    deq = q4_0.dequantize_q4_0(blocks, 64)
    assert np.array_equal(deq, q4_0.dequantize_q4_0(blocks.copy(), 64))
    assert np.array_equal(deq, gguf_pkg.quants.dequantize(np.asarray(t.data), gguf_pkg.GGMLQuantizationType.Q4_0))

    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    lin = _native.make_linear(blocks, 128, 64, False)

    def run():
        out = np.empty((3, 128), np.float32)
        lin(x, out)
        return out

    def gemm(b):
        return q4_0.gemm(x, QuantizedTensor("q4_0", (128, 64), "float16", {}, {"blocks": b}))

    first = run()
    assert np.array_equal(first, gemm(blocks.copy()))
    rw = np.memmap(f, dtype=np.uint8, mode="r+", offset=t.data_offset, shape=(t.n_bytes,))
    rw[:] = other_blocks.reshape(-1)
    rw.flush()
    second = run()
    assert np.array_equal(second, gemm(other_blocks)) and not np.array_equal(first, second)


def test_refusals(tok_dir, tmp_path):
    m = _model()
    f = tmp_path / "x.gguf"
    with pytest.raises(qgguf.GGUFError, match="other="):
        qgguf.export(m, f, tokenizer=tok_dir, other="int4")
    with pytest.raises(qgguf.GGUFError, match="pass tokenizer="):
        qgguf.export(m, f)
    m.config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(qgguf.GGUFError, match="not supported"):
        qgguf.export(m, f, tokenizer=tok_dir)
    m.config.architectures = ["LlamaForCausalLM"]
    m.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    with pytest.raises(qgguf.GGUFError, match="llama3"):
        qgguf.export(m, f, tokenizer=tok_dir)
    with pytest.raises(FileNotFoundError):
        qgguf.load(tmp_path / "missing.gguf")


def test_sentencepiece_style_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>"]))
    PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>").save_pretrained(tmp_path)
    with pytest.raises(qgguf.GGUFError, match="byte-level BPE"):
        qgguf.export(_model(), tmp_path / "x.gguf", tokenizer=tmp_path)


def test_load_names_unsupported_types(tok_dir, tmp_path):
    f = tmp_path / "tiny.gguf"
    qgguf.export(_model(), f, tokenizer=tok_dir)
    # the same file with one tensor in Q5_0, which no qformats format holds
    r = gguf_pkg.GGUFReader(str(f))
    w = gguf_pkg.GGUFWriter(str(tmp_path / "q5.gguf"), "llama")
    for k, fld in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = fld.types[0]
        if vt == gguf_pkg.GGUFValueType.ARRAY:
            w.add_array(k, fld.contents())
        else:
            w.add_key_value(k, fld.contents(), vt)
    for t in r.tensors:
        if t.name == "blk.1.attn_v.weight":
            x = gguf_pkg.quants.dequantize(np.asarray(t.data), t.tensor_type)
            w.add_tensor(t.name, gguf_pkg.quants.quantize(x, gguf_pkg.GGMLQuantizationType.Q5_0),
                         raw_dtype=gguf_pkg.GGMLQuantizationType.Q5_0)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(qgguf.GGUFError, match=r"blk\.1\.attn_v\.weight \(Q5_0\)"):
        qgguf.load(tmp_path / "q5.gguf")


def test_cli_export_and_eval_without_shared(tok_dir, tmp_path, capsys):
    """`qformats export-gguf` on a folder written by save_quantized, then `qformats eval` of the
    file and of the folder: the same perplexity; the printout names what was written how."""
    import qformats
    from transformers import AutoTokenizer

    m = _model()
    d = tmp_path / "q"
    qformats.save_quantized(m, d, tokenizer=AutoTokenizer.from_pretrained(tok_dir))
    out = tmp_path / "q.gguf"
    capsys.readouterr()
    assert cli.main(["export-gguf", str(d), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Q4_0" in printed and "Q8_0" in printed and "decoded from a format with no GGML type" in printed
    assert not (tmp_path / "q.gguf.part").exists()
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 3, encoding="utf-8")
    ppl = {}
    for src in (d, out):
        assert cli.main(["eval", str(src), "--text", str(text), "--seqlen", "64", "--max-tokens", "0",
                         "--no-progress", "--score-from", "32"]) == 0
        ppl[src.name] = re.search(r"perplexity: ([0-9.]+)", capsys.readouterr().out).group(1)
    assert ppl["q"] == ppl["q.gguf"]
    assert cli.main(["export-gguf", str(d), str(out), "--other", "int4", "--overwrite"]) == 2
    assert "--other int4: expected one of" in capsys.readouterr().err


# -- the shared pydoc Llama -----------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    if not (LLAMA / "config.json").is_file() or not VALID.is_file():
        pytest.skip("shared test model or text not found")
    d = tmp_path_factory.mktemp("gguf")
    assert cli.main(["quantize", str(LLAMA), "--format", "q4_0", "--out", str(d / "q"),
                     "--no-progress"]) == 0
    assert cli.main(["export-gguf", str(d / "q"), str(d / "q.gguf")]) == 0
    return d


@needs_llama
def test_cli_eval_of_the_file_equals_the_folder(exported, capsys):
    capsys.readouterr()
    out = {}
    for src in ("q", "q.gguf"):
        assert cli.main(["eval", str(exported / src), "--text", str(VALID), "--max-tokens", "1024",
                         "--no-progress", "--score-from", "256"]) == 0
        out[src] = re.search(r"perplexity: ([0-9.]+)", capsys.readouterr().out).group(1)
    assert out["q"] == out["q.gguf"]
    assert cli.main(["export-gguf", str(exported / "q"), str(exported / "q.gguf")]) == 2
    assert "exists" in capsys.readouterr().err


@needs_llama
def test_tokenization_of_the_file_equals_the_model(exported):
    from transformers import AutoTokenizer

    text = VALID.read_text(encoding="utf-8")[:20000]
    a = AutoTokenizer.from_pretrained(LLAMA)(text, add_special_tokens=False)["input_ids"]
    b = qgguf.load_tokenizer(exported / "q.gguf")(text, add_special_tokens=False)["input_ids"]
    assert a == b


def _llama_cpp_tool(name):
    d = os.environ.get("LLAMA_CPP_BIN")
    p = Path(d) / name if d else shutil.which(name)
    return Path(p) if p and Path(p).is_file() else None


@needs_llama
@pytest.mark.skipif(_llama_cpp_tool("llama-perplexity") is None,
                    reason="llama.cpp's llama-perplexity not found (set LLAMA_CPP_BIN)")
def test_llama_cpp_perplexity_agrees(exported):
    """llama.cpp runs the exported file; its perplexity over the first 8 chunks of 512 tokens
    (second halves scored) is within 1% of qformats' on the same windows."""
    from qformats.evaluate import lm_windows, perplexity

    tool = _llama_cpp_tool("llama-perplexity")
    run = subprocess.run([str(tool), "-m", str(exported / "q.gguf"), "-f", str(VALID), "-c", "512",
                          "--chunks", "8", "-t", str(os.cpu_count() or 1)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = float(re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr).group(1))
    m = qgguf.load(exported / "q.gguf")
    tok = qgguf.load_tokenizer(exported / "q.gguf")
    w, _ = lm_windows(tok, VALID.read_text(encoding="utf-8"), 512)
    ours = perplexity(m, w[:8], progress=False, score_from=256)["ppl"]
    assert abs(theirs / ours - 1) < 0.01, (theirs, ours)


@needs_llama
@pytest.mark.skipif(_llama_cpp_tool("llama-quantize") is None,
                    reason="llama.cpp's llama-quantize not found (set LLAMA_CPP_BIN)")
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_llama_cpp_quantized_file_loads(tmp_path, llama, fmt):
    """A file quantized by llama.cpp itself (F16 export -> llama-quantize --pure q4_0 / q8_0)
    loads into layers whose bytes are qformats' own quantization of the same weights, computes
    the same logits, and exports back to the same tensors."""
    import copy

    from qformats.model import quantize_model

    f16 = tmp_path / "f16.gguf"
    assert cli.main(["export-gguf", str(LLAMA), str(f16)]) == 0
    q = tmp_path / f"{fmt}.gguf"
    run = subprocess.run([str(_llama_cpp_tool("llama-quantize")), "--pure", "--token-embedding-type", "f16",
                          "--output-tensor-type", "f16", str(f16), str(q), fmt],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    m = qgguf.load(q)
    ref = copy.deepcopy(llama.model)
    quantize_model(ref, format=fmt)
    mine, theirs = dict(quantized_linears(ref)), dict(quantized_linears(m))
    assert mine.keys() == theirs.keys() and len(mine) == 42
    for k in mine:
        assert torch.equal(mine[k].blocks, theirs[k].blocks), k
    assert torch.equal(_logits(m), _logits(ref))
    again = tmp_path / "again.gguf"
    qgguf.export(m, again, tokenizer=LLAMA)
    assert _tensors(again) == _tensors(q)
