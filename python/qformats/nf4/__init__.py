"""nf4: bitsandbytes' 4-bit NormalFloat (QLoRA, arXiv:2305.14314), byte-compatible with
bitsandbytes 0.50 ``bitsandbytes.functional.quantize_4bit(A, blocksize, quant_type="nf4",
compress_statistics=...)`` on the CPU.

The input is flattened and cut into blocks of ``blocksize`` values (32..4096, a power of two;
default 64; the last block may be partial). Each block stores a float32 ``absmax``; each value a
4-bit code into the 16 NF4 levels, two per byte, the even element in the high nibble (odd n: the
last low nibble is the padding code 7). Decoded value: ``CODE[code] * absmax``. With
``compress_statistics=True`` the absmax vector is itself quantized as bitsandbytes does it: offset
= its mean, ``absmax - offset`` in blocks of 256 with the signed dynamic 8-bit map (uint8
``absmax``, float32 ``absmax2`` per 256 blocks, float32 ``offset``). The exact rules, corner cases
and where bitsandbytes deviates from the obvious reading are in ``src/formats/nf4/nf4.h`` and
:mod:`qformats.nf4.reference`.

Error bound per block with stored absmax ``A`` (see the tests)::

    |x - x'| <= A * (MAX_HALF_GAP + 2**-21) + 2**-149        MAX_HALF_GAP = 0.1519036

(half of the widest gap between NF4 levels, -1 .. -0.6961928), except in a full block whose
absmax is below 1e-38 (subnormal input), where bitsandbytes scales by 1/1e-38 and the bound is
``|x - x'| <= A``. With compressed statistics the decoded absmax ``A'`` replaces ``A`` in the
decoder, which adds ``|A - A'| <= absmax2 * DYNAMIC_MAX_ERROR (7.05e-3) + 2**-22 * (|A'| + |offset|)``
(``2 * absmax2`` when absmax2 < 2**-126) times ``|code| <= 1``.

Devices: numpy arrays and CPU tensors run the CPU kernels; CUDA tensors (CUDA builds) run the
CUDA kernels on the tensor's device, on torch's current stream, with outputs on that device and
the same bytes as the CPU (offset included: computed on the device in torch's CPU summation
order). :func:`gemm` runs on both (on CUDA: ``src/gemm/weight_only_cuda.cuh``).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _arrays as A
from .._core import QuantizedTensor, check_quantized, output_dtype
from .._spec import PREFILL_TUNE_ROWS, WEIGHT_ONLY_ROWS, FormatSpec, LinearKernel
from .._core import float_dtype as _float_dtype
from . import _native, reference

FORMAT = "nf4"
QUANT_TYPE = "nf4"
BLOCKSIZES = reference.BLOCKSIZES          #: allowed ``blocksize`` values
DOUBLE_QUANT_BLOCK = reference.DOUBLE_QUANT_BLOCK  #: blocksize of the absmax quantization (256)
CODE = reference.CODE                      #: the 16 NF4 levels (float32)
DYNAMIC_MAP = reference.DYNAMIC_MAP        #: the 256-entry map of the compressed absmax (float32)
MAX_HALF_GAP = reference.MAX_HALF_GAP
DYNAMIC_MAX_ERROR = reference.DYNAMIC_MAX_ERROR

__all__ = ["SPEC", "quantize", "dequantize", "expected_buffers", "quantize_nf4", "dequantize_nf4", "gemm",
           "BLOCKSIZES", "CODE", "DYNAMIC_MAP", "reference"]


def _check_blocksize(blocksize: Any) -> int:
    if isinstance(blocksize, bool) or not isinstance(blocksize, (int, np.integer)):
        raise TypeError(f"blocksize: expected an int, got {type(blocksize).__name__}")
    if int(blocksize) not in BLOCKSIZES:
        raise ValueError(f"blocksize must be a power of two in [32, 4096] {BLOCKSIZES}, got {blocksize}")
    return int(blocksize)


def _n_blocks(n: int, blocksize: int) -> int:
    return -(-n // blocksize)


def _all_finite(a: Any) -> bool:
    if A.is_torch(a):  # on the tensor's device: only the answer crosses to the host
        return bool(a.isfinite().all())
    return bool(np.isfinite(a).all())


def _check_params(params: dict) -> tuple[int, bool]:
    """(blocksize, compress_statistics) from a params dict; ValueError/TypeError if malformed."""
    if not isinstance(params, dict):
        raise TypeError(f"params: expected a dict, got {type(params).__name__}")
    unknown = set(params) - {"blocksize", "quant_type", "compress_statistics"}
    if unknown:
        raise ValueError(f"unknown nf4 parameters {sorted(unknown)}")
    blocksize = _check_blocksize(params.get("blocksize", 64))
    if params.get("quant_type", QUANT_TYPE) != QUANT_TYPE:
        raise ValueError(f"quant_type must be 'nf4', got {params.get('quant_type')!r}")
    cs = params.get("compress_statistics", False)
    if not isinstance(cs, bool):
        raise TypeError(f"compress_statistics: expected a bool, got {type(cs).__name__}")
    return blocksize, cs


def expected_buffers(shape, params) -> dict:
    """Buffer names -> (dtype, shape) for an nf4 tensor of logical ``shape``.

    ``params``: ``blocksize`` (default 64), ``quant_type`` ("nf4"), ``compress_statistics``
    (default False). With n = prod(shape) and nb = ceil(n / blocksize): ``packed`` uint8
    [ceil(n/2)] and ``absmax`` float32 [nb]; compressed: ``absmax`` uint8 [nb], ``absmax2``
    float32 [ceil(nb/256)], ``offset`` float32 [1]. Raises ValueError/TypeError on bad params.
    """
    blocksize, cs = _check_params(params)
    n = math.prod(int(s) for s in shape)
    nb = _n_blocks(n, blocksize)
    bufs = {"packed": ("uint8", ((n + 1) // 2,))}
    if cs:
        bufs["absmax"] = ("uint8", (nb,))
        bufs["absmax2"] = ("float32", (_n_blocks(nb, DOUBLE_QUANT_BLOCK),))
        bufs["offset"] = ("float32", (1,))
    else:
        bufs["absmax"] = ("float32", (nb,))
    return bufs


def quantize_nf4(flat: Any, blocksize: int = 64) -> tuple[Any, Any]:
    """Quantize a 1-D tensor to NF4 (bitsandbytes ``quantize_4bit(flat, blocksize, quant_type="nf4")``).

    Args:
        flat: float32, float16 or bfloat16 numpy array / torch tensor ``[n]``, contiguous,
            finite; on the CPU or (CUDA builds) a CUDA device, launched on the current stream.
        blocksize: values per absmax block, a power of two in [32, 4096].
    Returns:
        ``(packed, absmax)``: uint8 ``[ceil(n/2)]`` (two codes per byte, the even element in the
        high nibble) and float32 ``[ceil(n/blocksize)]``, in the library and on the device of
        ``flat``.
    Raises:
        TypeError: not a numpy array / torch tensor, not a float dtype, blocksize not an int.
        ValueError: not 1-D, non-contiguous, NaN or Inf, bad blocksize.
    """
    blocksize = _check_blocksize(blocksize)
    A.check_float(flat, "flat", ndim=1)
    return _quantize_flat(flat, blocksize)


def _quantize_flat(x: Any, blocksize: int) -> tuple[Any, Any]:
    n = int(np.prod(x.shape, dtype=np.int64))
    packed = A.empty(x, ((n + 1) // 2,), "uint8")
    absmax = A.empty(x, (_n_blocks(n, blocksize),), "float32")
    with A.stream_for(x) as stream:
        _native.quantize(x, blocksize, packed, absmax, stream)
    return packed, absmax


def _decode(packed: Any, absmax: Any, shape: tuple, blocksize: int, dtype: str) -> Any:
    """``CODE[code] * absmax`` in float32, rounded once to ``dtype``, written directly by the
    native kernel (one pass) on the buffers' device."""
    A.same_device(("packed", packed), ("absmax", absmax))
    out = A.empty(packed, shape, dtype)
    with A.stream_for(packed) as stream:
        _native.dequantize(packed, absmax, blocksize, out, stream)
    return out


