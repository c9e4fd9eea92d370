"""Pure-numpy reference codec for nf4: the pack spec in executable form.

Source: bitsandbytes 0.50 ``bitsandbytes.functional.quantize_4bit(A, blocksize,
quant_type="nf4", compress_statistics=...)`` on the CPU: the 4-bit part is its "default" torch
backend (``backends/default/ops.py``), the double quantization of absmax is
``quantize_blockwise(absmax - absmax.mean(), blocksize=256)`` with the signed dynamic map on its
compiled CPU kernel (``csrc/cpu_ops.cpp``, a 65536-cell lookup table). NF4 itself is from QLoRA
(Dettmers et al., arXiv:2305.14314). Every operation is a separately rounded float32 operation
(numpy never fuses multiply and add). See ``src/formats/nf4/nf4.h`` for the rules and corner
cases; every function here equals the bitsandbytes bytes.
"""
from __future__ import annotations

import numpy as np

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DOUBLE_QUANT_BLOCK = 256
PAD_CODE = 7

#: The 16 NF4 values (bitsandbytes ``get_4bit_type("nf4")``), exact float32.
CODE = np.array([float.fromhex(s) for s in (
    "-0x1p+0", "-0x1.647362p-1", "-0x1.0cd66p-1", "-0x1.94654p-2",
    "-0x1.23449ap-2", "-0x1.7a6a7ep-3", "-0x1.74f0e2p-4", "0x0p+0",
    "0x1.45f5fep-4", "0x1.4995c6p-3", "0x1.f809bap-3", "0x1.5a0674p-2",
    "0x1.c3497p-2", "0x1.200f56p-1", "0x1.722766p-1", "0x1p+0",
)], dtype=np.float32)
#: Decision boundaries, fl32(CODE[j] + CODE[j+1]) / 2 (bitsandbytes ``_get_4bit_quantize_bounds``).
MIDPOINTS = ((CODE[:-1] + CODE[1:]) / np.float32(2)).astype(np.float32)
#: fl32(1e-38), bitsandbytes' ``absmax.clamp(min=1e-38)`` (subnormal, bits 0x006CE3EE).
TINY = np.float32(1e-38)
#: Largest distance from a value in [-1, 1] to its code: half the widest gap (-1 .. -0.696).
MAX_HALF_GAP = float(np.max(np.diff(CODE.astype(np.float64))) / 2)

