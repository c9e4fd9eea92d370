"""mixed2bit weight-only GEMM on the CPU and the GPU (kept apart from the codec module;
``qformats.mixed2bit`` re-exports :func:`gemm`)."""
from __future__ import annotations

from typing import Any

from .. import _arrays as A
from .._core import QuantizedTensor, check_quantized

# The chunk index that the CUDA GEMM finds each group's slot in the 2-bit or 4-bit list with
# (per row and 32-group chunk: the 4-bit groups before it and its map bits) is computed once per
# weight (two small launches and one host sync, which a decode step should not pay) and kept on
# the group_map tensor itself as (its version counter, index), so it lives exactly as long as
# the buffer and is recomputed if the buffer is modified in place.
_CACHE_ATTR = "_qformats_n4_before"


def _row_index(q: QuantizedTensor) -> Any:
    """int64 ``[rows * ceil(G / 32) + 1]`` on the GPU (G = K / group_size): for each row of the
    CUDA weight ``q`` and chunk of 32 of its groups, the 4-bit groups before the chunk (low 32
    bits) and the chunk's group_map bits (high 32); the last entry is the total. Raises
    ValueError when group_map does not mark exactly ``n4`` groups."""
    gm = q.buffers["group_map"]
    hit = getattr(gm, _CACHE_ATTR, None)
    if hit is not None and hit[0] == gm._version:
        return hit[1]
    import torch

    from . import _native

    rows, K = q.shape
    G = K // q.params["group_size"]
    idx = torch.empty(rows * ((G + 31) // 32) + 1, dtype=torch.int64, device=gm.device)
    with A.stream_for(gm) as stream:
        _native.row_index(gm, rows, G, idx, stream)
    total = int(idx[-1])
    if total != q.params["n4"]:
        raise ValueError(f"mixed2bit: group_map marks {total} 4-bit groups but n4 is {q.params['n4']}")
    setattr(gm, _CACHE_ATTR, (gm._version, idx))
    return idx


def gemm_cuda_supported(w: QuantizedTensor) -> bool:
    """Whether the CUDA GEMM kernel takes weight ``w``'s parameters: group_size = 16 * 2^j <= 512,
    a power-of-two scale_block, no outliers. :func:`gemm` falls back to dequantize + matmul on
    the GPU otherwise."""
    from . import _native

    p = w.params
    return bool(_native.gemm_cuda_supports(*w.shape, p["group_size"], p["scale_block"], p["n4"], p["n_out"]))


def gemm(x: Any, w: QuantizedTensor) -> Any:
    """``Y = X . W^T`` with float activations and mixed2bit weights, never fully materialized:
    decoded a tile of rows at a time on the CPU (for N <= 4 on AVX2 / AVX-512 CPUs a row at a
    time in registers, with group_size 16 the 2-bit groups as ``s * sum(q x) - m * sum(x)``),
    in registers on the GPU (the 2-bit and 4-bit groups streamed from their own arrays: the
    asynchronous dequantization of arXiv 2311.16442).

    Args:
        x: float32, float16 or bfloat16 ``[N, K]`` array/tensor (16-bit values are converted to
            float32 exactly on the CPU), C-contiguous, finite; CPU, or CUDA with w's buffers on
            the same device.
        w: a mixed2bit QuantizedTensor of shape ``[M, K]``.
    Returns:
        ``[N, M]`` in the library and on the device of ``x``: float32 on the CPU (vectorized
        decoders for the 2- and 4-bit groups, outliers patched into each tile, FMA sums in an
        order fixed by the instruction set, not by the thread count); ``x``'s dtype on CUDA. There,
        float16 / bfloat16 ``x`` on sm_80+ runs on tensor cores with each weight rounded to x's
        dtype first (``q * s_eff - m_eff`` with s_eff, m_eff in that dtype: one rounding per
        weight, as dequantize + matmul rounds it) and float32 products and sums; float32 ``x``
        (or an older GPU) combines each 16-value unit's ``sum(q * x)`` and ``sum(x)`` as
        ``s_eff * sum(q x) - m_eff * sum(x)`` in float32 (``src/formats/mixed2bit/mixed2bit_gemm_cuda.cu``).
        Weights the CUDA kernel does not
        take (:func:`gemm_cuda_supported` False: outliers, other group sizes) are dequantized on
        the GPU and multiplied with torch.
    Raises:
        TypeError / ValueError: as :func:`dequantize` for ``w``; x not a float array, not 2-D,
            K mismatch, non-contiguous or non-finite; x and w on different devices; a group_map
            that does not mark n4 groups.
    """
    from . import FORMAT, _native, _native_args, dequantize  # imported at the end of __init__

    w = check_quantized(w, FORMAT)
    A.check_type(x, "x")
    A.check_float(x, "x", ndim=2)
    M, K = w.shape
    if x.shape[1] != K:
        raise ValueError(f"x: expected K={K} columns, got shape {tuple(x.shape)}")
    A.same_device(("x", x), *w.buffers.items())
    if A.is_cuda(x):
        if not gemm_cuda_supported(w):
            return x @ dequantize(w, dtype=A.dtype_name(x)).T
        n4_before = _row_index(w)
        x, out = A.gemm_operands(x, x.shape[0], M)
        with A.stream_for(x) as stream:
            _native.gemm(x, *_native_args(w), out, n4_before, stream)
        return out
    out = A.empty(x, (x.shape[0], M), "float32")
    _native.gemm(x, *_native_args(w), out)
    return out
