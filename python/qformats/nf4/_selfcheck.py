"""nf4's self-check: its native codecs and CPU GEMMs against ``nf4.reference`` on small numpy
arrays (numpy only; run on the installed wheel by ``tools/wheel_check.py``, see
:mod:`qformats._selfcheck`)."""
from __future__ import annotations

from .. import nf4
from .._selfcheck import Check, close, rand, same


def run(check: Check) -> None:
    ref = nf4.reference
    w, x = rand(12, 100, seed=8), rand(2, 100, seed=9)   # 1200 values: a partial last block

    @check("nf4: quantize == reference (plain, compressed statistics), dequantize == reference")
    def _():
        packed, absmax = nf4.quantize_nf4(w.reshape(-1), blocksize=64)
        rp, ra = ref.quantize(w, 64)
        same(packed, rp, "packed")
        same(absmax, ra, "absmax")
        same(nf4.dequantize_nf4(packed, absmax, w.size, 64), ref.dequantize(rp, ra, w.size, 64), "dequantize_nf4")
        qt = nf4.quantize(w, blocksize=64, compress_statistics=True)
        q, a2, off = ref.double_quant(ra)
        for name, want in (("packed", rp), ("absmax", q), ("absmax2", a2), ("offset", off)):
            same(qt.buffers[name], want, f"compressed {name}")
        want = ref.dequantize(rp, ref.dequantize_absmax(q, a2, off), w.size, 64).reshape(w.shape)
        same(qt.dequantize(), want, "compressed dequantize")

    @check("nf4: gemm on the CPU")
    def _():
        for cs in (False, True):
            qt = nf4.quantize(w, blocksize=64, compress_statistics=cs)
            close(nf4.gemm(x, qt), x, qt.dequantize(), f"gemm compress_statistics={cs}")
