"""bitsandbytes 4-bit (nf4) checkpoints as transformers writes them: qformats.bnb.load_bnb /
save_bnb and the tensor-level from_bnb_state / to_bnb_state.

Without bitsandbytes (CI's default): the tensor round trip (Hypothesis), the file layout against
transformers' BitsAndBytesConfig, save_bnb -> load_bnb (identical bytes and logits) and the
refusals. With bitsandbytes (the ``compat`` extra; its CPU backend): checkpoints written by
transformers + bitsandbytes themselves are loaded and compared byte for byte, and qformats'
exports are loaded by transformers + bitsandbytes.
"""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

import qformats  # noqa: E402
from qformats import nf4  # noqa: E402
from qformats.bnb import from_bnb_state, load_bnb, save_bnb, to_bnb_state  # noqa: E402
from qformats.nn import QuantizedLinear, quantized_linears  # noqa: E402
from conftest import SHARED  # noqa: E402  (tests/conftest.py: ../shared beside the repository)
from strategies import assert_bytes_equal  # noqa: E402

QS = "weight.quant_state.bitsandbytes__nf4"
LLAMA = SHARED / "models" / "pydoc-llama-17m"


def _bnb_cpu_reason():
    """None when transformers can quantize / load bitsandbytes 4-bit models on this CPU, else
    why not."""
    try:
        import accelerate  # noqa: F401
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        return f"bitsandbytes / accelerate not installed ({e.name})"
    from transformers.integrations import validate_bnb_backend_availability

    if not validate_bnb_backend_availability(raise_exception=False):
        return "the installed bitsandbytes has no backend for this machine's devices"
    return None


needs_bnb = pytest.mark.skipif(_bnb_cpu_reason() is not None, reason=str(_bnb_cpu_reason()))
needs_llama = pytest.mark.skipif(not (LLAMA / "config.json").is_file(),
                                 reason=f"shared test model not found under {SHARED}")


@pytest.fixture(autouse=True, scope="module")
def _eager():
    # bitsandbytes wraps CPU fallbacks in torch.compile (seconds per shape here); eager runs
    # the same float32 ops.
    with torch._dynamo.config.patch(disable=True):
        yield


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _same_qlinear(a, b):
    assert (a.format, a.params, a.weight_dtype, a.buffer_names) == (b.format, b.params, b.weight_dtype,
                                                                     b.buffer_names)
    for n in a.buffer_names:
        assert_bytes_equal(getattr(a, n), getattr(b, n))


# -- tensor level (no bitsandbytes) -----------------------------------------------------------

@settings(max_examples=40)
@given(out_f=st.integers(1, 9), in_f=st.integers(1, 300), blocksize=st.sampled_from([32, 64, 128, 256]),
       cs=st.booleans(), dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       storage=st.sampled_from(["uint8", "float16", "float32"]), seed=st.integers(0, 2**16))
