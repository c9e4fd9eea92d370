"""CUDA decoders and GEMMs fed hostile buffers: random bytes in the buffers of every format
(the shapes and dtypes a real tensor has, any contents: NaN/Inf/huge scales, any codes, lying
mixed2bit maps and outlier indices, compressed nf4 statistics). Every call either raises the
same clear exception as the CPU (ValueError / TypeError) or returns what the CPU returns for
the same bytes; compute-sanitizer memcheck over these tests (`SANITIZE_K=hostile
tools/gpu_check.sh sanitize`) checks that nothing is read or written out of bounds."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import requires_cuda

import qformats
from qformats import QuantizedTensor

pytestmark = requires_cuda
torch = pytest.importorskip("torch")

SEEDS = range(20)
# Per format, keyword arguments of quantize giving several buffer layouts.
VARIANTS = {
    "q4_0": [{}], "q8_1": [{}],
    "int8": [{"granularity": "row"}, {"granularity": "group", "group_size": 64}],
    "int4": [{"group_size": 64}, {"group_size": 128, "symmetric": True}],
    "nf4": [{"blocksize": 64}, {"blocksize": 64, "compress_statistics": True}],
    "mixed2bit": [{}],
}
CASES = [(f, kw) for f in qformats.FORMATS for kw in VARIANTS[f]]


def _hostile(qt: QuantizedTensor, rng: np.random.Generator) -> QuantizedTensor:
    """qt with random bytes in a random non-empty subset of its buffers (keeping some buffers
    intact lets the hostile ones reach the kernels past the structural checks)."""
    names = sorted(qt.buffers)
    pick = [n for n in names if rng.random() < 0.5] or [names[rng.integers(len(names))]]
    bufs = {}
    for k, b in qt.buffers.items():
        a = np.asarray(b)
        if k in pick:
            a = rng.integers(0, 256, a.nbytes, dtype=np.uint8).view(a.dtype).reshape(a.shape)
        bufs[k] = a
    return QuantizedTensor(qt.format, qt.shape, qt.dtype, dict(qt.params), bufs)


def _same(g, c, what):
    c = torch.as_tensor(np.asarray(c)) if not isinstance(c, torch.Tensor) else c
    torch.testing.assert_close(g.cpu(), c, rtol=0, atol=0, equal_nan=True, msg=what)


@pytest.mark.parametrize("fmt, kw", CASES, ids=[f"{f}-{'-'.join(map(str, kw.values())) or 'default'}"
                                                 for f, kw in CASES])
def test_hostile_buffers_cuda_decode_and_gemm(fmt, kw):
    mod = getattr(qformats, fmt)
    rng = np.random.default_rng(1234)
    w = rng.standard_normal((48, 512)).astype(np.float16)
    good = mod.quantize(w, **kw)
    decoded = errors = 0
    for seed in SEEDS:
        cq = _hostile(good, np.random.default_rng(seed))
        try:
            c = cq.dequantize()
        except (ValueError, TypeError) as e:
            with pytest.raises(type(e)):
                cq.to("cuda").dequantize()
            errors += 1
            continue
        gq = cq.to("cuda")
        _same(gq.dequantize(), c, f"{fmt} seed {seed}: CUDA dequantize != CPU")
        decoded += 1
        if not hasattr(mod, "gemm") or fmt == "q8_1":
            continue
        for n in (1, 5):
            x = torch.from_numpy(rng.standard_normal((n, 512)).astype(np.float16))
            y = mod.gemm(x.cuda(), gq)
            torch.cuda.synchronize()
            assert y.is_cuda and tuple(y.shape) == (n, 48) and y.dtype == torch.float16
            ref = x.double() @ torch.as_tensor(np.asarray(c)).double().T
            ok = torch.isfinite(ref) & (ref.abs() < 6e4)  # where fp16 can hold the product
            bound = (x.double().abs() @ torch.as_tensor(np.asarray(c)).double().abs().T) * 2e-2 + 1e-3
            err = (y.cpu().double() - ref).abs()
            assert bool((err[ok] <= bound[ok]).all()), f"{fmt} seed {seed} N={n}: GEMM off the decode"
    assert decoded + errors == len(SEEDS)
    assert decoded > 0, "no hostile buffer got past the checks: the kernels were not exercised"
