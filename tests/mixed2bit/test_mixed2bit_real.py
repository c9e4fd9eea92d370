"""mixed2bit on real weights: the linear layers of ../shared/models/pydoc-llama-17m (a small
Llama, fp16 safetensors shards). At the defaults every matrix must store <= 3.0 bits per weight
and have a lower weight NMSE (||W - W'||^2 / ||W||^2) than uniform 2-bit (ratio_4bit=0) at the
same group size, also when the 4-bit groups are chosen by a sensitivity vector. Skips cleanly
when the model is absent. Run with -s to see the per-matrix numbers."""
from pathlib import Path

import numpy as np
import pytest

from qformats import mixed2bit as M

MODEL = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "pydoc-llama-17m"


@pytest.fixture(scope="module")
def linear_weights() -> dict:
    """{name: float16 [out, in]} for every 2-D ``*proj.weight`` (no embeddings / lm_head)."""
    shards = sorted(MODEL.glob("*.safetensors")) if MODEL.is_dir() else []
    if not shards:
        pytest.skip(f"{MODEL} is absent")
    from safetensors.numpy import load_file

    out = {}
    for shard in shards:
        for name, t in load_file(str(shard)).items():
            if name.endswith("proj.weight") and t.ndim == 2:
                out[name] = np.ascontiguousarray(t)
    if not out:
        pytest.skip(f"no *proj.weight matrices in {MODEL}")
    return dict(sorted(out.items()))


def _sensitivity(K: int, seed: int) -> np.ndarray:
    """A stand-in for a Hessian diagonal E[x_k^2]: per-input-channel activation scales with
    heavy tails (log-normal, a few channels ~10x the rest), as LLM activations have."""
    rng = np.random.default_rng(seed)
    return (rng.lognormal(0.0, 1.0, K) ** 2).astype(np.float32)


def _report(rows, title):
    print(f"\n{title}")
    print(f"{'matrix':45s} {'shape':>11s} {'bits':>6s} {'nmse mixed':>11s} {'nmse 2-bit':>11s}")
    for name, shape, bits, e, e0 in rows:
        print(f"{name:45s} {str(shape):>11s} {bits:6.3f} {e:11.5f} {e0:11.5f}")
    bits = np.array([r[2] for r in rows])
    e = np.array([r[3] for r in rows])
    e0 = np.array([r[4] for r in rows])
    print(f"{len(rows)} matrices: bits {bits.min():.4f}..{bits.max():.4f}; mean NMSE mixed "
          f"{e.mean():.5f} vs 2-bit {e0.mean():.5f} (ratio {np.mean(e / e0):.3f})")


def test_defaults_beat_uniform_2bit_within_3_bits(linear_weights):
    rows = []
    for name, w in linear_weights.items():
        q = M.quantize(w)
        q0 = M.quantize(w, ratio_4bit=0.0)
        e, e0 = M.nmse(w, q), M.nmse(w, q0)
        rows.append((name, w.shape, q.avg_bits, e, e0))
        assert q.avg_bits <= 3.0, (name, q.avg_bits)
        assert q0.avg_bits < q.avg_bits
        assert e < e0, (name, e, e0)
    _report(rows, "mixed2bit defaults (group 16, 10% 4-bit) vs ratio_4bit=0, selection by range")


def test_sensitivity_selection_beats_uniform_2bit(linear_weights):
    rows = []
    for i, (name, w) in enumerate(linear_weights.items()):
        sens = _sensitivity(w.shape[1], seed=i)
        q = M.quantize(w, sensitivity=sens)
        q0 = M.quantize(w, ratio_4bit=0.0)
        assert q.params["selection"] == "sensitivity"
        e, e0 = M.nmse(w, q), M.nmse(w, q0)
        rows.append((name, w.shape, q.avg_bits, e, e0))
        assert q.avg_bits <= 3.0, (name, q.avg_bits)
        assert e < e0, (name, e, e0)
        # The sensitivity-weighted error, which this selection targets, drops too.
        w64 = w.astype(np.float64)
        def werr(qq):
            return float(np.sum(sens.astype(np.float64) * (w64 - qq.dequantize("float32")) ** 2))
        assert werr(q) < werr(q0), name
    _report(rows, "mixed2bit defaults with a sensitivity vector vs ratio_4bit=0")


def test_outliers_reduce_error_further(linear_weights):
    # 0.5% fp16 outliers in the 2-bit groups (48 bits each: index + value, so ~3.15 bits in
    # all): the error must drop. A few matrices only.
    for name in list(linear_weights)[:3]:
        w = linear_weights[name]
        q = M.quantize(w)
        qo = M.quantize(w, outlier_ratio=0.005)
        assert qo.params["n_out"] > 0
        assert M.nmse(w, qo) < M.nmse(w, q), name
        print(f"\n{name}: outliers 0.5%: {qo.avg_bits:.3f} bits, NMSE {M.nmse(w, qo):.5f} "
              f"(no outliers: {q.avg_bits:.3f} bits, {M.nmse(w, q):.5f})")


def test_activation_hessian_diagonal(linear_weights):
    """Sensitivity = a real Hessian diagonal E[x_k^2] of each linear layer's inputs, from one
    1024-token forward pass of the model over its held-out text (../shared/data/pydoc)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    text_path = MODEL.parents[1] / "data" / "pydoc" / "valid.txt"
    if not text_path.is_file():
        pytest.skip(f"{text_path} is absent")
    tok = transformers.AutoTokenizer.from_pretrained(str(MODEL))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    ids = tok(text_path.read_text()[:20000], return_tensors="pt", truncation=True, max_length=1024).input_ids
    diag = {}

    def hook(name):
        def fn(mod, inp, out):
            x = inp[0].reshape(-1, inp[0].shape[-1]).double()
            diag[name + ".weight"] = (x * x).mean(0).float().numpy()
        return fn

    handles = [mod.register_forward_hook(hook(name)) for name, mod in model.named_modules()
               if name + ".weight" in linear_weights]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    assert set(diag) == set(linear_weights)
    res = []
    for name, w in linear_weights.items():
        s = diag[name]
        w64 = w.astype(np.float64)

        def werr(q):
            return float(np.sum(s * (w64 - q.dequantize("float32")) ** 2) / np.sum(s * w64 ** 2))
        qs, qr, q0 = M.quantize(w, sensitivity=s), M.quantize(w), M.quantize(w, ratio_4bit=0.0)
        assert qs.avg_bits <= 3.0
        assert M.nmse(w, qs) < M.nmse(w, q0) and werr(qs) < werr(q0), name
        res.append([M.nmse(w, qs), werr(qs), M.nmse(w, qr), werr(qr), M.nmse(w, q0), werr(q0)])
    r = np.mean(res, axis=0)
    print(f"\nHessian-diagonal sensitivity over {len(res)} matrices (mean NMSE / H-weighted NMSE): "
          f"sensitivity {r[0]:.5f} / {r[1]:.5f}, range {r[2]:.5f} / {r[3]:.5f}, "
          f"2-bit {r[4]:.5f} / {r[5]:.5f}")
