"""QuantizedTensor, state dicts, safetensors save/load, runtime facts, lazy format imports."""
import json

import numpy as np
import pytest

import qformats
from qformats import QuantizedTensor, int4, q4_0, q8_1
from qformats import _arrays as A


def _qt(lib="numpy"):
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    if lib == "torch":
        import torch

        x = torch.from_numpy(x).bfloat16()
    return q4_0.quantize(x)


def test_cuda_available_is_false_without_gpu():
    # No GPU on the CI machine; the extension must still load and answer.
    from qformats import _runtime

    assert isinstance(qformats.cuda_available(), bool)
    if _runtime.cuda_device_count() == 0:
        assert qformats.cuda_available() is False


def test_lazy_format_access_and_unknown_format():
    assert qformats.q8_1 is q8_1
    with pytest.raises(AttributeError):
        qformats.not_a_format
    with pytest.raises(ValueError, match="unknown qformats format"):
        QuantizedTensor("nope", (32,), "float32", {}, {}).dequantize()


def test_state_dict_roundtrip_weights_only(tmp_path):
    torch = pytest.importorskip("torch")
    for lib in ("numpy", "torch"):
        qt = _qt(lib)
        path = tmp_path / f"{lib}.pt"
        torch.save(qt.state_dict(), path)
        back = QuantizedTensor.from_state_dict(torch.load(path, weights_only=True))
        assert back.metadata() == qt.metadata()
        np.testing.assert_array_equal(np.asarray(back.dequantize(dtype="float32")),
                                      np.asarray(qt.dequantize(dtype="float32"), dtype=np.float32))


def test_from_state_dict_rejects_mismatch():
    pytest.importorskip("torch")
    sd = _qt().state_dict()
    sd["buffers"]["blocks"] = sd["buffers"]["blocks"][:, :1]
    with pytest.raises(ValueError, match="blocks"):
        QuantizedTensor.from_state_dict(sd)
    with pytest.raises(ValueError, match="not a QuantizedTensor"):
        QuantizedTensor.from_state_dict({"format": "q4_0"})


def test_save_load_roundtrip(tmp_path):
    a, b = _qt(), q8_1.quantize(np.ones((2, 32), np.float16))
    path = tmp_path / "t.safetensors"
    qformats.save(path, {"a": a, "b": b})
    back = qformats.load(path)
    assert set(back) == {"a", "b"}
    assert back["a"].metadata() == a.metadata() and back["b"].dtype == "float16"
    np.testing.assert_array_equal(back["a"].buffers["blocks"], a.buffers["blocks"])
    np.testing.assert_array_equal(back["b"].dequantize(), b.dequantize())


def test_load_rejects_foreign_and_corrupt_files(tmp_path):
    from safetensors.numpy import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(plain))
    with pytest.raises(ValueError, match="not a qformats file"):
        qformats.load(plain)
    bad_meta = tmp_path / "bad.safetensors"
    save_file({"a.blocks": np.ones((1, 18), np.uint8)}, str(bad_meta),
              metadata={"qformats": json.dumps({"version": 1, "tensors": {"a": {
                  "format": "q4_0", "shape": [64], "dtype": "float32", "params": {},
                  "buffers": ["blocks"]}}})})
    with pytest.raises(ValueError, match="blocks"):
        qformats.load(bad_meta)
    truncated = tmp_path / "trunc.safetensors"
    qformats.save(truncated, {"a": _qt()})
    truncated.write_bytes(truncated.read_bytes()[:-10])
    with pytest.raises(ValueError):
        qformats.load(truncated)


def test_save_rejects_bad_values(tmp_path):
    with pytest.raises(TypeError):
        qformats.save(tmp_path / "x.safetensors", {"a": np.ones(3)})
    with pytest.raises(ValueError, match="contain no"):
        qformats.save(tmp_path / "x.safetensors", {"a.b": _qt()})


def test_to_device_cpu_and_repr():
    torch = pytest.importorskip("torch")
    qt = _qt()
    assert qt.to("cpu") is qt
    t = qt.to(torch.device("cpu")) if False else qt.to("cpu")
    assert "q4_0" in repr(t) and "avg_bits=4.500" in repr(t)
    moved = _qt("torch").to("cpu")
    assert isinstance(moved.buffers["blocks"], torch.Tensor)


def test_dequantize_dtype_override_and_errors():
    qt = _qt()
    assert qt.dequantize(dtype="float16").dtype == np.float16
    with pytest.raises(TypeError):
        qt.dequantize(dtype="int8")
    with pytest.raises(TypeError, match="bfloat16"):
        qt.dequantize(dtype="bfloat16")  # numpy buffers cannot hold bfloat16
    with pytest.raises(ValueError, match="expected a q8_1"):
        q8_1.dequantize(qt)


def test_skip_finite_check_scope():
    x = np.zeros((1, 32), np.float32)
    x[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        q4_0.quantize_q4_0(x)
    with qformats.skip_finite_check():
        q4_0.quantize_q4_0(x)  # no scan: no error (output unspecified for NaN input)
    with pytest.raises(ValueError, match="NaN"):
        q4_0.quantize_q4_0(x)  # restored on exit


def test_dtype_names_per_library():
    """The array helpers name dtypes from one table per library: the same names whichever library
    asked first, byte order ignored as numpy's .name does, and torch's bfloat16 by its name."""
    torch = pytest.importorskip("torch")
    assert A.dtype_name(torch.zeros(1, dtype=torch.float32)) == "float32"
    assert A.dtype_name(np.zeros(1, np.float32)) == "float32"
    assert A.dtype_name(np.zeros(1, ">f4")) == "float32"
    assert A.dtype_name(torch.zeros(1, dtype=torch.bfloat16)) == "bfloat16"
    assert A.dtype_name(np.zeros(1, np.uint8)) == "uint8"
    assert A.is_torch(torch.zeros(1)) and not A.is_torch(np.zeros(1))
    # a big-endian buffer is still refused where buffers are checked
    q = int4.quantize(np.ones((2, 128), np.float32), group_size=128)
    q.buffers["scales"] = q.buffers["scales"].astype(">f4")
    with pytest.raises(TypeError, match="byte order"):
        int4.dequantize(q)
