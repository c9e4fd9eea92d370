"""transformers integration (qformats.hf): save_pretrained / from_pretrained of quantized
models with bit-identical logits for every format, quantize on load equal to quantize_model,
sharded folders, folders written by save_quantized and the CLI, and clear errors for folders
with missing or mismatched packed weights (never randomly initialized layers)."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("qformats' transformers integration needs transformers >= 5", allow_module_level=True)

import qformats  # noqa: E402
from qformats import FORMATS  # noqa: E402
from qformats.hf import QFormatsConfig  # noqa: E402
from qformats.nn import QuantizedLinear  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from .conftest import LLAMA  # noqa: E402

IDS = torch.randint(0, 8192, (2, 48), generator=torch.Generator().manual_seed(0))
# each format at settings that divide the model's in_features (384, 1024)
CHOICES = {"int4": {"bits": 4}, "nf4": {"format": "nf4", "blocksize": 64},
           "q4_0": {"format": "q4_0"}, "q8_0": {"format": "q8_0"}, "q8_1": {"format": "q8_1"}, "int8": {"bits": 8},
           "mixed2bit": {"format": "mixed2bit", "ratio_4bit": 0.1}}


def _logits(model, ids=IDS):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def _quantized(llama, **choice):
    m = copy.deepcopy(llama.model)
    qformats.quantize_model(m, **choice)
    return m


def _load(d, **kw):
    return AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, **kw)


def test_every_format_has_a_case():
    assert set(CHOICES) == set(FORMATS)


@pytest.mark.parametrize("fmt", sorted(CHOICES))
def test_save_pretrained_from_pretrained_identical_logits(llama, tmp_path, fmt):
    m = _quantized(llama, **CHOICES[fmt])
    before = _logits(m)
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "qformats" and len(cfg["layers"]) == 42
    assert {layer["format"] for layer in cfg["layers"].values()} == {fmt}
    back = _load(tmp_path)
    assert sum(isinstance(x, QuantizedLinear) for x in back.modules()) == 42
    assert torch.equal(_logits(back), before)
    # no float weight was made for a quantized layer, and the packed bytes are the same
    for name, q in back.named_modules():
        if isinstance(q, QuantizedLinear):
            ref = m.get_submodule(name)
            assert all(torch.equal(getattr(q, b), getattr(ref, b)) for b in q.buffer_names)


def test_quantize_on_load_equals_quantize_model(llama, tmp_path):
    choice = {"bits": 4, "group_size": 64, "overrides": {"*.down_proj": {"format": "nf4"}}}
    m = _quantized(llama, **choice)
    got = _load(LLAMA, dtype=torch.float32, quantization_config=QFormatsConfig(**choice))
    assert type(got.lm_head) is torch.nn.Linear
    assert {n for n, x in got.named_modules() if isinstance(x, QuantizedLinear)} == \
        {n for n, x in m.named_modules() if isinstance(x, QuantizedLinear)}
    for name, q in got.named_modules():
        if isinstance(q, QuantizedLinear):
            ref = m.get_submodule(name)
            assert (q.format, q.params) == (ref.format, ref.params), name
            assert all(torch.equal(getattr(q, b), getattr(ref, b)) for b in q.buffer_names), name
    assert torch.equal(_logits(got), _logits(m))
    # and it saves and loads like any quantized model
    got.save_pretrained(tmp_path)
    assert torch.equal(_logits(_load(tmp_path)), _logits(m))


def test_quantize_on_load_bad_config_fails_before_loading():
    with pytest.raises(ValueError, match="format= or bits="):
        QFormatsConfig()
    with pytest.raises(ValueError, match="bits must be one of"):
        QFormatsConfig(bits=3)
    with pytest.raises(ValueError, match="group_size"):
        QFormatsConfig(bits=4, group_size=12)


def test_save_quantized_folder_loads_with_from_pretrained(llama, tmp_path):
    m = _quantized(llama, bits=4, overrides={"*.down_proj": {"bits": 2}})
    qformats.save_quantized(m, tmp_path / "one")
    qformats.save_quantized(m, tmp_path / "sharded", max_shard_size=2_000_000)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    before = _logits(m)
    for d in ("one", "sharded"):
        assert torch.equal(_logits(_load(tmp_path / d)), before), d
        assert torch.equal(_logits(qformats.load_quantized(tmp_path / d)), before), d


@pytest.mark.parametrize("loaded", [False, True], ids=["quantize_model", "from_pretrained"])
def test_generate_compiles_the_decode_step(llama, tmp_path, loaded):
    """generate() with a static cache and a compile_config compiles its decode step for a qformats
    model, quantized in memory or loaded (transformers does so only where the model's
    hf_quantizer says it is compileable, and otherwise runs eager with a log line alone): dynamo
    traces the whole step with fullgraph (a recording backend that runs the traced graph as it is),
    and the tokens equal an eager generate()'s."""
    from transformers import CompileConfig

    m = _quantized(llama, format="q4_0")
    if loaded:
        m.save_pretrained(tmp_path)
        m = _load(tmp_path)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = IDS[:1, :8]
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0)
    eager = m.generate(ids, disable_compile=True, **kw)
    cfg = CompileConfig(backend=backend, fullgraph=True, mode=None)
    cfg._compile_all_devices = True  # transformers compiles on CUDA only unless told
    torch._dynamo.reset()
    try:
        compiled = m.generate(ids, compile_config=cfg, **kw)
    finally:
        torch._dynamo.reset()
    assert graphs, "generate() ran its decode step without compiling it"
    assert torch.equal(compiled, eager)


