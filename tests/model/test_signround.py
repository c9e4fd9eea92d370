"""method="signround": trainable rounding for int4 asymmetric groups (qformats.signround).

Small settings throughout (a tiny random Llama, a 2-block synthetic residual net, a few
samples of 16-32 tokens, <= 20 iterations), so the file runs in seconds."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qformats  # noqa: E402
from qformats import int4, mixed2bit  # noqa: E402
from qformats._core import validate  # noqa: E402
from qformats.nn import QuantizedLinear  # noqa: E402
from qformats import signround as sr  # noqa: E402
from qformats.int4 import rounding as int4_rounding  # noqa: E402
from qformats.mixed2bit import rounding as m2_rounding  # noqa: E402
from qformats.mixed2bit.reference import tiled_is4  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


# -- a tiny synthetic "transformer": embedding, 2 residual MLP blocks with a kwarg, a head ----

class _Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x, gate=None):
        y = self.down(F.gelu(self.up(x)))
        return x + (y * gate if gate is not None else y)


class _Net(nn.Module):
    def __init__(self, vocab=64, d=64, h=128, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([_Block(d, h), _Block(d, h)])
        self.lm_head = nn.Linear(d, vocab)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, d))

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.layers:
            x = b(x, gate=self.gate)
        return self.lm_head(x)


def _ids(n=4, L=16, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (L,), generator=g) for _ in range(n)]


def _weight(out_f=16, in_f=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[0, :32] = 0.0                      # an all-zero group: scale 0
    w[1, :32] = w[1, :32].abs() + 0.01   # a group without negative values (lo = 0)
    w[2, 32:] = -w[2, 32:].abs() - 0.01  # one without positive values (hi = 0)
    return w


def _random_params(w, gs, seed=3):
    g = torch.Generator().manual_seed(seed)
    v = torch.rand(w.shape, generator=g) - 0.5
    ng = w.shape[1] // gs
    a = 0.5 + 0.5 * torch.rand(w.shape[0], ng, generator=g)
    b = 0.5 + 0.5 * torch.rand(w.shape[0], ng, generator=g)
    return v, a, b


# -- the fake quantization and its export ----------------------------------------------------

def test_initial_parameters_are_int4_rtn_bit_for_bit():
    w = _weight()
    gs = 32
    v = torch.zeros_like(w)
    one = torch.ones(w.shape[0], w.shape[1] // gs)
    rtn = int4.quantize(w, group_size=gs)
    fq = int4_rounding.fake_quant_int4(w, v, one, one, gs)
    assert torch.equal(fq.view(torch.int32), rtn.dequantize("float32").view(torch.int32))
    qt = int4_rounding.export_int4(w, v, one, one, gs)
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(qt.buffers[name], rtn.buffers[name]), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_export_equals_trained_fake_quant(seed):
    w = _weight(seed=seed)
    gs = 32
    v, a, b = _random_params(w, gs, seed)
    fq = int4_rounding.fake_quant_int4(w, v, a, b, gs)
    qt = int4_rounding.export_int4(w, v, a, b, gs, dtype="float16")
    validate(qt)
    assert qt.params == {"group_size": gs, "symmetric": False} and qt.dtype == "float16"
    deq = int4.dequantize(qt, dtype="float32")
    assert torch.equal(deq.view(torch.int32), fq.view(torch.int32))  # bitwise
    assert (qt.buffers["scales"][0, 0] == 0) and (qt.buffers["zeros"][0, 0] == 0)
    # the packed layer computes what the fake-quantized one does
    bias = torch.randn(w.shape[0])
    lin = QuantizedLinear.from_quantized(qt, bias)
    x = torch.randn(5, w.shape[1])
    torch.testing.assert_close(lin(x), F.linear(x, fq, bias), rtol=1.3e-6, atol=1e-5)
    assert torch.equal(lin.dequantize_weight("float32").view(torch.int32), fq.view(torch.int32))


@pytest.mark.parametrize("scale_block", [16, 5])
def test_2bit_initial_parameters_are_mixed2bit_rtn_bit_for_bit(scale_block):
    w = _weight(24, 96)
    w[3, :16] = -0.0
    gs = 16
    v = torch.zeros_like(w)
    one = torch.ones(w.shape[0], w.shape[1] // gs)
    rtn = mixed2bit.quantize(w, group_size=gs, ratio_4bit=0.0, scale_block=scale_block)
    qt = m2_rounding.export_2bit(w, v, one, one, gs, scale_block)
    assert qt.params == rtn.params
    for name in rtn.buffers:
        assert torch.equal(qt.buffers[name], rtn.buffers[name]), name
    fq = m2_rounding.fake_quant_2bit(w, v, one, one, gs, scale_block)
    assert torch.equal(fq.view(torch.int32), rtn.dequantize("float32").view(torch.int32))


@pytest.mark.parametrize("seed", [0, 1])
def test_2bit_export_equals_trained_fake_quant(seed):
    w = _weight(24, 96, seed=seed)
    gs, sb = 16, 16 if seed == 0 else 7
    v, a, b = _random_params(w, gs, seed)
    fq = m2_rounding.fake_quant_2bit(w, v, a, b, gs, sb)
    qt = m2_rounding.export_2bit(w, v, a, b, gs, sb, dtype="float16")
    validate(qt)
    deq = mixed2bit.dequantize(qt, dtype="float32")
    assert torch.equal(deq.view(torch.int32), fq.view(torch.int32))  # bitwise
    bias = torch.randn(w.shape[0])
    lin = QuantizedLinear.from_quantized(qt, bias)
    x = torch.randn(5, w.shape[1])
    torch.testing.assert_close(lin(x), F.linear(x, fq, bias), rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("ratio,sb", [(0.1, 16), (0.25, 5), (1.0, 3)])
def test_mixed_initial_parameters_are_calibrated_mixed2bit_rtn_bit_for_bit(ratio, sb):
    w = _weight(24, 96)
    w[3, :16] = -0.0
    gs = 16
    sens = torch.rand(96, generator=torch.Generator().manual_seed(7)) * 3
    is4 = m2_rounding.select_4bit(w, gs, ratio, sens, sb)
    rtn = mixed2bit.quantize(w, group_size=gs, ratio_4bit=ratio, sensitivity=sens, scale_block=sb)
    assert int(is4.sum()) == rtn.params["n4"] > 0
    v = torch.zeros_like(w)
    one = torch.ones(w.shape[0], w.shape[1] // gs)
    qt = m2_rounding.export_mixed2bit(w, v, one, one, gs, sb, is4, ratio, "sensitivity")
    assert qt.params == rtn.params
    for name in rtn.buffers:
        assert torch.equal(qt.buffers[name], rtn.buffers[name]), name
    fq = m2_rounding.fake_quant_mixed2bit(w, v, one, one, gs, sb, is4)
    assert torch.equal(fq.view(torch.int32), rtn.dequantize("float32").view(torch.int32))


@pytest.mark.parametrize("seed,ratio,gs,sb", [(0, 0.1, 16, 16), (1, 0.3, 32, 7), (2, 0.5, 16, 1)])
def test_mixed_export_equals_trained_fake_quant(seed, ratio, gs, sb):
    w = _weight(24, 96, seed=seed)
    v, a, b = _random_params(w, gs, seed)
    is4 = m2_rounding.select_4bit(w, gs, ratio, None, sb)
    fq = m2_rounding.fake_quant_mixed2bit(w, v, a, b, gs, sb, is4)
    qt = m2_rounding.export_mixed2bit(w, v, a, b, gs, sb, is4, ratio, "range", dtype="float16")
    validate(qt)
    assert qt.params["n4"] == int(is4.sum()) > 0 and qt.params["selection"] == "range"
    deq = mixed2bit.dequantize(qt, dtype="float32")
    assert torch.equal(deq.view(torch.int32), fq.view(torch.int32))  # bitwise
    # 4-bit groups really use 4-bit codes and 8-bit second-order codes after training
    assert int(qt.buffers["scales4"].max()) > 15
    bias = torch.randn(w.shape[0])
    lin = QuantizedLinear.from_quantized(qt, bias)
    x = torch.randn(5, w.shape[1])
    torch.testing.assert_close(lin(x), F.linear(x, fq, bias), rtol=1.3e-6, atol=1e-5)
    with pytest.raises(ValueError, match="ratio_4bit"):
        m2_rounding.export_mixed2bit(w, v, a, b, gs, sb, is4, 0.0, "range")


# The tiled layout: rows of several tiles (4800 = 256 + 44 groups of 16), a short last tile.
@pytest.mark.parametrize("ratio,gs,sb,sens", [(0.1, 16, 16, True), (0.25, 16, 64, False), (0.0, 32, 4, False)])
def test_tiled_initial_parameters_are_tiled_rtn_bit_for_bit(ratio, gs, sb, sens):
    w = _weight(6, 4800)
    w[3, :16] = -0.0
    s = torch.rand(4800, generator=torch.Generator().manual_seed(7)) * 3 if sens else None
    rtn = mixed2bit.quantize(w, group_size=gs, ratio_4bit=ratio, sensitivity=s, scale_block=sb, layout="tiled")
    is4 = m2_rounding.select_4bit(w, gs, ratio, s, sb, "tiled") if ratio else None
    v = torch.zeros_like(w)
    one = torch.ones(w.shape[0], w.shape[1] // gs)
    qt = m2_rounding.export_mixed2bit(w, v, one, one, gs, sb, is4, ratio, "sensitivity" if sens else "range",
                                      layout="tiled")
    assert qt.params == rtn.params
    for name in rtn.buffers:
        assert torch.equal(qt.buffers[name], rtn.buffers[name]), name
    fq = m2_rounding.fake_quant_mixed2bit(w, v, one, one, gs, sb, is4, layout="tiled")
    assert torch.equal(fq.view(torch.int32), rtn.dequantize("float32").view(torch.int32))


@pytest.mark.parametrize("seed,ratio,gs,sb", [(0, 0.1, 16, 16), (1, 0.3, 32, 8), (2, 0.5, 16, 1)])
def test_tiled_export_equals_trained_fake_quant(seed, ratio, gs, sb):
    w = _weight(8, 4800, seed=seed)
    v, a, b = _random_params(w, gs, seed)
    is4 = m2_rounding.select_4bit(w, gs, ratio, None, sb, "tiled")
    fq = m2_rounding.fake_quant_mixed2bit(w, v, a, b, gs, sb, is4, layout="tiled")
    qt = m2_rounding.export_mixed2bit(w, v, a, b, gs, sb, is4, ratio, "range", dtype="float16", layout="tiled")
    validate(qt)
    assert qt.params["layout"] == "tiled" and qt.params["n4"] == int(is4.sum()) > 0
    deq = mixed2bit.dequantize(qt, dtype="float32")
    assert torch.equal(deq.view(torch.int32), fq.view(torch.int32))  # bitwise
    assert int(qt.buffers["scales"][is4.reshape(w.shape[0], -1)].max()) > 15  # 8-bit sc after training
    bias = torch.randn(w.shape[0])
    lin = QuantizedLinear.from_quantized(qt, bias)
    x = torch.randn(5, w.shape[1])
    torch.testing.assert_close(lin(x), F.linear(x, fq, bias), rtol=1.3e-6, atol=1e-5)
    # the global layout's selection has the right total but not the per-tile counts
    with pytest.raises(ValueError, match="tile"):
        m2_rounding.export_mixed2bit(w, v, a, b, gs, sb, m2_rounding.select_4bit(w, gs, ratio, None, sb), ratio,
                                     "range", layout="tiled")
    with pytest.raises(ValueError, match="layout"):
        m2_rounding.fake_quant_mixed2bit(w, v, a, b, gs, sb, is4, layout="rows")


def test_clipping_changes_the_exported_scales():
    w = _weight()
    gs = 32
    v = torch.zeros_like(w)
    one = torch.ones(w.shape[0], 2)
    half = torch.full((w.shape[0], 2), 0.5)
    s1 = int4_rounding.export_int4(w, v, one, one, gs).buffers["scales"]
    s2 = int4_rounding.export_int4(w, v, half, half, gs).buffers["scales"]
    # scale = (alpha * hi - beta * lo) / 15: halved by alpha = beta = 1/2
    torch.testing.assert_close(s2, s1 / 2, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt,gs,ratio", [("int4", 32, 0.0), ("mixed2bit", 16, 0.0), ("mixed2bit", 16, 0.25)])
def test_straight_through_gradients_reach_every_parameter(fmt, gs, ratio):
    w = _weight()
    lin = nn.Linear(64, 16)
    with torch.no_grad():
        lin.weight.copy_(w)
    is4 = m2_rounding.select_4bit(w, gs, ratio) if ratio else None
    m = sr.SignRoundLinear(lin, _rounding(lin, gs, fmt, is4, ratio))
    with torch.no_grad():
        m.alpha.fill_(0.9)
        m.beta.fill_(0.8)
    m(torch.randn(8, 64)).pow(2).sum().backward()
    for p in (m.v, m.alpha, m.beta):
        assert p.grad is not None and p.grad.abs().sum() > 0


def _grads(fq, w, v, a, b):
    """(fake-quantized weight, grad v, grad alpha, grad beta) under a fixed upstream gradient."""
    v, a, b = (t.clone().requires_grad_(True) for t in (v, a, b))
    y = fq(w, v, a, b)
    up = torch.sin(torch.arange(y.numel(), dtype=torch.float32)).reshape(y.shape)
    (y * up).sum().backward()
    return y.detach(), v.grad, a.grad, b.grad


def _bits(t):
    return t.view(torch.int32)


@pytest.mark.parametrize("fmt,gs,ratio,sb", [("int4", 32, 0.0, 16), ("mixed2bit", 16, 0.0, 16),
                                             ("mixed2bit", 16, 0.25, 5), ("mixed2bit", 32, 1.0, 3),
                                             ("mixed2bit-tiled", 16, 0.25, 8)])
def test_layer_rounding_reuses_weight_part_and_equals_the_function_bit_for_bit(fmt, gs, ratio, sb):
    # The per-layer object computes what depends on the weight alone once (WeightMemo); its
    # values and gradients equal the standalone function's at every call, also after the
    # weight is changed in place (the memo is recomputed), ties in maxima included.
    layout = "tiled" if fmt.endswith("tiled") else "global"
    w = (_weight(24, 96 if layout == "global" else 4800) * 64).round() / 64
    is4 = m2_rounding.select_4bit(w, gs, ratio, None, sb, layout) if ratio else None
    if fmt == "int4":
        r, f = int4_rounding.Int4Rounding(gs), lambda *t: int4_rounding.fake_quant_int4(*t, gs)
    else:
        r = m2_rounding.Mixed2bitRounding(tuple(w.shape), gs, sb, is4, ratio, layout=layout)
        f = lambda *t: m2_rounding.fake_quant_mixed2bit(*t, gs, sb, is4, layout)  # noqa: E731
    for step in range(3):
        if step == 2:
            w.mul_(0.5)  # in place: the memo must not serve the old bounds
        v, a, b = _random_params(w, gs, seed=step)
        a[::3] = 1.0
        for x, y in zip(_grads(r.fake_quant, w, v, a, b), _grads(f, w, v, a, b)):
            assert torch.equal(_bits(x), _bits(y))


def test_mixed2bit_layer_rounding_still_refuses_fields_too_large_for_fp16():
    w = _weight(8, 32)
    w[0, 0] = 3e7  # scale / 15 beyond fp16 for any alpha in [0.5, 1]
    r = m2_rounding.Mixed2bitRounding(tuple(w.shape), 16, 16)
    v, a, b = _random_params(w, 16)
    with pytest.raises(ValueError, match="too large"):
        r.fake_quant(w, v, a, b)
    with pytest.raises(ValueError, match="too large"):
        m2_rounding.fake_quant_2bit(w, v, a, b, 16)


@pytest.mark.parametrize("fmt,gs,ratio", [("int4", 32, 0.0), ("mixed2bit", 16, 0.25)])
def test_signround_linear_node_and_cache_equal_the_plain_fake_quant(fmt, gs, ratio):
    # qweight() with gradients is one autograd node (run on WEIGHT_OP_THREADS threads), without
    # them a cached tensor: both equal the format's fake_quant and its gradients bit for bit,
    # and the cache follows every change of the parameters.
    w = _weight()
    lin = nn.Linear(64, 16)
    with torch.no_grad():
        lin.weight.copy_(w)
    is4 = m2_rounding.select_4bit(w, gs, ratio) if ratio else None
    m = sr.SignRoundLinear(lin, _rounding(lin, gs, fmt, is4, ratio))
    v, a, b = _random_params(w, gs)
    with torch.no_grad():
        m.v.copy_(v), m.alpha.copy_(a), m.beta.copy_(b)
    want = _grads(m.rounding.fake_quant, m.weight, v, a, b)
    y = m.qweight()
    (y * torch.sin(torch.arange(y.numel(), dtype=torch.float32)).reshape(y.shape)).sum().backward()
    for x, z in zip((y.detach(), m.v.grad, m.alpha.grad, m.beta.grad), want):
        assert torch.equal(_bits(x), _bits(z))
    with torch.no_grad():
        first = m.qweight()
        assert m.qweight() is first  # the same parameters: reused
        m.v.sub_(0.25 * torch.sign(m.v.grad))
        m.clamp_()
        again = m.qweight()
    assert again is not first
    fresh = m.rounding.fake_quant(m.weight, m.v.detach(), m.alpha.detach(), m.beta.detach())
    assert torch.equal(_bits(again), _bits(fresh)) and not torch.equal(again, first)


def _rounding(lin, gs, fmt, is4, ratio):
    """The format's trainable rounding of ``lin`` (scale_block 16 for mixed2bit)."""
    if fmt == "int4":
        return int4_rounding.Int4Rounding(gs)
    return m2_rounding.Mixed2bitRounding(tuple(lin.weight.shape), gs, 16, is4, ratio)


