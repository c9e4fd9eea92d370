"""Save and load QuantizedTensors through safetensors, with the format metadata in the
file header (key ``"qformats"``, a JSON object ``{name: metadata}``)."""
from __future__ import annotations

import json
import os
from typing import Mapping

import numpy as np

from . import _files
from ._core import QuantizedTensor, validate

_META_KEY = "qformats"
_VERSION = 1


def save(path: str | os.PathLike, tensors: Mapping[str, QuantizedTensor]) -> None:
    """Write ``{name: QuantizedTensor}`` to a safetensors file at ``path``.

    Each buffer is stored as tensor ``"<name>.<buffer>"``; formats, shapes, dtypes and params
    go in the header. Buffers on a GPU are copied to the CPU. The file is written to a
    temporary file beside ``path`` and renamed into place, so ``path`` is either left as it was
    (on any error or Ctrl-C) or holds the whole new file.

    Raises:
        TypeError: ``tensors`` is not a mapping of QuantizedTensors.
        ValueError: a name that is empty or contains ``"."``; ``path`` is empty or a folder.
        OSError: ``path`` cannot be written (missing parent folder, permissions).
    """
    from safetensors.numpy import save_file

    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors: expected a mapping {{name: QuantizedTensor}}, got "
                        f"{type(tensors).__name__}")
    if os.fspath(path) == "":
        raise ValueError("path: empty; expected a file name")
    if os.path.isdir(path):
        raise ValueError(f"path {os.fspath(path)}: is a folder; expected a file name")
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
    with _files.cleanup_on_sigterm():
        tmp = _files.temp_path(path)
        try:
            save_file(arrays, os.fspath(tmp),
                      metadata={_META_KEY: json.dumps({"version": _VERSION, "tensors": meta})})
            _files.fix_mode(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def load(path: str | os.PathLike, device: str | None = None) -> dict[str, QuantizedTensor]:
    """Read a file written by :func:`save`. Buffers come back as numpy arrays, or as torch
    tensors on ``device`` when one is given (``"cpu"`` included: torch tensors on the CPU,
    sharing memory with the arrays read; ``"cuda:0"``, ...).

    Before any tensor data is read, the header is checked against the file: a header length
    past the end of the file (or over 100 MB), metadata nested too deeply, tensors whose byte
    ranges the file does not hold, and QuantizedTensor shapes that do not match their buffers
    (:func:`qformats._core.validate`) are refused, so a small file cannot make qformats
    allocate much more than its own size.

    Raises:
        ValueError: ``path`` is missing, a folder or not a regular file (a FIFO is refused,
            not opened), the file is not a qformats file, is truncated or corrupt, or its
            header and tensors disagree.
    """
    from safetensors import safe_open

    header = _files.read_safetensors_header(path, "qformats file")  # checks it is a regular file
    size = os.path.getsize(path)
    for k, v in header.items():
        if k == "__metadata__":
            continue
        offs = v.get("data_offsets") if isinstance(v, dict) else None
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and 0 <= o <= size for o in offs)):
            raise ValueError(f"{path}: tensor {k!r} has data offsets {offs!r} outside the file "
                             f"({size} bytes); truncated or corrupt file")
    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            header = (f.metadata() or {}).get(_META_KEY)
            if header is None:
                raise ValueError(f"{path}: not a qformats file (no '{_META_KEY}' metadata)")
            info = _files.loads_json(header, f"{path}: the '{_META_KEY}' metadata")
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
        import torch

        out = {k: QuantizedTensor(v.format, v.shape, v.dtype, v.params,
                                  {b: torch.from_numpy(a).to(device) for b, a in v.buffers.items()})
               for k, v in out.items()}
    return out
