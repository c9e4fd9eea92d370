"""The CUDA side of mixed2bit's weight-only GEMM: whether the kernel takes a weight, and the
chunk index it reads (imported by the package, which defines :func:`~qformats.mixed2bit.gemm`)."""
from __future__ import annotations

from typing import Any

from .. import _arrays as A
from .._core import QuantizedTensor
from . import _native, reference

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
    import torch  # the index is only made for CUDA tensors, so torch is there


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


_MAP_CHECKED_ATTR = "_qformats_tiled_map_ok"


def _check_tiled_map(q: QuantizedTensor, dims: tuple) -> None:
    """Raise ValueError unless every tile of the tiled-layout CUDA weight ``q`` marks its count
    of 4-bit groups in ``map`` (``dims``: rows, K, group_size, scale_block, n4_full, n4_last).
    One launch and one host sync, remembered on the map tensor as its version counter, as
    :func:`_row_index` does."""
    m = q.buffers["map"]
    if getattr(m, _MAP_CHECKED_ATTR, None) == m._version:
        return
    import torch  # CUDA tensors only

    bad = torch.zeros(1, dtype=torch.int32, device=m.device)
    with A.stream_for(m) as stream:
        _native.tiled_check_map(*dims, m, bad, stream)
    n = int(bad)
    if n:
        raise ValueError(f"mixed2bit tiled: the map of {n} tile(s) does not mark their n4 groups (n4_full / n4_last)")
    setattr(m, _MAP_CHECKED_ATTR, m._version)


def gemm_cuda_supported(w: QuantizedTensor) -> bool:
    """Whether the CUDA GEMM kernel takes weight ``w``'s parameters. The global layout:
    group_size = 16 * 2^j <= 512, a power-of-two scale_block, no outliers; the tiled layout:
    group_size = 16 * 2^j <= 512. :func:`gemm` falls back to dequantize + matmul on the GPU
    otherwise."""
    p = w.params
    if p.get("layout", "global") == "tiled":
        rows, K = w.shape
        gs = p["group_size"]
        return bool(_native.tiled_gemm_cuda_supports(rows, K, gs, p["scale_block"],
                                                     *reference.tiled_tile_counts(K, gs, p["ratio_4bit"])))
    return bool(_native.gemm_cuda_supports(*w.shape, p["group_size"], p["scale_block"], p["n4"], p["n_out"]))