# -- block training -----------------------------------------------------------------------------

def _setup_block(net, ids, gs=32, fmt="int4", ratio=0.0):
    """(fp32 block copy with SignRoundLinears, linears, inputs, targets) for block 0."""
    inputs = sr.capture_block_inputs(net, net.layers[0], [i.reshape(1, -1) for i in ids])
    fb = copy.deepcopy(net.layers[0]).float()
    with torch.no_grad():
        targets = [fb(x, **kw) for x, kw in inputs]
    linears = {}
    for rel in ("up", "down"):
        lin = getattr(fb, rel)
        is4 = m2_rounding.select_4bit(lin.weight, gs, ratio) if ratio else None
        linears[rel] = sr.SignRoundLinear(lin, _rounding(lin, gs, fmt, is4, ratio))
        setattr(fb, rel, linears[rel])
    return fb, linears, inputs, targets


@pytest.mark.parametrize("fmt,gs,ratio", [("int4", 32, 0.0), ("mixed2bit", 16, 0.0), ("mixed2bit", 16, 0.2)])
def test_train_block_improves_on_rtn_keeps_ranges_and_exports_what_it_trained(fmt, gs, ratio):
    net = _Net()
    fb, linears, inputs, targets = _setup_block(net, _ids(), gs, fmt, ratio)
    assert set(inputs[0][1]) == {"gate"} and inputs[0][0].dtype == torch.float32
    st = sr.train_block(fb, linears, inputs, targets, iters=20, lr=None, batch_size=8)
    assert st["loss"] <= st["rtn_loss"] and st["best_loss"] == min(st["losses"])
    assert st["losses"][0] == pytest.approx(st["rtn_loss"], rel=1e-6)
    assert st["loss"] < st["rtn_loss"]  # 20 steps of SignSGD do help on this block
    assert st["loss"] == pytest.approx(st["best_loss"], rel=1e-5)  # full batch: same samples
    for m in linears.values():
        assert m.v.min() >= -0.5 and m.v.max() <= 0.5
        for p in (m.alpha, m.beta):
            assert p.min() >= 0.5 and p.max() <= 1.0
        assert not torch.equal(m.v, torch.zeros_like(m.v))  # trained, not RTN
    # the packed block (QuantizedLinears from the exported buffers) == the trained block
    qb = copy.deepcopy(fb)
    for rel, m in linears.items():
        qt = m.export()
        q = QuantizedLinear.from_quantized(qt, m.bias)
        assert torch.equal(q.dequantize_weight("float32").view(torch.int32),
                           m.qweight().detach().view(torch.int32))
        setattr(qb, rel, q)
    with torch.no_grad():
        for x, kw in inputs:
            torch.testing.assert_close(qb(x, **kw), fb(x, **kw), rtol=1.3e-6, atol=1e-5)


