"""q8_0 equals the gguf package's numpy Q8_0 byte for byte (optional peer: skipped without it)."""
import numpy as np
import pytest
from hypothesis import given, settings

from qformats import _arrays as A, q8_0
from strategies import float_inputs

gguf = pytest.importorskip("gguf")
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _gguf_quantize(x32: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # gguf's own casts of the inf/NaN corner (common/int8_block.h)
        return gguf.quants.quantize(x32, Q8_0)


@settings(max_examples=300, deadline=None)
@given(float_inputs(block=32, min_rows=1, min_blocks=1))
def test_matches_gguf(inp):
    theirs = _gguf_quantize(inp.x32)
    # The spec (reference) equals gguf on every input, including scales that overflow fp16...
    spec = q8_0.reference.quantize(inp.x32)
    assert spec.tobytes() == theirs.tobytes() and spec.size == theirs.size
    if A.fp16_field_overflowed(spec, 0):
        return  # ...which the public API refuses (tested in test_q8_0.py)
    ours = q8_0.quantize_q8_0(inp.x)  # numpy, or torch for bfloat16 input
    assert A.to_numpy(ours).tobytes() == theirs.tobytes()
    deq = gguf.quants.dequantize(theirs, Q8_0)
    got = A.to_numpy(q8_0.dequantize_q8_0(ours, inp.x32.shape[-1]))
    assert got.shape == deq.shape and got.dtype == deq.dtype and got.tobytes() == deq.tobytes()


def test_matches_gguf_on_large_gaussian():
    x = (np.random.default_rng(0).standard_normal((256, 4096)) *
         np.logspace(-6, 3, 256)[:, None]).astype(np.float32)
    ours = q8_0.quantize_q8_0(x)
    assert ours.tobytes() == _gguf_quantize(x).tobytes()
    assert q8_0.dequantize_q8_0(ours, 4096).tobytes() == gguf.quants.dequantize(ours.reshape(256, -1), Q8_0).tobytes()
