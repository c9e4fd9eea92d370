"""QuantizedTensor: a tensor in one of the qformats formats, as named packed buffers plus the
metadata needed to decode it (format, logical shape, original dtype, format parameters).
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _arrays as A

#: The formats shipped with the package, in display order: the one registration line of a format.
#: Each is the subpackage ``qformats.<name>``, which says what it is in its ``SPEC``
#: (:class:`qformats._spec.FormatSpec`).
FORMATS = ("q4_0", "q8_0", "q8_1", "int8", "int4", "nf4", "mixed2bit")


def format_module(name: str):
    """The subpackage implementing format ``name`` (raises ValueError for an unknown name)."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"unknown qformats format {name!r}")
    try:
        mod = importlib.import_module(f"qformats.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"qformats.{name}":  # the format exists but something it needs does not
            raise ImportError(f"qformats format {name!r} could not be loaded: {e}") from e
        raise ValueError(f"unknown qformats format {name!r}") from e
    if getattr(mod, "FORMAT", None) != name:
        raise ValueError(f"unknown qformats format {name!r}")
    return mod


def format_spec(name: str):
    """The :class:`~qformats._spec.FormatSpec` of format ``name`` (ValueError for an unknown
    name, ImportError for a format whose native module cannot load)."""
    return format_module(name).SPEC


@dataclass
class QuantizedTensor:
    """A quantized tensor.

    Attributes:
        format: format name (``"q4_0"``, ``"nf4"``, ...), the subpackage that decodes it.
        shape: logical shape of the original tensor.
        dtype: original element type, ``"float32"``, ``"float16"`` or ``"bfloat16"``;
            :meth:`dequantize` returns it unless told otherwise.
        params: format parameters (JSON-serializable: ints, floats, strings, bools, None).
        buffers: named packed arrays, all numpy arrays or all torch tensors on one device.
    """

    format: str
    shape: tuple
    dtype: str
    params: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)

    def __post_init__(self):
        self.shape = _check_shape(self.shape)

    # -- decoding ---------------------------------------------------------------------------
    def dequantize(self, dtype: str | None = None):
        """Decode to a dense array of ``self.shape`` in ``dtype`` (default: the original dtype),
        in the buffers' library and device. See the format's ``dequantize`` for details."""
        return format_module(self.format).dequantize(self, dtype=dtype)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes stored in the buffers (every code, scale, zero point, map and outlier)."""
        return int(sum(_nbytes(b) for b in self.buffers.values()))

    @property
    def avg_bits(self) -> float:
        """Stored bits per element of the logical tensor: 8 * nbytes / numel."""
        return 8.0 * self.nbytes / self.numel if self.numel else 0.0

    @property
    def device(self) -> str:
        b = next(iter(self.buffers.values()), None)
        return A.device_of(b) if b is not None else "cpu"

    # -- movement ----------------------------------------------------------------------------
    def to(self, device) -> "QuantizedTensor":
        """A copy with every buffer on ``device`` (torch tensors; numpy buffers are converted
        with torch.from_numpy). ``to("cpu")`` on numpy buffers returns self."""
        if all(isinstance(b, np.ndarray) for b in self.buffers.values()) and str(device) == "cpu":
            return self
        import torch

        bufs = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v).to(device)
                for k, v in self.buffers.items()}
        return QuantizedTensor(self.format, self.shape, self.dtype, dict(self.params), bufs)

    def numpy(self) -> "QuantizedTensor":
        """A copy with every buffer as a numpy array on the CPU."""
        return QuantizedTensor(self.format, self.shape, self.dtype, dict(self.params),
                               {k: A.to_numpy(v) for k, v in self.buffers.items()})

    # -- serialization -----------------------------------------------------------------------
    def metadata(self) -> dict:
        """Everything but the buffers' contents, JSON-serializable."""
        return {"format": self.format, "shape": list(self.shape), "dtype": self.dtype,
                "params": self.params, "buffers": sorted(self.buffers)}

    def state_dict(self) -> dict:
        """A plain dict that ``torch.save`` writes and ``torch.load(..., weights_only=True)``
        reads back: metadata as strings, ints and lists, buffers as torch tensors (numpy
        buffers are wrapped without a copy). Needs torch."""
        import torch

        return {
            "format": self.format,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "params_json": json.dumps(self.params, sort_keys=True),
            "buffers": {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                        for k, v in self.buffers.items()},
        }

    @classmethod
    def from_state_dict(cls, sd: dict) -> "QuantizedTensor":
        """Rebuild from :meth:`state_dict` output. Raises ValueError if it is malformed or
        does not match its format's buffers."""
        try:
            qt = cls(sd["format"], tuple(sd["shape"]), sd["dtype"], json.loads(sd["params_json"]),
                     dict(sd["buffers"]))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a QuantizedTensor state dict: {e!r}") from e
        validate(qt)
        return qt

    def __repr__(self) -> str:
        return (f"QuantizedTensor(format={self.format!r}, shape={self.shape}, dtype={self.dtype!r}, "
                f"params={self.params}, avg_bits={self.avg_bits:.3f}, device={self.device!r})")


