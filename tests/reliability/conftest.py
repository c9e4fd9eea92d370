"""Fixtures of the reliability tests (helpers in reliability_helpers.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from reliability.reliability_helpers import LLAMA, SHARED


@pytest.fixture
def llama_dir() -> Path:
    if not (LLAMA / "config.json").is_file():
        pytest.skip(f"shared test model not found under {SHARED}")
    return LLAMA


@pytest.fixture
def tiny_saved(tmp_path):
    """A tiny random Llama, quantized (int4) and saved: (model, folder)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import qformats
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).eval()
    qformats.quantize_model(m, bits=4, group_size=32)
    d = tmp_path / "tiny-q"
    qformats.save_quantized(m, d)
    return m, d
