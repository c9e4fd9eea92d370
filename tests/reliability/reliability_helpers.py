"""Helpers of the reliability tests: risky calls run in a child Python with a memory cap
(RLIMIT_AS) and a timeout, so that a crash, a hang or a memory bomb fails the test instead of
the test run."""
from __future__ import annotations

import functools
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import qformats  # (the copy under test: the installed one, or python/ in place)

ROOT = Path(__file__).resolve().parents[2]
# The child imports the same qformats as this process: the installed package in CI (the
# source tree has no native modules there), python/ in an in-place build.
PACKAGE_PARENT = Path(qformats.__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
LLAMA = SHARED / "models" / "pydoc-llama-17m"


def _child_env(env: dict | None) -> dict:
    child_env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), HF_HUB_OFFLINE="1",
                     OMP_NUM_THREADS="1", QFORMATS_NUM_THREADS="1")
    for k, v in (env or {}).items():
        if v is None:
            child_env.pop(k, None)
        else:
            child_env[k] = v
    return child_env


@functools.lru_cache(maxsize=None)
def libraries_mb() -> int:
    """MiB of address space a child Python maps once torch and qformats are imported (VmPeak):
    about 0.6 GiB with a CPU build of torch, about 3.8 GiB with a CUDA build, whose GPU libraries
    are mapped whether or not a GPU is used."""
    probe = ("import torch, qformats\n"
             "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmPeak:')))")
    r = subprocess.run([sys.executable, "-c", probe], env=_child_env(None), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1]) >> 10  # kB -> MiB


def run_capped(code: str, *, mem_mb: int = 896, timeout: float = 60.0,
               args: tuple = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a child Python (importing the qformats under test) whose address space is capped at
    ``mem_mb`` MiB beyond what the child maps with torch and qformats imported (:func:`libraries_mb`, so
    that a CUDA build of torch gets the same room as a CPU build); fails the test if it runs past
    ``timeout`` seconds. ``env`` adds to (or, with None values, removes from) the child's environment."""
    limit = (libraries_mb() + mem_mb) << 20

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    child_env = _child_env(env)
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=child_env,
                              preexec_fn=cap, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"child ran past {timeout} s (a hang):\n{code}")


def run_cli(*argv: str, mem_mb: int = 3456, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``qformats ARGV`` in a capped child."""
    return run_capped("import sys; from qformats.cli import main; sys.exit(main(sys.argv[1:]))",
                      mem_mb=mem_mb, timeout=timeout, args=argv)
