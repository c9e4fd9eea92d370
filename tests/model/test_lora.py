"""LoRA (PEFT) on QuantizedLinear: qformats.lora's layer and registration. A small random net
quantized by quantize_model: the PEFT-initialized adapter (lora_B = 0) leaves the output equal
to the quantized net's; LoRA gradients equal those of the same adapters on the dequantized float
net (so they pass through the operator's backward); the packed bytes never change; disabled
adapters, several adapters, mixed batches, adapter dtypes, saving and loading adapters; merging
refused; errors. Then pydoc-llama-17m: a few AdamW steps lower the loss on a fixed batch."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import qformats  # noqa: E402
import qformats.lora  # noqa: E402
from qformats.nn import QuantizedLinear  # noqa: E402

#: int4 through bits=4 (what the brief's users call), nf4 (QLoRA's format) and the other formats.
QUANT = [{"bits": 4}, {"format": "nf4"}, {"format": "q4_0"}, {"format": "int8"}, {"format": "mixed2bit"}]
QIDS = ["int4-bits4", "nf4", "q4_0", "int8", "mixed2bit"]
TARGETS = ["0", "2"]  # small_net's two Linears: [256 -> 128, bias] and [128 -> 64, no bias]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    qformats.lora.register()


def _quantized_net(make_small_net, quant, dtype=torch.float32):
    """small_net (seeded) quantized by quantize_model: equal nets on every call. (A second
    call stands in for copy.deepcopy, which a QuantizedLinear bound to a native kernel does not
    support.)"""
    net = make_small_net().to(dtype)
    report = qformats.quantize_model(net, **quant)
    assert isinstance(net[0], QuantizedLinear) and isinstance(net[2], QuantizedLinear), report
    return net


def _lora(net, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(target_modules=TARGETS, r=4, lora_alpha=8)
    cfg.update(kw)
    return peft.get_peft_model(net, peft.LoraConfig(**cfg))


def _packed(model) -> dict:
    """Every packed buffer's bytes (a copy), by module name and buffer name."""
    return {(name, b): getattr(m, b).detach().contiguous().view(torch.uint8).clone()
            for name, m in model.named_modules() if isinstance(m, QuantizedLinear) for b in m.buffer_names}


