"""The user's choice of format, resolved without torch: ``bits`` -> format
(:data:`BITS_FORMATS`), a generic ``group_size`` folded into the format's own parameter, and the
parameters checked on a tiny weight (:func:`resolve_spec`). The CLI checks its flags with it
before torch is imported; :mod:`qformats.plan` applies it to each layer.
"""
from __future__ import annotations

import inspect
from typing import Optional

import numpy as np

from ._core import FORMATS, format_module, format_spec

__all__ = ["MAX_BLOCK", "BITS_FORMATS", "block", "resolve_spec"]

#: Largest block / group (values along in_features) that :func:`resolve_spec` accepts: 2**20,
#: longer than any Linear's rows, so that a mistyped ``--group-size 268435456`` is refused
#: before anything of that size is allocated.
MAX_BLOCK = 1 << 20

#: ``bits`` -> (format, default params): a policy of the model level (which format and settings
#: ``bits=`` means), not a fact of the formats; each format's own defaults are in its ``SPEC``.
BITS_FORMATS = {
    8: ("int8", {"granularity": "row"}),
    4: ("int4", {"group_size": 128, "symmetric": False}),
    2: ("mixed2bit", {"group_size": 16, "ratio_4bit": 0.0}),
}



def block(fmt: str, params: dict) -> int:
    """in_features must be a multiple of this for ``fmt`` with ``params`` (1: any): the
    format's own :attr:`~qformats._spec.FormatSpec.block`."""
    return int(format_spec(fmt).block(params))


def row_block(fmt: str, params: dict) -> int:
    """out_features must be a multiple of this for ``fmt`` with ``params`` (1: any): the
    format's own :attr:`~qformats._spec.FormatSpec.row_block`."""
    return int(format_spec(fmt).row_block(params))


def fits(fmt: str, params: dict, layer) -> bool:
    """Whether ``fmt`` with ``params`` can hold the weight of ``layer`` (an ``nn.Linear``):
    in_features a multiple of :func:`block`, out_features of :func:`row_block`."""
    return layer.in_features % block(fmt, params) == 0 and layer.out_features % row_block(fmt, params) == 0


def _apply_group_size(fmt: str, params: dict, group_size: Optional[int]) -> dict:
    """Fold a generic ``group_size`` into ``fmt``'s own parameter
    (:attr:`~qformats._spec.FormatSpec.with_group_size`; ValueError where the format cannot
    take it)."""
    if group_size is None:
        return params
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    return dict(format_spec(fmt).with_group_size(dict(params), group_size))


def resolve_spec(format: Optional[str] = None, bits: Optional[int] = None,
                 group_size: Optional[int] = None, **params) -> tuple[str, dict]:
    """``(format, quantize params)`` for one layer from the user's choice, validated.

    Args:
        format: a qformats format name (any of ``qformats.FORMATS``).
        bits: 8, 4 or 2 (see :data:`BITS_FORMATS`); exactly one of ``format`` and ``bits``.
        group_size: values per group (int4, mixed2bit, int8 -> per-group scales, nf4 ->
            ``blocksize``; q4_0 / q8_0 / q8_1 only accept 32).
        **params: the format's ``quantize`` keyword arguments (override the defaults).
    Returns:
        the format name and the keyword arguments for its ``quantize``.
    Raises:
        ValueError: neither or both of format and bits, bits not in 8/4/2, an unknown format
            or parameter, a parameter value the format rejects (e.g. an int4 group_size that is
            not a multiple of 8), per-layer tensors (``sensitivity``).
    """
    if (format is None) == (bits is None):
        raise ValueError("give exactly one of format= (a qformats format) and bits= (8, 4 or 2)"
                         + (f"; got format={format!r} and bits={bits!r}" if format is not None else ""))
    if bits is not None:
        if isinstance(bits, bool) or bits not in BITS_FORMATS:
            raise ValueError(f"bits must be one of {sorted(BITS_FORMATS, reverse=True)} "
                             f"(8: int8, 4: int4, 2: mixed2bit), got {bits!r}")
        fmt, defaults = BITS_FORMATS[int(bits)]
        base = dict(defaults)
    else:
        if not isinstance(format, str) or format not in FORMATS:
            raise ValueError(f"unknown format {format!r}; known: {', '.join(FORMATS)}")
        fmt, base = format, {}
    base = _apply_group_size(fmt, base, group_size)
    base.update(params)
    if "sensitivity" in base:
        raise ValueError("sensitivity is a per-layer tensor from calibration data: pass "
                         "calibration= (token ids, or a text with tokenizer=) and quantize_model "
                         "measures it for each mixed2bit layer")
    mod = format_module(fmt)
    try:
        inspect.signature(mod.quantize).bind(None, **base)
    except TypeError as e:
        raise ValueError(f"{fmt}: bad parameters {base}: {e}") from e
    # Try the parameters on a tiny weight, so that a bad value fails before any layer changes.
    try:
        blk = block(fmt, base)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{fmt}: bad parameters {base}: {e}") from e
    if blk > MAX_BLOCK:  # checked before the trial weight [2, blk] is allocated
        raise ValueError(f"{fmt}: a block/group of {blk} values is larger than any weight row "
                         f"qformats quantizes (at most {MAX_BLOCK}); use a smaller group size")
    try:
        mod.quantize(np.zeros((max(2, row_block(fmt, base)), blk * -(-32 // blk)), np.float32), **base)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{fmt}: bad parameters {base}: {e}") from e
    return fmt, base
