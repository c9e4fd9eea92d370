"""q4_0's self-check: its native codecs and CPU GEMMs against ``q4_0.reference`` on small numpy
arrays (numpy only; run on the installed wheel by ``tools/wheel_check.py``, see
:mod:`qformats._selfcheck`)."""
from __future__ import annotations

import numpy as np

from .. import q4_0, q8_1
from .._selfcheck import Check, close, rand, same


def run(check: Check) -> None:
    ref = q4_0.reference
    w, x = rand(24, 128), rand(3, 128, seed=1)

    @check("q4_0: quantize == reference, dequantize == reference, QuantizedTensor round trip")
    def _():
        blocks = q4_0.quantize_q4_0(w)
        same(blocks, ref.quantize(w), "quantize_q4_0")
        same(q4_0.dequantize_q4_0(blocks, 128), ref.dequantize(blocks), "dequantize_q4_0")
        qt = q4_0.quantize(w)
        same(qt.dequantize(), ref.dequantize(ref.quantize(w)), "QuantizedTensor.dequantize")

    @check("q4_0: gemm (float x q4_0) and gemm_q4_0_q8_1 on the CPU")
    def _():
        qt = q4_0.quantize(w)
        wd = ref.dequantize(qt.buffers["blocks"])
        close(q4_0.gemm(x, qt), x, wd, "q4_0.gemm")
        xq = q8_1.quantize_q8_1(x)
        y = q4_0.gemm_q4_0_q8_1(qt.buffers["blocks"], xq, 24, 3, 128)   # W . A^T: [M, N]
        close(np.asarray(y).T, q8_1.reference.dequantize(xq), wd, "gemm_q4_0_q8_1")
