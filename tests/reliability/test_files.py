"""Hostile files: FIFOs, folders, lying safetensors headers, deep and huge JSON, symlinks out
of the source folder, interrupted saves, tampered quantization configs."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from reliability.reliability_helpers import run_capped

import qformats
from qformats import _files


def _q4():
    return qformats.q4_0.quantize(np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64))


# -- qformats.load / save ------------------------------------------------------------------------

def test_load_fifo_refused_without_blocking(tmp_path):
    fifo = tmp_path / "w.safetensors"
    os.mkfifo(fifo)
    r = run_capped(f"""
        import qformats
        try:
            qformats.load({str(fifo)!r})
        except ValueError as e:
            print("ValueError:", e)
        """, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "not a regular file" in r.stdout and str(fifo) in r.stdout


def test_load_folder_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="is a folder"):
        qformats.load(tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        qformats.load(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("n", [2**63, 2**64 - 1, 10**9, 1000])
def test_load_absurd_header_length(tmp_path, n):
    f = tmp_path / "w.safetensors"
    f.write_bytes(struct.pack("<Q", n) + b"{}" + b" " * 50)
    with pytest.raises(ValueError, match="header length"):
        qformats.load(f)


def test_load_deep_metadata(tmp_path):
    f = tmp_path / "w.safetensors"
    qformats.save(f, {"w": _q4()})
    deep = "[" * 100_000 + "]" * 100_000
    from safetensors.numpy import save_file
    save_file({"w.blocks": np.zeros(1, np.uint8)}, str(f), metadata={"qformats": deep})
    with pytest.raises(ValueError, match="nested"):
        qformats.load(f)


def test_load_offsets_past_the_file(tmp_path):
    header = json.dumps({"w.blocks": {"dtype": "U8", "shape": [1 << 40],
                                      "data_offsets": [0, 1 << 40]}}).encode()
    f = tmp_path / "w.safetensors"
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(ValueError, match="outside the file"):
        qformats.load(f)


def test_save_to_folder_or_empty_path(tmp_path):
    with pytest.raises(ValueError, match="is a folder"):
        qformats.save(tmp_path, {"w": _q4()})
    with pytest.raises(ValueError, match="empty"):
        qformats.save("", {"w": _q4()})
    assert list(tmp_path.iterdir()) == []


def test_save_is_atomic_and_cleans_up(tmp_path, monkeypatch):
    f = tmp_path / "w.safetensors"
    qformats.save(f, {"w": _q4()})
    before = f.read_bytes()
    import safetensors.numpy

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        qformats.save(f, {"w": _q4()})
    assert f.read_bytes() == before  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary left


def test_load_device_cpu_gives_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    f = tmp_path / "w.safetensors"
    q = _q4()
    qformats.save(f, {"w": q})
    back = qformats.load(f, device="cpu")["w"]
    assert all(isinstance(b, torch.Tensor) and b.device.type == "cpu" for b in back.buffers.values())
    assert torch.equal(back.dequantize(), torch.from_numpy(q.dequantize()))
    plain = qformats.load(f)["w"]
    assert all(isinstance(b, np.ndarray) for b in plain.buffers.values())


def test_mixed2bit_empty_rows_bomb_in_a_small_file(tmp_path):
    """A ~1000-byte file holding a mixed2bit tensor of shape (2**28, 0): loads and decodes to
    an empty array within a cap of 0.9 GiB beyond the libraries, in well under the timeout."""
    m = qformats.mixed2bit
    params = dict(m.quantize(np.ones((1, 16), np.float32), ratio_4bit=0.0).params)
    shape = (2**28, 0)
    bufs = {k: np.zeros(s, dt) for k, (dt, s) in m.expected_buffers(shape, params).items()}
    f = tmp_path / "bomb.safetensors"
    qformats.save(f, {"w": qformats.QuantizedTensor("mixed2bit", shape, "float32", params, bufs)})
    assert f.stat().st_size < 2000
    r = run_capped(f"""
        import qformats
        out = qformats.load({str(f)!r})["w"].dequantize()
        print(out.shape, out.nbytes)
        """, mem_mb=896, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "(268435456, 0) 0"


# -- JSON helpers ------------------------------------------------------------------------------

def test_read_json_caps(tmp_path):
    f = tmp_path / "c.json"
    f.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match="nested"):
        _files.read_json(f)
    f.write_text("[" * 100_000 + "]" * 100_000)  # past Python's recursion limit
    with pytest.raises(ValueError, match="nested"):
        _files.read_json(f)
    with open(f, "wb") as fh:  # sparse: 100 MB on paper, nothing on disk
        fh.truncate(100 << 20)
    with pytest.raises(ValueError, match="larger than"):
        _files.read_json(f)
    os.unlink(f)
    os.mkfifo(f)
    with pytest.raises(ValueError, match="not a regular file"):
        _files.read_json(f)


def test_read_json_reads_what_the_file_holds_up_to_the_limit(tmp_path, monkeypatch):
    """read_json sizes its read by the file; a file longer than its size said when opened (it grew)
    is read on, and still refused past max_bytes."""
    f = tmp_path / "c.json"
    f.write_text('{"a": [1, 2, 3]}')
    assert _files.read_json(f, max_bytes=16) == {"a": [1, 2, 3]}
    with pytest.raises(ValueError, match="larger than 15 bytes"):
        _files.read_json(f, max_bytes=15)
    real_fstat = os.fstat

    def stale_fstat(fd):  # the size the file had before it grew
        st = real_fstat(fd)
        return os.stat_result((*st[:6], 3, *st[7:]))
    monkeypatch.setattr(_files.os, "fstat", stale_fstat)
    assert _files.read_json(f) == {"a": [1, 2, 3]}
    with pytest.raises(ValueError, match="larger than 10 bytes"):
        _files.read_json(f, max_bytes=10)
