"""quantize_model on the shared pydoc Llama (bits 8/4/2, overrides, perplexity, KL) and on
small modules (ignore patterns, layers left in float, bad configurations)."""
from __future__ import annotations

import copy
import math
import warnings

import pytest

torch = pytest.importorskip("torch")

import qformats  # noqa: E402
from qformats.evaluate import kl_divergence, perplexity, size_report  # noqa: E402
from qformats.model import QuantizationReport, matches, resolve_spec  # noqa: E402
from qformats.nn import QuantizedLinear  # noqa: E402

N_DECODER_LINEARS = 42  # 6 blocks x (q, k, v, o, gate, up, down)


@pytest.fixture(scope="module")
def quantized(llama, windows):
    """{bits: (model, report, ppl)} for bits 8, 4, 2 (copies of the fp32 model)."""
    out = {}
    for bits in (8, 4, 2):
        m = copy.deepcopy(llama.model)
        rep = qformats.quantize_model(m, bits=bits)
        out[bits] = (m, rep, perplexity(m, windows, progress=False)["ppl"])
    return out


@pytest.mark.parametrize("bits,fmt,avg_bits,max_rel", [
    (8, "int8", 8.0718, 0.01),                          # + a float32 scale per row
    (4, "int4", 4.3125, 0.05),                          # groups of 128: + 40 bits / 128 values
    (2, "mixed2bit", 2.6875, 0.5),                      # 2 + 1/2 (scale codes) + 1/8 + 1/16
])
def test_bits_presets(llama, quantized, base_ppl, bits, fmt, avg_bits, max_rel):
    m, rep, ppl = quantized[bits]
    assert isinstance(rep, QuantizationReport) and rep.method == "rtn"
    qls = [(n, mod) for n, mod in m.named_modules() if isinstance(mod, QuantizedLinear)]
    assert len(qls) == N_DECODER_LINEARS == len(rep.quantized)
    assert all(mod.format == fmt for _, mod in qls) and rep.formats == {fmt: N_DECODER_LINEARS}
    if bits == 2:
        assert all(mod.params["ratio_4bit"] == 0.0 and mod.params["n4"] == 0 for _, mod in qls)
        assert all(mod.params["group_size"] == 16 for _, mod in qls)
    if bits == 4:
        assert all(mod.params == {"group_size": 128, "symmetric": False} for _, mod in qls)
    if bits == 8:
        assert all(mod.params == {"granularity": "row"} for _, mod in qls)
    # lm_head and the embeddings untouched (same values, still float modules)
    assert type(m.lm_head) is torch.nn.Linear
    assert torch.equal(m.lm_head.weight, llama.model.lm_head.weight)
    assert torch.equal(m.model.embed_tokens.weight, llama.model.model.embed_tokens.weight)
    assert [l.name for l in rep.ignored] == ["lm_head"] and not rep.skipped and not rep.warnings
    # sizes: 10.62M quantized values
    assert rep.avg_bits == pytest.approx(avg_bits, abs=1e-3)
    assert rep.size["quantized_values"] == 10_616_832
    assert rep.size["avg_bits"] == pytest.approx(rep.avg_bits)
    assert rep.size == size_report(m)
    # quality: the perplexity on two 512-token windows
    assert 10 < base_ppl < 200
    assert math.isfinite(ppl) and abs(ppl / base_ppl - 1) < max_rel, (bits, ppl, base_ppl)
    assert str(rep).startswith(f"quantized {N_DECODER_LINEARS} of 43 Linear layers (rtn): {fmt}")


def test_quality_order_and_kl(llama, quantized, windows):
    kls = {b: kl_divergence(quantized[b][0], llama.model, windows[:1], progress=False)["kl"]
           for b in (8, 4, 2)}
    assert 0 < kls[8] < kls[4] < kls[2] < 1.0, kls
    assert kls[8] < 1e-3
    same = kl_divergence(llama.model, llama.model, windows[:1], progress=False)
    assert same["kl"] == 0.0 and same["tokens"] == 511
    sizes = [quantized[b][1].total_bytes for b in (8, 4, 2)]
    assert sizes[0] > sizes[1] > sizes[2]


def test_perplexity_from_tokenizer_and_text(llama, valid_text, windows, quantized):
    m = quantized[8][0]
    a = perplexity(m, windows, progress=False)
    b = perplexity(m, llama.tokenizer, valid_text, seqlen=512, max_tokens=1024, progress=False)
    assert a["ppl"] == b["ppl"] and b["windows"] == 2 and b["seqlen"] == 512
    c = kl_divergence(m, llama.model, llama.tokenizer, valid_text, max_tokens=512, progress=False)
    assert c["windows"] == 1 and c["kl"] > 0


