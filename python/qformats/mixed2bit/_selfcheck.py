"""mixed2bit's self-check: its native codecs and CPU GEMMs against ``mixed2bit.reference`` on small numpy
arrays (numpy only; run on the installed wheel by ``tools/wheel_check.py``, see
:mod:`qformats._selfcheck`)."""
from __future__ import annotations

import numpy as np

from .. import mixed2bit
from .._selfcheck import Check, close, rand, same


def run(check: Check) -> None:
    ref = mixed2bit.reference
    w, x = rand(8, 64, seed=10), rand(3, 64, seed=11)
    kw = dict(group_size=16, ratio_4bit=0.25, outlier_ratio=0.02, scale_block=4)

    @check("mixed2bit: quantize == reference (with outliers), dequantize == reference")
    def _():
        qt = mixed2bit.quantize(w, **kw)
        bufs = ref.quantize(w, **kw)
        assert qt.params["n_out"] > 0 and qt.params["n4"] > 0
        for name in mixed2bit.BUFFER_NAMES:
            same(qt.buffers[name], bufs[name], name)
        same(qt.dequantize(), ref.dequantize(bufs, 8, 64, 16, 4), "dequantize")

    @check("mixed2bit: pack_2bit / unpack_2bit == reference")
    def _():
        v = np.random.default_rng(12).integers(0, 4, (3, 48)).astype(np.uint8)
        packed = mixed2bit.pack_2bit(v)
        same(packed, ref.pack_2bit(v), "pack_2bit")
        same(mixed2bit.unpack_2bit(packed, v.size), v.reshape(-1), "unpack_2bit")

    @check("mixed2bit: gemm on the CPU")
    def _():
        qt = mixed2bit.quantize(w, **kw)
        close(mixed2bit.gemm(x, qt), x, qt.dequantize(), "gemm")
