"""QuantizedLinear and the qformats:: torch operators: equal to F.linear on the dequantized
weight for every format (the reference path), the CPU kernels within float32 rounding of it
(q4_0: llama.cpp's q8_1 product exactly), bias handling, state dicts, device/dtype
conversions, errors, gradients, the kernel dispatch hook and torch.compile(fullgraph=True)."""
from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import qformats  # noqa: E402
from qformats import ops  # noqa: E402
from qformats.nn import QuantizedLinear, quantized_linears  # noqa: E402

#: Every format, some with non-default parameters (in_features 256 divides every block).
CASES = [
    ("q4_0", {}),
    ("q8_0", {}),
    ("q8_1", {}),
    ("int8", {}),
    ("int8", {"granularity": "group", "group_size": 64}),
    ("int4", {"group_size": 64}),
    ("int4", {"group_size": 128, "symmetric": True}),
    ("nf4", {}),
    ("nf4", {"blocksize": 128, "compress_statistics": True}),
    ("mixed2bit", {}),
    ("mixed2bit", {"ratio_4bit": 0.0, "outlier_ratio": 0.01, "group_size": 32}),
]
IDS = [f"{f}-{'-'.join(f'{k}={v}' for k, v in p.items()) or 'default'}" for f, p in CASES]
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _linear(bias=True, seed=0, in_f=256, out_f=96):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.bias is not None and lin.bias.normal_()
    return lin


