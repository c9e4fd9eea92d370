"""qformats: low-bit weight formats with bit-exact native codecs and quantized GEMM.

Formats are subpackages, imported on first use::

    from qformats import q4_0
    qt = q4_0.quantize(w)          # QuantizedTensor
    w_hat = qt.dequantize()

Formats: q4_0, q8_0, q8_1 (GGML blocks), int8, int4, nf4 (bitsandbytes), mixed2bit (2/4-bit).
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


# -- transformers (qformats.hf) and PEFT (qformats.lora) -----------------------------------------
# `import qformats` registers quant_method "qformats" with transformers (from_pretrained /
# save_pretrained) and QuantizedLinear with PEFT's LoRA, each once that library is imported, not
# before: importing them (and torch) here would cost seconds on the numpy-only paths and the
# CLI's argument checks. A finder at the front of sys.meta_path wraps the loader of the module
# after which registration can run (transformers.modeling_utils; peft, the package, whose
# __init__ ends with every tuner imported) and registers right after it has run; a library
# imported before qformats is registered now. A library too old for the integration is left
# alone (ImportError / RuntimeError from register()); calling qformats.hf / qformats.lora
# directly says why.
_AFTER_IMPORT = {"transformers.modeling_utils": "qformats.hf", "peft": "qformats.lora"}


def _register(module: str) -> None:
    try:
        importlib.import_module(module).register()
    except (ImportError, RuntimeError):
        pass


class _RegisterAfter(importlib.abc.Loader):
    """Runs a module's real loader, then registers the qformats integration that waited for it."""

    def __init__(self, inner, hook, name):
        self.inner, self.hook, self.name = inner, hook, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        self.hook.loaded(self.name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Answers for the modules in ``waiting`` with their real spec, its loader wrapped. A spec
    asked for without an import (``importlib.util.find_spec``, as availability checks do) costs
    nothing: the module stays waiting until it is executed."""

    def __init__(self, waiting: dict):
        self.waiting, self.busy = dict(waiting), set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.waiting or fullname in self.busy:
            return None
        self.busy.add(fullname)
        try:  # the other finders locate the real module (this one declines while busy)
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader, self, fullname)
        return spec

    def loaded(self, fullname):
        integration = self.waiting.pop(fullname, None)
        if not self.waiting and self in sys.meta_path:
            sys.meta_path.remove(self)
        if integration is not None:
            _register(integration)


for _trigger in [t for t in _AFTER_IMPORT if t in sys.modules]:
    _register(_AFTER_IMPORT.pop(_trigger))
if _AFTER_IMPORT:
    sys.meta_path.insert(0, _ImportHook(_AFTER_IMPORT))
