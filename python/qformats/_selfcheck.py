"""Self-checks of the formats: each format's native codecs against its ``reference`` bytes.

Every format ships ``qformats.<fmt>._selfcheck``, a module with one function::

    def run(check: Check) -> None

that registers its checks on small numpy arrays with ``@check("name")`` (each check runs at
once; an ``AssertionError`` or any other exception fails it without stopping the others):
the native quantizer's bytes == the reference codec's (:func:`same`, byte equality),
dequantize == the reference decoder, pack/unpack where the format offers them, and its CPU
GEMMs, integer ones exactly (:func:`same`) and float ones within 1e-5 of the float64 product
(:func:`close`). The modules need numpy and the built native modules only (no torch, no
pytest): ``tools/wheel_check.py`` runs them (:func:`run_format`, for every name of
``qformats.FORMATS``) on an installed wheel in a fresh environment, and
``tests/core/test_selfcheck.py`` on the in-place build. A format without a ``_selfcheck``
module fails both.
"""
from __future__ import annotations

import importlib
import traceback
from typing import Callable

import numpy as np

__all__ = ["Check", "Checks", "same", "close", "rand", "run_format"]

#: ``check("name")`` returns a decorator that runs the decorated function now.
Check = Callable[[str], Callable[[Callable[[], None]], Callable[[], None]]]


class Checks:
    """A :data:`Check` that prints ``ok`` / ``FAIL`` per check and records the failed names."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
        def run(fn: Callable[[], None]) -> Callable[[], None]:
            try:
                fn()
                print(f"  ok    {name}")
            except Exception:  # noqa: BLE001 - every failure is reported, none stops the rest
                self.fail(name, traceback.format_exc().strip())
            return fn
        return run

    def fail(self, name: str, why: str = "") -> None:
        """Record a failure found outside a check (printed with ``why`` indented below)."""
        self.failures.append(name)
        print(f"  FAIL  {name}")
        if why:
            print("        " + why.replace("\n", "\n        "))


def same(got, want, what: str) -> None:
    """Equal dtype, shape and bytes."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.tobytes() == want.tobytes(), f"{what}: bytes differ from the reference"


def close(got, x, w, what: str) -> None:
    """``||got - x w^T|| <= 1e-5 ||(|x| |w|^T)||`` in float64 (tests/gemm/test_gemm_cpu.py)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    got = np.asarray(got, np.float64)
    assert got.shape == (x64.shape[0], w64.shape[0]), f"{what}: shape {got.shape}"
    err = np.linalg.norm(got - x64 @ w64.T)
    scale = np.linalg.norm(np.abs(x64) @ np.abs(w64).T)
    assert err <= 1e-5 * scale, f"{what}: error {err:.3e} > 1e-5 * {scale:.3e}"


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    """Standard normal float32 of ``shape``, reproducible from ``seed``."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run_format(fmt: str, check: Checks) -> None:
    """Run format ``fmt``'s self-check, ``qformats.<fmt>._selfcheck.run(check)``. A format
    without one, a self-check that does not import, and an exception outside its checks are
    failures recorded on ``check``."""
    name = f"qformats.{fmt}._selfcheck"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            check.fail(f"{fmt}: import {name}", traceback.format_exc().strip())
        else:
            check.fail(f"{fmt}: no self-check",
                       f"format {fmt!r} has no module {name}: add python/qformats/{fmt}/_selfcheck.py "
                       "defining run(check) (see qformats/_selfcheck.py)")
        return
    except Exception:  # noqa: BLE001 - reported as a failure of this format
        check.fail(f"{fmt}: import {name}", traceback.format_exc().strip())
        return
    if not callable(getattr(mod, "run", None)):
        check.fail(f"{fmt}: no self-check", f"{name} defines no run(check)")
        return
    try:
        mod.run(check)
    except Exception:  # noqa: BLE001 - an error outside its checks
        check.fail(f"{fmt}: self-check", traceback.format_exc().strip())