def test_perplexity_score_from(make_tiny_llama):
    """score_from=P counts the predictions of positions P+1.. only (llama.cpp's second half
    with P = seqlen // 2): the NLL over exactly those targets, computed here by hand."""
    from qformats.evaluate import EvalError

    m = make_tiny_llama()
    w = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = torch.log_softmax(m(input_ids=w).logits.double(), -1)
    nll = -logp[:, :-1].gather(-1, w[:, 1:, None])[..., 0]  # [3, 31]: target positions 1..31
    for p in (0, 16, 30):
        r = perplexity(m, w, progress=False, score_from=p)
        assert r["tokens"] == 3 * (31 - p)
        assert r["nll"] == pytest.approx(float(nll[:, p:].mean()), rel=1e-5)
    for bad in (-1, 31):
        with pytest.raises(EvalError, match="score_from"):
            perplexity(m, w, progress=False, score_from=bad)


def test_overrides(llama):
    m = copy.deepcopy(llama.model)
    rep = qformats.quantize_model(m, bits=4, overrides={
        "*.down_proj": {"bits": 8},
        "layers.0.*": {"group_size": 64},
        "model.layers.5.self_attn.v_proj": {"format": "nf4", "blocksize": 128},
        "layers.5.self_attn.k_proj": {"skip": True},
    })
    by = {l.name: l for l in rep.layers}
    assert by["model.layers.1.mlp.down_proj"].format == "int8"
    assert by["model.layers.1.mlp.down_proj"].params == {"granularity": "row"}
    # both patterns match layer 0's down_proj: int8, then group_size 64 -> per-group int8
    assert by["model.layers.0.mlp.down_proj"].params == {"granularity": "group", "group_size": 64}
    assert by["model.layers.0.self_attn.q_proj"].params == {"group_size": 64, "symmetric": False}
    assert by["model.layers.3.self_attn.q_proj"].params == {"group_size": 128, "symmetric": False}
    assert by["model.layers.5.self_attn.v_proj"].format == "nf4"
    assert by["model.layers.5.self_attn.v_proj"].params["blocksize"] == 128
    assert by["model.layers.5.self_attn.k_proj"].status == "ignored"
    assert type(m.model.layers[5].self_attn.k_proj) is torch.nn.Linear
    assert rep.formats == {"int4": 34, "int8": 6, "nf4": 1}
    ids = torch.randint(0, 8192, (1, 32))
    with torch.inference_mode():
        assert torch.isfinite(m(input_ids=ids).logits).all()


def test_format_and_params(make_tiny_llama):
    m = make_tiny_llama()
    rep = qformats.quantize_model(m, format="nf4", group_size=32, compress_statistics=True)
    assert rep.formats == {"nf4": 14}
    assert all(l.params == {"blocksize": 32, "quant_type": "nf4", "compress_statistics": True}
               for l in rep.quantized)
    m = make_tiny_llama()
    rep = qformats.quantize_model(m, bits=2, ratio_4bit=0.25, ignore=[])
    assert len(rep.quantized) == 15 and type(m.lm_head) is QuantizedLinear  # ignore=[]: all
    assert all(l.params["ratio_4bit"] == 0.25 for l in rep.quantized)
    m = make_tiny_llama()
    rep = qformats.quantize_model(m, format="q4_0", ignore=["*mlp*"])
    # a given ignore list replaces the default one: lm_head is quantized too
    assert len(rep.quantized) == 9 and type(m.lm_head) is QuantizedLinear
    assert {l.reason for l in rep.ignored} == {"matches ignore pattern '*mlp*'"}


def test_layers_left_in_float_are_reported(make_small_net):
    net = make_small_net()  # Linear(256 -> 128), GELU, Linear(128 -> 64)
    with pytest.warns(UserWarning, match="kept in float"):
        rep = qformats.quantize_model(net, bits=4, group_size=256)
    assert [l.status for l in rep.layers] == ["quantized", "skipped"]
    assert type(net[2]) is torch.nn.Linear and type(net[0]) is QuantizedLinear
    assert "in_features=128 is not a multiple of the int4 block of 256" in rep.warnings[0]
    assert "kept in float" in rep.summary()
    assert rep.to_dict()["layers"][1]["status"] == "skipped"


def test_multihead_attention_out_proj_stays_float():
    mha = torch.nn.Sequential(torch.nn.Linear(64, 64))
    mha.attn = torch.nn.MultiheadAttention(64, 4)
    with pytest.warns(UserWarning, match="MultiheadAttention"):
        rep = qformats.quantize_model(mha, bits=8)
    assert rep.formats == {"int8": 1} and type(mha.attn.out_proj) is not QuantizedLinear


