"""Check an installed qformats wheel on a machine without a GPU (run by tools/wheel_check.sh).

Run it with the interpreter of the fresh environment the wheel was installed into, in isolated
mode (``python -I tools/wheel_check.py WHEEL``) from outside the source tree, so that
``import qformats`` can only find the installed copy. It checks:

* the wheel holds ``qformats/py.typed`` and, next to every extension ``_native*.so``, a
  ``_native.pyi`` that parses and names every public function and class of the module;
* ``qformats`` and every submodule import (those that need torch or transformers, absent here,
  are listed and skipped); ``cuda_available()`` is False and no device is counted, whether the
  native modules were built with CUDA kernels or not (a CUDA wheel must import and run its CPU
  paths on a machine without a GPU). The build kind is printed; ``--cpu-built`` requires
  ``cuda_built()`` False (a wheel built without nvcc), ``--cuda-built`` requires it True;
* per format, every name of ``qformats.FORMATS``, the format's own self-check shipped in the
  wheel, ``qformats.<fmt>._selfcheck.run(check)`` (python/qformats/<fmt>/_selfcheck.py; the
  helpers and the interface are in python/qformats/_selfcheck.py), on small numpy arrays: the
  native quantizer's bytes == the format's ``reference`` codec, dequantize == the reference
  decoder, pack/unpack where offered, and the CPU GEMMs (integer ones exact, float ones within
  1e-5 of the float64 product as tests/gemm does); a format without one fails;
* the thread pool is one per process: the wheel holds ``qformats/_runtime/libqformats_threads.so``
  and a format's codec runs on the workers that ``qformats.set_num_threads`` asked for;
* a safetensors save/load round trip.

Exits 1 listing every failed check.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pkgutil
import sys
import tempfile
import zipfile

from qformats._selfcheck import Checks, rand, run_format, same

OPTIONAL = {"torch", "transformers", "tqdm"}   # not dependencies of the wheel
# Shared libraries that pkgutil lists as modules (any *.so is a candidate) but are not Python
# extensions: the thread pool every extension links (src/common/thread_pool.h).
NOT_MODULES = {"qformats._runtime.libqformats_threads"}
check = Checks()            # check("name") runs the decorated function now: ok / FAIL
failures = check.failures


# -- the wheel's files -----------------------------------------------------------------------

def check_wheel(path: str) -> None:
    print(f"wheel {os.path.basename(path)}")
    names = zipfile.ZipFile(path).namelist()

    @check("py.typed in the wheel")
    def _():
        assert "qformats/py.typed" in names, "qformats/py.typed missing"

    exts = sorted(n for n in names if os.path.basename(n).startswith("_native.") and n.endswith((".so", ".pyd")))

    @check(f"{len(exts)} extensions, one per format and the runtime")
    def _():
        from qformats import FORMATS
        dirs = {os.path.dirname(n) for n in exts}
        want = {f"qformats/{f}" for f in FORMATS} | {"qformats/_runtime"}
        assert want <= dirs, f"missing extensions: {sorted(want - dirs)}"

    for ext in exts:
        pyi = os.path.dirname(ext) + "/_native.pyi"
        mod = pyi[:-len(".pyi")].replace("/", ".")

        @check(f"{pyi}: present, parses, names every function and class of {mod}")
        def _():
            assert pyi in names, f"{pyi} missing"
            tree = ast.parse(zipfile.ZipFile(path).read(pyi).decode())
            defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            m = importlib.import_module(mod)
            public = {n for n in dir(m) if not n.startswith("_") and callable(getattr(m, n))}
            assert public, f"{mod} exports nothing"
            assert public <= defs, f"not in the stub: {sorted(public - defs)}"


# -- imports and runtime ---------------------------------------------------------------------

def check_imports(cuda_built: bool | None) -> None:
    import qformats

    print(f"qformats {qformats.__version__} from {os.path.dirname(qformats.__file__)}")

    @check("imported from the installed wheel, not a source tree")
    def _():
        assert "site-packages" in qformats.__file__, qformats.__file__

    @check("torch is not installed (the numpy paths stand alone)")
    def _():
        assert importlib.util.find_spec("torch") is None, "torch is importable here"

    skipped = []
    for info in pkgutil.walk_packages(qformats.__path__, "qformats."):
        if info.name in NOT_MODULES:
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in OPTIONAL:
                check.fail(f"import {info.name}", repr(e))
            else:
                skipped.append(f"{info.name} ({e.name})")
        except Exception as e:  # noqa: BLE001
            check.fail(f"import {info.name}", repr(e))
    print("  ok    every other submodule imports; skipped, needing an optional package: "
          f"{', '.join(skipped) or 'none'}")

    want = {None: "either build", True: "a CUDA build required", False: "a CPU-only build required"}

    @check(f"build kind ({want[cuda_built]}); cuda_available() is False, no device")
    def _():
        from qformats import _runtime
        built = bool(_runtime.cuda_built())
        kind = "CUDA kernels compiled in (cuda_built() True)" if built else "CPU only (cuda_built() False)"
        print(f"  build: {kind}")
        if cuda_built is True:
            assert built, "expected a CUDA build (cuda_built() is False)"
        elif cuda_built is False:
            assert not built, "the extensions were compiled with CUDA: was nvcc visible?"
        assert qformats.cuda_available() is False
        assert _runtime.cuda_device_count() == 0


def check_threads(names: list[str]) -> None:
    import numpy as np

    import qformats
    from qformats import _runtime, q4_0

    @check("one thread pool for every format (libqformats_threads, set_num_threads)")
    def _():
        assert "qformats/_runtime/libqformats_threads.so" in names, "libqformats_threads.so missing"
        qformats.set_num_threads(3)
        q4_0.quantize(np.ones((1024, 4096), np.float32))  # big enough to be split
        assert _runtime.pool_workers() == 2, f"{_runtime.pool_workers()} workers, expected 2"
        qformats.set_num_threads(1)
        assert _runtime.pool_workers() == 0, f"{_runtime.pool_workers()} workers, expected 0"


def check_io() -> None:
    import qformats
    from qformats import nf4, q4_0

    @check("save / load round trip (safetensors)")
    def _():
        w = rand(8, 64, seed=13)
        tensors = {"a": q4_0.quantize(w), "b": nf4.quantize(w, compress_statistics=True)}
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "w.safetensors")
            qformats.save(path, tensors)
            back = qformats.load(path)
        for k, qt in tensors.items():
            assert back[k].format == qt.format and tuple(back[k].shape) == tuple(qt.shape)
            for name, buf in qt.buffers.items():
                same(back[k].buffers[name], buf, f"{k}.{name}")


def main() -> int:
    args = sys.argv[1:]
    flags = {"--cuda-built": True, "--cpu-built": False}
    wanted = [flags[a] for a in args if a in flags]
    args = [a for a in args if a not in flags]
    if len(args) != 1 or len(wanted) > 1:
        print(f"usage: python -I {sys.argv[0]} WHEEL [--cuda-built | --cpu-built]", file=sys.stderr)
        return 2
    cuda_built = wanted[0] if wanted else None   # None: either build is accepted
    check_imports(cuda_built)
    check_wheel(args[0])
    print("formats (numpy, CPU kernels): each format's own qformats.<fmt>._selfcheck")
    from qformats import FORMATS
    for fmt in FORMATS:   # a format without a self-check fails here
        run_format(fmt, check)
    check_io()
    check_threads(zipfile.ZipFile(args[0]).namelist())
    if failures:
        print(f"wheel check: {len(failures)} failed: {'; '.join(failures)}")
        return 1
    print("wheel check: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
