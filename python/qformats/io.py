"""Save and load QuantizedTensors through safetensors, with the format metadata in the
file header (key ``"qformats"``, a JSON object ``{name: metadata}``)."""
from __future__ import annotations

import json
import os
from typing import Mapping

import numpy as np

from ._core import QuantizedTensor, validate

_META_KEY = "qformats"
_VERSION = 1


def save(path: str | os.PathLike, tensors: Mapping[str, QuantizedTensor]) -> None:
    """Write ``{name: QuantizedTensor}`` to a safetensors file at ``path``.

    Each buffer is stored as tensor ``"<name>.<buffer>"``; formats, shapes, dtypes and params
    go in the header. Buffers on a GPU are copied to the CPU. Raises TypeError for values that
    are not QuantizedTensors and ValueError for names containing ``"."``.
    """
    from safetensors.numpy import save_file

    arrays, meta = {}, {}
    for name, qt in tensors.items():
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"{name!r}: expected a QuantizedTensor, got {type(qt).__name__}")
        if not name or "." in name:
            raise ValueError(f"tensor name {name!r} must be non-empty and contain no '.'")
        host = qt.numpy()
        for b, arr in host.buffers.items():
            arrays[f"{name}.{b}"] = np.ascontiguousarray(arr)
        meta[name] = qt.metadata()
    save_file(arrays, os.fspath(path),
              metadata={_META_KEY: json.dumps({"version": _VERSION, "tensors": meta})})


def load(path: str | os.PathLike, device: str | None = None) -> dict[str, QuantizedTensor]:
    """Read a file written by :func:`save`. Buffers come back as numpy arrays, or as torch
    tensors on ``device`` when one is given (``"cpu"``, ``"cuda:0"``, ...).

    Raises ValueError if the file is not a qformats file, or its header and tensors disagree.
    """
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            header = (f.metadata() or {}).get(_META_KEY)
            if header is None:
                raise ValueError(f"{path}: not a qformats file (no '{_META_KEY}' metadata)")
            info = json.loads(header)
            out = {}
            for name, m in info["tensors"].items():
                bufs = {b: f.get_tensor(f"{name}.{b}") for b in m["buffers"]}
                qt = QuantizedTensor(m["format"], tuple(m["shape"]), m["dtype"], m["params"], bufs)
                validate(qt)
                out[name] = qt
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt qformats metadata: {e!r}") from e
    except Exception as e:  # safetensors raises its own error types for truncated files
        if isinstance(e, (ValueError, OSError)):
            raise
        raise ValueError(f"{path}: cannot read as safetensors: {e}") from e
    if device is not None:
        out = {k: v.to(device) for k, v in out.items()}
    return out
