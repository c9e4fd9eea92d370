"""Build and machine facts from the native runtime module, and the CPU thread setting.

The thread setting is one per process: every format's codecs and GEMMs run on one pool in the
shared library ``libqformats_threads`` next to this module.
"""
from __future__ import annotations

import numbers
import warnings

from ._native import MAX_THREADS, cuda_built, cuda_device_count, num_threads, num_threads_env_note, pool_workers
from ._native import set_num_threads as _set_num_threads

__all__ = ["MAX_THREADS", "cuda_built", "cuda_device_count", "num_threads", "set_num_threads", "pool_workers"]


def set_num_threads(n: int) -> None:
    """Set the CPU threads of every qformats codec and GEMM, for the whole process.

    Args:
        n: threads, an int in ``[1, MAX_THREADS]`` (1024). The calling thread counts as one;
            a pool already started is resized at once (after a running call finishes), so the
            process's OS threads follow. Where the OS refuses to create a thread (a process
            or memory limit), the kernels run with the threads that could be created.

    The starting value is ``QFORMATS_NUM_THREADS`` when it is an integer >= 1 (capped at
    ``MAX_THREADS``), else the CPUs this process may run on. The CLI's ``--threads`` sets it too.
    Results never depend on it: each output element is computed by one thread in one order.

    Raises:
        TypeError: ``n`` is not an integer (a bool included).
        ValueError: ``n`` is outside ``[1, MAX_THREADS]``.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"set_num_threads: n must be an int, got {type(n).__name__}")
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"set_num_threads: n must be in [1, {MAX_THREADS}], got {n}")
    _set_num_threads(int(n))


if num_threads_env_note():
    warnings.warn(num_threads_env_note(), RuntimeWarning, stacklevel=2)