def test_tensor_round_trip(out_f, in_f, blocksize, cs, dtype, storage, seed):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=False).to(getattr(torch, dtype))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 3)
    q = QuantizedLinear.from_linear(lin, "nf4", blocksize=blocksize, compress_statistics=cs)
    size = torch.empty((), dtype=getattr(torch, storage)).element_size()
    if q.packed.numel() % size:
        with pytest.raises(ValueError, match="whole number"):
            to_bnb_state(q, quant_storage=storage)
        return
    t = to_bnb_state(q, quant_storage=storage)
    n = out_f * in_f
    assert t["weight"].dtype == getattr(torch, storage)
    assert tuple(t["weight"].shape) == ((n + 1) // 2 // size, 1)
    # the first value of the row-major [out, in] weight is the high nibble of byte 0
    codes = t["weight"].reshape(-1).view(torch.uint8)
    w32 = nf4.dequantize(q.quantized_weight, dtype="float32").reshape(-1)
    absmax0 = float(nf4.decoded_absmax(q.quantized_weight)[0])
    assert float(w32[0]) == float(np.float32(nf4.CODE[int(codes[0]) >> 4]) * np.float32(absmax0))
    assert sorted(t) == sorted(["weight", "weight.absmax", "weight.quant_map", QS]
                               + (["weight.nested_absmax", "weight.nested_quant_map"] if cs else []))
    meta = json.loads(bytes(t[QS].numpy()))
    assert meta["shape"] == [out_f, in_f] and meta["dtype"] == dtype and meta["blocksize"] == blocksize
    # no two tensors share memory (safetensors refuses that)
    ptrs = [v.untyped_storage().data_ptr() for v in t.values()]
    assert len(set(ptrs)) == len(ptrs)
    bufs, params = from_bnb_state(t, (out_f, in_f))
    assert params == q.params
    assert list(bufs) == list(q.buffer_names)
    for k, v in bufs.items():
        assert_bytes_equal(v, getattr(q, k))


def _qlinear(cs=False, shape=(8, 96), blocksize=64):
    torch.manual_seed(1)
    lin = torch.nn.Linear(shape[1], shape[0], bias=False)
    return QuantizedLinear.from_linear(lin, "nf4", blocksize=blocksize, compress_statistics=cs)


def test_from_bnb_state_refuses_bad_input():
    t = to_bnb_state(_qlinear(cs=True))
    with pytest.raises(ValueError, match=r"shape \[8, 96\] differs from the layer's \[96, 8\]"):
        from_bnb_state(t, (96, 8))
    fp4 = dict(t)
    fp4["weight.quant_state.bitsandbytes__fp4"] = fp4.pop(QS)
    with pytest.raises(ValueError, match="'fp4' is not supported"):
        from_bnb_state(fp4, (8, 96))
    missing = {k: v for k, v in t.items() if k != "weight.nested_absmax"}
    with pytest.raises(ValueError, match="missing \\['weight.nested_absmax'\\]"):
        from_bnb_state(missing, (8, 96))
    short = dict(t, weight=t["weight"][:-1])
    with pytest.raises(ValueError, match="weight: expected \\[384, 1\\]"):
        from_bnb_state(short, (8, 96))
    bad_map = dict(t, **{"weight.quant_map": t["weight.quant_map"].flip(0).contiguous()})
    with pytest.raises(ValueError, match="quant_map: differs"):
        from_bnb_state(bad_map, (8, 96))
    wrong_absmax = dict(t, **{"weight.absmax": t["weight.absmax"].float()})
    with pytest.raises(ValueError, match="weight.absmax: expected uint8 \\[12\\], got float32"):
        from_bnb_state(wrong_absmax, (8, 96))
    j = json.loads(bytes(t[QS].numpy()))
    j["nested_blocksize"] = 128
    nb = dict(t, **{QS: torch.tensor(list(json.dumps(j).encode()), dtype=torch.uint8)})
    with pytest.raises(ValueError, match="nested_blocksize must be 256"):
        from_bnb_state(nb, (8, 96))
    with pytest.raises(ValueError, match="expected an nf4 QuantizedLinear, got 'int4'"):
        to_bnb_state(QuantizedLinear.from_linear(torch.nn.Linear(64, 8), "int4", group_size=32))


# -- model level without bitsandbytes ----------------------------------------------------------

def _quantized_tiny(make_tiny_llama, cs, tie=False):
    if tie:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).eval()
    else:
        m = make_tiny_llama()
    qformats.quantize_model(m, format="nf4", blocksize=64, compress_statistics=cs)
    return m


