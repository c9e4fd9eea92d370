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
* per format, on small numpy arrays: the native quantizer's bytes == the format's ``reference``
  codec, dequantize == the reference decoder, pack/unpack where offered, and the CPU GEMMs
  (integer ones exact, float ones within 1e-5 of the float64 product as tests/gemm does);
  a safetensors save/load round trip.

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
import traceback
import zipfile

import numpy as np

F32 = np.float32
OPTIONAL = {"torch", "transformers", "tqdm"}   # not dependencies of the wheel
failures: list[str] = []


def check(name: str):
    """Decorator: run a check now, print ok / FAIL, record failures (assertion or exception)."""
    def run(fn):
        try:
            fn()
            print(f"  ok    {name}")
        except Exception:  # noqa: BLE001 - every failure is reported, none stops the rest
            failures.append(name)
            print(f"  FAIL  {name}")
            print("        " + traceback.format_exc().strip().replace("\n", "\n        "))
        return fn
    return run


def same(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.tobytes() == want.tobytes(), f"{what}: bytes differ from the reference"


def close(got, x, w, what: str) -> None:
    """||got - x w^T|| <= 1e-5 ||(|x| |w|^T)|| in float64 (tests/gemm/test_gemm_cpu.py)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    got = np.asarray(got, np.float64)
    assert got.shape == (x64.shape[0], w64.shape[0]), f"{what}: shape {got.shape}"
    err = np.linalg.norm(got - x64 @ w64.T)
    scale = np.linalg.norm(np.abs(x64) @ np.abs(w64).T)
    assert err <= 1e-5 * scale, f"{what}: error {err:.3e} > 1e-5 * {scale:.3e}"


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(F32)


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
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in OPTIONAL:
                failures.append(f"import {info.name}")
                print(f"  FAIL  import {info.name}: {e!r}")
            else:
                skipped.append(f"{info.name} ({e.name})")
        except Exception as e:  # noqa: BLE001
            failures.append(f"import {info.name}")
            print(f"  FAIL  import {info.name}: {e!r}")
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


# -- formats ---------------------------------------------------------------------------------

def check_q4_0() -> None:
    from qformats import q4_0, q8_1
    ref = q4_0.reference
    w, x = rand(24, 128), rand(3, 128, seed=1)

    @check("q4_0: quantize == reference, dequantize == reference, QuantizedTensor round trip")
    def _():
        blocks = q4_0.quantize_q4_0(w)
        same(blocks, ref.quantize(w), "quantize_q4_0")
        same(q4_0.dequantize_q4_0(blocks, 128), ref.dequantize(blocks), "dequantize_q4_0")
        qt = q4_0.quantize(w)
        same(qt.dequantize(), ref.dequantize(ref.quantize(w)), "QuantizedTensor.dequantize")

    @check("q4_0: gemm (float x q4_0) and gemm_q4_0_q8_1 on the CPU")
    def _():
        qt = q4_0.quantize(w)
        wd = ref.dequantize(qt.buffers["blocks"])
        close(q4_0.gemm(x, qt), x, wd, "q4_0.gemm")
        xq = q8_1.quantize_q8_1(x)
        y = q4_0.gemm_q4_0_q8_1(qt.buffers["blocks"], xq, 24, 3, 128)   # W . A^T: [M, N]
        close(np.asarray(y).T, q8_1.reference.dequantize(xq), wd, "gemm_q4_0_q8_1")


def check_q8_1() -> None:
    from qformats import q8_1
    ref = q8_1.reference
    x = rand(5, 96, seed=2)

    @check("q8_1: quantize == reference, dequantize == reference")
    def _():
        blocks = q8_1.quantize_q8_1(x)
        same(blocks, ref.quantize(x), "quantize_q8_1")
        same(q8_1.dequantize_q8_1(blocks, 96), ref.dequantize(blocks), "dequantize_q8_1")
        same(q8_1.quantize(x).dequantize(), ref.dequantize(blocks), "QuantizedTensor.dequantize")


def check_int8() -> None:
    from qformats import int8
    ref = int8.reference
    w, x = rand(16, 64, seed=3), rand(4, 64, seed=4)

    @check("int8: quantize == reference (tensor, row, group), dequantize == reference")
    def _():
        for gran in ("tensor", "row", "group"):
            qt = int8.quantize(w, granularity=gran, group_size=32)
            q, s = ref.quantize(w, gran, 32)
            same(qt.buffers["q"], q, f"{gran} q")
            same(qt.buffers["scale"], s, f"{gran} scale")
            same(qt.dequantize(), ref.dequantize(q, s, gran, 32), f"{gran} dequantize")

    @check("int8: int8_matmul exact, int8_linear on the CPU")
    def _():
        xq, wq = int8.quantize(x), int8.quantize(w)
        acc = int8.int8_matmul(xq.buffers["q"], wq.buffers["q"])
        same(acc, ref.matmul(xq.buffers["q"], wq.buffers["q"]).astype(np.int32), "int8_matmul")
        y = int8.int8_linear(xq.buffers["q"], xq.buffers["scale"], wq.buffers["q"], wq.buffers["scale"])
        close(y, xq.dequantize(), wq.dequantize(), "int8_linear")


def check_int4() -> None:
    from qformats import int4
    ref = int4.reference
    w, x = rand(16, 128, seed=5), rand(3, 128, seed=6)

    @check("int4: quantize == reference (asymmetric, symmetric), dequantize == reference")
    def _():
        qt = int4.quantize(w, group_size=32)
        qw, s, z = ref.quantize_asym(w, 32)
        for name, want in (("qweight", qw), ("scales", s), ("zeros", z)):
            same(qt.buffers[name], want, f"asym {name}")
        same(qt.dequantize(), ref.dequantize(qw, s, z, 32), "asym dequantize")
        qt = int4.quantize(w, group_size=32, symmetric=True)
        qw, s = ref.quantize_sym(w, 32)
        same(qt.buffers["qweight"], qw, "sym qweight")
        same(qt.buffers["scales"], s, "sym scales")
        same(qt.dequantize(), ref.dequantize(qw, s, None, 32), "sym dequantize")

    @check("int4: pack_int4 / unpack_int4 == reference")
    def _():
        codes = np.random.default_rng(7).integers(0, 16, (6, 40)).astype(np.uint8)
        packed = int4.pack_int4(codes)
        same(packed, ref.pack(codes), "pack uint8")
        same(int4.unpack_int4(packed), codes, "unpack")
        signed = (codes.astype(np.int16) - 8).astype(np.int8)
        same(int4.pack_int4(signed), ref.pack(signed), "pack int8")
        same(int4.unpack_int4(int4.pack_int4(signed), signed=True), signed, "unpack signed")

    @check("int4: gemm on the CPU, int4_matmul exact")
    def _():
        for sym in (False, True):
            qt = int4.quantize(w, group_size=32, symmetric=sym)
            close(int4.gemm(x, qt), x, qt.dequantize(), f"gemm symmetric={sym}")
        a = int4.quantize(x, group_size=32, symmetric=True).buffers["qweight"]
        b = int4.quantize(w, group_size=32, symmetric=True).buffers["qweight"]
        same(int4.int4_matmul(a, b), ref.matmul(a, b).astype(np.int32), "int4_matmul")


def check_nf4() -> None:
    from qformats import nf4
    ref = nf4.reference
    w, x = rand(12, 100, seed=8), rand(2, 100, seed=9)   # 1200 values: a partial last block

    @check("nf4: quantize == reference (plain, compressed statistics), dequantize == reference")
    def _():
        packed, absmax = nf4.quantize_nf4(w.reshape(-1), blocksize=64)
        rp, ra = ref.quantize(w, 64)
        same(packed, rp, "packed")
        same(absmax, ra, "absmax")
        same(nf4.dequantize_nf4(packed, absmax, w.size, 64), ref.dequantize(rp, ra, w.size, 64), "dequantize_nf4")
        qt = nf4.quantize(w, blocksize=64, compress_statistics=True)
        q, a2, off = ref.double_quant(ra)
        for name, want in (("packed", rp), ("absmax", q), ("absmax2", a2), ("offset", off)):
            same(qt.buffers[name], want, f"compressed {name}")
        want = ref.dequantize(rp, ref.dequantize_absmax(q, a2, off), w.size, 64).reshape(w.shape)
        same(qt.dequantize(), want, "compressed dequantize")

    @check("nf4: gemm on the CPU")
    def _():
        for cs in (False, True):
            qt = nf4.quantize(w, blocksize=64, compress_statistics=cs)
            close(nf4.gemm(x, qt), x, qt.dequantize(), f"gemm compress_statistics={cs}")


def check_mixed2bit() -> None:
    from qformats import mixed2bit
    ref = mixed2bit.reference
    w, x = rand(8, 64, seed=10), rand(3, 64, seed=11)
    kw = dict(group_size=16, ratio_4bit=0.25, outlier_ratio=0.02, scale_block=4)

    @check("mixed2bit: quantize == reference (with outliers), dequantize == reference")
    def _():
        qt = mixed2bit.quantize(w, **kw)
        bufs = ref.quantize(w, **kw)
        assert qt.params["n_out"] > 0 and qt.params["n4"] > 0
        for name in mixed2bit.BUFFER_NAMES:
            same(qt.buffers[name], bufs[name], name)
        same(qt.dequantize(), ref.dequantize(bufs, 8, 64, 16, 4), "dequantize")

    @check("mixed2bit: pack_2bit / unpack_2bit == reference")
    def _():
        v = np.random.default_rng(12).integers(0, 4, (3, 48)).astype(np.uint8)
        packed = mixed2bit.pack_2bit(v)
        same(packed, ref.pack_2bit(v), "pack_2bit")
        same(mixed2bit.unpack_2bit(packed, v.size), v.reshape(-1), "unpack_2bit")

    @check("mixed2bit: gemm on the CPU")
    def _():
        qt = mixed2bit.quantize(w, **kw)
        close(mixed2bit.gemm(x, qt), x, qt.dequantize(), "gemm")


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
    print("formats (numpy, CPU kernels)")
    from qformats import FORMATS
    for fmt in FORMATS:   # each format's check is the function check_<format> above
        globals().get(f"check_{fmt}", lambda: None)()
    check_io()
    untested = [fmt for fmt in FORMATS if f"check_{fmt}" not in globals()]
    if untested:
        failures.append("formats without a wheel check")
        print(f"  FAIL  formats without a check here: {sorted(untested)} (add one to tools/wheel_check.py)")
    if failures:
        print(f"wheel check: {len(failures)} failed: {'; '.join(failures)}")
        return 1
    print("wheel check: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
