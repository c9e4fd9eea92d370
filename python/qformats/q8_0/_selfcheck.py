"""q8_0's self-check: its native codecs against ``q8_0.reference`` on small numpy arrays (numpy
only; run on the installed wheel by ``tools/wheel_check.py``, see :mod:`qformats._selfcheck`)."""
from __future__ import annotations

from .. import q8_0
from .._selfcheck import Check, rand, same


def run(check: Check) -> None:
    ref = q8_0.reference
    x = rand(5, 96, seed=3)

    @check("q8_0: quantize == reference, dequantize == reference")
    def _():
        blocks = q8_0.quantize_q8_0(x)
        same(blocks, ref.quantize(x), "quantize_q8_0")
        same(q8_0.dequantize_q8_0(blocks, 96), ref.dequantize(blocks), "dequantize_q8_0")
        same(q8_0.quantize(x).dequantize(), ref.dequantize(blocks), "QuantizedTensor.dequantize")
