"""mixed2bit weight-only GEMM on the CPU (kept apart from the codec module; ``qformats.mixed2bit``
re-exports :func:`gemm`)."""
from __future__ import annotations

from typing import Any

from .. import _arrays as A
from .._core import QuantizedTensor, check_quantized


def gemm(x: Any, w: QuantizedTensor) -> Any:
    """``Y = X . W^T`` with float activations and mixed2bit weights, decoded a cache-sized tile
    of rows at a time (vectorized decoders for the 2- and 4-bit groups, outliers patched into the
    tile), never fully materialized, multiplied in float32 (FMA), threaded.

    Args:
        x: float32, float16 or bfloat16 ``[N, K]`` array/tensor (16-bit values are converted to
            float32 exactly), C-contiguous, CPU, finite.
        w: a mixed2bit QuantizedTensor of shape ``[M, K]`` (CPU buffers).
    Returns:
        float32 ``[N, M]`` in the library of ``x``: float32 dot products of x with exactly the
        values :func:`qformats.mixed2bit.dequantize` gives, summed in an order fixed by the CPU's
        instruction set (AVX-512, AVX2 or plain C++), not by the thread count.
    Raises:
        TypeError / ValueError: as :func:`qformats.mixed2bit.dequantize` for ``w``; x not a float
            array, not 2-D, K mismatch, non-contiguous or non-finite.
        NotImplementedError: x or w on a CUDA device (the GEMM is CPU-only for now).
    """
    from . import FORMAT, _native, _native_args  # this module is imported at the end of __init__

    w = check_quantized(w, FORMAT)
    A.check_type(x, "x")
    A.cpu_only("mixed2bit.gemm", x, *w.buffers.values())
    A.check_float(x, "x", ndim=2)
    M, K = w.shape
    if x.shape[1] != K:
        raise ValueError(f"x: expected K={K} columns, got shape {tuple(x.shape)}")
    out = A.empty(x, (x.shape[0], M), "float32")
    _native.gemm(x, *_native_args(w), out)
    return out
