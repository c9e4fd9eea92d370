"""Pure-numpy reference codec for int8: the pack spec in executable form.

Source of the rounding: bitsandbytes' ``int8_vectorwise_quant`` (default backend,
``torch.round(A * (127.0 / row_stats))``): a float32 multiplier ``m = 127 / absmax``
computed once per unit, a float32 multiply, round half to even. Every operation is a
separately rounded float32 operation (numpy never fuses multiply and add). See
``src/formats/int8/int8.h`` for the layout, the rules and the corner cases.
"""
from __future__ import annotations

import numpy as np

QMAX = 127


def unit_len(shape: tuple, granularity: str, group_size: int) -> int:
    """Values per scale: numel for "tensor", K for "row", group_size for "group"."""
    if granularity == "tensor":
        return int(np.prod(shape, dtype=np.int64))
    if granularity == "row":
        return int(shape[-1])
    return int(group_size)


def scale_shape(shape: tuple, granularity: str, group_size: int) -> tuple:
    """Shape of the float32 scale buffer for an input of ``shape``."""
    if granularity == "tensor":
        return (1,) * len(shape)
    if granularity == "row":
        return (*shape[:-1], 1)
    return (*shape[:-1], shape[-1] // group_size)


def quantize(x: np.ndarray, granularity: str = "row", group_size: int = 128):
    """float [..., K] -> (q int8 [..., K], scale float32 of :func:`scale_shape`).

    Per unit: absmax = max|x|; m = fl32(127 / absmax); q = clip(rint(fl32(x * m)), -127, 127)
    with q = 0 where x * m is NaN (0 * inf); scale = fl32(absmax / 127).
    """
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    n = unit_len(shape, granularity, group_size)
    sshape = scale_shape(shape, granularity, group_size)
    n_units = int(np.prod(sshape, dtype=np.int64))
    u = x.reshape(n_units, n)
    absmax = np.abs(u).max(axis=-1) if n else np.zeros(n_units, dtype=np.float32)
    absmax = absmax.astype(np.float32)  # |x| is never -0, so absmax of +-0 is +0
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        m = np.float32(QMAX) / absmax                       # +inf for absmax 0 or < ~3.7e-37
        v = u * m[:, None]                                  # float32; NaN for 0 * inf
        r = np.clip(np.rint(v), -QMAX, QMAX)                # clamp in float (inf -> +-127)
        q = np.where(np.isnan(v), np.float32(0), r).astype(np.int8)
    scale = (absmax / np.float32(QMAX)).astype(np.float32)
    return q.reshape(shape), scale.reshape(sshape)


def dequantize(q: np.ndarray, scale: np.ndarray, granularity: str = "row", group_size: int = 128) -> np.ndarray:
    """int8 codes and float32 scales (as from :func:`quantize`) -> float32 ``q * scale``."""
    q = np.asarray(q, dtype=np.int8)
    shape = q.shape
    n = unit_len(shape, granularity, group_size)
    s = np.asarray(scale, dtype=np.float32).reshape(-1)
    with np.errstate(over="ignore"):  # 127 * fl(FLT_MAX / 127) rounds to inf: the spec says so
        return (q.reshape(s.size, n).astype(np.float32) * s[:, None]).reshape(shape)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int8 [N, K] x int8 [M, K] -> int64 [N, M] = A . B^T (exact)."""
    return np.asarray(a, dtype=np.int64) @ np.asarray(b, dtype=np.int64).T
