"""Hypothesis strategies shared by every format's tests.

``float_inputs`` draws float inputs of shape [rows, K] that cover what the format rules are
sensitive to: empty inputs, one block, odd sizes, exact ties of |x|, +-0, subnormals, huge
values, constant blocks, values of wildly different scales; as float32 / float16 numpy arrays
or bfloat16 torch tensors. Each draw carries the exact float32 values the reference computes on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

EDGE_VALUES = [0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.1754944e-38, 1e-30, 1e-7, -6.1e-5,
               0.5, -0.5, 1.0, -1.0, 1.5, 8.0, -8.0, 127.0, 1e4, -65504.0, 3e38, -3.4e38]
DTYPE_MAX = {"float32": 3.4028235e38, "float16": 65504.0, "bfloat16": 3.38e38}


@dataclass
class FloatInput:
    x: Any            # numpy float32/float16 array or torch bfloat16 tensor, C-contiguous
    x32: np.ndarray   # the same values as float32 numpy (exact)
    dtype: str

    def __repr__(self) -> str:  # keeps Hypothesis' falsifying examples readable
        return f"FloatInput(dtype={self.dtype}, shape={self.x32.shape}, x32={self.x32!r})"


def to_dtype(x32: np.ndarray, dtype: str) -> FloatInput:
    """Clip to the dtype's range, convert, and return the exact float32 values alongside."""
    lim = np.float32(DTYPE_MAX[dtype])
    x32 = np.clip(x32, -lim, lim).astype(np.float32)
    if dtype == "float32":
        x = np.ascontiguousarray(x32)
    elif dtype == "float16":
        x = np.ascontiguousarray(x32.astype(np.float16))
    else:
        import torch

        x = torch.from_numpy(np.ascontiguousarray(x32)).to(torch.bfloat16)
        return FloatInput(x, x.float().numpy(), dtype)
    return FloatInput(x, x.astype(np.float32), dtype)


def _element(kind: str):
    if kind == "edge":
        return st.sampled_from(EDGE_VALUES)
    if kind == "any":
        return st.floats(width=32, allow_nan=False, allow_infinity=False)
    return st.floats(-10, 10, width=32)


@st.composite
def float_inputs(draw, block: int = 32, max_rows: int = 3, max_blocks: int = 4, min_blocks: int = 0,
                 k_multiple: int | None = None, dtypes=("float32", "float16", "bfloat16"),
                 min_rows: int = 0) -> FloatInput:
    """[rows, K] inputs with K = n_blocks * block (or a multiple of ``k_multiple`` if given:
    then K need not fill whole blocks, for formats with partial blocks)."""
    rows = draw(st.integers(min_rows, max_rows))
    if k_multiple is None:
        k = block * draw(st.integers(min_blocks, max_blocks))
    else:
        k = k_multiple * draw(st.integers(min_blocks, max_blocks * block // k_multiple))
    dtype = draw(st.sampled_from(dtypes))
    kind = draw(st.sampled_from(["small", "edge", "any", "scaled", "constant", "ties"]))
    shape = (rows, k)
    if kind in ("small", "edge", "any"):
        x = draw(hnp.arrays(np.float32, shape, elements=_element(kind)))
    elif kind == "scaled":  # Gaussian rows at scales from subnormal to huge
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        scale = np.float32(10.0) ** draw(st.integers(-42, 37))
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
    elif kind == "constant":
        x = np.full(shape, draw(st.sampled_from(EDGE_VALUES)), dtype=np.float32)
    else:  # exact ties of |x|: values drawn from {a, -a, b}
        a = draw(st.sampled_from(EDGE_VALUES + [3.0, 0.25]))
        b = draw(st.sampled_from([0.0, 1.0, -2.0]))
        x = draw(hnp.arrays(np.float32, shape, elements=st.sampled_from([a, -a, b])))
    return to_dtype(np.asarray(x, dtype=np.float32), dtype)


def assert_bytes_equal(a: Any, b: Any) -> None:
    """Bit-exact: same shape, same dtype, same bytes (floats compared as raw bits)."""
    a = _np(a)
    b = _np(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    ab = np.ascontiguousarray(a).view(np.uint8)
    bb = np.ascontiguousarray(b).view(np.uint8)
    if not np.array_equal(ab, bb):
        bad = np.flatnonzero(np.ascontiguousarray(a).reshape(-1).view(np.uint8) != bb.reshape(-1))
        raise AssertionError(f"{bad.size} bytes differ, first at byte {bad[:8]}")


def _np(x: Any) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        import torch

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16: compare its raw bits
            x = x.view(torch.int16)
        return x.numpy()
    return np.asarray(x)


def on_cuda(x: Any) -> Any:
    """The same values as a torch tensor on the current CUDA device."""
    import torch

    return (x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))).cuda()


def misaligned_copy(x: Any) -> Any:
    """A contiguous CUDA copy of x whose data pointer is NOT 16-byte aligned (a view at element
    offset 1 of a larger buffer), to exercise the kernels' unaligned paths."""
    import torch

    t = on_cuda(x)
    if t.numel() == 0:
        return t  # nothing to misalign: an empty tensor's pointer is never dereferenced
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view