def _check_shape(shape: Any) -> tuple:
    """``shape`` as a tuple of Python ints; TypeError for anything but a sequence of integers
    (a float such as 2.7 is refused, not truncated), ValueError for a negative size."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shape: expected a sequence of ints, got {type(shape).__name__}")
    out = []
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"shape: expected ints, got {s!r} ({type(s).__name__}) in {tuple(shape)}")
        if s < 0:
            raise ValueError(f"shape: sizes must be >= 0, got {tuple(shape)}")
        out.append(int(s))
    return tuple(out)


def _nbytes(b: Any) -> int:
    if A.is_torch(b):
        return b.numel() * b.element_size()
    return int(b.nbytes)


def validate(qt: QuantizedTensor) -> None:
    """Check that ``qt`` has its format's buffers with the expected dtypes and shapes (each
    format module's ``expected_buffers(shape, params)``). Raises ValueError otherwise, and
    TypeError for a shape that is not a sequence of ints or a buffer that is not a numpy
    array / torch tensor (a list, None, a sparse tensor)."""
    qt.shape = _check_shape(qt.shape)  # the attribute may have been reassigned since __init__
    if not isinstance(qt.buffers, dict):
        raise TypeError(f"buffers: expected a dict {{name: array}}, got {type(qt.buffers).__name__}")
    if qt.dtype not in A.FLOAT_DTYPES:
        raise ValueError(f"bad dtype {qt.dtype!r} in a {qt.format} QuantizedTensor")
    mod = format_module(qt.format)
    try:
        expected = mod.expected_buffers(qt.shape, qt.params)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"bad {qt.format} parameters {qt.params}: {e}") from e
    if set(expected) != set(qt.buffers):
        raise ValueError(f"{qt.format}: expected buffers {sorted(expected)}, got {sorted(qt.buffers)}")
    for name, (dtype, shape) in expected.items():
        b = qt.buffers[name]
        A.check_type(b, f"{qt.format} buffer {name!r}")
        if A.dtype_name(b) != dtype or tuple(b.shape) != tuple(shape):
            raise ValueError(f"{qt.format} buffer {name!r}: expected {dtype}{list(shape)}, "
                             f"got {A.dtype_name(b)}{list(b.shape)}")


def check_quantized(q: Any, fmt: str) -> QuantizedTensor:
    """``q`` if it is a valid QuantizedTensor of format ``fmt``; TypeError/ValueError otherwise."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"expected a QuantizedTensor, got {type(q).__name__}")
    if q.format != fmt:
        raise ValueError(f"expected a {fmt} QuantizedTensor, got format {q.format!r}")
    validate(q)
    return q


def float_dtype(dtype: Any) -> str:
    """'float32' / 'float16' / 'bfloat16' from a name, numpy dtype or torch dtype (TypeError otherwise)."""
    name = str(dtype).removeprefix("torch.")
    if name not in A.FLOAT_DTYPES:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in A.FLOAT_DTYPES:
        raise TypeError(f"dtype: expected one of {A.FLOAT_DTYPES}, got {dtype!r}")
    return name


def output_dtype(q: QuantizedTensor, dtype: str | None) -> str:
    """The dtype a dequantize call returns: ``dtype`` if given, else the original one."""
    return float_dtype(q.dtype if dtype is None else dtype)