#: bitsandbytes ``create_dynamic_map(signed=True)``: the 8-bit map of the double quantization.
DYNAMIC_MAP = np.array([float.fromhex(s) for s in (
    "-0x1.fc6666p-1", "-0x1.f53334p-1", "-0x1.eep-1", "-0x1.e6ccccp-1", "-0x1.df999ap-1", "-0x1.d86666p-1",
    "-0x1.d13334p-1", "-0x1.cap-1", "-0x1.c2ccccp-1", "-0x1.bb999ap-1", "-0x1.b46666p-1", "-0x1.ad3334p-1",
    "-0x1.a6p-1", "-0x1.9eccccp-1", "-0x1.97999ap-1", "-0x1.906666p-1", "-0x1.893334p-1", "-0x1.82p-1",
    "-0x1.7accccp-1", "-0x1.73999ap-1", "-0x1.6c6668p-1", "-0x1.653334p-1", "-0x1.5ep-1", "-0x1.56ccccp-1",
    "-0x1.4f999ap-1", "-0x1.486668p-1", "-0x1.413334p-1", "-0x1.3ap-1", "-0x1.32ccccp-1", "-0x1.2b999ap-1",
    "-0x1.246668p-1", "-0x1.1d3334p-1", "-0x1.16p-1", "-0x1.0eccccp-1", "-0x1.079998p-1", "-0x1.006666p-1",
    "-0x1.f26664p-2", "-0x1.e4p-2", "-0x1.d59998p-2", "-0x1.c73334p-2", "-0x1.b8ccccp-2", "-0x1.aa6666p-2",
    "-0x1.9cp-2", "-0x1.8d9998p-2", "-0x1.7f3334p-2", "-0x1.70ccccp-2", "-0x1.626666p-2", "-0x1.54p-2",
    "-0x1.459998p-2", "-0x1.373334p-2", "-0x1.28ccccp-2", "-0x1.1a6668p-2", "-0x1.0cp-2", "-0x1.fb3332p-3",
    "-0x1.de6666p-3", "-0x1.c1999ap-3", "-0x1.a4ccccp-3", "-0x1.88p-3", "-0x1.6b3334p-3", "-0x1.4e6666p-3",
    "-0x1.31999ap-3", "-0x1.14ccccp-3", "-0x1.fp-4", "-0x1.b66668p-4", "-0x1.93d70ap-4", "-0x1.8851eep-4",
    "-0x1.7ccccep-4", "-0x1.7147aep-4", "-0x1.65c29p-4", "-0x1.5a3d7p-4", "-0x1.4eb854p-4", "-0x1.433334p-4",
    "-0x1.37ae14p-4", "-0x1.2c28f6p-4", "-0x1.20a3d6p-4", "-0x1.151ebap-4", "-0x1.09999ap-4", "-0x1.fc28f6p-5",
    "-0x1.e51ebap-5", "-0x1.ce147ap-5", "-0x1.b70a3ep-5", "-0x1.ap-5", "-0x1.88f5c2p-5", "-0x1.71eb86p-5",
    "-0x1.5ae146p-5", "-0x1.43d70ap-5", "-0x1.2ccccep-5", "-0x1.15c29p-5", "-0x1.fd70a4p-6", "-0x1.cf5c2ap-6",
    "-0x1.a147aep-6", "-0x1.733334p-6", "-0x1.451ebap-6", "-0x1.170a3ep-6", "-0x1.d1eb86p-7", "-0x1.75c29p-7",
    "-0x1.3e76c8p-7", "-0x1.2c083p-7", "-0x1.19999ap-7", "-0x1.072b02p-7", "-0x1.e978d4p-8", "-0x1.c49ba6p-8",
    "-0x1.9fbe76p-8", "-0x1.7ae148p-8", "-0x1.56041ap-8", "-0x1.3126e8p-8", "-0x1.0c49bap-8", "-0x1.ced914p-9",
    "-0x1.851eb8p-9", "-0x1.3b645ap-9", "-0x1.e353f8p-10", "-0x1.4fdf3ap-10", "-0x1.eecbfep-11", "-0x1.b3d07cp-11",
    "-0x1.78d5p-11", "-0x1.3dd982p-11", "-0x1.02de02p-11", "-0x1.8fc506p-12", "-0x1.19ce0ap-12", "-0x1.47ae16p-13",
    "-0x1.743e96p-14", "-0x1.15df66p-14", "-0x1.6f0068p-15", "-0x1.64840cp-16", "-0x1.040bfep-17", "-0x1.b43528p-19",
    "-0x1.27476ep-21", "0x0.0p+0", "0x1.27476ep-21", "0x1.b43528p-19", "0x1.040bfep-17", "0x1.64840cp-16",
    "0x1.6f0068p-15", "0x1.15df66p-14", "0x1.743e96p-14", "0x1.47ae16p-13", "0x1.19ce0ap-12", "0x1.8fc506p-12",
    "0x1.02de02p-11", "0x1.3dd982p-11", "0x1.78d5p-11", "0x1.b3d07cp-11", "0x1.eecbfep-11", "0x1.4fdf3ap-10",
    "0x1.e353f8p-10", "0x1.3b645ap-9", "0x1.851eb8p-9", "0x1.ced914p-9", "0x1.0c49bap-8", "0x1.3126e8p-8",
    "0x1.56041ap-8", "0x1.7ae148p-8", "0x1.9fbe76p-8", "0x1.c49ba6p-8", "0x1.e978d4p-8", "0x1.072b02p-7",
    "0x1.19999ap-7", "0x1.2c083p-7", "0x1.3e76c8p-7", "0x1.75c29p-7", "0x1.d1eb86p-7", "0x1.170a3ep-6",
    "0x1.451ebap-6", "0x1.733334p-6", "0x1.a147aep-6", "0x1.cf5c2ap-6", "0x1.fd70a4p-6", "0x1.15c29p-5",
    "0x1.2ccccep-5", "0x1.43d70ap-5", "0x1.5ae146p-5", "0x1.71eb86p-5", "0x1.88f5c2p-5", "0x1.ap-5",
    "0x1.b70a3ep-5", "0x1.ce147ap-5", "0x1.e51ebap-5", "0x1.fc28f6p-5", "0x1.09999ap-4", "0x1.151ebap-4",
    "0x1.20a3d6p-4", "0x1.2c28f6p-4", "0x1.37ae14p-4", "0x1.433334p-4", "0x1.4eb854p-4", "0x1.5a3d7p-4",
    "0x1.65c29p-4", "0x1.7147aep-4", "0x1.7ccccep-4", "0x1.8851eep-4", "0x1.93d70ap-4", "0x1.b66668p-4",
    "0x1.fp-4", "0x1.14ccccp-3", "0x1.31999ap-3", "0x1.4e6666p-3", "0x1.6b3334p-3", "0x1.88p-3",
    "0x1.a4ccccp-3", "0x1.c1999ap-3", "0x1.de6666p-3", "0x1.fb3332p-3", "0x1.0cp-2", "0x1.1a6668p-2",
    "0x1.28ccccp-2", "0x1.373334p-2", "0x1.459998p-2", "0x1.54p-2", "0x1.626666p-2", "0x1.70ccccp-2",
    "0x1.7f3334p-2", "0x1.8d9998p-2", "0x1.9cp-2", "0x1.aa6666p-2", "0x1.b8ccccp-2", "0x1.c73334p-2",
    "0x1.d59998p-2", "0x1.e4p-2", "0x1.f26664p-2", "0x1.006666p-1", "0x1.079998p-1", "0x1.0eccccp-1",
    "0x1.16p-1", "0x1.1d3334p-1", "0x1.246668p-1", "0x1.2b999ap-1", "0x1.32ccccp-1", "0x1.3ap-1",
    "0x1.413334p-1", "0x1.486668p-1", "0x1.4f999ap-1", "0x1.56ccccp-1", "0x1.5ep-1", "0x1.653334p-1",
    "0x1.6c6668p-1", "0x1.73999ap-1", "0x1.7accccp-1", "0x1.82p-1", "0x1.893334p-1", "0x1.906666p-1",
    "0x1.97999ap-1", "0x1.9eccccp-1", "0x1.a6p-1", "0x1.ad3334p-1", "0x1.b46666p-1", "0x1.bb999ap-1",
    "0x1.c2ccccp-1", "0x1.cap-1", "0x1.d13334p-1", "0x1.d86666p-1", "0x1.df999ap-1", "0x1.e6ccccp-1",
    "0x1.eep-1", "0x1.f53334p-1", "0x1.fc6666p-1", "0x1p+0",
)], dtype=np.float32)
_DYN_MID = (np.float32(0.5) * (DYNAMIC_MAP[:-1] + DYNAMIC_MAP[1:])).astype(np.float32)
_CELL_VALUES = (np.float32(-1) + (np.float32(2) * np.arange(65536, dtype=np.float32))
                / np.float32(65535)).astype(np.float32)
