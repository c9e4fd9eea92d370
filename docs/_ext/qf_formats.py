"""Sphinx extension: the format pages' toctree entries from the registration list.

A toctree line that reads ``%FORMATS%`` (in ``docs/formats/index.md`` and
``docs/api/index.rst``) becomes one entry per name of ``qformats.FORMATS``, in that order and
with that line's indentation, so a new format's pages (``docs/formats/<fmt>.md``,
``docs/api/<fmt>.rst``) are listed without editing the indexes; a registered format without its
page is a "nonexisting document" warning, an error under ``-W``.
"""
from __future__ import annotations

import re

import qformats

MARK = re.compile(r"^([ \t]*)%FORMATS%[ \t]*$", re.M)


def expand(text: str) -> str:
    """``text`` with every ``%FORMATS%`` line replaced by the format names, one per line."""
    return MARK.sub(lambda m: "\n".join(m.group(1) + fmt for fmt in qformats.FORMATS), text)


def _source_read(app, docname, source):
    source[0] = expand(source[0])


def setup(app):
    app.connect("source-read", _source_read)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