def dequantize_nf4(packed: Any, absmax: Any, n: int, blocksize: int = 64, dtype: str = "float32") -> Any:
    """Decode NF4 codes: ``CODE[code] * absmax`` (bitsandbytes ``dequantize_4bit``).

    Args:
        packed: uint8 ``[ceil(n/2)]`` from :func:`quantize_nf4`.
        absmax: float32 ``[ceil(n/blocksize)]`` (decoded, not the compressed uint8 form), on the
            device of ``packed``.
        n: number of values.
        blocksize: as used to quantize.
        dtype: output dtype, "float32" (default), "float16" or "bfloat16" (torch only): decoded
            in float32 and rounded once (nearest even).
    Returns:
        ``[n]`` of ``dtype`` in the library and on the device of ``packed``.
    Raises:
        TypeError / ValueError: wrong dtypes, shapes, n, blocksize or dtype; buffers on
            different devices.
    """
    n = A.check_int(n, "n")
    blocksize = _check_blocksize(blocksize)
    dtype = _float_dtype(dtype)
    A.check_array(packed, "packed", "uint8", ((n + 1) // 2,))
    A.check_array(absmax, "absmax", "float32", (_n_blocks(n, blocksize),))
    return _decode(packed, absmax, (n,), blocksize, dtype)


def quantize(x: Any, blocksize: int = 64, compress_statistics: bool = False) -> QuantizedTensor:
    """Quantize ``x`` to an nf4 :class:`~qformats.QuantizedTensor`, as bitsandbytes
    ``quantize_4bit(x, blocksize=blocksize, compress_statistics=compress_statistics,
    quant_type="nf4")`` (same bytes).

    Args:
        x: float32, float16 or bfloat16 numpy array / torch tensor, any shape with ndim >= 1
            (flattened row-major before blocking), contiguous, finite; on the CPU or (CUDA
            builds) a CUDA device, launched on the current stream.
        blocksize: values per absmax block, a power of two in [32, 4096] (default 64).
        compress_statistics: also quantize absmax (bitsandbytes' nested/double quantization).
    Returns:
        QuantizedTensor with params ``{"blocksize", "quant_type": "nf4", "compress_statistics"}``
        and buffers as :func:`expected_buffers` (in the library and on the device of ``x``).
    Raises:
        TypeError: not a numpy array / torch tensor, wrong dtype, blocksize not an int,
            compress_statistics not a bool.
        ValueError: a scalar, non-contiguous, NaN or Inf, bad blocksize; with
            compress_statistics, values so large (~1e38) that the float32 sum of the absmax
            values or a decoded absmax overflows (bitsandbytes would store these statistics and
            decode inf and NaN).
    """
    blocksize = _check_blocksize(blocksize)
    if not isinstance(compress_statistics, bool):
        raise TypeError(f"compress_statistics: expected a bool, got {type(compress_statistics).__name__}")
    A.check_float(x, "x")
    packed, absmax = _quantize_flat(x, blocksize)
    buffers = {"packed": packed}
    if compress_statistics:
        nb = absmax.shape[0]
        q = A.empty(x, (nb,), "uint8")
        absmax2 = A.empty(x, (_n_blocks(nb, DOUBLE_QUANT_BLOCK),), "float32")
        offset = A.empty(x, (1,), "float32")
        decoded = A.empty(x, (nb,), "float32")
        with A.stream_for(x) as stream:
            _native.double_quant(absmax, q, absmax2, offset, stream)
            _native.dequantize_absmax(q, absmax2, offset, decoded, stream)
        # bitsandbytes stores these bytes too (offset = inf once the float32 sum of absmax
        # overflows; or a decoded absmax DYNAMIC_MAP[q] * absmax2 + offset that rounds past
        # FLT_MAX, as for one block of ~3.4e38 among zero blocks), but such a tensor decodes to
        # inf and NaN: refuse it instead. A non-finite offset or absmax2 makes the decoded absmax
        # of its blocks non-finite too, so one check (one host sync on a GPU) covers all three.
        if nb and not _all_finite(decoded):
            raise ValueError("x: with compress_statistics=True a float32 statistic of the block absmax "
                             "values (their sum, or a decoded absmax) overflows (|x| too large, ~1e38); "
                             "use compress_statistics=False")
        buffers.update(absmax=q, absmax2=absmax2, offset=offset)
    else:
        buffers["absmax"] = absmax
    params = {"blocksize": blocksize, "quant_type": QUANT_TYPE, "compress_statistics": compress_statistics}
    return QuantizedTensor(FORMAT, tuple(x.shape), A.dtype_name(x), params, buffers)


def decoded_absmax(q: QuantizedTensor) -> Any:
    """The float32 per-block absmax of an nf4 QuantizedTensor ([n_blocks]); for compressed
    statistics ``fl32(fl32(DYNAMIC_MAP[absmax] * absmax2) + offset)``, as bitsandbytes."""
    q = check_quantized(q, FORMAT)
    _, cs = _check_params(q.params)
    absmax = q.buffers["absmax"]
    if not cs:
        return absmax
    absmax2, offset = q.buffers["absmax2"], q.buffers["offset"]
    A.same_device(("absmax", absmax), ("absmax2", absmax2), ("offset", offset))
    out = A.empty(absmax, tuple(absmax.shape), "float32")
    with A.stream_for(absmax) as stream:
        _native.dequantize_absmax(absmax, absmax2, offset, out, stream)
    return out


def dequantize(q: QuantizedTensor, dtype: str | None = None) -> Any:
    """Decode an nf4 QuantizedTensor to ``q.shape`` in ``dtype`` (default: the original dtype;
    bfloat16 needs torch buffers): float32 ``CODE[code] * absmax`` rounded once to ``dtype``, as
    bitsandbytes ``dequantize_4bit``, written directly (one pass), in the buffers' library and on
    their device. Raises TypeError/ValueError for a tensor that is not a valid nf4
    QuantizedTensor (or whose buffers are on different devices)."""
    q = check_quantized(q, FORMAT)
    blocksize, _ = _check_params(q.params)
    dtype = output_dtype(q, dtype)
    A.same_device(*q.buffers.items())
    return _decode(q.buffers["packed"], decoded_absmax(q), q.shape, blocksize, dtype)


def gemm(x: Any, w: QuantizedTensor) -> Any:
    """``Y = X . W^T`` with float activations and nf4 weights, W decoded a tile at a time on the
    CPU (in registers for N <= 4 on AVX-512 and AVX2 CPUs) and in registers on the GPU, never
    materialized whole.

    Args:
        x: float32, float16 or bfloat16 ``[N, K]`` numpy array / torch tensor (CPU, or CUDA with
            w's buffers on the same device), contiguous, finite. On CUDA, K % 32 == 0.
        w: a 2-D nf4 QuantizedTensor of shape ``[M, K]`` (blocks run over the flattened W, so they
            may straddle rows when K % blocksize != 0), plain or with compressed statistics.
    Returns:
        ``[N, M]`` in the library and on the device of ``x``: float32 on the CPU, ``x``'s dtype on
        CUDA. Each dot product is a float32 (FMA) sum of ``x[n, k] * w'[m, k]`` with ``w' =
        CODE[code] * absmax`` exactly as :func:`dequantize` (bitsandbytes ``dequantize_4bit``);
        the CPU orders the sum by instruction set (AVX-512, AVX2 or plain C++), not by thread
        count; the GPU kernel (``src/gemm/weight_only_cuda.cuh``) applies each block's absmax to
        the block's sum of ``CODE * x`` and rounds once to the output dtype.
    Raises:
        TypeError: x not a float32/float16/bfloat16 array or tensor, w not a QuantizedTensor.
        ValueError: shapes do not match, w not 2-D, NaN/Inf in x, non-contiguous x, x and w on
            different devices, K % 32 != 0 on CUDA.
    """
    w = check_quantized(w, FORMAT)
    A.check_type(x, "x")
    A.check_float(x, "x", ndim=2)
    if len(w.shape) != 2:
        raise ValueError(f"w: expected a 2-D weight [M, K], got shape {w.shape}")
    M, K = w.shape
    if x.shape[1] != K:
        raise ValueError(f"x: expected shape [N, {K}] to match w {list(w.shape)}, got {tuple(x.shape)}")
    A.same_device(("x", x), *w.buffers.items())
    if A.is_cuda(x) and K % 32:
        raise ValueError(f"nf4.gemm on CUDA needs K % 32 == 0, got K={K}")
    blocksize, _ = _check_params(w.params)
    absmax = decoded_absmax(w)
    x, out = A.gemm_operands(x, x.shape[0], M)
    with A.stream_for(x) as stream:
        _native.gemm(x, w.buffers["packed"], absmax, out, M, K, blocksize, stream,
                     A.gemm_workspace(x, x.shape[0], M))
    return out

# -- the format's face --------------------------------------------------------------------------

def _make_linear(q: QuantizedTensor, derived: Any = None) -> LinearKernel | None:
    """nf4 weight ``q`` [M, K] bound to the native weight-only kernel, with its absmax decoded
    once (``derived["absmax_decoded"]`` for compressed statistics); None on CUDA for K % 32."""
    M, K = q.shape
    packed = q.buffers["packed"]
    if A.is_cuda(packed) and K % 32:
        return None
    blocksize, cs = _check_params(q.params)
    absmax = (derived or {}).get("absmax_decoded") if cs else None
    if absmax is None:
        absmax = decoded_absmax(q)
    return LinearKernel(_native.make_linear(packed, absmax, M, K, blocksize),
                        {"absmax_decoded": absmax} if cs else {})


SPEC = FormatSpec(
    name=FORMAT,
    summary="NF4 codes, two per byte (even element high), float32 absmax per block (4.5 bits at 64)",
    source="bitsandbytes 0.50 quantize_4bit(quant_type='nf4') (QLoRA, arXiv 2305.14314)",
    defaults={"blocksize": 64},
    group_param="blocksize",
    block=lambda p: 1,  # blocks run over the flattened weight, as bitsandbytes
    quantize=quantize,
    dequantize=dequantize,
    expected_buffers=expected_buffers,
    gemm=gemm,
    linear_rows=WEIGHT_ONLY_ROWS,
    tune_rows=PREFILL_TUNE_ROWS,
    make_linear=_make_linear,
)
