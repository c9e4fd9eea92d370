"""q8_1's self-check: its native codecs and CPU GEMMs against ``q8_1.reference`` on small numpy
arrays (numpy only; run on the installed wheel by ``tools/wheel_check.py``, see
:mod:`qformats._selfcheck`)."""
from __future__ import annotations

from .. import q8_1
from .._selfcheck import Check, rand, same


def run(check: Check) -> None:
    ref = q8_1.reference
    x = rand(5, 96, seed=2)

    @check("q8_1: quantize == reference, dequantize == reference")
    def _():
        blocks = q8_1.quantize_q8_1(x)
        same(blocks, ref.quantize(x), "quantize_q8_1")
        same(q8_1.dequantize_q8_1(blocks, 96), ref.dequantize(blocks), "dequantize_q8_1")
        same(q8_1.quantize(x).dequantize(), ref.dequantize(blocks), "QuantizedTensor.dequantize")