@pytest.mark.parametrize("fmt,params", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_forward_equals_dequantized_linear(fmt, params, dtype, reference_path):
    lin = _linear()
    q = QuantizedLinear.from_linear(lin, fmt, **params)
    x = torch.randn(2, 5, 256).to(dtype)
    y = q(x)
    w = q.quantized_weight.dequantize(DTYPES[dtype])
    assert y.dtype == dtype and y.shape == (2, 5, 96)
    assert torch.equal(y, F.linear(x, w, q.bias.to(dtype)))
    # the same through the functional entry point, with the QuantizedTensor
    assert torch.equal(ops.linear(x, q.quantized_weight, q.bias), y)
    # and close to the float layer (quantization error only)
    ref = lin(x.float())
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < (0.5 if fmt == "mixed2bit" else 0.2), rel


#: CPU kernel path against F.linear on the dequantized weight: the kernels sum in float32 in
#: another order, so |y - ref| <= TOL * (|x| @ |W|^T) (float32: K = 256 terms, 2^-24 each, with
#: room; 16-bit x: one rounding of the float32 result to x's dtype on each side).
CPU_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("fmt,params", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("lead", [(1,), (2, 5), (32,), (33,)], ids=["1", "2x5", "32", "33"])
def test_cpu_kernel_path(fmt, params, dtype, lead):
    """With the CPU kernels on (the default), few rows go through the format's native kernel:
    within float32 rounding of dequantize + F.linear, q4_0 exactly llama.cpp's product with
    q8_1 activations plus the bias; more rows than ``linear_rows["cpu"]`` take the reference
    path bitwise. The bias is added in float32."""
    q = QuantizedLinear.from_linear(_linear(), fmt, **params)
    spec = qformats._core.format_spec(fmt)
    x = torch.randn(*lead, 256).to(dtype)
    y = q(x)
    assert y.dtype == dtype and y.shape == (*lead, 96)
    assert torch.equal(ops.linear(x, q.quantized_weight, q.bias), y)
    w = q.quantized_weight.dequantize(DTYPES[dtype])
    ref = F.linear(x, w, q.bias.to(dtype))
    rows = x.numel() // 256
    if rows > spec.linear_rows.get("cpu", 0):
        assert torch.equal(y, ref)
        return
    if fmt == "q4_0":  # llama.cpp's path: x quantized to q8_1, integer dot products
        exact = qformats.q4_0.linear(x.float().reshape(-1, 256), q.quantized_weight) + q.bias.float()
        assert torch.equal(y, exact.to(dtype).reshape(y.shape))
        # against the float product: the q8_1 rounding of x, half a step of max|x| / 127 per block
        step = x.float().reshape(-1, 8, 32).abs().amax(-1) / 127
        bound = (step.repeat_interleave(32, -1) / 2 @ w.float().abs().T).reshape(y.shape)
        assert ((y.float() - ref.float()).abs() <= bound * 1.01 + CPU_TOL[dtype] * ref.float().abs() + 1e-6).all()
        return
    scale = (x.float().abs() @ w.float().abs().T) + q.bias.float().abs()
    err = (y.float() - ref.float()).abs()
    assert (err <= CPU_TOL[dtype] * scale).all(), (err / scale).max()


#: The cases whose format binds a CPU kernel (q8_0 and q8_1 have none: their layers take the operator path).
BOUND = [(i, c) for i, c in zip(IDS, CASES) if "cpu" in qformats._core.format_spec(c[0]).linear_rows]


@pytest.mark.parametrize("fmt,params", [c for _, c in BOUND], ids=[i for i, _ in BOUND])
def test_bound_dense_path(fmt, params, monkeypatch):
    """Above the kernel's rows a layer with a bound kernel decodes through it
    (``Linear.dequantize``) and calls F.linear itself, without the operator: the same bytes as
    the format's dequantize, the same result as the operator path; the decode refuses a wrong
    output."""
    q = QuantizedLinear.from_linear(_linear(), fmt, **params)
    run = q._kernel
    for dtype, name in DTYPES.items():
        w = torch.full((96, 256), float("nan"), dtype=dtype)
        run.dequantize(w)
        assert torch.equal(w, q.quantized_weight.dequantize(name)), name
    x = torch.randn(3, 40, 256).to(torch.bfloat16)
    with torch.no_grad():
        ref = q._operator(x)
        monkeypatch.setattr(QuantizedLinear, "_operator", lambda self, x: pytest.fail("operator path taken"))
        assert torch.equal(q(x), ref)
    assert run.dequantize_workspace == 0  # (CPU)
    with pytest.raises(ValueError, match="out"):
        run.dequantize(torch.empty(96, 255))
    with pytest.raises(TypeError, match="out"):
        run.dequantize(torch.empty(96, 256, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        run.dequantize(torch.empty(256, 96).T)


def test_from_linear_keeps_bias_and_leaves_linear_alone(reference_path):
    lin = _linear()
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    q = QuantizedLinear.from_linear(lin, "int4", group_size=64)
    assert torch.equal(lin.weight, w0) and torch.equal(lin.bias, b0)
    assert isinstance(q.bias, torch.nn.Parameter) and torch.equal(q.bias, b0)
    assert q.bias.data_ptr() != lin.bias.data_ptr()  # a copy
    assert (q.in_features, q.out_features, q.weight_dtype) == (256, 96, "float32")
    assert not hasattr(q, "weight")
    x = torch.randn(3, 256)
    assert torch.equal(q(x), F.linear(x, q.dequantize_weight(), q.bias))
    nob = QuantizedLinear.from_linear(_linear(bias=False), "nf4")
    assert nob.bias is None and set(nob.state_dict()) == {"packed", "absmax"}
    assert torch.equal(nob(x), F.linear(x, nob.dequantize_weight(), None))


def test_from_linear_fp16_weight_records_dtype(reference_path):
    lin = _linear().half()
    q = QuantizedLinear.from_linear(lin, "int8")
    assert q.weight_dtype == "float16" and q.bias.dtype == torch.float16
    assert q.dequantize_weight().dtype == torch.float16
    x = torch.randn(4, 256)
    assert torch.equal(q(x), F.linear(x, q.dequantize_weight(torch.float32), q.bias.float()))


@pytest.mark.parametrize("fmt,params", CASES, ids=IDS)
def test_state_dict_round_trip(fmt, params):
    q = QuantizedLinear.from_linear(_linear(), fmt, **params)
    sd = q.state_dict()
    assert set(sd) == {"bias", *q.buffer_names}
    assert all(sd[n].dtype == getattr(q, n).dtype for n in q.buffer_names)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd2 = torch.load(buf, weights_only=True)
    fresh = QuantizedLinear(256, 96, True, format=fmt, params=q.params)
    fresh.load_state_dict(sd2)
    x = torch.randn(3, 256)
    assert torch.equal(fresh(x), q(x))
    # the same through a meta skeleton and assign=True
    skel = QuantizedLinear.from_config(q.config(), device="meta")
    skel.load_state_dict(sd2, assign=True)
    assert torch.equal(skel(x), q(x))


@pytest.mark.parametrize("fmt,params", CASES, ids=IDS)
def test_deepcopy_pickle_and_dequantize_weight(fmt, params):
    """copy.deepcopy and torch.save of a whole layer (the bound kernel is made again), and
    dequantize_weight equal to the format's own dequantize (formats with derived tensors,
    such as nf4 with compressed statistics, included)."""
    import copy

    q = QuantizedLinear.from_linear(_linear(), fmt, **params)
    x = torch.randn(3, 256)
    y = q(x)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    for other in (copy.deepcopy(q), torch.load(buf, weights_only=False)):
        assert other._kernel is not None or q._kernel is None
        assert torch.equal(other(x), y)
        assert all(getattr(other, n).data_ptr() != getattr(q, n).data_ptr()  # copies
                   for n in q.buffer_names if getattr(q, n).numel())
    mod = getattr(qformats, fmt)
    assert torch.equal(q.dequantize_weight(torch.float32), mod.dequantize(q.quantized_weight))


def test_state_dict_mismatches_raise():
    q = QuantizedLinear.from_linear(_linear(), "int4", group_size=64)
    sd = q.state_dict()
    bad = dict(sd, scales=sd["scales"].half())
    fresh = QuantizedLinear(256, 96, format="int4", params=q.params)
    with pytest.raises(RuntimeError, match="dtype mismatch"):
        fresh.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="size mismatch"):
        QuantizedLinear(256, 96, format="int4", params={"group_size": 128}).load_state_dict(sd)
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict({k: v for k, v in sd.items() if k != "zeros"})


def test_conversions_keep_packed_dtypes(reference_path):
    q = QuantizedLinear.from_linear(_linear(), "mixed2bit")
    before = {n: getattr(q, n).clone() for n in q.buffer_names}
    for conv in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.float(),
                 lambda m: m.to("cpu"), lambda m: m.double()):
        conv(q)
        for n in q.buffer_names:
            assert getattr(q, n).dtype == before[n].dtype
            assert torch.equal(getattr(q, n), before[n])
    assert q.bias.dtype == torch.float64
    q.to(torch.bfloat16)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    assert torch.equal(q(x), F.linear(x, q.dequantize_weight(torch.bfloat16), q.bias))
    e = q.to_empty(device="meta")
    assert all(getattr(e, n).device.type == "meta" for n in e.buffer_names)
    assert all(getattr(e, n).dtype == before[n].dtype for n in e.buffer_names)


def test_repr_and_sizes():
    q = QuantizedLinear.from_linear(_linear(), "int4", group_size=64)
    r = repr(q)
    for s in ("in_features=256", "out_features=96", "format=int4", "group_size=64",
              "symmetric=False", "bits=4.625", "bias=True"):
        assert s in r, r
    assert q.nbytes == q.quantized_weight.nbytes == 96 * (128 + 4 * 4 + 4)
    assert q.avg_bits == pytest.approx(q.quantized_weight.avg_bits)
    net = torch.nn.Sequential(q, torch.nn.ReLU())
    assert quantized_linears(net) == [("0", q)]


def test_bad_input_and_arguments():
    q = QuantizedLinear.from_linear(_linear(), "q4_0")
    with pytest.raises(ValueError, match=r"\[\.\.\., 256\]"):
        q(torch.randn(3, 128))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        q(torch.ones(3, 256, dtype=torch.int32))
    with pytest.raises(TypeError):
        q(torch.randn(3, 256).double())
    with pytest.raises(TypeError, match="nn.Linear"):
        QuantizedLinear.from_linear(torch.nn.Conv1d(3, 3, 1), "q4_0")
    lin = _linear()
    with pytest.raises(TypeError, match="weight: expected a torch.Tensor"):
        QuantizedLinear.from_weight(lin.weight.detach().numpy(), None, "q4_0")
    with pytest.raises(TypeError, match="bias: expected a torch.Tensor"):
        QuantizedLinear.from_weight(lin.weight, lin.bias.tolist(), "q4_0")
    with pytest.raises(ValueError, match="bias: expected shape"):
        QuantizedLinear.from_weight(lin.weight, lin.bias[:-1], "q4_0")
    with pytest.raises(ValueError, match="unknown qformats format"):
        QuantizedLinear.from_linear(_linear(), "q5_k")
    with pytest.raises(ValueError, match="unknown qformats format"):
        QuantizedLinear(256, 96, format="fp8")
    with pytest.raises(ValueError, match="multiple"):
        QuantizedLinear.from_linear(_linear(in_f=200), "q4_0")
    with pytest.raises(ValueError):
        QuantizedLinear(256, 96, format="int4", params={"group_size": 100})
    with pytest.raises(TypeError):
        QuantizedLinear.from_linear(_linear(), "int4", group_size="64")
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedLinear(256, 96, format="mixed2bit", params={"group_size": 16})  # no n4/n_out


def test_numpy_quantized_tensor_through_ops(reference_path):
    w = _linear().weight.detach().numpy()
    qt = qformats.nf4.quantize(w)
    x = torch.randn(2, 256)
    y = ops.linear(x, qt)
    assert torch.equal(y, F.linear(x, torch.from_numpy(qt.dequantize("float32"))))
    assert torch.equal(ops.dequantize(qt), torch.from_numpy(qt.dequantize("float32")))


def test_gradient_wrt_input_and_bias():
    q = QuantizedLinear.from_linear(_linear(), "int4", group_size=64)
    x = torch.randn(4, 3, 256, requires_grad=True)
    (q(x) ** 2).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    b2 = q.bias.detach().clone().requires_grad_()
    (F.linear(x2, q.dequantize_weight(), b2) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(q.bias.grad, b2.grad)


def test_kernel_dispatch_hook():
    q = QuantizedLinear.from_linear(_linear(), "int8")
    x = torch.randn(2, 256)
    expected = q(x)
    calls = []

    def kernel(xx, qt, bias):
        calls.append(qt.format)
        return NotImplemented if xx.shape[0] == 2 else torch.zeros(*xx.shape[:-1], qt.shape[0])

    assert ops.register_linear_kernel("int8", "cpu", kernel) is None
    try:
        assert torch.equal(q(x), expected)          # the kernel declined: reference path
        assert torch.count_nonzero(q(torch.randn(3, 256))) == 0  # the kernel's answer
        assert calls == ["int8", "int8"]
    finally:
        assert ops.register_linear_kernel("int8", "cpu", None) is kernel
    assert torch.equal(q(x), expected)
    with pytest.raises(ValueError):
        ops.register_linear_kernel("int9", "cpu", kernel)


def test_torch_compile_fullgraph_default_backend(make_small_net):
    """The default backend (inductor; needs the C++ compiler, ~10 s cold here)."""
    net = make_small_net()
    net[0] = QuantizedLinear.from_linear(net[0], "int4", group_size=64)
    net[2] = QuantizedLinear.from_linear(net[2], "mixed2bit", ratio_4bit=0.0)
    x = torch.randn(4, 256)
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True)
    with torch.no_grad():
        eager = net(x)
        got = compiled(x)
    # inductor fuses the GELU / bias arithmetic: equal up to float32 rounding
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)


def test_torch_compile_fullgraph_hf_model(make_tiny_llama):
    """A quantized Hugging Face Llama traces as one graph (aot_eager: bit-identical)."""
    model = make_tiny_llama()
    qformats.quantize_model(model, bits=4, group_size=32,
                            overrides={"*.down_proj": {"bits": 2}, "*.o_proj": {"format": "nf4"}})
    ids = torch.randint(0, 256, (2, 16))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        eager = model(input_ids=ids, use_cache=False).logits
        got = compiled(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, eager)


def test_fake_implementations():
    q = QuantizedLinear.from_linear(_linear(), "nf4")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(7, 3, 256, dtype=torch.bfloat16))
        bufs = [mode.from_tensor(getattr(q, n)) for n in q.buffer_names]
        y = torch.ops.qformats.linear(x, q._meta, bufs, None)
        w = torch.ops.qformats.dequantize(q._meta, bufs, torch.float16)
    assert y.shape == (7, 3, 96) and y.dtype == torch.bfloat16
    assert w.shape == (96, 256) and w.dtype == torch.float16


