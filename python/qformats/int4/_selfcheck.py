"""int4's self-check: its native codecs and CPU GEMMs against ``int4.reference`` on small numpy
arrays (numpy only; run on the installed wheel by ``tools/wheel_check.py``, see
:mod:`qformats._selfcheck`)."""
from __future__ import annotations

import numpy as np

from .. import int4
from .._selfcheck import Check, close, rand, same


def run(check: Check) -> None:
    ref = int4.reference
    w, x = rand(16, 128, seed=5), rand(3, 128, seed=6)

    @check("int4: quantize == reference (asymmetric, symmetric), dequantize == reference")
    def _():
        qt = int4.quantize(w, group_size=32)
        qw, s, z = ref.quantize_asym(w, 32)
        for name, want in (("qweight", qw), ("scales", s), ("zeros", z)):
            same(qt.buffers[name], want, f"asym {name}")
        same(qt.dequantize(), ref.dequantize(qw, s, z, 32), "asym dequantize")
        qt = int4.quantize(w, group_size=32, symmetric=True)
        qw, s = ref.quantize_sym(w, 32)
        same(qt.buffers["qweight"], qw, "sym qweight")
        same(qt.buffers["scales"], s, "sym scales")
        same(qt.dequantize(), ref.dequantize(qw, s, None, 32), "sym dequantize")

    @check("int4: pack_int4 / unpack_int4 == reference")
    def _():
        codes = np.random.default_rng(7).integers(0, 16, (6, 40)).astype(np.uint8)
        packed = int4.pack_int4(codes)
        same(packed, ref.pack(codes), "pack uint8")
        same(int4.unpack_int4(packed), codes, "unpack")
        signed = (codes.astype(np.int16) - 8).astype(np.int8)
        same(int4.pack_int4(signed), ref.pack(signed), "pack int8")
        same(int4.unpack_int4(int4.pack_int4(signed), signed=True), signed, "unpack signed")

    @check("int4: gemm on the CPU, int4_matmul exact")
    def _():
        for sym in (False, True):
            qt = int4.quantize(w, group_size=32, symmetric=sym)
            close(int4.gemm(x, qt), x, qt.dequantize(), f"gemm symmetric={sym}")
        a = int4.quantize(x, group_size=32, symmetric=True).buffers["qweight"]
        b = int4.quantize(w, group_size=32, symmetric=True).buffers["qweight"]
        same(int4.int4_matmul(a, b), ref.matmul(a, b).astype(np.int32), "int4_matmul")