#: bitsandbytes' ``build_quantize_lut``: table cell -> 8-bit code (midpoints strictly below the cell).
DYNAMIC_LUT = np.searchsorted(_DYN_MID, _CELL_VALUES, side="left").astype(np.uint8)
#: Largest ``|v - DYNAMIC_MAP[code(v)]|`` over v in [-1, 1] (at the cell edges; 7.03e-3 at v = -1).
DYNAMIC_MAX_ERROR = float(max(
    np.max(np.abs(_CELL_VALUES.astype(np.float64) - DYNAMIC_MAP[DYNAMIC_LUT])) + 1.0 / 65535,
    abs(-1.0 - float(DYNAMIC_MAP[0])),
))


def _check_blocksize(blocksize: int) -> int:
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize!r}")
    return int(blocksize)


def codes_of(s: np.ndarray) -> np.ndarray:
    """float32 scaled values -> uint8 codes: the number of MIDPOINTS strictly below (ties go down)."""
    s = np.asarray(s, dtype=np.float32)
    return (s[..., None] > MIDPOINTS).sum(axis=-1, dtype=np.uint8)


def quantize(x: np.ndarray, blocksize: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """float values (any shape, flattened) -> (packed uint8 [ceil(n/2)], absmax float32 [n_blocks])."""
    blocksize = _check_blocksize(blocksize)
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    n = x.size
    full = n // blocksize
    nb = -(-n // blocksize)
    absmax = np.zeros(nb, dtype=np.float32)
    codes = np.full(n + (n & 1), PAD_CODE, dtype=np.uint8)
    if full:
        xb = x[: full * blocksize].reshape(full, blocksize)
        a = np.abs(xb).max(axis=1)
        absmax[:full] = a
        r = (np.float32(1) / np.maximum(a, TINY)).astype(np.float32)  # reciprocal once per block
        codes[: full * blocksize] = codes_of(xb * r[:, None]).reshape(-1)
    if nb > full:  # the partial last block: clamped absmax, true division
        a = np.maximum(np.abs(x[full * blocksize:]).max(), TINY)
        absmax[full] = a
        codes[full * blocksize: n] = codes_of(x[full * blocksize:] / a)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed.astype(np.uint8), absmax


def dequantize(packed: np.ndarray, absmax: np.ndarray, n: int, blocksize: int = 64) -> np.ndarray:
    """(packed, float32 absmax) -> float32 [n]: CODE[code] * absmax of the element's block."""
    blocksize = _check_blocksize(blocksize)
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    absmax = np.asarray(absmax, dtype=np.float32).reshape(-1)
    codes = np.stack([packed >> 4, packed & 0x0F], axis=-1).reshape(-1)[:n]
    scale = absmax[np.arange(n) // blocksize]
    return (CODE[codes] * scale).astype(np.float32)


def _ceil_log2(v: int) -> int:
    return 1 if v <= 2 else int(v - 1).bit_length()


def _multi_row_sum(rows: np.ndarray) -> np.ndarray:
    """torch's multi_row_sum, nrows = 4: ``rows`` is [groups, 4, lanes] float32; returns [4, lanes]."""
    groups = rows.shape[0]
    power = max(4, _ceil_log2(groups) // 4)
    step, mask = 1 << power, (1 << power) - 1
    zero = np.zeros(rows.shape[1:], dtype=np.float32)
    acc = [zero.copy() for _ in range(4)]
    n_chunks = groups // step
    # Level 0 of every complete chunk: a sequential sum (from 0) of `step` groups, all chunks at once.
    chunk = np.zeros((n_chunks, *rows.shape[1:]), dtype=np.float32)
    body = rows[: n_chunks * step].reshape(n_chunks, step, *rows.shape[1:])
    for j in range(step):
        chunk = chunk + body[:, j]
    for c in range(n_chunks):  # the carries between levels, in torch's order
        i = (c + 1) * step
        acc[0] = chunk[c]
        for j in range(1, 4):
            acc[j] = acc[j] + acc[j - 1]
            acc[j - 1] = zero.copy()
            if i & (mask << (j * power)):
                break
    for i in range(n_chunks * step, groups):
        acc[0] = acc[0] + rows[i]
    for j in range(1, 4):
        acc[0] = acc[0] + acc[j]
    return acc[0]


def _row_sum(vals: np.ndarray) -> np.ndarray:
    """torch's row_sum (ilp 4) over ``vals`` [size, lanes] -> [lanes]."""
    size = vals.shape[0]
    groups = size // 4
    ps = _multi_row_sum(vals[: groups * 4].reshape(groups, 4, *vals.shape[1:]))
    for i in range(groups * 4, size):
        ps[0] = ps[0] + vals[i]
    for k in range(1, 4):
        ps[0] = ps[0] + ps[k]
    return ps[0]


def mean_torch_order(x: np.ndarray) -> np.float32:
    """float32 mean, summed in the order of torch's CPU ``Tensor.sum`` on one thread (x86-64,
    8-lane AVX2 kernel): what bitsandbytes' ``absmax.mean()`` returns. See nf4_cpu.cpp."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    n = x.size
    if n == 0:  # torch: 0 / 0 on x86 is the default NaN, sign bit set
        return np.array([0xFFC00000], dtype=np.uint32).view(np.float32)[0]
    with np.errstate(over="ignore", invalid="ignore"):  # the float32 sum may overflow to inf
        return _mean(x, n)


def _mean(x: np.ndarray, n: int) -> np.float32:
    lanes = 8
    if n < lanes:
        total = _row_sum(x[:, None])[0]
    else:
        nv = n // lanes
        row = _row_sum(x[: nv * lanes].reshape(nv, lanes))
        total = np.float32(0)
        for v in x[nv * lanes:]:
            total = np.float32(total + v)
        for v in row:
            total = np.float32(total + v)
    total = np.float32(np.float32(0) + total)
    return np.float32(total / np.float32(n))


def dynamic_codes_of(v: np.ndarray) -> np.ndarray:
    """float32 v (= d / absmax2 as a product) -> uint8 codes of DYNAMIC_MAP via the 65536-cell table."""
    v = np.asarray(v, dtype=np.float32)
    nan = np.isnan(v)
    v = np.clip(np.where(nan, np.float32(0), v), np.float32(-1), np.float32(1)).astype(np.float32)
    t = ((((v + np.float32(1)) * np.float32(0.5)) * np.float32(65535)) + np.float32(0.5)).astype(np.float32)
    return np.where(nan, np.uint8(0), DYNAMIC_LUT[t.astype(np.int64)]).astype(np.uint8)


def double_quant(absmax: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 absmax [nb] -> (uint8 codes [nb], float32 absmax2 [ceil(nb/256)], float32 offset [1])."""
    absmax = np.asarray(absmax, dtype=np.float32).reshape(-1)
    nb = absmax.size
    offset = mean_torch_order(absmax)
    with np.errstate(invalid="ignore"):  # an overflowed (inf) offset: bitsandbytes stores the NaNs
        d = (absmax - offset).astype(np.float32)
    n2 = -(-nb // DOUBLE_QUANT_BLOCK)
    q = np.zeros(nb, dtype=np.uint8)
    absmax2 = np.zeros(n2, dtype=np.float32)
    for b in range(n2):
        blk = d[b * DOUBLE_QUANT_BLOCK: (b + 1) * DOUBLE_QUANT_BLOCK]
        a2 = np.float32(np.max(np.where(np.isnan(blk), np.float32(0), np.abs(blk))))
        absmax2[b] = a2
        if a2 == 0:
            continue  # codes 0
        with np.errstate(over="ignore", invalid="ignore"):
            r = np.float32(np.float32(1) / a2)  # inf when a2 < ~2.9e-39
            q[b * DOUBLE_QUANT_BLOCK: b * DOUBLE_QUANT_BLOCK + blk.size] = dynamic_codes_of(blk * r)
    return q, absmax2, np.array([offset], dtype=np.float32)


def dequantize_absmax(q: np.ndarray, absmax2: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Inverse of :func:`double_quant`: fl32(fl32(DYNAMIC_MAP[q] * absmax2) + offset), float32 [nb]."""
    q = np.asarray(q, dtype=np.uint8).reshape(-1)
    absmax2 = np.asarray(absmax2, dtype=np.float32).reshape(-1)
    off = np.asarray(offset, dtype=np.float32).reshape(-1)[0]
    scale = absmax2[np.arange(q.size) // DOUBLE_QUANT_BLOCK]
    with np.errstate(invalid="ignore", over="ignore"):  # inf statistics decode to NaN/inf
        return ((DYNAMIC_MAP[q] * scale).astype(np.float32) + off).astype(np.float32)


def stats_overflow(q: np.ndarray, absmax2: np.ndarray, offset: np.ndarray) -> bool:
    """Whether compressed statistics overflow float32 (the rule ``qformats.nf4.quantize`` refuses
    by).

    Args:
        q: uint8 [nb], the 8-bit codes of the block absmax values (:func:`double_quant`).
        absmax2: float32 [ceil(nb / 256)], one scale per 256 codes.
        offset: float32 [1], the mean of the absmax values that the codes are relative to.
    Returns:
        True when a decoded absmax (:func:`dequantize_absmax`, unitless like the weights) is not
        finite: a non-finite offset (the float32 sum of the absmax values overflowed) or absmax2
        makes its blocks' decoded absmax non-finite, and a finite pair can still decode past
        FLT_MAX (one block of ~3.4e38 among zero blocks). False for nb = 0. Raises nothing beyond
        numpy's own errors for arrays of other shapes.
    Source: bitsandbytes' nested (double) quantization, ``bitsandbytes.functional.quantize_4bit``
    with ``compress_statistics=True`` (0.45-0.50), which stores such statistics and decodes inf
    and NaN.
    """
    if np.asarray(q).size == 0:
        return False
    return not np.isfinite(dequantize_absmax(q, absmax2, offset)).all()
