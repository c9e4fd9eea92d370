"""q4_0 equals the gguf package's numpy Q4_0 byte for byte (optional peer)."""
import numpy as np
import pytest
from hypothesis import given, settings

from qformats import _arrays as A, q4_0
from strategies import float_inputs

gguf = pytest.importorskip("gguf")
Q4_0 = gguf.GGMLQuantizationType.Q4_0


def _gguf_quantize(x32: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # gguf's own casts of the inf/NaN corner (see q4_0.h)
        return gguf.quants.quantize(x32, Q4_0)


@settings(max_examples=150, deadline=None)
@given(float_inputs(block=32, min_rows=1, min_blocks=1))
def test_matches_gguf(inp):
    theirs = _gguf_quantize(inp.x32)
    # The spec (reference) equals gguf on every input, including scales that overflow fp16...
    spec = q4_0.reference.quantize(inp.x32)
    np.testing.assert_array_equal(spec.reshape(theirs.shape), theirs)
    if A.fp16_field_overflowed(spec, 0):
        return  # ...which the public API refuses (tested in test_q4_0.py)
    ours = q4_0.quantize_q4_0(inp.x)
    np.testing.assert_array_equal(np.asarray(ours).reshape(theirs.shape), theirs)
    deq = gguf.quants.dequantize(theirs, Q4_0)
    np.testing.assert_array_equal(q4_0.dequantize_q4_0(ours, inp.x32.shape[-1]), deq)


def test_matches_gguf_on_large_gaussian():
    x = (np.random.default_rng(0).standard_normal((256, 4096)) *
         np.logspace(-6, 3, 256)[:, None]).astype(np.float32)
    np.testing.assert_array_equal(q4_0.quantize_q4_0(x).reshape(256, -1), _gguf_quantize(x))