def test_train_block_outputs_are_the_trained_blocks_and_give_the_final_loss():
    net = _Net()
    fb, linears, inputs, targets = _setup_block(net, _ids(n=5))
    st = sr.train_block(fb, linears, inputs, targets, iters=4, lr=None, batch_size=2, keep_outputs=True)
    outs = st.pop("outputs")
    with torch.no_grad():
        for y, (x, kw) in zip(outs, inputs):
            torch.testing.assert_close(y, fb(x, **kw), rtol=1e-6, atol=1e-7)
    # the loss over all samples (batches of 2, weighted by their share) from those outputs
    loss = sum(float(F.mse_loss(torch.cat(outs[i:i + 2]), torch.cat(targets[i:i + 2])) * (len(outs[i:i + 2]) / 5))
               for i in range(0, 5, 2))
    assert st["loss"] == loss
    assert "outputs" not in sr.train_block(fb, linears, inputs, targets, iters=0, lr=None, batch_size=2)


def test_best_parameters_seen_are_kept():
    # A learning rate of 5 throws every parameter to a bound on the first step (V = +-0.5,
    # alpha/beta = 0.5 or 1): far worse than RTN, so the kept parameters are the initial ones.
    net = _Net()
    fb, linears, inputs, targets = _setup_block(net, _ids())
    st = sr.train_block(fb, linears, inputs, targets, iters=3, lr=5.0, batch_size=8)
    assert st["best_iter"] == 0 and len(st["losses"]) == 4
    assert min(st["losses"][1:]) > st["losses"][0]
    assert st["loss"] == pytest.approx(st["rtn_loss"], rel=1e-6)
    for m in linears.values():
        assert torch.equal(m.v, torch.zeros_like(m.v))
        assert torch.equal(m.alpha, torch.ones_like(m.alpha))
        assert torch.equal(m.beta, torch.ones_like(m.beta))
    # and a normal run whose best is after the last step: the final parameters are kept
    fb, linears, inputs, targets = _setup_block(net, _ids())
    st = sr.train_block(fb, linears, inputs, targets, iters=20, lr=None, batch_size=8)
    assert st["losses"][st["best_iter"]] == st["best_loss"] == min(st["losses"])
    # iters=0: RTN, evaluated once
    fb, linears, inputs, targets = _setup_block(net, _ids())
    st = sr.train_block(fb, linears, inputs, targets, iters=0, lr=None, batch_size=2)
    assert st["best_iter"] == 0 and len(st["losses"]) == 1 and st["loss"] == st["rtn_loss"]