def _randomize_b(pm, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _float_twin(qnet):
    """A Sequential like ``qnet`` with every QuantizedLinear replaced by an nn.Linear holding
    its dequantized float32 weight (and its bias)."""
    layers = []
    for m in qnet:
        if isinstance(m, QuantizedLinear):
            lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            with torch.no_grad():
                lin.weight.copy_(m.dequantize_weight(torch.float32))
                if m.bias is not None:
                    lin.bias.copy_(m.bias)
            m = lin
        else:
            m = copy.deepcopy(m)
        layers.append(m)
    return torch.nn.Sequential(*layers)


def test_import_does_not_import_peft():
    code = "import sys, qformats, qformats.lora, qformats.nn; assert 'peft' not in sys.modules, 'peft imported'"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("quant", QUANT, ids=QIDS)
def test_wraps_and_starts_at_base_output(make_small_net, quant):
    net, ref = _quantized_net(make_small_net, quant), _quantized_net(make_small_net, quant)
    originals = {t: net[int(t)] for t in TARGETS}
    pm = _lora(net)
    for t in TARGETS:
        layer = pm.base_model.model[int(t)]
        assert isinstance(layer, qformats.lora.QuantizedLoraLinear)
        assert layer.get_base_layer() is originals[t]  # wrapped, not copied
        assert not torch.any(layer.lora_B["default"].weight)  # PEFT's init: B = 0
        assert torch.any(layer.lora_A["default"].weight)
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    assert len(trainable) == 4
    assert not pm.base_model.model[0].base_layer.bias.requires_grad  # the base bias is frozen
    x = torch.randn(3, 256)
    assert torch.equal(pm(x), ref(x))
    assert "lora.QuantizedLoraLinear" in repr(pm)


@pytest.mark.parametrize("quant", QUANT[:2], ids=QIDS[:2])
def test_gradients_match_the_dequantized_float_net(make_small_net, quant):
    net = _quantized_net(make_small_net, quant)
    twin = _float_twin(net)
    pm, pf = _lora(net), _lora(twin)
    _randomize_b(pm)
    with torch.no_grad():  # the same adapters on both
        for n, p in pf.named_parameters():
            if "lora_" in n:
                p.copy_(pm.get_parameter(n))
    x = torch.randn(5, 256, requires_grad=True)
    xf = x.detach().clone().requires_grad_()
    yq, yf = pm(x), pf(xf)
    torch.testing.assert_close(yq, yf, rtol=1e-4, atol=1e-5)
    (yq.square().mean()).backward()
    (yf.square().mean()).backward()
    # Layer 0's adapter gets its gradient through the quantized layer 2 (the operator's backward).
    names = [n for n, p in pm.named_parameters() if p.requires_grad]
    for n in names:
        g, gf = pm.get_parameter(n).grad, pf.get_parameter(n).grad
        assert g is not None and torch.any(g != 0), n
        torch.testing.assert_close(g, gf, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(x.grad, xf.grad, rtol=1e-4, atol=1e-6)
    for m in pm.modules():
        if isinstance(m, QuantizedLinear):
            assert all(getattr(m, b).grad is None and not getattr(m, b).requires_grad for b in m.buffer_names)


@pytest.mark.parametrize("quant", QUANT[:2], ids=QIDS[:2])
def test_training_leaves_packed_bytes_and_disable_gives_base(make_small_net, quant):
    net, ref = _quantized_net(make_small_net, quant), _quantized_net(make_small_net, quant)
    pm = _lora(net, lora_dropout=0.1)
    before = _packed(pm)
    assert len(before) == sum(len(m.buffer_names) for m in ref.modules() if isinstance(m, QuantizedLinear))
    lora0 = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    bias0 = pm.base_model.model[0].base_layer.bias.detach().clone()
    x, target = torch.randn(8, 256), torch.randn(8, 64)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    pm.train()
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(pm(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
    pm.eval()
    after = _packed(pm)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k
    assert torch.equal(pm.base_model.model[0].base_layer.bias, bias0)
    for n, p in pm.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, lora0[n]), n  # A and B both moved
    y = pm(x)
    assert not torch.allclose(y, ref(x))
    with pm.disable_adapter():
        assert torch.equal(pm(x), ref(x))
    assert torch.equal(pm(x), y)


def test_merge_refused_and_unload(make_small_net):
    net, ref = (_quantized_net(make_small_net, {"format": "nf4"}) for _ in range(2))
    pm = _lora(net)
    _randomize_b(pm)
    x = torch.randn(4, 256)
    y = pm(x)
    layer = pm.base_model.model[0]
    with pytest.raises(NotImplementedError, match="quantize the weight again"):
        layer.merge()
    with pytest.raises(NotImplementedError, match="nf4"):
        pm.merge_and_unload()
    assert not layer.merged and isinstance(pm.base_model.model[0], qformats.lora.QuantizedLoraLinear)
    assert torch.equal(pm(x), y)  # nothing changed
    with pytest.warns(UserWarning, match="Already unmerged"):
        layer.unmerge()
    # The documented float merge: dequantized weight + delta gives the adapted layer's output.
    base = layer.get_base_layer()
    delta = layer.get_delta_weight("default")
    assert delta.shape == (base.out_features, base.in_features) and torch.any(delta != 0)
    merged = base.dequantize_weight(torch.float32) + delta
    torch.testing.assert_close(torch.nn.functional.linear(x, merged, base.bias), layer(x), rtol=1e-4, atol=1e-5)
    before = _packed(pm)
    plain = pm.unload()
    assert plain[0] is base and isinstance(plain[2], QuantizedLinear)
    after = _packed(plain)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after.values(), before.values()))
    assert torch.equal(plain(x), ref(x))


def test_several_adapters_and_mixed_batch(make_small_net):
    net, ref = (_quantized_net(make_small_net, {"bits": 4}) for _ in range(2))
    pm = _lora(net)
    pm.add_adapter("second", peft.LoraConfig(target_modules=TARGETS, r=2, lora_alpha=2))
    _randomize_b(pm)
    pm.eval()
    x = torch.randn(3, 256)
    base = ref(x)
    pm.set_adapter("default")
    y1 = pm(x)
    pm.set_adapter("second")
    y2 = pm(x)
    assert not torch.allclose(y1, y2) and not torch.allclose(y1, base)
    pm.base_model.set_adapter(["default", "second"])  # both active: their outputs add up
    both = pm(x)
    # Not layer-wise additive through the GELU, so compare one layer.
    layer, xl = pm.base_model.model[0], torch.randn(2, 256)
    b0 = layer.get_base_layer()(xl)
    d1 = layer.lora_B["default"](layer.lora_A["default"](xl)) * layer.scaling["default"]
    d2 = layer.lora_B["second"](layer.lora_A["second"](xl)) * layer.scaling["second"]
    torch.testing.assert_close(layer(xl), b0 + d1 + d2, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(both, y1) and not torch.allclose(both, y2)
    mixed = pm(x, adapter_names=["default", "second", "__base__"])
    torch.testing.assert_close(mixed[0], y1[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed[1], y2[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed[2], base[2], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="Length of `adapter_names`"):
        pm(x, adapter_names=["default"])


def test_adapter_dtypes(make_small_net):
    # Adapters are made in the dtype the weight was quantized from; PEFT's
    # autocast_adapter_dtype (default) then makes float16 ones float32.
    net = _quantized_net(make_small_net, {"format": "nf4"}, dtype=torch.float16)
    net16 = _quantized_net(make_small_net, {"format": "nf4"}, dtype=torch.float16)
    pm16 = peft.get_peft_model(net16, peft.LoraConfig(target_modules=TARGETS, r=4),
                               autocast_adapter_dtype=False)
    assert pm16.base_model.model[0].lora_A["default"].weight.dtype == torch.float16
    pm = peft.get_peft_model(net, peft.LoraConfig(target_modules=TARGETS, r=4))
    layer = pm.base_model.model[0]
    assert layer.lora_A["default"].weight.dtype == torch.float32
    _randomize_b(pm)
    # float16 activations: the base computes in float16, the float32 adapter on x cast to float32,
    # its output cast back; the result is float16 and requires grad through the adapter.
    x = torch.randn(3, 256, dtype=torch.float16)
    y = layer(x)
    assert y.dtype == torch.float16 and y.requires_grad
    d = layer.lora_B["default"](layer.lora_A["default"](x.float())) * layer.scaling["default"]
    torch.testing.assert_close(y, (layer.get_base_layer()(x).float() + d).half(), rtol=2e-3, atol=2e-3)
    y.float().sum().backward()
    assert layer.lora_A["default"].weight.grad.dtype == torch.float32


def test_save_and_load_adapter(make_small_net, tmp_path):
    net, fresh = (_quantized_net(make_small_net, {"format": "nf4"}) for _ in range(2))
    pm = _lora(net)
    _randomize_b(pm)
    pm.eval()
    x = torch.randn(3, 256)
    pm.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved), list(saved)  # no packed weights in the adapter
    # PEFT makes this config itself: it reaches QuantizedLinear through register()'s hook.
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    assert isinstance(loaded.base_model.model[0], qformats.lora.QuantizedLoraLinear)
    assert torch.equal(loaded(x), pm(x))


def test_user_mapping_wins(make_small_net):
    class Mine(qformats.lora.QuantizedLoraLinear):
        pass

    net = _quantized_net(make_small_net, {"bits": 4})
    cfg = peft.LoraConfig(target_modules=TARGETS, r=4)
    cfg._register_custom_module({QuantizedLinear: Mine})
    pm = peft.get_peft_model(net, cfg)
    assert type(pm.base_model.model[0]) is Mine and type(pm.base_model.model[2]) is Mine


def test_register_is_idempotent():
    from peft.tuners.lora.model import LoraModel

    f = LoraModel.__dict__["_create_new_module"]
    r = LoraModel.__dict__["_replace_module"]
    qformats.lora.register()
    assert LoraModel.__dict__["_create_new_module"] is f and LoraModel.__dict__["_replace_module"] is r


def test_errors(make_small_net, monkeypatch):
    with pytest.raises(ValueError, match="plain LoRA only.*use_dora"):
        _lora(_quantized_net(make_small_net, {"bits": 4}), use_dora=True)
    with pytest.raises(ValueError, match="init_lora_weights='pissa'"):
        _lora(_quantized_net(make_small_net, {"bits": 4}), init_lora_weights="pissa")
    net = _quantized_net(make_small_net, {"bits": 4})
    cfg = peft.LoraConfig(target_modules=TARGETS, r=4)
    with pytest.raises(TypeError, match="wraps a qformats QuantizedLinear, got Linear"):
        qformats.lora.QuantizedLoraLinear(torch.nn.Linear(8, 8), "default", config=cfg, r=4)
    pm = _lora(net)
    with pytest.raises(ValueError, match=r"expected shape \[\.\.\., 256\]"):
        pm(torch.randn(3, 100))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        pm.base_model.model[0](torch.ones(3, 256, dtype=torch.float64))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        qformats.lora.nothing
    monkeypatch.setattr(peft, "__version__", "0.18.1")
    with pytest.raises(ImportError, match=r"needs peft>=0\.19, found 0\.18\.1"):
        qformats.lora._import_peft()
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'qformats\[lora\]'"):
        qformats.lora._import_peft()


def test_pydoc_llama_loss_drops(llama, valid_text):
    """QLoRA in small: pydoc-llama-17m, int4 (bits=4), LoRA on q_proj and v_proj, AdamW on one
    fixed batch of held-out text: the loss falls, the packed weights stay as they were."""
    model = copy.deepcopy(llama.model)
    report = qformats.quantize_model(model, bits=4)
    n_q = sum(isinstance(m, QuantizedLinear) for m in model.modules())
    assert n_q == 42, report  # 6 layers x 7 projections; lm_head stays float
    pm = _lora(model, target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16)
    wrapped = [m for m in pm.modules() if isinstance(m, qformats.lora.QuantizedLoraLinear)]
    assert len(wrapped) == 12
    before = _packed(pm)
    ids = llama.tokenizer(valid_text[:4000], return_tensors="pt").input_ids[0]
    batch = ids[:128].reshape(2, 64)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=5e-3)
    pm.train()
    with torch.no_grad():
        loss0 = pm(input_ids=batch, labels=batch).loss.item()
    for _ in range(4):
        loss = pm(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        loss1 = pm(input_ids=batch, labels=batch).loss.item()
    assert loss1 < 0.8 * loss0, (loss0, loss1)  # measured: 3.17 -> 1.31
    after = _packed(pm)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.skipif(not torch.cuda.is_available() or not qformats.cuda_available(),
                    reason="no CUDA device / CUDA build")
@pytest.mark.parametrize("fmt", ["int4", "nf4"])
def test_cuda_lora_steps(fmt):
    """QLoRA on the GPU (a random Llama, bf16 activations as QLoRA trains): gradients reach
    the adapters through the CUDA path, the loss on a fixed batch falls, packed bytes stay."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    qformats.quantize_model(model, **({"bits": 4, "group_size": 64} if fmt == "int4" else {"format": "nf4"}))
    pm = _lora(model, target_modules=["q_proj", "v_proj", "up_proj"], r=8, lora_alpha=16)
    before = _packed(pm)
    batch = torch.randint(0, 512, (4, 64), device="cuda", generator=None)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    pm.train()
    with torch.no_grad():
        loss0 = pm(input_ids=batch, labels=batch).loss.item()
    for _ in range(8):
        pm(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        loss1 = pm(input_ids=batch, labels=batch).loss.item()
    assert loss1 < 0.9 * loss0, (loss0, loss1)
    after = _packed(pm)
    assert all(torch.equal(after[k], before[k]) and after[k].is_cuda for k in before)
