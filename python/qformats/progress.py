"""Progress bars: tqdm on stderr, or a silent stand-in when disabled or when tqdm (in the
``demo`` extra) is not installed."""
from __future__ import annotations

import sys
from typing import Iterable

__all__ = ["progress_bar"]


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **kw):
    """A tqdm progress bar on stderr (a silent pass-through when ``enabled`` is False or tqdm
    is not installed). Keyword arguments go to tqdm (``total``, ``desc``, ``leave``, ...)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the demo extra
        enabled = False
    if not enabled:
        return _NullBar(iterable)
    kw.setdefault("file", sys.stderr)
    kw.setdefault("dynamic_ncols", True)
    if not getattr(kw["file"], "isatty", lambda: False)():
        kw.setdefault("mininterval", 5.0)  # a log file: a line every few seconds is enough
    return tqdm(iterable, **kw)


class _NullBar:
    """The part of tqdm's interface that compare uses, doing nothing."""

    def __init__(self, iterable=None):
        self._it = iterable

    def __iter__(self):
        return iter(self._it if self._it is not None else ())

    def update(self, n=1):
        pass

    def set_postfix_str(self, *a, **k):
        pass

    def set_description_str(self, *a, **k):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
