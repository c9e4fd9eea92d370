"""Every function of every format's native module (``qformats.<fmt>._native``, the formats of
``qformats._core.FORMATS``) called with huge, overflowing and negative size arguments (2**62,
2**63 - 1, -1, 2**31, ...) and with emptied arrays: a ValueError or OverflowError that names
the argument (nanobind's TypeError for integers past int64), or a correct call, never a crash,
a write out of bounds or into an input. The calls run in a capped child
(native_sizes_child.py says what it checks); a crash shows here as a signal."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from reliability.reliability_helpers import run_capped

from qformats._core import FORMATS

CHILD = Path(__file__).with_name("native_sizes_child.py")


def _died(rc: int) -> str:
    return signal.Signals(-rc).name if rc < 0 else f"exit status {rc}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_functions_refuse_hostile_sizes(fmt):
    r = run_capped(CHILD.read_text(), args=(fmt,), timeout=60)
    last = (r.stderr.strip().splitlines() or ["(nothing)"])[-1]
    assert r.returncode == 0, f"child died ({_died(r.returncode)}); last case: {last}\n{r.stderr[-3000:]}"
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["n_failures"] == 0, "\n".join(summary["failures"])
    res = summary["results"]
    assert res["ok"] > 0  # the valid template calls ran
    if fmt not in ("q8_0", "q8_1"):  # (their functions take no integers: only emptied arrays are tried)
        assert res["OverflowError"] > 0 and res["ValueError"] > 0 and res["TypeError"] > 0


def test_issue_17_reproduction_raises_overflow_error():
    """The case of issue 17: 4 scales of 2**62 values wrap to 0 elements, which an empty q and
    out matched; the kernel then read 2**64 values (a segfault)."""
    r = run_capped("""
        import numpy as np
        from qformats.int8 import _native
        try:
            _native.dequantize(np.zeros(0, np.int8), np.ones(4, np.float32), np.zeros(0, np.float32), 2**62, 0)
        except OverflowError as e:
            print("OverflowError:", e)
        """)
    assert r.returncode == 0, f"child died ({_died(r.returncode)}):\n{r.stderr}"
    assert r.stdout.startswith("OverflowError:") and "unit_len" in r.stdout, r.stdout
