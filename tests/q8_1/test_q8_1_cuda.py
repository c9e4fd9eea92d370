"""q8_1 on the GPU: bytes equal the CPU and the reference; dequantize equal; streams; layouts."""
import numpy as np
import pytest
from hypothesis import given, settings

from conftest import requires_cuda
from qformats import _arrays as A, q8_1
from strategies import assert_bytes_equal, float_inputs, misaligned_copy, on_cuda

pytestmark = requires_cuda
torch = pytest.importorskip("torch")


@settings(max_examples=200, deadline=None)
@given(float_inputs(block=32, max_rows=4, max_blocks=12))
def test_gpu_quantize_equals_cpu_and_reference(inp):
    ref = q8_1.reference.quantize(inp.x32)
    if A.fp16_field_overflowed(ref, 0):
        with pytest.raises(ValueError, match="overflows fp16"):
            q8_1.quantize_q8_1(on_cuda(inp.x))
        return
    g = q8_1.quantize_q8_1(on_cuda(inp.x))
    assert g.is_cuda
    assert_bytes_equal(g, ref)
    assert_bytes_equal(g, q8_1.quantize_q8_1(inp.x))
    for dtype in ("float32", "float16", "bfloat16"):
        gd = q8_1.dequantize_q8_1(g, inp.x32.shape[-1], dtype)
        cd = q8_1.dequantize_q8_1(torch.from_numpy(ref), inp.x32.shape[-1], dtype)
        assert gd.is_cuda and gd.dtype == getattr(torch, dtype)
        assert_bytes_equal(gd, cd)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 32), (3, 4096), (1000, 96), (257, 8192)])
def test_gpu_large_and_misaligned(shape, dtype):
    x = torch.randn(shape, dtype=getattr(torch, dtype)) * torch.logspace(-3, 3, shape[0])[:, None].to(getattr(torch, dtype))
    cpu = q8_1.quantize_q8_1(x)
    assert_bytes_equal(q8_1.quantize_q8_1(x.cuda()), cpu)
    assert_bytes_equal(q8_1.quantize_q8_1(misaligned_copy(x)), cpu)
    k = shape[-1]
    want = q8_1.dequantize_q8_1(cpu, k, dtype)
    out_mis = misaligned_copy(torch.zeros(shape, dtype=getattr(torch, dtype)))
    q8_1._native.dequantize(cpu.cuda(), out_mis, torch.cuda.current_stream().cuda_stream)
    assert_bytes_equal(out_mis, want)
    assert_bytes_equal(q8_1.dequantize_q8_1(misaligned_copy(cpu), k, dtype), want)


def test_gpu_runs_on_the_callers_stream():
    x = torch.randn(512, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
    with torch.cuda.stream(s):
        y = x * 2  # queued on s: quantize must come after it
        q = q8_1.quantize_q8_1(y)
    s.synchronize()
    assert_bytes_equal(q, q8_1.quantize_q8_1((x * 2).cpu()))


def test_gpu_output_poisoned_then_fully_written():
    x = torch.randn(300, 1024, device="cuda")
    out = torch.full((300, 32, 36), 0xAB, dtype=torch.uint8, device="cuda")
    q8_1._native.quantize(x, out, torch.cuda.current_stream().cuda_stream)
    assert_bytes_equal(out, q8_1.quantize_q8_1(x.cpu()))


def test_gpu_mixed_devices_raise():
    x = torch.randn(4, 64)
    blocks = q8_1.quantize_q8_1(x).cuda()
    out = torch.empty(4, 64)
    with pytest.raises(ValueError, match="same device"):
        q8_1._native.dequantize(blocks, out, 0)
    with pytest.raises(ValueError, match="contiguous"):
        q8_1.quantize_q8_1(torch.randn(64, 64, device="cuda").t())
