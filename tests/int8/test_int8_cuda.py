"""int8 on the GPU: bytes equal the CPU and the reference for every granularity and input
dtype; dequantize equal for every output dtype; every team size and the long-unit (segment)
path; misaligned pointers; the caller's stream; poisoned outputs; device mixes."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import requires_cuda
import qformats.int8 as I
from qformats import QuantizedTensor
from qformats.int8 import reference as R
from strategies import assert_bytes_equal, float_inputs, misaligned_copy, on_cuda

pytestmark = requires_cuda
torch = pytest.importorskip("torch")

FLOATS = ("float32", "float16", "bfloat16")
GRANULARITIES = [("tensor", 128), ("row", 128), ("group", 3), ("group", 8), ("group", 16), ("group", 32),
                 ("group", 64)]


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _assert_decodes_equal(gq: QuantizedTensor) -> None:
    """GPU dequantize == CPU dequantize of the same buffers, bytes, for every output dtype."""
    cq = gq.to("cpu")
    for dtype in FLOATS:
        gd = gq.dequantize(dtype)
        assert gd.is_cuda and gd.dtype == getattr(torch, dtype) and tuple(gd.shape) == gq.shape
        assert_bytes_equal(gd, cq.dequantize(dtype))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_gpu_quantize_equals_cpu_and_reference(data):
    g, gs = data.draw(st.sampled_from(GRANULARITIES), label="granularity")
    block = gs if g == "group" else data.draw(st.sampled_from([1, 3, 8]), label="block")
    inp = data.draw(float_inputs(block=block, max_rows=4, max_blocks=12), label="x")
    rq, rs = R.quantize(inp.x32, g, gs)
    gq = I.quantize(on_cuda(inp.x), g, gs)
    assert gq.buffers["q"].is_cuda and gq.buffers["scale"].is_cuda and gq.dtype == inp.dtype
    cq = I.quantize(inp.x, g, gs)
    for name, ref in (("q", rq), ("scale", rs)):
        assert_bytes_equal(gq.buffers[name], ref)
        assert_bytes_equal(gq.buffers[name], cq.buffers[name])
    _assert_decodes_equal(gq)


def _spiky(shape, dtype, seed):
    """Gaussian rows at scales 1e-3..1e3 with one large value planted per row at a random
    place (so the absmax sits in a different lane / segment in every row)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.logspace(-3, 3, shape[0], dtype=np.float32)[:, None]
    if shape[1]:
        cols = rng.integers(0, shape[1], shape[0])
        x[np.arange(shape[0]), cols] = np.where(rng.random(shape[0]) < 0.5, -1, 1) * 8 * np.abs(x).max(axis=1)
    return torch.from_numpy(x).to(getattr(torch, dtype))


def _check_everywhere(x, g, gs):
    """CPU result == GPU result for aligned and misaligned input, and the decodes, including
    into a misaligned output."""
    cpu = I.quantize(x, g, gs)
    for xx in (x.cuda(), misaligned_copy(x)):
        gq = I.quantize(xx, g, gs)
        assert_bytes_equal(gq.buffers["q"], cpu.buffers["q"])
        assert_bytes_equal(gq.buffers["scale"], cpu.buffers["scale"])
    _assert_decodes_equal(gq)
    # misaligned codes in (vector path off) and misaligned output
    unit = R.unit_len(tuple(x.shape), g, gs)
    codes, scale = misaligned_copy(cpu.buffers["q"]), cpu.buffers["scale"].cuda()
    for dtype in FLOATS:
        out = misaligned_copy(torch.zeros(x.shape, dtype=getattr(torch, dtype)))
        I._native.dequantize(codes, scale, out, unit, _stream())
        assert_bytes_equal(out, cpu.dequantize(dtype))
    # aligned input, misaligned codes out
    q_out = misaligned_copy(torch.zeros(x.shape, dtype=torch.int8))
    s_out = torch.empty(cpu.buffers["scale"].shape, dtype=torch.float32, device="cuda")
    I._native.quantize(x.cuda(), q_out, s_out, unit, _stream())
    assert_bytes_equal(q_out, cpu.buffers["q"])
    assert_bytes_equal(s_out, cpu.buffers["scale"])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 8), (3, 4096), (1000, 4096), (257, 8192)])
@pytest.mark.parametrize("g,gs", [("tensor", 0), ("row", 0), ("group", 64), ("group", 128)])
def test_gpu_large_and_misaligned(shape, dtype, g, gs):
    if g == "group" and shape[1] % gs:
        pytest.skip("K not a multiple of the group")
    _check_everywhere(_spiky(shape, dtype, 0), g, gs or 128)


# Unit lengths around every team size (1..512 threads of 4 chunks) and past a CTA (the
# segment path): multiples of 8 take the vector path (8 values a chunk: a CTA holds 16384),
# the others the element path (1 value a chunk: a CTA holds 2048).
UNIT_LENGTHS = [8, 24, 40, 264, 520, 4104, 16376, 16384, 16392, 40000, 65544,
                1, 3, 5, 33, 255, 1023, 2047, 2048, 2049, 6001]


