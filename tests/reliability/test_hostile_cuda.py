"""CUDA decoders and GEMMs fed hostile buffers: random bytes in the buffers of every format
(the shapes and dtypes a real tensor has, any contents: NaN/Inf/huge scales, any codes, lying
mixed2bit maps and outlier indices, compressed nf4 statistics). Every call either raises the
same clear exception as the CPU (ValueError / TypeError; mixed2bit's asynchronous CUDA decoder
returns all-NaN instead, as documented, and its CUDA gemm raises) or returns what the CPU
returns for the same bytes; compute-sanitizer memcheck over these tests (`SANITIZE_K=hostile
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
    "q4_0": [{}], "q8_0": [{}], "q8_1": [{}],
    "int8": [{"granularity": "row"}, {"granularity": "group", "group_size": 64}],
    "int4": [{"group_size": 64}, {"group_size": 128, "symmetric": True}],
    "nf4": [{"blocksize": 64}, {"blocksize": 64, "compress_statistics": True}],
    "mixed2bit": [{}],
}
CASES = [(f, kw) for f in qformats.FORMATS for kw in VARIANTS[f]]


def _hostile(qt: QuantizedTensor, rng: np.random.Generator) -> QuantizedTensor:
    """qt with random bytes at a random fraction (5 %, 30 % or all) of the bytes of a random
    non-empty subset of its buffers: keeping some buffers and rows intact lets hostile values
    reach the kernels past the structural checks, next to ordinary ones."""
    names = sorted(qt.buffers)
    pick = [n for n in names if rng.random() < 0.5] or [names[rng.integers(len(names))]]
    bufs = {}
    for k, b in qt.buffers.items():
        a = np.asarray(b)
        if k in pick:
            raw = a.copy().view(np.uint8).reshape(-1)
            hit = rng.random(raw.size) < rng.choice([0.05, 0.3, 1.0])
            raw[hit] = rng.integers(0, 256, int(hit.sum()), dtype=np.uint8)
            a = raw.view(a.dtype).reshape(a.shape)
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
    decoded = errors = compared = 0
    cuda_gemm = hasattr(mod, "gemm") and fmt != "q8_1"
    if cuda_gemm:
        try:
            mod.gemm(torch.zeros((1, 512), dtype=torch.float16, device="cuda"), good.to("cuda"))
        except ValueError as e:
            assert "CPU only" in str(e), e  # int8: no CUDA weight-only kernel, said so
            cuda_gemm = False
    for seed in SEEDS:
        cq = _hostile(good, np.random.default_rng(seed))
        try:
            c = cq.dequantize()
        except (ValueError, TypeError) as e:
            gq = cq.to("cuda")
            try:
                g = gq.dequantize()
            except type(e):
                pass
            else:  # the asynchronous CUDA decoder's documented signal: every value NaN
                assert bool(torch.isnan(g).all()), f"{fmt} seed {seed}: the CPU says {e}, CUDA decoded it"
            if cuda_gemm:
                with pytest.raises((ValueError, TypeError)):
                    mod.gemm(torch.ones((1, 512), dtype=torch.float16, device="cuda"), gq)
            errors += 1
            continue
        gq = cq.to("cuda")
        _same(gq.dequantize(), c, f"{fmt} seed {seed}: CUDA dequantize != CPU")
        decoded += 1
        if not cuda_gemm:
            continue
        for n in (1, 5):
            x = torch.from_numpy(rng.standard_normal((n, 512)).astype(np.float16))
            y = mod.gemm(x.cuda(), gq)
            torch.cuda.synchronize()
            assert y.is_cuda and tuple(y.shape) == (n, 48) and y.dtype == torch.float16
            wd = torch.as_tensor(np.asarray(c)).double()
            ref = x.double() @ wd.T
            mag = x.double().abs() @ wd.abs().T
            # Compared where fp16 arithmetic is defined whatever the order of the sums: every
            # partial sum below fp16's range, and every weight below 4096 (the tensor-core
            # decoders form 16 * w in fp16 for half of the nibbles, weight_only_mma_cuda.cuh).
            ok = (mag < 3e4) & (wd.abs().amax(dim=1) < 4096)[None, :]
            err = (y.cpu().double() - ref).abs()
            assert bool((err[ok] <= (2e-2 * mag + 1e-3)[ok]).all()), f"{fmt} seed {seed} N={n}: GEMM off the decode"
            compared += int(ok.sum())
    assert decoded + errors == len(SEEDS)
    assert decoded > 0, "no hostile buffer got past the checks: the kernels were not exercised"
    if cuda_gemm:
        assert compared > 0, "no GEMM output was in range to compare"
