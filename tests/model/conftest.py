"""Fixtures of the model-level tests: the shared 17M-parameter Llama and its evaluation text
(skipped cleanly when ../shared is absent), a tiny random Llama built from a config (no
download), and small helpers."""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
LLAMA = SHARED / "models" / "pydoc-llama-17m"
VALID = SHARED / "data" / "pydoc" / "valid.txt"


def _need_llama():
    if not (LLAMA / "config.json").is_file() or not VALID.is_file():
        pytest.skip(f"shared test model or text not found under {SHARED}")


@pytest.fixture(scope="session")
def llama():
    """The pydoc Llama in float32 (a LoadedModel: .model, .tokenizer, .path). Tests must not
    modify it: quantize a copy.deepcopy."""
    _need_llama()
    from qformats.evaluate import load_model

    return load_model(LLAMA)


@pytest.fixture(scope="session")
def valid_text():
    _need_llama()
    return VALID.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def valid_path():
    _need_llama()
    return VALID


@pytest.fixture(scope="session")
def windows(llama, valid_text):
    """Two evenly spaced 512-token windows of pydoc/valid.txt."""
    from qformats.evaluate import lm_windows

    w, _ = lm_windows(llama.tokenizer, valid_text, 512, 2 * 512)
    return w


@pytest.fixture(scope="session")
def base_ppl(llama, windows):
    from qformats.evaluate import perplexity

    return perplexity(llama.model, windows, progress=False)["ppl"]


def tiny_llama(seed: int = 0):
    """A random 2-layer LlamaForCausalLM (hidden 64, vocab 256), float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def small_net(seed: int = 0):
    """nn.Sequential(Linear(256, 128, bias), GELU, Linear(128, 64, no bias))."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 64, bias=False))


@pytest.fixture
def make_tiny_llama():
    return tiny_llama


@pytest.fixture
def make_small_net():
    return small_net


@pytest.fixture
def reference_path():
    """QuantizedLinear and qformats.ops.linear on the CPU take dequantize + F.linear (bitwise
    the reference) instead of the native kernels during the test."""
    from qformats import ops

    ops.use_builtin_kernels(cuda=True, cpu=False)
    try:
        yield
    finally:
        ops.use_builtin_kernels(cuda=True, cpu=True)