# -- quantize_model(method="signround") -----------------------------------------------------------

@pytest.mark.parametrize("bits,gs,fmt", [(4, 32, "int4"), (2, 16, "mixed2bit")])
def test_quantize_model_synthetic_net_matches_trained_losses(bits, gs, fmt):
    net = _Net()
    ref = copy.deepcopy(net)
    ids = _ids()
    rep = qformats.quantize_model(net, bits=bits, group_size=gs, method="signround", calibration=ids,
                                  iters=10, nsamples=4, seqlen=16, batch_size=4)
    assert rep.method == "signround" and rep.formats == {fmt: 4}
    assert [l.name for l in rep.ignored] == ["lm_head"]
    blocks = rep.signround["blocks"]
    assert len(blocks) == 2 and blocks[0]["layers"] == ["layers.0.up", "layers.0.down"]
    for b in blocks:
        assert b["loss"] <= b["rtn_loss"]
    # the packed model's block 0, on the inputs it sees, has the loss the training reported
    inputs = sr.capture_block_inputs(net, net.layers[0], [i.reshape(1, -1) for i in ids])
    with torch.no_grad():
        loss = sum(F.mse_loss(net.layers[0](x, **kw), ref.layers[0](x, **kw)) for x, kw in inputs) / 4
    assert float(loss) == pytest.approx(blocks[0]["loss"], rel=1e-4)
    # block 1 is trained on the outputs of the quantized block 0
    x1 = [(net.layers[0](x, **kw).detach(), kw) for x, kw in inputs]
    with torch.no_grad():
        loss1 = sum(F.mse_loss(net.layers[1](x, **kw), ref.layers[1](x, **kw)) for x, kw in x1) / 4
    assert float(loss1) == pytest.approx(blocks[1]["loss"], rel=1e-4)


