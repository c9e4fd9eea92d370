"""Helpers of the reliability tests: risky calls run in a child Python with a memory cap
(RLIMIT_AS) and a timeout, so that a crash, a hang or a memory bomb fails the test instead of
the test run."""
from __future__ import annotations

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


def run_capped(code: str, *, mem_mb: int = 1536, timeout: float = 60.0,
               args: tuple = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a child Python (importing the qformats under test) whose address space is capped at
    ``mem_mb`` MiB; fails the test if it runs past ``timeout`` seconds. ``env`` adds to (or, with
    None values, removes from) the child's environment."""
    limit = mem_mb << 20

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    child_env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), HF_HUB_OFFLINE="1",
                     OMP_NUM_THREADS="1", QFORMATS_NUM_THREADS="1")
    for k, v in (env or {}).items():
        if v is None:
            child_env.pop(k, None)
        else:
            child_env[k] = v
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=child_env,
                              preexec_fn=cap, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"child ran past {timeout} s (a hang):\n{code}")


def run_cli(*argv: str, mem_mb: int = 4096, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``qformats ARGV`` in a capped child."""
    return run_capped("import sys; from qformats.cli import main; sys.exit(main(sys.argv[1:]))",
                      mem_mb=mem_mb, timeout=timeout, args=argv)
