"""qformats: low-bit weight formats with bit-exact native codecs and quantized GEMM.

Formats are subpackages, imported on first use::

    from qformats import q4_0
    qt = q4_0.quantize(w)          # QuantizedTensor
    w_hat = qt.dequantize()

Formats: q4_0, q8_1 (GGML blocks), int8, int4, nf4 (bitsandbytes), mixed2bit (2/4-bit).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from ._arrays import skip_finite_check
from ._core import FORMATS, QuantizedTensor, format_spec
from ._spec import FormatSpec, LinearKernel
from .io import load, save

__version__ = "0.1.0"
__all__ = ["FORMATS", "FormatSpec", "LinearKernel", "format_spec", "QuantizedTensor", "save", "load",
           "cuda_available", "num_threads", "set_num_threads", "skip_finite_check", "__version__", *FORMATS,
           "quantize_model", "QuantizationReport", "save_quantized", "load_quantized", "nn", "ops",
           "QFormatsConfig"]
# Model-level API (needs torch), imported on first use: name -> submodule.
_LAZY = {"quantize_model": "model", "QuantizationReport": "model", "save_quantized": "saving",
         "load_quantized": "saving", "nn": "nn", "ops": "ops", "QFormatsConfig": "hf"}


def cuda_available() -> bool:
    """True when the native code was built with CUDA and the CUDA runtime sees a device."""
    # on first use: `import qformats` loads no native module (see _arrays.cuda_built)
    from ._runtime import cuda_built, cuda_device_count

    return bool(cuda_built()) and cuda_device_count() > 0


def num_threads() -> int:
    """The CPU threads of every format's codecs and GEMMs, for the whole process: an int in
    [1, 1024], the calling thread included (see :func:`set_num_threads` for the default).
    Raises nothing."""
    # on first use, as cuda_available: `import qformats` loads no native module
    from ._runtime import num_threads as n

    return n()


def set_num_threads(n: int) -> None:
    """Set the CPU threads of every format's codecs and GEMMs, for the whole process.

    Args:
        n: threads, an int in [1, 1024]; the calling thread counts as one. A thread pool already
            started is resized at once (after a running call finishes), so the process's OS
            threads follow; where the OS refuses a thread (a process or memory limit), the
            kernels run with those it could create.

    The starting value is ``QFORMATS_NUM_THREADS`` when it is an integer >= 1 (capped at
    1024; any other value is ignored with a RuntimeWarning at import), else the CPUs this
    process may run on (``os.sched_getaffinity``). The CLI's ``--threads`` sets it too. Results
    never depend on it: each output element is computed by one thread, in one order.

    Raises:
        TypeError: ``n`` is not an int (a bool included).
        ValueError: ``n`` is outside [1, 1024].
    """
    from ._runtime import set_num_threads as set_n  # on first use, as above

    set_n(n)


def __getattr__(name: str):
    # `import qformats; qformats.nf4` and `from qformats import nf4` both import lazily, so a
    # broken or absent format never stops the others from loading.
    if name in FORMATS:
        return importlib.import_module(f"qformats.{name}")
    if name in _LAZY:
        mod = importlib.import_module(f"qformats.{_LAZY[name]}")
        return mod if name == _LAZY[name] else getattr(mod, name)
    raise AttributeError(f"module 'qformats' has no attribute {name!r}")


# -- transformers' from_pretrained / save_pretrained (qformats.hf) ------------------------------
# `import qformats` registers quant_method "qformats" with transformers, but only once
# transformers.modeling_utils has been imported: importing transformers (and torch) here would
# cost seconds on the numpy-only paths and the CLI's argument checks. A finder at the front of
# sys.meta_path wraps that one module's loader and registers right after it has run; if it was
# imported before qformats, registration happens now.
_HF_TRIGGER = "transformers.modeling_utils"


def _register_with_transformers() -> None:
    try:
        importlib.import_module("qformats.hf").register()
    except ImportError:  # transformers < 5 has no third-party quantizer loading: not registered
        pass


class _RegisterAfter(importlib.abc.Loader):
    """Runs the real loader of transformers.modeling_utils, then registers qformats."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        _register_with_transformers()


class _TransformersHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _HF_TRIGGER:
            return None
        sys.meta_path.remove(self)  # once; the other finders locate the real module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


if _HF_TRIGGER in sys.modules:
    _register_with_transformers()
else:
    sys.meta_path.insert(0, _TransformersHook())