@pytest.mark.parametrize("unit", UNIT_LENGTHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_large_unit_lengths(unit, dtype):
    rows = 5 if unit < 20000 else 3
    x = _spiky((rows, 2 * unit), dtype, unit)
    for g, gs in (("row", 128), ("group", unit)):
        _check_everywhere(x, g, gs)


@pytest.mark.parametrize("shape", [(0, 32), (3, 0), (0,), (5,), (2, 3, 32)])
@pytest.mark.parametrize("g", ["tensor", "row", "group"])
def test_gpu_shapes_and_empty(shape, g):
    x = torch.randn(shape)
    gs = 32 if len(shape) and shape[-1] % 32 == 0 and shape[-1] else 1
    cpu = I.quantize(x, g, gs)
    gq = I.quantize(x.cuda(), g, gs)
    for name in ("q", "scale"):
        assert_bytes_equal(gq.buffers[name], cpu.buffers[name])
    _assert_decodes_equal(gq)


def test_gpu_seed_calls_per_tensor():
    x = _spiky((300, 1000), "float16", 5)
    q, s = I.quantize_tensor(x.cuda())
    cq, cs = I.quantize_tensor(x)
    assert_bytes_equal(q, cq)
    assert_bytes_equal(s, cs)
    d = I.dequantize_tensor(q, s)
    assert d.is_cuda and d.dtype == torch.float32
    assert_bytes_equal(d, I.dequantize_tensor(cq, cs))


def test_gpu_runs_on_the_callers_stream():
    x = torch.randn(512, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
    with torch.cuda.stream(s):
        y = x * 2  # queued on s: quantize must come after it
        row = I.quantize(y, "row")
        ten = I.quantize(y, "tensor")  # the segment path, with its stream-ordered workspace
        d = row.dequantize("float16")
    s.synchronize()
    xc = (x * 2).cpu()
    for qt, g in ((row, "row"), (ten, "tensor")):
        cpu = I.quantize(xc, g)
        assert_bytes_equal(qt.buffers["q"], cpu.buffers["q"])
        assert_bytes_equal(qt.buffers["scale"], cpu.buffers["scale"])
    assert_bytes_equal(d, I.quantize(xc, "row").dequantize("float16"))


@pytest.mark.parametrize("g,gs", [("tensor", 0), ("row", 0), ("group", 64), ("group", 5)])
def test_gpu_output_poisoned_then_fully_written(g, gs):
    shape = (300, 1040) if g == "group" and gs == 5 else (300, 1024)
    x = torch.randn(shape, device="cuda")
    cpu = I.quantize(x.cpu(), g, gs or 128)
    unit = R.unit_len(shape, g, gs)
    q = torch.full(shape, 0x55, dtype=torch.int8, device="cuda")
    scale = torch.full(cpu.buffers["scale"].shape, float("nan"), device="cuda")
    I._native.quantize(x, q, scale, unit, _stream())
    assert_bytes_equal(q, cpu.buffers["q"])
    assert_bytes_equal(scale, cpu.buffers["scale"])
    for dtype in FLOATS:
        out = torch.full(shape, float("nan"), dtype=getattr(torch, dtype), device="cuda")
        I._native.dequantize(q, scale, out, unit, _stream())
        assert_bytes_equal(out, cpu.dequantize(dtype))


def test_gpu_mixed_devices_raise():
    x = torch.randn(4, 64)
    qt = I.quantize(x, "row")
    mixed = QuantizedTensor("int8", qt.shape, qt.dtype, qt.params,
                            {"q": qt.buffers["q"].cuda(), "scale": qt.buffers["scale"]})
    with pytest.raises(ValueError, match="device"):
        I.dequantize(mixed)
    with pytest.raises(ValueError, match="same device"):
        I._native.dequantize(qt.buffers["q"].cuda(), qt.buffers["scale"], torch.empty(4, 64, device="cuda"), 64, 0)
    with pytest.raises(ValueError, match="same device"):
        I._native.quantize(x.cuda(), torch.empty(4, 64, dtype=torch.int8), torch.empty(4, 1, device="cuda"), 64, 0)
    with pytest.raises(ValueError, match="contiguous"):
        I.quantize(torch.randn(64, 64, device="cuda").t())
    with pytest.raises(ValueError, match="device"):
        I.dequantize_tensor(torch.zeros(4, 8, dtype=torch.int8, device="cuda"), torch.ones(1, 1))


def test_gpu_matmul_checks_devices():
    a = torch.zeros(2, 8, dtype=torch.int8, device="cuda")
    assert I.int8_matmul(a, a).is_cuda
    with pytest.raises(ValueError, match="device"):
        I.int8_matmul(a.cpu(), a)
    with pytest.raises(ValueError, match="same device"):  # the native adapter on its own
        I._native.int8_matmul(a, a, torch.empty(2, 2, dtype=torch.int32), 2, 2, 8, 0)
