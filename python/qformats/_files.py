"""File plumbing shared by the readers and writers: regular files only, JSON with a size cap
and a depth limit, safetensors headers read with their length checked against the file, and
writes that go to a temporary file in the target's folder and are renamed into place (the
temporary is removed when anything, Ctrl-C or SIGTERM included, interrupts them).
"""
from __future__ import annotations

import json
import os
import signal
import stat
import struct
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Union

#: Largest JSON file read (quantization_config.json, config.json, ...): 64 MiB.
MAX_JSON_BYTES = 64 << 20
#: Deepest nesting of lists/objects accepted in a JSON file read by qformats.
MAX_JSON_DEPTH = 64
#: Largest safetensors header read: 100 MB, safetensors' own limit.
MAX_HEADER_BYTES = 100_000_000


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` as a Path if it names a regular file (symlinks to one included).

    Raises:
        ValueError: it does not exist, or is a folder, FIFO, device or socket (reading a FIFO
            would block forever).
    """
    p = Path(path)
    if os.fspath(p) == "":
        raise ValueError(f"{what}: empty path")
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ValueError(f"{what} {p}: no such file") from None
    except OSError as e:
        raise ValueError(f"{what} {p}: cannot read it: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what} {p}: is a folder, expected a file")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what} {p}: not a regular file (a FIFO, device or socket)")
    return p


def _open_regular(p: Path, what: str) -> IO[bytes]:
    """Open a regular file for reading without blocking on a FIFO swapped in after the check."""
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{what} {p}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _depth_ok(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return False
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return True


def read_json(path: str | os.PathLike, what: str = "JSON file", *,
              max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The parsed JSON of a regular file at most ``max_bytes`` long and at most ``max_depth``
    levels deep. Raises ValueError (naming the file) for anything else: not a regular file,
    too large, not UTF-8, not JSON, nested too deeply."""
    p = regular_file(path, what)
    with _open_regular(p, what) as f:
        # sized by the file, not by max_bytes: read(n) allocates n bytes first (64 MiB for a
        # config of a few hundred bytes); a file that grew meanwhile is read on, up to the limit
        size = min(os.fstat(f.fileno()).st_size, max_bytes)
        data = f.read(size + 1)
        if len(data) > size:
            data += f.read(max_bytes + 1 - len(data))
    if len(data) > max_bytes:
        raise ValueError(f"{what} {p}: larger than {max_bytes} bytes; not a file qformats reads")
    return loads_json(data, f"{what} {p}", max_depth=max_depth)


def loads_json(data: bytes | str, where: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` with the depth limit of :func:`read_json`; ValueError naming ``where``."""
    try:
        obj = json.loads(data)
    except RecursionError:
        raise ValueError(f"{where}: JSON nested more than {max_depth} levels deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    if not _depth_ok(obj, max_depth):
        raise ValueError(f"{where}: JSON nested more than {max_depth} levels deep")
    return obj


def read_safetensors_header(path: str | os.PathLike, what: str = "safetensors file") -> dict:
    """The JSON header of a safetensors file (no tensor data is read). Raises ValueError for a
    file that is not regular, shorter than its header says, a header length over 100 MB, or
    a header that is not a JSON object."""
    p = regular_file(path, what)
    with _open_regular(p, what) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{what} {p}: truncated (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise ValueError(f"{what} {p}: header length {n} is larger than the file "
                             f"({size} bytes) or the 100 MB limit; corrupt file")
        header = loads_json(f.read(n), f"{what} {p}")
    if not isinstance(header, dict):
        raise ValueError(f"{what} {p}: the header is not a JSON object")
    return header


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM inside :func:`cleanup_on_sigterm`."""


@contextmanager
def cleanup_on_sigterm() -> Iterator[None]:
    """While the block runs, SIGTERM (``kill``'s default signal) unwinds it as Ctrl-C does, so
    its ``finally`` clauses remove the temporaries; the process then dies of SIGTERM, as it
    would have. Only in the main thread and while SIGTERM has its default action (a handler the
    program installed is left alone); elsewhere the block runs unchanged."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def raise_terminated(signum, frame):
        raise _Terminated

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # dies here, with the temporaries gone
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def temp_path(path: str | os.PathLike) -> Path:
    """A new, empty temporary file beside ``path`` (for writers that take a file name); the
    caller renames it into place (``os.replace``) or removes it."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    return Path(tmp)


def fix_mode(path: str | os.PathLike) -> None:
    """Give a file made by mkstemp (0600) the mode a plain ``open`` would (0666 & ~umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def check_output_dir(directory: Union[str, os.PathLike], source: Union[str, os.PathLike, None] = None,
                     *, overwrite: bool = True) -> Path:
    """``directory`` as a Path, after the checks made before anything is loaded or written
    (:func:`save_quantized` makes the first two; ``qformats quantize --out`` all of them).
    Raises ValueError for an empty path, a path that is an existing file, the ``source``
    folder itself (or a path that resolves to it), or, with ``overwrite=False``, an existing
    folder that is not empty."""
    if os.fspath(directory) == "":
        raise ValueError("directory: empty path; name the output folder")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a folder")
    if source is not None and os.fspath(source) != "" and Path(source).is_dir() \
            and out.resolve() == Path(source).resolve():
        raise ValueError(f"{out}: is the model's source folder; write the quantized model to "
                         "another folder")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out}: folder exists and is not empty (use a new folder, or allow "
                         "overwriting)")
    return out
