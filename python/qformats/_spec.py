"""What a format is, said in one place: :class:`FormatSpec`, one frozen instance per format
(``qformats.<fmt>.SPEC``), like the ``type_traits`` table of ggml (``ggml.c``). The layers above
the formats (the registry in ``_core``, ``ops`` and ``nn``, the model-level tools, the CLI,
``compare``, benchmarks and tools) read these fields and never branch on a format's name.

This module imports nothing from the package, so every format package can import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

__all__ = ["FormatSpec", "LinearKernel", "WEIGHT_ONLY_ROWS", "TUNE_ROWS", "PREFILL_TUNE_ROWS", "fixed_blocks"]

#: The ``linear_rows`` of the formats whose weight-only kernels run in QuantizedLinear: up to 16
#: activation rows on CUDA and 32 on the CPU: where the kernels measured faster than dequantize +
#: cuBLAS / F.linear (past them the dequantizing path is faster on some shapes); benchmarks/
#: README.md has the measurements.
WEIGHT_ONLY_ROWS = MappingProxyType({"cuda": 16, "cpu": 32})

#: The ``tune_rows`` of the formats with CUDA weight-only kernels: from 17 up to 128 rows on CUDA,
#: QuantizedLinear measures whether the kernel or dequantize + cuBLAS is faster (qformats.crossover);
#: on the H200 the sm_90a kernels of int4, nf4 and q4_0 won up to 128 rows on Llama-7B-sized
#: weights, and every kernel measured slower from 256 rows (benchmarks/README.md).
TUNE_ROWS = MappingProxyType({"cuda": 128})

#: The ``tune_rows`` of the formats with a CUDA prefill kernel (int4, nf4, q4_0): from 33 fp16 or
#: bf16 rows (q4_0: 16) on an sm_90a build their kernel decodes the packed weight inside a Hopper
#: wgmma main loop, which on the H200 beat dequantize + cuBLAS at some of 256-1024 rows on
#: Llama-7B-sized weights and lost by 4-15% elsewhere (benchmarks/README.md, "The prefill kernel in
#: the library"), so QuantizedLinear measures it up to 4096 rows; past that the dequantizing path
#: decodes once for more products.
PREFILL_TUNE_ROWS = MappingProxyType({"cuda": 4096})


@dataclass(frozen=True)
class LinearKernel:
    """A weight bound to a native product kernel, made once by :attr:`FormatSpec.make_linear`.

    Attributes:
        run: the native ``Linear`` object of the format's extension (``src/bindings/linear.h``):
            ``run(x, out, bias, stream, workspace=None)`` with x ``[..., K]``
            float32/float16/bfloat16 on the weight's device, out ``[N, M]`` (x's dtype on CUDA,
            float32 on the CPU), bias ``[M]`` of out's dtype or None, stream a ``cudaStream_t``
            as an int (0 on the CPU), workspace None or uint8 of ``run.gemm_workspace(N)`` bytes
            on the weight's device (CUDA; faster where it is > 0).
        derived: tensors computed from the packed buffers that ``run`` reads (nf4's decoded
            ``absmax``, mixed2bit's CUDA chunk index), by name; a module that keeps the kernel
            registers them as non-persistent buffers so that they move and stay alive with it.
    """

    run: Any
    derived: Mapping[str, Any] = field(default_factory=dict)


def _no_group_size(params: dict, group_size: int) -> dict:
    raise ValueError("this format has no group parameter")


def fixed_blocks(name: str, qk: int) -> Callable[[dict, int], dict]:
    """``with_group_size`` of a format with fixed blocks of ``qk`` values (the GGML blocks):
    accepts ``group_size == qk`` only."""
    def fold(params: dict, group_size: int) -> dict:
        if group_size != qk:
            raise ValueError(f"{name} has fixed blocks of {qk} values; group_size={group_size} is not possible")
        return dict(params)

    return fold


@dataclass(frozen=True)
class FormatSpec:
    """One format's facts and entry points.

    Attributes:
        name: the format's name, also its subpackage ``qformats.<name>``.
        summary: one line: layout and bits per value.
        source: where the format comes from (paper, llama.cpp file, library version).
        defaults: the parameters :attr:`quantize` uses when given none (read-only mapping).
        group_param: the parameter that a generic ``group_size`` sets (``"group_size"``,
            ``"blocksize"``), or None for fixed blocks.
        block: ``block(params) -> int``: the last dimension (in_features) must be a multiple
            of this for these params (1: any).
        row_block: ``row_block(params) -> int``: the first dimension of a 2-D weight
            (out_features) must be a multiple of this for these params (1: any; int4's tiles
            layout: 16).
        with_group_size: ``with_group_size(params, group_size) -> params``: params with a
            generic group size folded in; ValueError if the format cannot take it.
        quantize: ``quantize(x, **params) -> QuantizedTensor``.
        dequantize: ``dequantize(q, dtype=None)``.
        expected_buffers: ``expected_buffers(shape, params) -> {name: (dtype, shape)}``.
        gemm: ``gemm(x, w)`` weight-only product ``[N, M]`` (None: the format has none).
        linear_rows: activation rows up to which :class:`qformats.nn.QuantizedLinear` runs
            the native kernel, by device type (``{"cuda": 16, "cpu": 32}``); above them it
            decodes the weight with the bound kernel's ``dequantize`` and calls ``F.linear``
            (0 rows: a device where only that decode is bound); for a device not listed it
            takes the ``qformats::linear`` operator. Measured crossovers: benchmarks/README.md.
        tune_rows: activation rows up to which, above ``linear_rows``, QuantizedLinear
            measures which is faster, the kernel or dequantize + ``F.linear``, once per weight
            shape, row bucket and device (:mod:`qformats.crossover`), by device type.
        make_linear: ``make_linear(q, derived=None) -> LinearKernel | None``: ``q`` (a 2-D
            QuantizedTensor with torch buffers, already validated) bound to the native
            kernel, or None where the kernel does not take its params on that device;
            ``derived`` reuses tensors a previous call made (no allocation then).
        trainable: ``trainable(params) -> bool``: whether trainable rounding (signround)
            applies to a layer with these params.
        rounding: ``rounding(weight, params, sensitivity=None) -> Rounding``: the format's
            fake quantization for trainable rounding of one layer (torch; the interface is
            :class:`qformats._rounding.Rounding`, made in the format's ``rounding`` module),
            given where :attr:`trainable` can be true; ``sensitivity`` (float ``[in]``) feeds
            a calibrated choice made before training (see :attr:`calibrated`), or None.
        calibrated: ``calibrated(params) -> bool``: whether :attr:`quantize` takes a
            ``sensitivity=`` argument for these params (calibrated group selection).
        ggml_type: the GGML tensor type (a ``gguf.GGMLQuantizationType`` name, e.g. ``"Q4_0"``)
            whose data is this format's one buffer byte for byte, row after row (uint8
            ``[..., K // block, block bytes]``, no params), or None where no GGML type holds
            the format exactly. :mod:`qformats.gguf` writes and reads such weights without
            converting them.
    """

    name: str
    summary: str
    source: str
    defaults: Mapping[str, Any]
    group_param: Optional[str]
    block: Callable[[Mapping[str, Any]], int]
    quantize: Callable[..., Any]
    dequantize: Callable[..., Any]
    expected_buffers: Callable[..., dict]
    gemm: Optional[Callable[..., Any]] = None
    linear_rows: Mapping[str, int] = field(default_factory=dict)
    tune_rows: Mapping[str, int] = field(default_factory=dict)
    make_linear: Optional[Callable[..., Optional[LinearKernel]]] = None
    with_group_size: Optional[Callable[[dict, int], dict]] = None
    trainable: Callable[[Mapping[str, Any]], bool] = lambda params: False
    rounding: Optional[Callable[..., Any]] = None
    calibrated: Callable[[Mapping[str, Any]], bool] = lambda params: False
    ggml_type: Optional[str] = None
    row_block: Callable[[Mapping[str, Any]], int] = lambda params: 1

    def __post_init__(self):
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "linear_rows", MappingProxyType(dict(self.linear_rows)))
        object.__setattr__(self, "tune_rows", MappingProxyType(dict(self.tune_rows)))
        if self.with_group_size is None:
            gp = self.group_param

            def fold(params: dict, group_size: int) -> dict:
                if gp is None:
                    return _no_group_size(params, group_size)
                return {**params, gp: group_size}

            object.__setattr__(self, "with_group_size", fold)

    def params(self, **overrides: Any) -> dict:
        """The default params with ``overrides`` applied (a new dict)."""
        return {**self.defaults, **overrides}