def test_quantize_model_mixed_groups_selected_by_block_inputs():
    # mixed2bit with 4-bit groups: chosen from the second moments of the inputs the block
    # training feeds each layer (block 0: the embeddings), then trained; the packed layers
    # decode to the trained fake-quant weights (the losses match, as above)
    net = _Net()
    ref = copy.deepcopy(net)
    ids = _ids()
    rep = qformats.quantize_model(net, bits=2, ratio_4bit=0.25, method="signround", calibration=ids,
                                  iters=10, nsamples=4, seqlen=16, batch_size=4)
    assert rep.formats == {"mixed2bit": 4}
    up = net.layers[0].up
    assert up.params["selection"] == "sensitivity" and up.params["n4"] == 128  # 1/4 of 128 rows x 4 groups
    x = torch.cat([ref.embed(i) for i in ids]).reshape(-1, 64).double()
    sens = sr.sensitivity_from_moments(x.square().mean(0))
    want = m2_rounding.select_4bit(ref.layers[0].up.weight, 16, 0.25, sens)
    gm = up.group_map.to(torch.int64)
    got = ((gm.reshape(-1, 1) >> torch.arange(8)) & 1).reshape(-1)[:want.numel()].bool()
    assert torch.equal(got, want)
    inputs = sr.capture_block_inputs(net, net.layers[0], [i.reshape(1, -1) for i in ids])
    with torch.no_grad():
        loss = sum(F.mse_loss(net.layers[0](x, **kw), ref.layers[0](x, **kw)) for x, kw in inputs) / 4
    b0 = rep.signround["blocks"][0]
    assert float(loss) == pytest.approx(b0["loss"], rel=1e-4) and b0["loss"] < b0["rtn_loss"]
    # selection="range": the format's range rule
    net2 = copy.deepcopy(ref)
    qformats.quantize_model(net2, bits=2, ratio_4bit=0.25, method="signround", calibration=ids,
                            iters=0, nsamples=4, seqlen=16, selection="range")
    rng = mixed2bit.quantize(ref.layers[0].up.weight.detach(), group_size=16, ratio_4bit=0.25)
    assert net2.layers[0].up.params["selection"] == "range"
    assert torch.equal(net2.layers[0].up.group_map, rng.buffers["group_map"])
    # iters=0 is calibrated RTN: the same buffers as mixed2bit.quantize with that sensitivity
    assert not torch.equal(rng.buffers["group_map"], up.group_map)


