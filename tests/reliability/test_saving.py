"""save_quantized / load_quantized against hostile source folders, interrupted saves and
tampered quantization configs."""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qformats  # noqa: E402
from qformats.saving import CONFIG_NAME, WEIGHTS_NAME, check_output_dir  # noqa: E402


def test_symlink_out_of_source_not_copied(tiny_saved, tmp_path):
    m, _ = tiny_saved
    src = tmp_path / "src"
    src.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    os.symlink(secret, src / "generation_config.json")        # leads out: refused
    (src / "real_vocab.txt").write_text("a\nb\n")
    os.symlink("real_vocab.txt", src / "vocab.txt")            # stays inside: copied
    os.mkfifo(src / "merges.txt")                              # not a regular file: skipped
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="outside the source folder"):
        qformats.save_quantized(m, out, source=src)
    assert not (out / "generation_config.json").exists()
    assert not (out / "merges.txt").exists()
    assert (out / "vocab.txt").read_text() == "a\nb\n" and not (out / "vocab.txt").is_symlink()
    assert "password" not in "".join(p.read_text(errors="ignore") for p in out.iterdir() if p.is_file())


def test_output_dir_checks(tiny_saved, tmp_path):
    m, src = tiny_saved
    with pytest.raises(ValueError, match="empty path"):
        qformats.save_quantized(m, "")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        qformats.save_quantized(m, f)
    with pytest.raises(ValueError, match="source folder"):
        check_output_dir(src, src)
    with pytest.raises(ValueError, match="not empty"):
        check_output_dir(src, None, overwrite=False)
    assert check_output_dir(tmp_path / "new", src, overwrite=False) == tmp_path / "new"


