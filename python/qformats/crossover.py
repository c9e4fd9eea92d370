"""Measured crossovers: which of two ways of computing the same product is faster here.

:class:`qformats.nn.QuantizedLinear` runs its format's native kernel for up to
``FormatSpec.linear_rows`` activation rows (where it always measured faster) and dequantizes +
calls ``F.linear`` (cuBLAS) from ``FormatSpec.tune_rows`` on. In between, which one wins
depends on the format, the weight's shape, the row count and the GPU (on the H200 the int4
kernel wins up to ~32 rows on 14336x4096, nf4's only up to ~16; benchmarks/README.md). So the
layer measures it: the first call with a new (weight description, activation dtype, device,
bias or not, row bucket) times both paths on that call's input with CUDA events (each run
once to warm up, then three times, twice, alternating) and every later call of that key takes
the faster one. Row buckets are multiples of 8 up to 128 (17-24, 25-32, ...), then powers of two
(129-256, 257-512, ...): prompts of every length above 128 rows cost a few decisions per shape,
not one per 8 rows.

What a decision changes is the order of float32 sums (both paths compute the same products),
so results can differ in the last bits between processes whose measurements went differently;
within a process a key is decided once. ``QFORMATS_TUNE=0`` (read at each decision) switches
measuring off: rows above ``linear_rows`` then always take the dequantizing path. Nothing is
measured while a CUDA graph is being captured or under ``torch.compile`` (the default path
runs then, undecided keys stay undecided).
"""
from __future__ import annotations

import os
from typing import Callable, Hashable

import torch

__all__ = ["bucket", "decide", "decisions", "reset", "ENV"]

ENV = "QFORMATS_TUNE"
_DECIDED: dict = {}


def bucket(rows: int) -> int:
    """The row bucket of ``rows`` (an int >= 1: activation rows of one call, i.e. the product
    of x's leading dimensions): ``rows`` rounded up to a multiple of 8 up to 128, above that to
    a power of two; an int. Raises nothing for ints (``int(rows)`` errors for other types)."""
    rows = int(rows)
    if rows <= 128:
        return (rows + 7) // 8 * 8
    return 1 << (rows - 1).bit_length()


def _enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


def _time_ms(fn: Callable[[], object], reps: int = 3) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def decide(key: Hashable, first: Callable[[], object], second: Callable[[], object]) -> bool:
    """True when ``first`` is faster than ``second`` on the current CUDA device, measured once
    per ``key`` (both must compute the same result; each is called several times, so they
    must not modify their inputs). False, unmeasured and not recorded, while measuring is off,
    a CUDA graph is being captured or torch.compile traces."""
    if not _enabled():
        return False
    hit = _DECIDED.get(key)
    if hit is not None:
        return hit
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    first()
    second()  # warm-up: allocations, lazily made tensors, cuBLAS heuristics
    t = [0.0, 0.0]
    for _ in range(2):
        t[0] += _time_ms(first)
        t[1] += _time_ms(second)
    _DECIDED[key] = won = t[0] < t[1]
    return won


def decisions() -> dict:
    """A copy of the decisions made in this process: ``{key: first path won}``."""
    return dict(_DECIDED)


def reset() -> None:
    """Forget every decision (the next call of each key measures again)."""
    _DECIDED.clear()
