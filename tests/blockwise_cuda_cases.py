"""GPU tests shared by the fixed-size-block formats (q4_0, q8_0, q8_1), which run on the same CUDA
driver (src/common/blockwise_cuda.cuh). A format's test module calls
``add_blockwise_gpu_tests(globals(), fmt_module, quantize, dequantize)``."""
import pytest
from hypothesis import given, settings

from qformats import _arrays as A
from strategies import assert_bytes_equal, float_inputs, misaligned_copy, on_cuda


def add_blockwise_gpu_tests(namespace: dict, fmt, quantize, dequantize) -> None:
    torch = pytest.importorskip("torch")
    record = fmt.BLOCK_BYTES

    @settings(max_examples=200, deadline=None)
    @given(float_inputs(block=32, max_rows=4, max_blocks=12))
    def test_gpu_quantize_equals_cpu_and_reference(inp):
        ref = fmt.reference.quantize(inp.x32)
        if A.fp16_field_overflowed(ref, 0):
            with pytest.raises(ValueError, match="overflows fp16"):
                quantize(on_cuda(inp.x))
            return
        g = quantize(on_cuda(inp.x))
        assert g.is_cuda
        assert_bytes_equal(g, ref)
        assert_bytes_equal(g, quantize(inp.x))
        for dtype in ("float32", "float16", "bfloat16"):
            gd = dequantize(g, inp.x32.shape[-1], dtype)
            cd = dequantize(torch.from_numpy(ref), inp.x32.shape[-1], dtype)
            assert gd.is_cuda and gd.dtype == getattr(torch, dtype)
            assert_bytes_equal(gd, cd)

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    @pytest.mark.parametrize("shape", [(1, 32), (3, 4096), (1000, 96), (257, 8192)])
    def test_gpu_large_and_misaligned(shape, dtype):
        tdt = getattr(torch, dtype)
        x = torch.randn(shape, dtype=tdt) * torch.logspace(-3, 3, shape[0])[:, None].to(tdt)
        cpu = quantize(x)
        assert_bytes_equal(quantize(x.cuda()), cpu)
        assert_bytes_equal(quantize(misaligned_copy(x)), cpu)
        k = shape[-1]
        want = dequantize(cpu, k, dtype)
        out_mis = misaligned_copy(torch.zeros(shape, dtype=tdt))
        fmt._native.dequantize(cpu.cuda(), out_mis, torch.cuda.current_stream().cuda_stream)
        assert_bytes_equal(out_mis, want)
        assert_bytes_equal(dequantize(misaligned_copy(cpu), k, dtype), want)

    def test_gpu_runs_on_the_callers_stream():
        x = torch.randn(512, 4096, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
        with torch.cuda.stream(s):
            y = x * 2  # queued on s: quantize must come after it
            q = quantize(y)
        s.synchronize()
        assert_bytes_equal(q, quantize((x * 2).cpu()))

    def test_gpu_output_poisoned_then_fully_written():
        x = torch.randn(300, 1024, device="cuda")
        out = torch.full((300, 32, record), 0xAB, dtype=torch.uint8, device="cuda")
        fmt._native.quantize(x, out, torch.cuda.current_stream().cuda_stream)
        assert_bytes_equal(out, quantize(x.cpu()))

    def test_gpu_mixed_devices_raise():
        x = torch.randn(4, 64)
        blocks = quantize(x).cuda()
        out = torch.empty(4, 64)
        with pytest.raises(ValueError, match="same device"):
            fmt._native.dequantize(blocks, out, 0)
        with pytest.raises(ValueError, match="contiguous"):
            quantize(torch.randn(64, 64, device="cuda").t())

    for name, fn in list(locals().items()):
        if name.startswith("test_"):
            namespace[name] = fn
