"""Calibrated round to nearest: ``quantize_model(..., format="mixed2bit", calibration=...)``
chooses mixed2bit's 4-bit groups by the activations' second moment (diag of X^T X).

Small settings: a synthetic net where the choice must differ from the range rule, and the
pydoc Llama with 2 calibration windows of 64 tokens."""
from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import qformats  # noqa: E402
from qformats import mixed2bit  # noqa: E402
from qformats import signround as sr  # noqa: E402
from qformats.nn import QuantizedLinear  # noqa: E402
from torch import nn  # noqa: E402


def _group_flags(q: QuantizedLinear) -> torch.Tensor:
    """bool [n_groups]: the 4-bit groups of a packed mixed2bit layer (from its group_map)."""
    gm = q.group_map.to(torch.int64)
    n = q.out_features * (q.in_features // q.params["group_size"])
    return (((gm.reshape(-1, 1) >> torch.arange(8)) & 1).reshape(-1)[:n]).bool()


class _EmbedNet(nn.Module):
    """Embedding (columns 0..15 scaled by 100) -> Linear(64, 8): the first 16 input columns
    carry almost all of the activation energy, columns 16..31 hold the weight's largest range."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 64)
        with torch.no_grad():
            self.embed.weight[:, :16] *= 100.0
        self.proj = nn.Linear(64, 8, bias=False)
        with torch.no_grad():
            w = torch.randn(8, 64) * 0.01
            w[:, 16:32] = torch.randn(8, 16) * 0.5   # large range, quiet inputs
            self.proj.weight.copy_(w)

    def forward(self, ids):
        return self.proj(self.embed(ids))


def _ids():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (1, 24), generator=g) for _ in range(3)]


def test_calibration_picks_the_loud_columns_not_the_wide_ones():
    net, ref = _EmbedNet(), _EmbedNet()
    rep = qformats.quantize_model(net, format="mixed2bit", ratio_4bit=0.25, calibration=_ids(),
                                  nsamples=3, seqlen=24, ignore=[])
    qformats.quantize_model(ref, format="mixed2bit", ratio_4bit=0.25, ignore=[])  # by range
    q, r = net.proj, ref.proj
    assert q.params["selection"] == "sensitivity" and r.params["selection"] == "range"
    assert q.params["n4"] == r.params["n4"] == 8  # a quarter of 8 rows x 4 groups
    flags = _group_flags(q).reshape(8, 4)
    assert flags[:, 0].all() and not flags[:, 1:].any()    # loud inputs: columns 0..15
    assert _group_flags(r).reshape(8, 4)[:, 1].all()       # range: columns 16..31
    assert rep.calibration["layers"] == 1 and rep.calibration["windows"] == [3, 24]
    # the sensitivity is the mean squared input (up to a factor), computed here independently
    x = torch.cat([net.embed(i) for i in _ids()]).reshape(-1, 64).double()
    sens = (x.square().mean(0) / x.square().mean()).float()
    w0 = _EmbedNet().proj.weight.detach().contiguous()
    want = mixed2bit.quantize(w0, group_size=16, ratio_4bit=0.25, sensitivity=sens)
    assert torch.equal(q.group_map, want.buffers["group_map"])
    # the lower reconstruction error on the calibration inputs is the point of it
    with torch.no_grad():
        y = _EmbedNet().proj(torch.cat([_EmbedNet().embed(i) for i in _ids()]))
        err_cal = (q(torch.cat([net.embed(i) for i in _ids()])) - y).square().mean()
        err_rng = (r(torch.cat([ref.embed(i) for i in _ids()])) - y).square().mean()
    assert err_cal < err_rng


def test_sensitivity_power_and_moments():
    m = torch.tensor([0.0, 1.0, 4.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(sr.sensitivity_from_moments(m), torch.tensor([0.0, 0.5, 2.0, 1.5]))
    torch.testing.assert_close(sr.sensitivity_from_moments(m, 0.5),
                               torch.tensor([0.0, 0.5, 2.0, 1.5]).sqrt())
    lin = nn.Linear(3, 2)
    x = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mom = sr.capture_second_moments({"l": lin}, lambda: lin(x.reshape(1, 2, 3)))
    torch.testing.assert_close(mom["l"], torch.tensor([5.0, 2.0, 0.0], dtype=torch.float64))


def test_calibrated_mixed2bit_on_pydoc_llama(llama, valid_text, windows):
    from qformats.evaluate import perplexity

    model = copy.deepcopy(llama.model)
    rep = qformats.quantize_model(model, format="mixed2bit", ratio_4bit=0.1, calibration=valid_text,
                                  tokenizer=llama.tokenizer, nsamples=2, seqlen=64)
    assert rep.formats == {"mixed2bit": 42} and rep.calibration["layers"] == 42
    assert rep.calibration["windows"] == [2, 64]
    qls = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.params["selection"] == "sensitivity" and m.params["n4"] > 0 for m in qls)
    assert 2.9 < rep.avg_bits < 3.0
    rng = copy.deepcopy(llama.model)
    qformats.quantize_model(rng, format="mixed2bit", ratio_4bit=0.1)
    # the choice differs from the range rule somewhere, and the model still works
    differ = sum(not torch.equal(a.group_map, b.group_map) for a, b in
                 zip(qls, [m for m in rng.modules() if isinstance(m, QuantizedLinear)]))
    assert differ > 0
    ppl = perplexity(model, windows[:1], progress=False)["ppl"]
    base = perplexity(llama.model, windows[:1], progress=False)["ppl"]
    assert base < ppl < 1.5 * base


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 4, "group_size": 32}, "only chooses mixed2bit's 4-bit groups"),
    ({"bits": 2}, "only chooses mixed2bit's 4-bit groups"),      # ratio_4bit=0: nothing to choose
    ({"format": "mixed2bit", "sensitivity_power": 0}, "sensitivity_power"),
    ({"format": "mixed2bit", "sensitivity_power": float("inf")}, "sensitivity_power"),
    ({"format": "mixed2bit", "nsamples": 0}, "nsamples"),
    ({"format": "mixed2bit", "seqlen": 1.5}, "seqlen"),
    ({"format": "mixed2bit", "tokenizer": None, "text": True}, "tokenizer"),
])
def test_calibration_bad_configs_leave_the_model_alone(kwargs, match):
    net = _EmbedNet()
    before = copy.deepcopy(net.state_dict())
    kwargs = dict(kwargs)
    cal = "some text" if kwargs.pop("text", False) else _ids()
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qformats.quantize_model(net, calibration=cal, ignore=[], **kwargs)
    assert all(type(m) is not QuantizedLinear for m in net.modules())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
