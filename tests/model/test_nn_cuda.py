"""QuantizedLinear on a CUDA device (skipped without one): packed buffers move with .to(),
quantizing a CUDA layer gives the CPU's bytes, the forward equals F.linear on the dequantized
weight, and a quantized model compiles with fullgraph and replays in a CUDA graph."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from conftest import requires_cuda  # noqa: E402
from qformats import ops, quantize_model  # noqa: E402
from qformats._core import format_spec  # noqa: E402
from qformats.nn import QuantizedLinear  # noqa: E402
from strategies import assert_bytes_equal  # noqa: E402

pytestmark = requires_cuda

CASES = [("q4_0", {}), ("q8_0", {}), ("q8_1", {}), ("int8", {}), ("int4", {"group_size": 64}),
         ("int4", {"group_size": 128, "symmetric": True}), ("nf4", {}),
         ("nf4", {"compress_statistics": True}), ("mixed2bit", {})]


@pytest.mark.parametrize("fmt,params", CASES, ids=[f"{f}-{p}" for f, p in CASES])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_forward_and_bytes(fmt, params, dtype, monkeypatch):
    monkeypatch.setenv("QFORMATS_TUNE", "0")  # the fixed paths (measured choices: test below)
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96).to(dtype)
    q_cpu = QuantizedLinear.from_linear(lin, fmt, **params)
    q_gpu = QuantizedLinear.from_linear(lin.cuda(), fmt, **params)
    for name, buf in q_cpu.quantized_weight.buffers.items():  # quantized on the GPU == on the CPU
        assert_bytes_equal(q_gpu.quantized_weight.buffers[name].cpu(), buf)
    moved = q_cpu.to("cuda")
    w = moved.quantized_weight.dequantize(str(dtype).removeprefix("torch."))
    for shape in ((3, 7, 256), (2, 256), (1, 256)):  # 21 rows: dequantize + cuBLAS; 1-2: our kernels
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        y = moved(x)
        assert y.is_cuda and y.dtype == dtype and y.shape == (*shape[:-1], 96)
        ref = F.linear(x, w, moved.bias.to(dtype))
        if x.numel() // 256 > format_spec(fmt).linear_rows.get("cuda", 0):
            assert torch.equal(y, ref)
        else:
            tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
            scale = (x.abs().float() @ w.abs().float().T).max()
            assert (y.float() - ref.float()).abs().max() <= tol * scale
            # the bias fused into the kernel's epilogue: bitwise the two-step gemm, then + bias
            two_step = format_spec(fmt).gemm(x.reshape(-1, 256), moved.quantized_weight) + moved.bias.to(dtype)
            assert torch.equal(y, two_step.reshape(y.shape))
        assert torch.equal(q_gpu(x), y)
    try:  # with the built-in kernels off, every shape takes the reference path exactly
        ops.use_builtin_kernels(cuda=False)
        x = torch.randn(2, 256, device="cuda", dtype=dtype)
        assert torch.equal(moved(x), F.linear(x, w, moved.bias.to(dtype)))
    finally:
        ops.use_builtin_kernels(cuda=True)


def test_cuda_compiled_model_and_graph_replay():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
    model = model.half().cuda()
    quantize_model(model, bits=4, group_size=64, ignore=[])
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(x), eager, rtol=1e-3, atol=1e-3)
        # CUDA graphs: capture the eager quantized forward once and replay it on new input.
        static_x = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(static_x)  # warm-up on the side stream, as torch's graph docs do
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = model(static_x)
        x2 = torch.randn_like(x)
        static_x.copy_(x2)
        graph.replay()
        torch.testing.assert_close(static_y, model(x2), rtol=0, atol=0)


@pytest.mark.parametrize("fmt,params", [("int4", {"group_size": 64}), ("nf4", {}), ("q4_0", {}),
                                        ("mixed2bit", {})])
def test_cuda_measured_crossover(fmt, params, monkeypatch):
    """Between linear_rows and tune_rows the layer takes whichever path measured faster: its
    output is bitwise one of the two, the choice is recorded once per row bucket and kept,
    QFORMATS_TUNE=0 takes the dequantizing path, and a CUDA graph capture measures nothing."""
    from qformats import crossover

    crossover.reset()
    monkeypatch.delenv("QFORMATS_TUNE", raising=False)
    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(torch.nn.Linear(1024, 512).half().cuda(), fmt, **params)
    spec = format_spec(fmt)
    lo, hi = spec.linear_rows["cuda"], spec.tune_rows["cuda"]
    for rows in (lo + 1, 32, 40, hi):  # four row buckets: 24, 32, 40 and hi's
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.float16)
        kernel = spec.gemm(x, q.quantized_weight) + q.bias
        deq = F.linear(x, q.dequantize_weight(torch.float16), q.bias)
        with torch.no_grad():
            y = q(x)
        won = [v for k, v in crossover.decisions().items() if k[-1] == crossover.bucket(rows)]
        assert len(won) == 1
        assert torch.equal(y, kernel if won[0] else deq), (rows, won)
        with torch.no_grad():
            assert torch.equal(q(x), y)  # decided once
    assert len(crossover.decisions()) == 4
    monkeypatch.setenv("QFORMATS_TUNE", "0")
    x = torch.randn(24, 1024, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        assert torch.equal(q(x), F.linear(x, q.dequantize_weight(torch.float16), q.bias))
    monkeypatch.delenv("QFORMATS_TUNE")
    crossover.reset()
    x = torch.randn(hi, 1024, device="cuda", dtype=torch.float16)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad():
        q(x[:1])  # warm the N = 1 kernel outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            y = q(x)
    g.replay()
    torch.cuda.synchronize()
    assert crossover.decisions() == {}
    assert torch.equal(y, F.linear(x, q.dequantize_weight(torch.float16), q.bias))


@pytest.mark.parametrize("fmt,params", [("int4", {"group_size": 64}), ("nf4", {"compress_statistics": True}),
                                        ("q4_0", {}), ("mixed2bit", {}), ("int8", {}),
                                        ("int8", {"granularity": "group", "group_size": 64})])
def test_cuda_bound_dense_path(fmt, params, monkeypatch):
    """Past tune_rows the layer decodes with its bound kernel (``Linear.dequantize`` on the
    current stream) and calls F.linear itself: bitwise the operator path, which it does not
    call; the decode equals the format's dequantize, needs its workspace where it has one
    (mixed2bit) and refuses an output on another device."""
    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(torch.nn.Linear(1024, 512).cuda(), fmt, **params)
    run = q._kernel
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        w = torch.full((512, 1024), float("nan"), device="cuda", dtype=dtype)
        nbytes = run.dequantize_workspace
        ws = torch.empty(nbytes, dtype=torch.uint8, device="cuda") if nbytes else None
        run.dequantize(w, ws, torch.cuda.current_stream().cuda_stream)
        assert torch.equal(w, q.dequantize_weight(dtype))
    if run.dequantize_workspace:
        with pytest.raises(ValueError, match="workspace"):
            run.dequantize(torch.empty(512, 1024, device="cuda"))
    with pytest.raises(ValueError, match="device"):
        run.dequantize(torch.empty(512, 1024))
    if format_spec(fmt).linear_rows["cuda"] == 0:  # bound for the decode only (int8)
        x = torch.randn(2, 1024, device="cuda", dtype=torch.float16)
        with pytest.raises(ValueError, match="no CUDA weight-only kernel"):
            run(x, torch.empty(2, 512, device="cuda", dtype=torch.float16), None,
                torch.cuda.current_stream().cuda_stream)
    hi = format_spec(fmt).tune_rows.get("cuda", 64)
    for rows, dtype in ((hi + 1, torch.float16), (hi + 300, torch.bfloat16), (max(2048, 2 * hi), torch.float16)):
        x = torch.randn(rows, 1024, device="cuda", dtype=dtype)
        with torch.no_grad():
            ref = q._operator(x)
            with monkeypatch.context() as m:
                m.setattr(QuantizedLinear, "_operator", lambda self, x: pytest.fail("operator path taken"))
                assert torch.equal(q(x), ref)