def test_quantize_model_signround_tiled_layout():
    # layout="tiled" trains and exports the tiled layout: 4-bit groups chosen per tile from the
    # block inputs, the packed layers decode to what was trained (the block loss is reproduced)
    net = _Net(d=256, h=512)
    ref = copy.deepcopy(net)
    ids = _ids(vocab=64)
    rep = qformats.quantize_model(net, bits=2, ratio_4bit=0.25, layout="tiled", method="signround",
                                  calibration=ids, iters=10, nsamples=4, seqlen=16, batch_size=4)
    assert rep.formats == {"mixed2bit": 4}
    up = net.layers[0].up
    assert up.params["layout"] == "tiled" and up.params["selection"] == "sensitivity"
    x = torch.cat([ref.embed(i) for i in ids]).reshape(-1, 256).double()
    want = m2_rounding.select_4bit(ref.layers[0].up.weight, 16, 0.25, sr.sensitivity_from_moments(
        x.square().mean(0)), 16, "tiled")
    qt = up.quantized_weight
    got = tiled_is4({"map": qt.buffers["map"].numpy()}, 512, 256, 16).reshape(-1)
    assert torch.equal(torch.from_numpy(got.copy()), want)
    inputs = sr.capture_block_inputs(net, net.layers[0], [i.reshape(1, -1) for i in ids])
    with torch.no_grad():
        loss = sum(F.mse_loss(net.layers[0](x, **kw), ref.layers[0](x, **kw)) for x, kw in inputs) / 4
    b0 = rep.signround["blocks"][0]
    assert float(loss) == pytest.approx(b0["loss"], rel=1e-4) and b0["loss"] < b0["rtn_loss"]


def test_signround_mixed_on_pydoc_llama(llama, valid_text):
    model = copy.deepcopy(llama.model)
    rep = qformats.quantize_model(model, bits=2, group_size=32, ratio_4bit=0.1, method="signround",
                                  calibration=valid_text, tokenizer=llama.tokenizer,
                                  iters=3, nsamples=2, seqlen=64, batch_size=2)
    assert rep.formats == {"mixed2bit": 42} and len(rep.signround["blocks"]) == 6
    assert all(b["loss"] <= b["rtn_loss"] for b in rep.signround["blocks"])
    qls = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.params["selection"] == "sensitivity" and m.params["n4"] > 0 for m in qls)
    assert rep.avg_bits < 3.0
    ids = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.isfinite(model(ids).logits).all()


