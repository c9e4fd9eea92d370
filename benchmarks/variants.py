"""The --variants option of benchmarks/gemm.py and benchmarks/codecs.py: extra rows of a format
at other quantize parameters than its defaults (e.g. mixed2bit's tiled layout)."""
from __future__ import annotations

from qformats._core import format_spec

DEFAULT = "mixed2bit:layout=tiled"
HELP = ("extra rows at other quantize parameters: FMT:KEY=VALUE[;KEY=VALUE], comma-separated, over the "
        "format's defaults (row name FMT-VALUE...; '' for none)")


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def rows(formats: list[str], variants: str) -> list[tuple[str, str, dict]]:
    """(row name, format, quantize parameters): every format of `formats` at its defaults, then
    each variant of `variants`."""
    out = [(f, f, dict(format_spec(f).defaults)) for f in formats]
    for v in filter(None, variants.split(",")):
        fmt, _, kvs = v.partition(":")
        extra = {k: _value(x) for k, x in (kv.split("=", 1) for kv in kvs.split(";") if kv)}
        out.append(("-".join([fmt, *map(str, extra.values())]), fmt, {**format_spec(fmt).defaults, **extra}))
    return out