def test_crossover_row_buckets():
    """The measured-crossover buckets: multiples of 8 up to 128 rows, powers of two above (a prompt
    of any length above 128 rows shares a decision with the others of its octave); every count
    lies in its bucket, and the buckets only grow."""
    from qformats.crossover import bucket

    assert [bucket(r) for r in (1, 8, 9, 17, 127, 128)] == [8, 8, 16, 24, 128, 128]
    assert [bucket(r) for r in (129, 256, 257, 1000, 2048, 2049, 4096)] == [256, 256, 512, 1024, 2048, 4096, 4096]
    b = [bucket(r) for r in range(1, 5000)]
    assert all(r <= v for r, v in zip(range(1, 5000), b)) and b == sorted(b)


def test_formats_with_a_prefill_kernel_measure_up_to_4096_rows():
    """int4, nf4 and q4_0 (whose CUDA kernels decode inside a wgmma main loop from 65 fp16 rows)
    let QuantizedLinear measure kernel against dequantize + cuBLAS up to 4096 rows on CUDA; the
    other formats with CUDA weight-only kernels up to 128."""
    from qformats import format_spec

    assert {f: format_spec(f).tune_rows.get("cuda") for f in ("int4", "nf4", "q4_0", "mixed2bit")} == {
        "int4": 4096, "nf4": 4096, "q4_0": 4096, "mixed2bit": 128}