def test_quantize_model_tiny_llama(make_tiny_llama):
    model = make_tiny_llama()
    rtn = copy.deepcopy(model)
    fp = copy.deepcopy(model)
    ids = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))]
    rep = qformats.quantize_model(model, bits=4, group_size=32, method="signround", calibration=ids,
                                  iters=15, nsamples=2, seqlen=32, batch_size=2)
    qformats.quantize_model(rtn, bits=4, group_size=32)
    assert rep.formats == {"int4": 14} and len(rep.signround["blocks"]) == 2
    for b in rep.signround["blocks"]:
        assert b["loss"] <= b["rtn_loss"]
    assert rep.signround["blocks"][0]["loss"] < rep.signround["blocks"][0]["rtn_loss"]
    with torch.no_grad():
        out = model(ids[0]).logits
        ref = fp(ids[0]).logits
    assert torch.isfinite(out).all() and out.shape == ref.shape


def test_amp_on_the_cpu(make_tiny_llama):
    """amp on the CPU: the blocks' products run under bfloat16 autocast (the round-to-nearest
    losses differ from float32's), training still ends no worse than round to nearest, and a
    second run gives the same bytes."""
    ids = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))]
    reps, states = [], []
    for amp in (False, True, True):
        model = make_tiny_llama()
        rep = qformats.quantize_model(model, bits=4, group_size=32, method="signround", calibration=ids,
                                      iters=4, nsamples=2, seqlen=16, batch_size=2, amp=amp)
        assert rep.signround["options"]["amp"] is amp
        assert all(b["loss"] <= b["rtn_loss"] for b in rep.signround["blocks"])
        reps.append(rep)
        states.append(model.state_dict())
    assert [b["rtn_loss"] for b in reps[1].signround["blocks"]] != [b["rtn_loss"] for b in reps[0].signround["blocks"]]
    assert [b["loss"] for b in reps[1].signround["blocks"]] == [b["loss"] for b in reps[2].signround["blocks"]]
    assert all(torch.equal(states[1][k], states[2][k]) for k in states[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("amp", [False, True])
def test_quantize_model_tiny_llama_on_cuda_twice_same_bytes(make_tiny_llama, amp):
    """On the GPU (float32, or bfloat16 autocast): trained layers on the model's device, no
    worse than RTN, and a second run gives the same bytes (the per-sample gradients,
    attention's included, are deterministic)."""
    ids = [torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(5))]
    states = []
    for _ in range(2):
        model = make_tiny_llama().cuda()
        rep = qformats.quantize_model(model, bits=4, group_size=32, method="signround", amp=amp,
                                      calibration=ids, iters=15, nsamples=4, seqlen=32, batch_size=4)
        assert rep.formats == {"int4": 14}
        assert all(b["loss"] <= b["rtn_loss"] for b in rep.signround["blocks"])
        assert rep.signround["blocks"][0]["loss"] < rep.signround["blocks"][0]["rtn_loss"]
        assert all(t.device.type == "cuda" for t in model.state_dict().values())
        states.append({k: v.cpu() for k, v in model.state_dict().items()})
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_signround_errors(make_tiny_llama):
    model = make_tiny_llama()
    with pytest.raises(NotImplementedError, match="int4 asymmetric"):
        qformats.quantize_model(model, bits=2, ratio_4bit=0.1, outlier_ratio=0.01, method="signround",
                                calibration=_ids(vocab=256))
    with pytest.raises(ValueError, match="selection"):
        qformats.quantize_model(model, bits=2, ratio_4bit=0.1, method="signround", selection="hessian",
                                calibration=_ids(vocab=256))
    with pytest.raises(ValueError, match="sensitivity_power"):
        qformats.quantize_model(model, bits=2, ratio_4bit=0.1, method="signround", sensitivity_power=-1,
                                calibration=_ids(vocab=256))
    with pytest.raises(NotImplementedError, match="int4 asymmetric"):
        qformats.quantize_model(model, format="nf4", method="signround", calibration=_ids(vocab=256))
    with pytest.raises(NotImplementedError, match="int4 asymmetric"):
        qformats.quantize_model(model, bits=4, group_size=32, symmetric=True, method="signround",
                                calibration=_ids(vocab=256))
    with pytest.raises(ValueError, match="tokenizer"):
        qformats.quantize_model(model, bits=4, group_size=32, method="signround", calibration="text")
    assert all(type(m) is not QuantizedLinear for m in model.modules())


def test_calibration_from_text():
    class Tok:
        def __call__(self, text, return_tensors=None):
            return {"input_ids": torch.arange(len(text)).reshape(1, -1) % 50}
    rows = sr.calibration_samples("x" * 100, Tok(), nsamples=3, seqlen=20)
    assert len(rows) == 3 and all(r.shape == (1, 20) for r in rows)
    assert [int(r[0, 0]) for r in rows] == [0, 40, 80 % 50]  # windows 0, 2, 4 of 5


# -- several ranks: the same bytes as one process ---------------------------------------------------

@pytest.mark.parametrize("n", range(1, 10))
def test_tree_sum_over_any_number_of_ranks_is_one_process_sum(n):
    """The subtrees that `world` ranks compute, added up the tree, give one process's sum bit
    for bit; summing the same terms in another order does not (so the order is what is fixed)."""
    g = torch.Generator().manual_seed(n)
    scale = 10.0 ** torch.randint(-6, 7, (n, 1), generator=g)
    terms = (torch.randn(n, 4096, generator=g) * scale).float()
    one = sr._tree_sum(0, n, lambda i: [terms[i].clone()])[0]
    for world in range(1, 6):
        nodes, owner = sr._nodes(n, world)
        assert nodes[0][0] == 0 and nodes[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(nodes, nodes[1:]))
        assert len(nodes) >= min(world, n) and len(owner) == len(nodes)
        assert sorted(set(owner)) == list(range(min(world, n)))  # every rank with a term works
        load = [sum(hi - lo for (lo, hi), r in zip(nodes, owner) if r == rank) for rank in range(world)]
        assert max(load) <= -(-n // world) + (n > world)  # within one term of an even split
        known = {(lo, hi): sr._tree_sum(lo, hi, lambda i: [terms[i].clone()]) for lo, hi in nodes}
        assert torch.equal(sr._tree_sum(0, n, None, known)[0].view(torch.int32), one.view(torch.int32))
    if n >= 4:  # from 4 terms the tree's order is not the running sum's
        plain = torch.randn(n, 4096, generator=g)
        seq = plain[0].clone()
        for i in range(1, n):
            seq += plain[i]
        assert not torch.equal(seq, sr._tree_sum(0, n, lambda i: [plain[i].clone()])[0])


def test_subtrees_balance_the_terms_over_the_ranks():
    """3 ranks and a batch of 8: 3, 3 and 2 samples each (a level of the tree alone gives 4, 2,
    2); 2 and 4 ranks keep whole levels (no extra gathered sums). The splitting is greedy: it
    stops at the first split that does not help (32 terms: 12, 12, 8, where 11, 11, 10 exists)."""
    def loads(n, world):
        nodes, owner = sr._nodes(n, world)
        return sorted((sum(hi - lo for (lo, hi), r in zip(nodes, owner) if r == rank) for rank in range(world)),
                      reverse=True), len(nodes)
    assert loads(8, 3) == ([3, 3, 2], 5)
    assert loads(8, 2) == ([4, 4], 2)
    assert loads(8, 4) == ([2, 2, 2, 2], 4)
    assert loads(32, 3) == ([12, 12, 8], 5)  # a level alone: 16, 8, 8


class _ThreadRanks:
    """Ranks for threads of one process (what qformats._dist.Ranks does over torch.distributed:
    gather, gather_objects, broadcast), to run train_block as `world` ranks in one test."""

    def __init__(self, rank, world, board):
        self.rank, self.world, self.board = rank, world, board
        self.several = world > 1

    def _exchange(self, x):
        slots, barrier = self.board
        slots[self.rank] = x
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    def gather(self, t):
        return [x.clone() for x in self._exchange(t.clone())]

    def gather_objects(self, obj):
        return self._exchange(obj)

    def broadcast(self, t, src):
        return self.gather(t)[src]


@pytest.mark.parametrize("world", [2, 3])
def test_train_block_on_several_ranks_gives_one_process_parameters(world):
    """train_block run as `world` ranks (threads exchanging tensors) ends with V / alpha / beta,
    losses and outputs equal bit for bit to one process's, each rank having run part of the
    forwards."""
    import threading

    net = _Net()
    ids = _ids(n=7)
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread everywhere: the products' order is the same in each
    try:
        fb, linears, inputs, targets = _setup_block(net, ids)
        calls = [0]
        fb.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        one = sr.train_block(fb, linears, inputs, targets, iters=6, lr=None, batch_size=5,
                             keep_outputs=True)
        runs = [_setup_block(net, ids) for _ in range(world)]
        counts = [0] * world
        for r, (b, *_) in enumerate(runs):
            b.register_forward_hook(lambda *a, r=r: counts.__setitem__(r, counts[r] + 1))
        board = ([None] * world, threading.Barrier(world, timeout=60))
        stats, errors = [None] * world, []

        def rank(r):
            try:
                b, lin, inp, tgt = runs[r]
                stats[r] = sr.train_block(b, lin, inp, tgt, iters=6, lr=None, batch_size=5,
                                          keep_outputs=True, ranks=_ThreadRanks(r, world, board))
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)
                board[1].abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(old)
    assert not errors, errors
    for r in range(world):
        st = dict(stats[r])
        assert st.pop("outputs") is not None
        assert st == {k: v for k, v in one.items() if k != "outputs"}
        assert all(torch.equal(a, b) for a, b in zip(stats[r]["outputs"], one["outputs"]))
        for name, m in runs[r][1].items():
            for p in ("v", "alpha", "beta"):
                assert torch.equal(getattr(m, p), getattr(linears[name], p)), (r, name, p)
        assert 0 < counts[r] < calls[0]  # the forwards were shared out
    assert sum(counts) >= calls[0]