def test_sharded_save_pretrained(llama, tmp_path):
    m = _quantized(llama, format="nf4")
    m.save_pretrained(tmp_path, max_shard_size="3MB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert torch.equal(_logits(_load(tmp_path)), _logits(m))


def test_load_quantized_then_save_pretrained_keeps_the_weights(llama, tmp_path):
    """The path that once loaded random weights: load_quantized -> save_pretrained ->
    from_pretrained."""
    m = _quantized(llama, bits=4)
    qformats.save_quantized(m, tmp_path / "q")
    back = qformats.load_quantized(tmp_path / "q")
    back.save_pretrained(tmp_path / "hf")
    assert torch.equal(_logits(_load(tmp_path / "hf")), _logits(m))
    # and load_quantized reads a save_pretrained folder too
    assert torch.equal(_logits(qformats.load_quantized(tmp_path / "hf")), _logits(m))


def test_cli_quantize_output_loads_with_from_pretrained(llama, tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "qformats.cli", "quantize", str(LLAMA), "--out", str(out),
                        "--bits", "4", "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = qformats.load_quantized(out)
    got = _load(out)
    assert sum(isinstance(x, QuantizedLinear) for x in got.modules()) == 42
    assert torch.equal(_logits(got), _logits(ref))


@pytest.fixture()
def saved(llama, tmp_path):
    m = _quantized(llama, bits=4)
    m.save_pretrained(tmp_path)
    return tmp_path


def _edit_weights(d, fn):
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_missing_packed_weight_raises(saved):
    _edit_weights(saved, lambda t: t.pop("model.layers.2.mlp.up_proj.qweight"))
    with pytest.raises(ValueError, match=r"does not hold.*model\.layers\.2\.mlp\.up_proj\.qweight"):
        _load(saved)


def test_mismatched_packed_weight_raises(saved):
    def shrink(t):
        t["model.layers.1.self_attn.q_proj.scales"] = t["model.layers.1.self_attn.q_proj.scales"][:-1]
    _edit_weights(saved, shrink)
    with pytest.raises(ValueError, match=r"q_proj\.scales.*records"):
        _load(saved)


def test_retyped_packed_weight_raises(saved):
    def retype(t):
        k = "model.layers.0.mlp.gate_proj.scales"
        t[k] = t[k].to(torch.float64)
    _edit_weights(saved, retype)
    with pytest.raises(ValueError, match=r"gate_proj\.scales.*float64.*records"):
        _load(saved)


def test_float_weights_under_a_quantized_config_raise(llama, saved):
    """A float checkpoint whose config.json claims qformats layers: the packed tensors are
    missing, so loading refuses instead of initializing them at random."""
    (saved / "model.safetensors").unlink()
    import shutil

    for f in LLAMA.glob("model*.safetensors*"):
        shutil.copy(f, saved / f.name)
    with pytest.raises(ValueError, match="does not hold the packed weight"):
        _load(saved)


def test_config_without_layers_raises(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "qformats", "bits": 4}
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lists no quantized layers"):
        _load(saved)


def test_import_qformats_registers_without_importing_transformers():
    code = ("import sys, importlib.util, qformats; "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules; "
            "assert importlib.util.find_spec('transformers.modeling_utils') is not None; "  # a check
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING; "           # is no import
            "import transformers.modeling_utils; "
            "assert AUTO_QUANTIZER_MAPPING['qformats'].__name__ == 'QFormatsHfQuantizer'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_import_qformats_registers_lora_with_peft():
    pytest.importorskip("peft")
    for order in ("import qformats, peft", "import peft, qformats"):
        code = (f"import importlib.util; assert importlib.util.find_spec('peft'); {order}; "
                "from peft.tuners.lora.model import LoraModel; "
                "assert LoraModel.__dict__['_create_new_module'].__func__._qformats_lora")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (order, r.stderr[-2000:])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_from_pretrained_peak_memory():
    """Peak host memory while from_pretrained loads a quantized folder (and runs a first
    forward, which reads every weight page) <= 1.2x the packed weights plus the unquantized
    tensors (benchmarks/hf_load_memory.py, on a smaller model)."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_load_memory.py"
    r = subprocess.run([sys.executable, str(bench), "--hidden", "1024", "--layers", "4", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["quantized_layers"] == 28
    assert m["anon_ratio"] <= 1.2 and m["rss_ratio"] <= 1.2 and m["rss_forward_ratio"] <= 1.2, m


@pytest.mark.skipif(not torch.cuda.is_available() or not qformats.cuda_available(),
                    reason="no CUDA device / CUDA build")
@pytest.mark.parametrize("fmt", ["int4", "nf4", "q4_0", "mixed2bit"])
def test_cuda_from_pretrained_identical_logits(tmp_path, fmt):
    """On the GPU (a random Llama: ../shared does not reach the GPU machine): quantize there,
    save_pretrained, from_pretrained(device_map="cuda"): the packed buffers land on the GPU
    and the logits equal the in-memory model's; quantize on load onto the GPU gives the same
    bytes as quantize_model there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "f32")
    m = _load(tmp_path / "f32", dtype=torch.float32).cuda()
    qformats.quantize_model(m, **CHOICES[fmt])
    ids = IDS[:, :32].remainder(1024).cuda()
    before = _logits(m, ids)
    m.save_pretrained(tmp_path / "q")
    back = _load(tmp_path / "q", device_map="cuda")
    q = back.model.layers[0].mlp.up_proj
    assert isinstance(q, QuantizedLinear) and q._buffers[q.buffer_names[0]].is_cuda
    assert torch.equal(_logits(back, ids), before)
    got = _load(tmp_path / "f32", dtype=torch.float32, device_map="cuda",
                quantization_config=QFormatsConfig(**CHOICES[fmt]))
    for name, x in got.named_modules():
        if isinstance(x, QuantizedLinear):
            ref = m.get_submodule(name)
            assert all(torch.equal(getattr(x, b), getattr(ref, b)) for b in x.buffer_names), name
    assert torch.equal(_logits(got, ids), before)


def test_layers_swapped_by_hand_still_save(tmp_path):
    """QuantizedLinear layers put in by hand (no quantize_model, no attach), and a layer
    changed after quantize_model: save_pretrained records them, from_pretrained rebuilds them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).eval()
    mlp = m.model.layers[1].mlp
    mlp.up_proj = QuantizedLinear.from_linear(mlp.up_proj, "q4_0")
    ids = torch.randint(0, 256, (1, 10))
    m.save_pretrained(tmp_path / "a")
    back = _load(tmp_path / "a")
    assert isinstance(back.model.layers[1].mlp.up_proj, QuantizedLinear)
    assert torch.equal(_logits(back, ids), _logits(m, ids))
    mlp.down_proj = QuantizedLinear.from_linear(mlp.down_proj, "int8")  # after attach
    m.save_pretrained(tmp_path / "b")
    assert torch.equal(_logits(_load(tmp_path / "b"), ids), _logits(m, ids))