@pytest.mark.parametrize("cs", [False, True])
def test_save_load_round_trip(make_tiny_llama, tmp_path, cs):
    from transformers import BitsAndBytesConfig

    m = _quantized_tiny(make_tiny_llama, cs)
    for p in m.parameters():  # float16 parameters, float32 rotary buffer: as from_pretrained
        p.data = p.data.half()
    save_bnb(m, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    want = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=cs,
                              bnb_4bit_compute_dtype=torch.float32,
                              llm_int8_skip_modules=["lm_head"]).to_dict()
    assert cfg["quantization_config"] == want
    assert cfg["dtype"] == "float16"
    stored = load_file(str(tmp_path / "model.safetensors"))
    up = "model.layers.0.mlp.up_proj."
    assert stored[up + "weight"].dtype == torch.uint8 and tuple(stored[up + "weight"].shape) == (64 * 128 // 2, 1)
    assert stored[up + "weight.absmax"].dtype == (torch.uint8 if cs else torch.float32)
    assert_bytes_equal(stored[up + "weight.quant_map"], torch.from_numpy(np.asarray(nf4.CODE, np.float32)))
    meta = json.loads(bytes(stored[up + QS].numpy()))
    assert list(meta) == ["quant_type", "blocksize", "dtype", "shape"] + (
        ["nested_blocksize", "nested_dtype", "nested_offset"] if cs else [])
    assert meta["shape"] == [128, 64] and meta["dtype"] == "float32"
    assert not any(k.endswith((".packed", ".absmax2", ".offset")) for k in stored)

    back = load_bnb(tmp_path)
    ours = dict(quantized_linears(m))
    theirs = dict(quantized_linears(back))
    assert sorted(ours) == sorted(theirs) and len(ours) == 14
    for name in ours:
        _same_qlinear(ours[name], theirs[name])
    assert back.model.embed_tokens.weight.dtype == torch.float16
    assert not hasattr(back.config, "quantization_config")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(back, ids), _logits(m, ids))
    f32 = load_bnb(tmp_path, dtype="float32")
    assert f32.model.embed_tokens.weight.dtype == torch.float32
    assert f32.model.layers[0].mlp.up_proj.packed.dtype == torch.uint8