@pytest.mark.parametrize("kwargs,match", [
    ({"format": "int5"}, "unknown format"),
    ({"bits": 3}, "bits must be one of"),
    ({"bits": 16}, "bits must be one of"),
    ({}, "exactly one of"),
    ({"bits": 4, "format": "int4"}, "exactly one of"),
    ({"bits": 2, "group_size": 24}, "multiple of 16"),     # mixed2bit groups are multiples of 16
    ({"bits": 4, "group_size": 12}, "multiple of 8"),
    ({"bits": 4, "group_size": 2048}, "no Linear layer could be quantized"),  # divides none
    ({"format": "q4_0", "group_size": 64}, "fixed blocks of 32"),
    ({"format": "nf4", "group_size": 48}, "power of two"),
    ({"bits": 4, "group_size": 0}, "positive int"),
    ({"bits": 4, "foo": 1}, "bad parameters"),
    ({"format": "mixed2bit", "ratio_4bit": 2.0}, r"\[0, 1\]"),
    ({"bits": 4, "overrides": {"*.nothing": {"bits": 8}}}, "match no nn.Linear"),
    ({"bits": 4, "overrides": {"0": {"format": "int7"}}}, "unknown format"),
    ({"bits": 4, "overrides": {"0": {"bits": 3}}}, "bits must be one of"),
    ({"bits": 4, "method": "gptq"}, "unknown method"),
])
def test_bad_configurations_raise_and_leave_the_model_alone(make_small_net, kwargs, match):
    net = make_small_net()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qformats.quantize_model(net, **kwargs)
    assert all(type(m) is not QuantizedLinear for m in net.modules())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_autoround_not_implemented(make_small_net):
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        qformats.quantize_model(make_small_net(), bits=4, method="autoround")


def test_signround_needs_calibration(make_small_net):
    with pytest.raises(ValueError, match="needs calibration"):
        qformats.quantize_model(make_small_net(), bits=4, method="signround")


def test_pattern_matching_and_spec():
    assert matches("model.layers.0.mlp.down_proj", ["down_proj"]) == "down_proj"
    assert matches("model.layers.0.mlp.down_proj", ["mlp.down_proj"]) == "mlp.down_proj"
    assert matches("model.layers.10.mlp.down_proj", ["layers.1.*"]) is None
    assert matches("model.layers.1.mlp.down_proj", ["layers.1.*"]) == "layers.1.*"
    assert matches("lm_head", ["lm_head"]) == "lm_head"
    assert matches("model.embed_tokens", ["*embed*"]) == "*embed*"
    assert matches("model.layers.0.mlp.up_proj", ["down_proj", "*embed*"]) is None
    assert resolve_spec(bits=8) == ("int8", {"granularity": "row"})
    assert resolve_spec(bits=8, group_size=64) == ("int8", {"granularity": "group", "group_size": 64})
    assert resolve_spec(bits=4) == ("int4", {"group_size": 128, "symmetric": False})
    assert resolve_spec(bits=2) == ("mixed2bit", {"group_size": 16, "ratio_4bit": 0.0})
    assert resolve_spec(format="nf4", group_size=128) == ("nf4", {"blocksize": 128})
    assert resolve_spec(format="q8_1") == ("q8_1", {})
    assert resolve_spec(format="q8_0") == ("q8_0", {})


def test_int4_tiles_layout_model(make_tiny_llama, make_small_net, tmp_path):
    """int4's tiles layout through quantize_model, save and load: every Linear quantized (their
    out_features are multiples of 16), the logits within float32 rounding of the rows layout's (the
    same decoded weights; the CPU sums them in another order), the saved model loads back equal; a
    layer whose out_features is not a multiple of 16 is kept in float with a reason."""
    x = torch.randint(0, 256, (2, 12))
    rows, tiles = make_tiny_llama(), make_tiny_llama()
    qformats.quantize_model(rows, format="int4", group_size=32)
    rep = qformats.quantize_model(tiles, format="int4", group_size=32, layout="tiles")
    assert rep.formats == {"int4": 14} and all(l.params["layout"] == "tiles" for l in rep.quantized)
    with torch.no_grad():
        a, b = rows(x).logits, tiles(x).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    qformats.save_quantized(tiles, tmp_path / "m")
    back = qformats.load_quantized(tmp_path / "m", model=make_tiny_llama())
    with torch.no_grad():
        assert torch.equal(back(x).logits, b)
    net = torch.nn.Sequential(torch.nn.Linear(64, 24), torch.nn.Linear(24, 32))
    with pytest.warns(UserWarning, match="row block of 16"):
        rep = qformats.quantize_model(net, format="int4", group_size=8, layout="tiles")
    assert [l.status for l in rep.layers] == ["skipped", "quantized"]
    assert "out_features=24 is not a multiple of the int4 row block of 16" in rep.warnings[0]


def test_fits_checks_both_dimensions():
    """choice.fits, which the budget's candidate filter uses: in_features against the format's
    block, out_features against its row block (int4's tiles layout: 16)."""
    from qformats.choice import fits

    lin = torch.nn.Linear(64, 24)
    assert fits("int4", {"group_size": 32}, lin)
    assert not fits("int4", {"group_size": 32, "layout": "tiles"}, lin)
    assert fits("int4", {"group_size": 32, "layout": "tiles"}, torch.nn.Linear(64, 32))
    assert not fits("int4", {"group_size": 128}, lin)
