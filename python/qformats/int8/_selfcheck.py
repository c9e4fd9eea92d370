"""int8's self-check: its native codecs and CPU GEMMs against ``int8.reference`` on small numpy
arrays (numpy only; run on the installed wheel by ``tools/wheel_check.py``, see
:mod:`qformats._selfcheck`)."""
from __future__ import annotations

import numpy as np

from .. import int8
from .._selfcheck import Check, close, rand, same


def run(check: Check) -> None:
    ref = int8.reference
    w, x = rand(16, 64, seed=3), rand(4, 64, seed=4)

    @check("int8: quantize == reference (tensor, row, group), dequantize == reference")
    def _():
        for gran in ("tensor", "row", "group"):
            qt = int8.quantize(w, granularity=gran, group_size=32)
            q, s = ref.quantize(w, gran, 32)
            same(qt.buffers["q"], q, f"{gran} q")
            same(qt.buffers["scale"], s, f"{gran} scale")
            same(qt.dequantize(), ref.dequantize(q, s, gran, 32), f"{gran} dequantize")

    @check("int8: int8_matmul exact, int8_linear on the CPU")
    def _():
        xq, wq = int8.quantize(x), int8.quantize(w)
        acc = int8.int8_matmul(xq.buffers["q"], wq.buffers["q"])
        same(acc, ref.matmul(xq.buffers["q"], wq.buffers["q"]).astype(np.int32), "int8_matmul")
        y = int8.int8_linear(xq.buffers["q"], xq.buffers["scale"], wq.buffers["q"], wq.buffers["scale"])
        close(y, xq.dequantize(), wq.dequantize(), "int8_linear")
