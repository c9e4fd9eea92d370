"""save_quantized / load_quantized: identical logits after a round trip (real and tiny
Hugging Face models, a plain nn.Sequential), the folder's contents, and clear ValueErrors for
corrupt or mismatched files."""
from __future__ import annotations

import copy
import json
import shutil

import pytest

torch = pytest.importorskip("torch")

import qformats  # noqa: E402
from qformats.nn import QuantizedLinear  # noqa: E402
from qformats.saving import (CONFIG_NAME, WEIGHTS_NAME, empty_weights, is_quantized_dir,  # noqa: E402
                             read_quantization_config)


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def test_real_model_round_trip_identical_logits(llama, tmp_path):
    m = copy.deepcopy(llama.model)
    qformats.quantize_model(m, bits=4, overrides={"*.down_proj": {"bits": 2},
                                                  "layers.0.*": {"format": "nf4"}})
    ids = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(0))
    before = _logits(m, ids)
    out = qformats.save_quantized(m, tmp_path / "q")
    names = {p.name for p in out.iterdir()}
    assert {WEIGHTS_NAME, CONFIG_NAME, "config.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    # a Hugging Face folder: config.json says how transformers rebuilds the quantized layers
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "qformats"
    cfg = read_quantization_config(out)
    assert cfg["quant_method"] == "qformats" and cfg["qformats_version"] == qformats.__version__
    assert len(cfg["layers"]) == 42 and cfg["layers"]["model.layers.0.mlp.up_proj"]["format"] == "nf4"
    assert cfg["layers"]["model.layers.3.mlp.down_proj"]["format"] == "mixed2bit"
    assert is_quantized_dir(out) and not is_quantized_dir(llama.path)

    back = qformats.load_quantized(out)
    assert torch.equal(_logits(back, ids), before)
    assert sum(isinstance(x, QuantizedLinear) for x in back.modules()) == 42
    assert type(back.lm_head) is torch.nn.Linear
    assert not any(t.device.type == "meta" for t in [*back.parameters(), *back.buffers()])
    assert not back.training
    # the saved tokenizer loads
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("def f(x):")["input_ids"] == llama.tokenizer("def f(x):")["input_ids"]


def test_fp16_storage_and_dtype_argument(make_tiny_llama, tmp_path):
    m = make_tiny_llama().half()
    qformats.quantize_model(m, bits=8)
    qformats.save_quantized(m, tmp_path)
    ids = torch.randint(0, 256, (1, 12))
    same = qformats.load_quantized(tmp_path)
    assert same.model.embed_tokens.weight.dtype == torch.float16
    assert torch.equal(_logits(same, ids), _logits(m, ids))
    f32 = qformats.load_quantized(tmp_path, dtype="float32")
    assert f32.model.embed_tokens.weight.dtype == torch.float32
    q = f32.model.layers[0].mlp.up_proj
    assert q.q.dtype == torch.int8 and q.scale.dtype == torch.float32  # packed dtypes kept
    assert _logits(f32, ids).dtype == torch.float32
    ref = m.float()  # QuantizedLinear.float() keeps the packed buffers
    assert torch.equal(_logits(f32, ids), _logits(ref, ids))


def test_integer_non_persistent_buffers_are_not_recorded(make_small_net, tmp_path):
    """An integer buffer the state dict leaves out (position ids, a layer's kernel index such as
    mixed2bit's CUDA chunk_index) is the model's own business: the folder records only the
    floating ones, whose dtype the loader restores, and loads."""
    net = make_small_net()
    qformats.quantize_model(net, bits=4, group_size=64)
    net[1].register_buffer("ids", torch.arange(4), persistent=False)
    net[1].register_buffer("freqs", torch.ones(4), persistent=False)
    qformats.save_quantized(net, tmp_path)
    assert read_quantization_config(tmp_path)["computed_buffers"] == {"1.freqs": "float32"}

    def make():
        m = make_small_net(seed=1)
        m[1].register_buffer("ids", torch.arange(4), persistent=False)
        m[1].register_buffer("freqs", torch.ones(4), persistent=False)
        return m
    back = qformats.load_quantized(tmp_path, model=make)
    assert torch.equal(back[1].ids, torch.arange(4))
    x = torch.randn(3, 256)
    assert torch.equal(back(x), net(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed2bit_quantized_on_cuda_saves_and_loads(make_tiny_llama, tmp_path):
    """mixed2bit layers on CUDA hold an integer chunk index (derived, not stored): a model
    quantized on the GPU saves a folder that loads, on the GPU and on the CPU."""
    m = make_tiny_llama().cuda()
    qformats.quantize_model(m, bits=2, group_size=16)
    qformats.save_quantized(m, tmp_path)
    ids = torch.randint(0, 256, (1, 12))
    back = qformats.load_quantized(tmp_path, device="cuda")
    assert torch.equal(_logits(back, ids.cuda()), _logits(m, ids.cuda()))
    cpu = qformats.load_quantized(tmp_path)
    assert torch.isfinite(_logits(cpu, ids)).all()


def test_tied_embeddings(make_tiny_llama, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    qformats.quantize_model(m, bits=4, group_size=32)
    qformats.save_quantized(m, tmp_path)
    assert read_quantization_config(tmp_path)["aliases"]
    back = qformats.load_quantized(tmp_path)
    ids = torch.randint(0, 256, (1, 10))
    assert torch.equal(_logits(back, ids), _logits(m, ids))


def test_plain_module_with_skeleton(make_small_net, tmp_path):
    net = make_small_net()
    qformats.quantize_model(net, bits=4, group_size=64, overrides={"2": {"format": "q8_1"}})
    x = torch.randn(5, 256)
    y = net(x)
    qformats.save_quantized(net, tmp_path)
    assert not (tmp_path / "config.json").exists()
    with pytest.raises(ValueError, match="no config.json"):
        qformats.load_quantized(tmp_path)
    back = qformats.load_quantized(tmp_path, model=make_small_net)      # a function
    assert torch.equal(back(x), y)
    with torch.device("meta"):  # everything on meta, a non-persistent buffer included
        skel = make_small_net()
        skel[1].register_buffer("table", torch.ones(3), persistent=False)
    with pytest.raises(ValueError, match="still on the meta device.*1.table"):
        qformats.load_quantized(tmp_path, model=skel)
    back2 = qformats.load_quantized(tmp_path, model=make_small_net(seed=1))  # a module
    assert torch.equal(back2(x), y)


def test_empty_weights_context():
    with empty_weights():
        lin = torch.nn.Linear(4096, 4096)
        emb = torch.nn.Embedding(10, 3)
        lin.register_buffer("b", torch.ones(3))
    assert lin.weight.device.type == "meta" and emb.weight.device.type == "meta"
    assert lin.b.device.type == "cpu" and isinstance(lin.weight, torch.nn.Parameter)
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # restored


# -- corrupt and mismatched folders --------------------------------------------------------------

@pytest.fixture
def good(make_tiny_llama, tmp_path):
    m = make_tiny_llama()
    qformats.quantize_model(m, bits=4, group_size=32, overrides={"*.down_proj": {"bits": 2}})
    d = tmp_path / "good"
    qformats.save_quantized(m, d)
    return d


def _rewrite_tensors(d, fn):
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / WEIGHTS_NAME))
    fn(t)
    save_file(t, str(d / WEIGHTS_NAME))


def _edit_config(d, fn):
    cfg = json.loads((d / CONFIG_NAME).read_text())
    cfg = fn(cfg) or cfg
    (d / CONFIG_NAME).write_text(json.dumps(cfg))


def test_good_folder_loads(good):
    assert isinstance(qformats.load_quantized(good).model.layers[0].mlp.down_proj, QuantizedLinear)


def _del(t, k):
    del t[k]


CORRUPTIONS = {
    "missing tensor": (lambda d: _rewrite_tensors(d, lambda t: _del(t, "model.layers.1.mlp.up_proj.scales")),
                       "missing tensor.*up_proj.scales"),
    "missing float tensor": (lambda d: _rewrite_tensors(d, lambda t: _del(t, "model.norm.weight")),
                             "missing tensor.*model.norm.weight"),
    "extra tensor": (lambda d: _rewrite_tensors(d, lambda t: t.update(extra=torch.ones(2))),
                     "does not have"),
    "wrong shape": (lambda d: _rewrite_tensors(d, lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.qweight": torch.zeros(64, 16, dtype=torch.uint8)})),
                    "q_proj.qweight.*shape"),
    "wrong dtype": (lambda d: _rewrite_tensors(d, lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.scales": torch.zeros(64, 2, dtype=torch.float16)})),
                    "dtype mismatch"),
    "truncated safetensors": (lambda d: (d / WEIGHTS_NAME).write_bytes(
        (d / WEIGHTS_NAME).read_bytes()[:-1000]), "cannot read it as safetensors"),
    "garbage safetensors": (lambda d: (d / WEIGHTS_NAME).write_bytes(b"\x00" * 64),
                            "cannot read it as safetensors"),
    "missing weights": (lambda d: (d / WEIGHTS_NAME).unlink(), "weights file.*missing"),
    "unknown format": (lambda d: _edit_config(d, lambda c: c["layers"][
        "model.layers.0.self_attn.q_proj"].update(format="int3")), "unknown qformats format 'int3'"),
    "bad params": (lambda d: _edit_config(d, lambda c: c["layers"][
        "model.layers.0.self_attn.q_proj"]["params"].update(group_size=7)), "q_proj"),
    "params that change buffer shapes": (lambda d: _edit_config(d, lambda c: c["layers"][
        "model.layers.0.self_attn.q_proj"]["params"].update(group_size=64)), "differ|shape"),
    "unknown layer": (lambda d: _edit_config(d, lambda c: c["layers"].update(
        {"model.layers.9.mlp": c["layers"]["model.layers.0.mlp.up_proj"]})),
                      "'model.layers.9.mlp' is not a Linear"),
    "layer of another size": (lambda d: _edit_config(d, lambda c: c["layers"].update(
        {"model.layers.0.mlp.up_proj": c["layers"]["model.layers.0.self_attn.q_proj"]})),
                              "up_proj"),
    "another tool's json": (lambda d: (d / CONFIG_NAME).write_text(json.dumps(
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})),
                            "not written by qformats.*gptq"),
    "json without method": (lambda d: (d / CONFIG_NAME).write_text('{"bits": 4}'),
                            "not written by qformats"),
    "invalid json": (lambda d: (d / CONFIG_NAME).write_text('{"quant_method": "qformats", '),
                     "not valid JSON"),
    "json list": (lambda d: (d / CONFIG_NAME).write_text("[1, 2]"), "JSON object"),
    "newer config": (lambda d: _edit_config(d, lambda c: c.update(config_version=99)),
                     "config_version"),
    "no quantization config": (lambda d: ((d / CONFIG_NAME).unlink(), (d / "config.json").unlink()),
                               "no quantization_config.json"),
    "no config.json": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "weights path escape": (lambda d: _edit_config(d, lambda c: c.update(weights="../x.safetensors")),
                            "file name in the folder"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_folders_raise_value_error(good, case):
    corrupt, match = CORRUPTIONS[case]
    corrupt(good)
    with pytest.raises(ValueError, match=match):
        qformats.load_quantized(good)


def test_not_a_folder(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        qformats.load_quantized(tmp_path / "nope")


def test_save_refuses_meta_tensors(tmp_path):
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="meta device"):
        qformats.save_quantized(net, tmp_path)
    with pytest.raises(TypeError):
        qformats.save_quantized("model", tmp_path)


def test_resave_to_same_folder(good):
    m = qformats.load_quantized(good)
    qformats.save_quantized(m, good)  # source == destination: nothing copied onto itself
    back = qformats.load_quantized(good)
    ids = torch.randint(0, 256, (1, 8))
    assert torch.equal(_logits(back, ids), _logits(m, ids))
    shutil.rmtree(good)


def test_folder_of_earlier_versions_loads_and_converts(good, tmp_path):
    """A folder as earlier qformats wrote it (weights in qformats_model.safetensors, named by
    quantization_config.json; config.json without quantization_config) still loads, and
    save_quantized(load_quantized(old), new) converts it to a folder from_pretrained reads."""
    ids = torch.randint(0, 256, (1, 12))
    ref = _logits(qformats.load_quantized(good), ids)
    (good / WEIGHTS_NAME).rename(good / "qformats_model.safetensors")
    cfg = json.loads((good / CONFIG_NAME).read_text())
    cfg["weights"] = "qformats_model.safetensors"
    (good / CONFIG_NAME).write_text(json.dumps(cfg))
    hf = json.loads((good / "config.json").read_text())
    del hf["quantization_config"]
    (good / "config.json").write_text(json.dumps(hf))
    old = qformats.load_quantized(good)
    assert torch.equal(_logits(old, ids), ref)
    qformats.save_quantized(old, tmp_path / "new")
    from transformers import AutoModelForCausalLM

    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "new")), ids), ref)