def test_round_trip_sharded_and_tied(make_tiny_llama, tmp_path):
    m = _quantized_tiny(make_tiny_llama, cs=False, tie=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    save_bnb(m, tmp_path / "one")
    stored = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert "lm_head.weight" not in stored  # tied: stored once, as transformers does
    # shard it the way transformers does: two files and an index
    keys = sorted(stored)
    shard = tmp_path / "two"
    shutil.copytree(tmp_path / "one", shard)
    (shard / "model.safetensors").unlink()
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, ks in halves.items():
        save_file({k: stored[k] for k in ks}, str(shard / fname), metadata={"format": "pt"})
    (shard / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    back = load_bnb(shard)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_logits(back, ids), _logits(m, ids))


def _rewrite(folder, drop=(), add=None, rename=None, config=None):
    p = folder / "model.safetensors"
    t = load_file(str(p))
    for k in drop:
        del t[k]
    for old, new in (rename or {}).items():
        t[new] = t.pop(old)
    t.update(add or {})
    save_file(t, str(p), metadata={"format": "pt"})
    if config:
        c = json.loads((folder / "config.json").read_text())
        c["quantization_config"].update(config)
        (folder / "config.json").write_text(json.dumps(c))


def test_load_bnb_refuses_bad_checkpoints(make_tiny_llama, tmp_path):
    m = _quantized_tiny(make_tiny_llama, cs=True)
    save_bnb(m, tmp_path / "ok")
    up = "model.layers.0.mlp.up_proj."

    def case(name, **kw):
        d = tmp_path / name
        shutil.copytree(tmp_path / "ok", d)
        _rewrite(d, **kw)
        return d

    with pytest.raises(ValueError, match="bnb_4bit_quant_type 'fp4' is not supported"):
        load_bnb(case("fp4cfg", config={"bnb_4bit_quant_type": "fp4"}))
    with pytest.raises(ValueError, match="up_proj.*'fp4' is not supported"):
        load_bnb(case("fp4key", rename={up + QS: up + "weight.quant_state.bitsandbytes__fp4"}))
    with pytest.raises(ValueError, match="8-bit"):
        load_bnb(case("int8", config={"load_in_4bit": False, "_load_in_4bit": False, "load_in_8bit": True}))
    with pytest.raises(ValueError, match=r"up_proj.*missing \['weight.nested_absmax'\]"):
        load_bnb(case("miss_q", drop=[up + "weight.nested_absmax"]))
    with pytest.raises(ValueError, match="missing tensor.*'model.norm.weight'"):
        load_bnb(case("miss_f", drop=["model.norm.weight"]))
    with pytest.raises(ValueError, match="'model.extra' that the LlamaForCausalLM model does not have"):
        load_bnb(case("extra", add={"model.extra": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[63\]"):
        load_bnb(case("shape_f", add={"model.norm.weight": torch.ones(63)}))
    bad = to_bnb_state(_qlinear(cs=True, shape=(64, 128)))[QS]  # the JSON of a [64, 128] weight
    with pytest.raises(ValueError, match=r"up_proj.*shape \[64, 128\] differs from the layer's \[128, 64\]"):
        load_bnb(case("shape_q", add={up + QS: bad}))
    with pytest.raises(ValueError, match="no bitsandbytes quantization_config"):
        load_bnb(case("other", config={"quant_method": "gptq"}))
    (tmp_path / "nofile").mkdir()
    shutil.copy(tmp_path / "ok" / "config.json", tmp_path / "nofile" / "config.json")
    with pytest.raises(ValueError, match="neither model.safetensors"):
        load_bnb(tmp_path / "nofile")


def test_save_bnb_refuses_other_formats(make_tiny_llama, tmp_path):
    m = make_tiny_llama()
    qformats.quantize_model(m, format="nf4", blocksize=64, overrides={"*.down_proj": {"format": "int4"}})
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj \\(int4\\)"):
        save_bnb(m, tmp_path / "a")
    with pytest.raises(ValueError, match="no nf4 QuantizedLinear"):
        save_bnb(make_tiny_llama(), tmp_path / "b")
    with pytest.raises(ValueError, match="no Hugging Face config"):
        save_bnb(torch.nn.Sequential(_qlinear()), tmp_path / "c")
    assert not (tmp_path / "a").exists()


# -- against bitsandbytes itself (CPU backend) ------------------------------------------------

@pytest.fixture(scope="module", params=[False, True], ids=["plain", "double_quant"])
def bnb_checkpoint(request, tmp_path_factory):
    """pydoc-llama-17m quantized by transformers + bitsandbytes on the CPU and saved with
    save_pretrained (double quant: sharded into 4 MB files). (folder, bitsandbytes model)."""
    reason = _bnb_cpu_reason()
    if reason:
        pytest.skip(reason)
    if not (LLAMA / "config.json").is_file():
        pytest.skip(f"shared test model not found under {SHARED}")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dq = request.param
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=dq,
                             bnb_4bit_compute_dtype=torch.float32)
    with torch._dynamo.config.patch(disable=True):
        model = AutoModelForCausalLM.from_pretrained(LLAMA, quantization_config=cfg, device_map="cpu")
        d = tmp_path_factory.mktemp("bnb")
        model.save_pretrained(d, **({"max_shard_size": "4MB"} if dq else {}))
    assert (d / "model.safetensors.index.json").is_file() == dq
    return d, model, dq


def _linear4bit(model):
    import bitsandbytes as bnb

    return {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _exact_bnb(model):
    """bitsandbytes >= 0.48 on a CPU with AVX-512 BF16 runs an eval-mode Linear4bit through a
    repacked weight in bfloat16 (``Linear4bit.support_avx512bf16_for_cpu``; ~1% of a logit apart
    after 6 layers); turned off, it dequantizes and multiplies in the model's dtype, the path
    the logit tolerances below are for. Without AVX-512 BF16 the flag is already False."""
    for lin in _linear4bit(model).values():
        if getattr(lin, "support_avx512bf16_for_cpu", False):
            lin.support_avx512bf16_for_cpu = False
    return model


def test_load_bnb_same_bytes_as_bitsandbytes(bnb_checkpoint):
    from transformers import AutoModelForCausalLM

    d, ref, dq = bnb_checkpoint
    ours = load_bnb(d)
    theirs = _linear4bit(ref)
    q = dict(quantized_linears(ours))
    assert sorted(q) == sorted(theirs) and len(q) == 42  # 6 layers x 7; lm_head stays float
    orig = AutoModelForCausalLM.from_pretrained(LLAMA)  # the float16 weights bnb quantized
    for name, lin in theirs.items():
        s = lin.weight.quant_state
        mine = q[name]
        assert mine.params == {"blocksize": 64, "quant_type": "nf4", "compress_statistics": dq}
        assert mine.weight_dtype == "float16"
        assert_bytes_equal(mine.packed, lin.weight.data.reshape(-1))
        assert_bytes_equal(mine.absmax, s.absmax)
        if dq:
            assert_bytes_equal(mine.absmax2, s.state2.absmax)
            assert_bytes_equal(mine.offset, s.offset.reshape(1))
        # and qformats' own quantizer makes the same bytes from the float16 weight
        w = orig.get_submodule(name).weight.detach()
        mine_q = nf4.quantize(w, blocksize=64, compress_statistics=dq)
        for k, v in mine_q.buffers.items():
            assert_bytes_equal(v, getattr(mine, k))
    sd_ref = ref.state_dict()
    for k, t in ours.state_dict().items():
        if k in sd_ref and not any(k.startswith(n + ".") for n in q):
            assert_bytes_equal(t, sd_ref[k])


def test_load_bnb_decodes_and_runs_like_bitsandbytes(bnb_checkpoint):
    import bitsandbytes.functional as F

    d, ref, dq = bnb_checkpoint
    ours = load_bnb(d)
    q = dict(quantized_linears(ours))
    for name, lin in _linear4bit(ref).items():
        s32 = copy.copy(lin.weight.quant_state)
        s32.dtype = torch.float32  # decode in float32 (see tests/nf4/test_nf4_bitsandbytes.py)
        want = F.dequantize_4bit(lin.weight.data, s32)
        assert_bytes_equal(nf4.dequantize(q[name].quantized_weight, dtype="float32"), want)
    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(0))
    a, b = _logits(ours, ids), _logits(_exact_bnb(ref), ids)
    assert a.dtype == b.dtype == torch.float16
    # Not bit-equal: bitsandbytes' CPU matmul (no AVX-512 BF16: dequantize to float32, then
    # torch.nn.functional.linear) and qformats' native kernel sum the same float32 products in
    # different orders, and each layer rounds to float16, so a different last bit sometimes
    # propagates. Measured: max |diff| ~ 1 float16 ulp of the largest logits (~0.008 at ~10).
    diff = (a.float() - b.float()).abs()
    assert diff.max() <= 0.05 and diff.mean() <= 2e-3, (diff.max(), diff.mean())
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.98


@needs_bnb
@needs_llama
@pytest.mark.parametrize("cs", [False, True])
def test_export_loads_in_bitsandbytes(llama, tmp_path, cs):
    from transformers import AutoModelForCausalLM

    m = copy.deepcopy(llama.model)
    qformats.quantize_model(m, format="nf4", blocksize=64, compress_statistics=cs)
    save_bnb(m, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()  # copied from the source folder
    with torch._dynamo.config.patch(disable=True):
        ref = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu")
        theirs = _linear4bit(ref)
        q = dict(quantized_linears(m))
        assert sorted(theirs) == sorted(q)
        for name, lin in theirs.items():
            s = lin.weight.quant_state
            assert_bytes_equal(lin.weight.data.reshape(-1), q[name].packed)
            assert_bytes_equal(s.absmax, q[name].absmax)
            assert s.nested == cs and s.dtype == torch.float32 and s.blocksize == 64
        assert type(ref.lm_head) is torch.nn.Linear
        ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(1))
        a, b = _logits(m, ids), _logits(_exact_bnb(ref), ids)
    assert a.dtype == b.dtype == torch.float32
    # float32 throughout: the same decoded weights, summed in different orders (measured max
    # |diff| ~6e-6 at |logit| ~10)
    assert (a - b).abs().max() <= 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))