def test_interrupted_save_leaves_old_model_or_clear_error(tiny_saved, monkeypatch):
    m, d = tiny_saved
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    import safetensors.torch

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        qformats.save_quantized(m, d)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # untouched, no temporaries

    monkeypatch.undo()
    import qformats.saving as S
    real = S.os.replace
    calls = []

    def replace_then_die(a, b):  # interrupted after the weights are in place
        calls.append(b)
        real(a, b)
        if str(b).endswith(WEIGHTS_NAME):
            raise KeyboardInterrupt

    monkeypatch.setattr(S.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        qformats.save_quantized(m, d)
    monkeypatch.undo()
    assert not any(p.name.startswith(".") for p in d.iterdir())
    with pytest.raises(ValueError, match=f"no {CONFIG_NAME}"):
        qformats.load_quantized(d)


def _edit_config(d, fn):
    cfg = json.loads((d / CONFIG_NAME).read_text())
    fn(cfg)
    (d / CONFIG_NAME).write_text(json.dumps(cfg))


def test_tampered_computed_buffers(tiny_saved):
    _, d = tiny_saved
    cfg = json.loads((d / CONFIG_NAME).read_text())
    name = next(iter(cfg["computed_buffers"]))
    _edit_config(d, lambda c: c["computed_buffers"].__setitem__(name, "bfloat16"))
    with pytest.raises(ValueError, match="computed buffer"):
        qformats.load_quantized(d)
    _edit_config(d, lambda c: c["computed_buffers"].__setitem__("model.nope", "float32"))
    with pytest.raises(ValueError, match="computed_buffers"):
        qformats.load_quantized(d)
    _edit_config(d, lambda c: c["computed_buffers"].__setitem__(name, "int64"))
    with pytest.raises(ValueError, match="computed_buffers"):
        qformats.load_quantized(d)


def test_half_model_computed_buffers_still_load(tmp_path):
    """The check keeps a legitimate dtype change: model.half() before saving."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    m = LlamaForCausalLM(cfg).eval().half()
    qformats.quantize_model(m, bits=8)
    qformats.save_quantized(m, tmp_path / "h")
    back = qformats.load_quantized(tmp_path / "h")
    ids = torch.randint(0, 64, (1, 8))
    assert torch.equal(back(ids).logits, m(ids).logits)


@pytest.mark.parametrize("edit, match", [
    (lambda layer: layer.pop("buffers"), "missing key 'buffers'"),
    (lambda layer: layer.__setitem__("in_features", 2.5), "in_features"),
    (lambda layer: layer.__setitem__("bias", "false"), "bias"),
    (lambda layer: layer.__setitem__("buffers", {"qweight": ["uint8", [-1]]}), "buffer 'qweight'"),
])
def test_malformed_layer_config(tiny_saved, edit, match):
    _, d = tiny_saved
    _edit_config(d, lambda c: edit(next(iter(c["layers"].values()))))
    with pytest.raises(ValueError, match=match):
        qformats.load_quantized(d)


def test_deep_and_huge_config(tiny_saved):
    _, d = tiny_saved
    (d / CONFIG_NAME).write_text('{"quant_method": "qformats", "x": ' + "[" * 50_000 + "]" * 50_000 + "}")
    with pytest.raises(ValueError, match="nested"):
        qformats.load_quantized(d)
    with open(d / CONFIG_NAME, "wb") as f:
        f.truncate(6 << 30)  # 6 GB on paper (sparse): refused unread
    with pytest.raises(ValueError, match="larger than"):
        qformats.load_quantized(d)


KILL_POINTS = """
import json, os, shutil, signal, sys
import torch, qformats
import qformats.saving as S
import safetensors.torch as st
from transformers import LlamaConfig, LlamaForCausalLM

def model(seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).eval()
    qformats.quantize_model(m, bits=4, group_size=32)
    return m

ids = torch.arange(16)[None]
def logits(d):
    with torch.no_grad():
        return qformats.load_quantized(d)(ids).logits

root = sys.argv[1]
old, new = os.path.join(root, "old"), os.path.join(root, "new")
B = model(1)
qformats.save_quantized(model(0), old)
qformats.save_quantized(B, new)
l_old, l_new = logits(old), logits(new)
assert not torch.equal(l_old, l_new)
real_replace, real_save_file = os.replace, st.save_file
# Ctrl-C raises KeyboardInterrupt here even where this process started with SIGINT ignored (a
# shell's background job: Python then installs no handler of its own)
signal.signal(signal.SIGINT, signal.default_int_handler)
for sig in (signal.SIGKILL, signal.SIGINT, signal.SIGTERM):
    for point in ("staged", 0, 1, 2, "done"):
        d = os.path.join(root, f"{sig.name}-{point}")
        shutil.copytree(old, d)
        pid = os.fork()
        if pid == 0:  # saves B over the old model, and gets the signal at `point`
            def die():
                os.kill(os.getpid(), sig)
            calls = [0]
            def replace(a, b):
                if calls[0] == point:
                    die()
                calls[0] += 1
                real_replace(a, b)
            def save_file(*a, **k):
                real_save_file(*a, **k)
                if point == "staged":
                    die()
            os.replace, st.save_file = replace, save_file
            try:
                qformats.save_quantized(B, d)
                if point == "done":
                    die()
            except KeyboardInterrupt:
                os._exit(3)
            os._exit(4)  # the signal did not stop the save
        _, status = os.waitpid(pid, 0)
        try:
            l = logits(d)
            got = "old" if torch.equal(l, l_old) else "new" if torch.equal(l, l_new) else "MIX"
        except ValueError as e:
            got = "error: " + str(e)
        left = sorted(n for n in os.listdir(d) if n.startswith("."))
        print(json.dumps({"sig": sig.name, "point": point, "status": status, "got": got, "left": left}))
"""


def test_killed_saves_leave_the_old_model_or_a_clear_error(tmp_path):
    """SIGKILL, SIGINT and SIGTERM while save_quantized replaces a saved model (after the
    weights are staged, before each rename, after the last): loading gives the old model,
    the new one, or a clear error, never a mix; Ctrl-C and SIGTERM leave no temporaries and
    SIGTERM still ends the process by SIGTERM."""
    import signal

    from reliability.reliability_helpers import run_capped

    r = run_capped(KILL_POINTS, mem_mb=3456, timeout=240, args=(str(tmp_path),))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    cases = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(cases) == 15, r.stdout
    for c in cases:
        where = f"{c['sig']} at {c['point']}: {c}"
        assert c["got"] in ("old", "new") or (c["got"].startswith("error: ") and CONFIG_NAME in c["got"]), where
        if c["point"] == "staged":
            assert c["got"] == "old", where  # nothing renamed yet: the old model, untouched
        if c["point"] == "done":
            assert c["got"] == "new", where
        if c["point"] in (0, 1):
            assert c["got"].startswith("error: "), where  # old configs gone, new ones not yet in
        if c["point"] == 2:  # config.json in place (after the weights): loads the new model, as
            assert c["got"] == "new", where  # from_pretrained would
        if c["sig"] == "SIGKILL":
            assert os.WIFSIGNALED(c["status"]) and os.WTERMSIG(c["status"]) == signal.SIGKILL, where
        else:
            if c["point"] != "done":
                assert c["left"] == [], where  # Ctrl-C / SIGTERM: temporaries removed
            if c["sig"] == "SIGINT":
                assert os.WIFEXITED(c["status"]) and os.WEXITSTATUS(c["status"]) == 3, where
            else:
                assert os.WIFSIGNALED(c["status"]) and os.WTERMSIG(c["status"]) == signal.SIGTERM, where
