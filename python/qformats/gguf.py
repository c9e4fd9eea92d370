"""GGUF files for llama.cpp: write a quantized Hugging Face model as one (:func:`export`), and
read one back as a model whose QuantizedLinear layers hold the file's bytes (:func:`load`,
:func:`load_tokenizer`).

A weight in a format whose spec names a GGML type (``FormatSpec.ggml_type``: q4_0 and q8_0
are GGML's ``Q4_0`` and ``Q8_0``, block for block) is written and read as those bytes, nothing
quantized again. Every
other tensor is written as a float type that holds it exactly (F16 where every value survives
the round trip through fp16, else F32 or BF16 as stored), or, on request, re-quantized into a
GGML format (``other=``); :func:`export` returns what it did with each tensor.

Supported: Llama-family causal LMs (``LlamaForCausalLM``, llama.cpp architecture ``llama``)
with default RoPE, and byte-level BPE vocabularies with GPT-2's pre-tokenizer (llama.cpp
tokenizer model ``gpt2``, pre-tokenizer ``gpt-2``); anything else raises :class:`GGUFError`
naming what is missing. Needs the ``gguf`` package (``pip install gguf``) and transformers.

Sources: the GGUF format (ggml ``docs/gguf.md``); the ``gguf`` package 0.19 (gguf-py:
``GGUFWriter``, ``GGUFReader``, ``get_tensor_name_map``, ``SpecialVocab``); llama.cpp
``convert_hf_to_gguf.py`` (``TextModel.set_gguf_parameters``, ``LlamaModel``: the
hyperparameters, the row permutation of ``q_proj`` / ``k_proj``, ``get_vocab_base``: the BPE
vocabulary) and ``src/llama-vocab.cpp`` (tokenizer model and pre-tokenizer names).

Use::

    from qformats import gguf
    written = gguf.export(model, "model-q4_0.gguf", tokenizer="path/to/hf-model")
    model = gguf.load("model-q4_0.gguf")            # QuantizedLinear layers, Q4_0 bytes
    tokenizer = gguf.load_tokenizer("model-q4_0.gguf")
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from ._core import FORMATS, QuantizedTensor, format_module, format_spec

__all__ = ["GGUFError", "ExportedTensor", "export", "load", "load_tokenizer", "ARCHITECTURES",
           "ggml_formats"]

#: Hugging Face architectures :func:`export` writes, and the llama.cpp architecture of each.
ARCHITECTURES = {"LlamaForCausalLM": "llama"}
# GGML types llama.cpp reads as float tensors, by numpy dtype of the values written
_FLOAT_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


class GGUFError(ValueError):
    """A model, file or tokenizer that this module cannot convert; the message says why."""


@dataclass(frozen=True)
class ExportedTensor:
    """What :func:`export` wrote for one tensor.

    Attributes:
        name: the GGUF tensor name (``blk.0.attn_q.weight``).
        source: the model's parameter or QuantizedLinear name (``model.layers.0.self_attn.q_proj.weight``).
        ggml_type: the GGML type written (``Q4_0``, ``F16``, ``F32``, ``BF16``).
        how: ``"bytes"`` (the format's own bytes), ``"float"`` (a float tensor as stored, or
            in F16 where that is exact), ``"dequantized"`` (a quantized weight in a format no
            GGML type holds, decoded) or ``"requantized"`` (decoded, then quantized with
            ``other=``).
        exact: whether the file holds exactly the model's values (False only for
            ``"requantized"``).
    """

    name: str
    source: str
    ggml_type: str
    how: str
    exact: bool


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("qformats.gguf needs the gguf package: pip install 'qformats[gguf]' (or gguf>=0.19)") from e
    return gguf


def ggml_formats() -> dict:
    """The formats GGUF holds byte for byte: ``{GGML type name (str, e.g. "Q4_0"): qformats
    format name}`` for every built format whose spec names a GGML type
    (:attr:`qformats.FormatSpec.ggml_type`); formats whose native module is not built are left
    out. Raises nothing."""
    out = {}
    for f in FORMATS:
        try:
            t = format_spec(f).ggml_type
        except (ImportError, ValueError):
            continue
        if t:
            out[t] = f
    return out


# -- the q / k row order ---------------------------------------------------------------------
# llama.cpp's rope kernel pairs dimension i with i + head_dim/2 (GPT-NeoX style ordering is
# Hugging Face's); convert_hf_to_gguf.py (LlamaModel.permute) reorders the rows of q_proj and
# k_proj per head so that its interleaved rotation gives the same result. Only whole rows move,
# so a row-blocked format's bytes are permuted without decoding.

def _to_gguf_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    rest = a.shape[1:]
    return np.ascontiguousarray(a.reshape(n_head, 2, a.shape[0] // n_head // 2, *rest)
                                .swapaxes(1, 2).reshape(a.shape))


def _from_gguf_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    rest = a.shape[1:]
    return np.ascontiguousarray(a.reshape(n_head, a.shape[0] // n_head // 2, 2, *rest)
                                .swapaxes(1, 2).reshape(a.shape))


def _row_heads(kind, config) -> Optional[int]:
    """Heads whose rows :func:`_to_gguf_rows` reorders for a tensor of MODEL_TENSOR ``kind``."""
    g = _gguf()
    if kind == g.MODEL_TENSOR.ATTN_Q:
        return int(config.num_attention_heads)
    if kind == g.MODEL_TENSOR.ATTN_K:
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return None


# -- hyperparameters -------------------------------------------------------------------------

def _rope_theta(config) -> float:
    rp = getattr(config, "rope_parameters", None) or {}
    rs = getattr(config, "rope_scaling", None) or {}
    kind = (rp.get("rope_type") or rp.get("type") or rs.get("rope_type") or rs.get("type")
            or "default")
    if kind != "default":
        raise GGUFError(f"RoPE type {kind!r} is not supported by qformats.gguf.export (only "
                        "'default'); llama.cpp's convert_hf_to_gguf.py writes the others")
    return float(rp.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _check_architecture(model) -> str:
    config = getattr(model, "config", None)
    archs = list(getattr(config, "architectures", None) or [type(model).__name__])
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    raise GGUFError(f"architecture {archs} is not supported by qformats.gguf (supported: "
                    f"{', '.join(ARCHITECTURES)})")


def _add_hparams(w, config, name: str, file_type) -> None:
    n_head = int(config.num_attention_heads)
    w.add_name(name)
    w.add_context_length(int(config.max_position_embeddings))
    w.add_embedding_length(int(config.hidden_size))
    w.add_block_count(int(config.num_hidden_layers))
    w.add_feed_forward_length(int(config.intermediate_size))
    w.add_head_count(n_head)
    w.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or n_head))
    w.add_rope_freq_base(_rope_theta(config))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(int(config.vocab_size))
    hd = _head_dim(config)
    w.add_rope_dimension_count(hd)
    if hd != config.hidden_size // n_head:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_file_type(file_type)
    w.add_quantization_version(_gguf().GGML_QUANT_VERSION)


# -- the vocabulary --------------------------------------------------------------------------

def _tokenizer_dir(tokenizer, model, tmp: str) -> tuple:
    """``(folder with tokenizer.json, tokenizer object)``."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        src = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        if not (src and (Path(src) / "tokenizer.json").is_file()):
            raise GGUFError("pass tokenizer= (a Hugging Face tokenizer or its folder): the model "
                            "does not name a folder with a tokenizer.json")
        tokenizer = src
    if isinstance(tokenizer, (str, os.PathLike)):
        d = Path(tokenizer)
        if not (d / "tokenizer.json").is_file():
            raise GGUFError(f"{d}: no tokenizer.json (a fast Hugging Face tokenizer is needed)")
        return d, AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise GGUFError("the tokenizer must be a fast Hugging Face tokenizer (tokenizer.json)")
    tokenizer.save_pretrained(tmp)
    return Path(tmp), tokenizer


def _pre_tokenizer(tj: dict) -> str:
    """llama.cpp's pre-tokenizer name for a tokenizer.json, or GGUFError."""
    model = tj.get("model") or {}
    pre = tj.get("pre_tokenizer") or {}
    if (model.get("type") == "BPE" and tj.get("normalizer") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)):
        return "gpt-2"  # GPT-2's regex, as the ByteLevel pre-tokenizer applies it
    raise GGUFError("only byte-level BPE tokenizers with GPT-2's pre-tokenizer are supported "
                    f"(tokenizer.json: model {model.get('type')!r}, pre_tokenizer "
                    f"{json.dumps(pre)[:120]}); llama.cpp's convert_hf_to_gguf.py handles others")


def _adds(tokenizer, token_id) -> tuple:
    """Whether encoding with special tokens prepends BOS / appends EOS."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    bos = token_id("bos") is not None and len(full) > len(plain) and full[0] == token_id("bos")
    eos = token_id("eos") is not None and len(full) > len(plain) and full[-1] == token_id("eos")
    return bos, eos


def _add_vocab(w, tok_dir: Path, tokenizer, n_vocab: int) -> None:
    g = _gguf()
    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    pre = _pre_tokenizer(tj)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise GGUFError(f"the tokenizer has ids up to {max(vocab.values())} but the model's "
                        f"vocab_size is {n_vocab}")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):  # as convert_hf_to_gguf.py's get_vocab_base
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(g.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(g.TokenType.CONTROL if added[i].special else g.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(g.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    sv = g.SpecialVocab(tok_dir, load_merges=True, n_vocab=len(tokens))
    if not sv.merges:
        raise GGUFError(f"{tok_dir}/tokenizer.json: no BPE merges found")
    # what the Hugging Face tokenizer does, so llama.cpp tokenizes the same ids
    bos, eos = _adds(tokenizer, lambda k: sv.special_token_ids.get(k))
    sv.add_special_token["bos"] = bos
    sv.add_special_token["eos"] = eos
    sv.add_to_gguf(w, quiet=True)


# -- export ----------------------------------------------------------------------------------

def _float_array(t) -> tuple:
    """``(numpy array, GGML type name)`` holding tensor ``t``'s values exactly: 1-D tensors
    (norms, biases) as F32 (llama.cpp's convention), float16 as F16, float32 as F16 where that
    loses nothing else F32, bfloat16 as BF16 (uint16 bit patterns)."""
    import torch

    t = t.detach().cpu()
    if t.dim() == 1:
        return t.float().numpy(), "F32"
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.uint16).numpy(), "BF16"
    if t.dtype == torch.float16:
        return t.contiguous().numpy(), "F16"
    f = t.float().contiguous()
    h = f.half()
    if torch.equal(h.float(), f):
        return h.numpy(), "F16"
    return f.numpy(), "F32"


def _quantized_array(layer) -> Optional[tuple]:
    """``(uint8 [N, K // block * bytes], GGML type)`` of a QuantizedLinear whose format is a
    GGML type, or None."""
    spec = format_spec(layer.format)
    if not spec.ggml_type:
        return None
    (buf,) = layer.buffer_names
    a = getattr(layer, buf).detach().cpu().contiguous().numpy()
    return a.reshape(a.shape[0], -1), spec.ggml_type


def _requantize(weight, fmt: str) -> tuple:
    spec = format_spec(fmt)
    q = format_module(fmt).quantize(weight.detach().float().cpu().contiguous())
    a = np.asarray(q.buffers[next(iter(q.buffers))])
    return a.reshape(a.shape[0], -1), spec.ggml_type


def _file_type(types: list):
    """general.file_type: llama.cpp's ``MOSTLY_<type>`` of the most common 2-D tensor type
    (``ALL_F32`` where that is F32 or has no such entry)."""
    g = _gguf()
    counts = {t: types.count(t) for t in set(types)}
    main = max(counts, key=lambda t: (counts[t], t != "F32"))
    return getattr(g.LlamaFileType, f"MOSTLY_{main}", g.LlamaFileType.ALL_F32)


def export(model, path: Union[str, os.PathLike], tokenizer: Any = None, *,
           other: Optional[str] = None, name: Optional[str] = None) -> list:
    """Write ``model`` as a GGUF file that llama.cpp (``llama-cli``, ``llama-perplexity``)
    loads and runs.

    Args:
        model: a Hugging Face ``LlamaForCausalLM`` whose Linear layers may be
            :class:`~qformats.nn.QuantizedLinear` (``quantize_model``, ``load_quantized``, a
            qformats folder loaded with ``from_pretrained``), on any device.
        path: the ``.gguf`` file to write (overwritten).
        tokenizer: its fast Hugging Face tokenizer, or the folder holding ``tokenizer.json``
            (default: the folder the model was loaded from).
        other: what to do with QuantizedLinear layers in a format that no GGML type holds
            (int4, nf4, ...): None (default) writes their decoded weight as F16 where exact,
            else F32; a format name with a GGML type (``"q4_0"``) quantizes the decoded
            weight into it (round to nearest, ``exact=False`` in the result).
        name: ``general.name`` (default: the model folder's name).
    Returns:
        a list of :class:`ExportedTensor`, one per tensor written, in file order.
    Raises:
        GGUFError: an architecture, RoPE type or tokenizer the export does not support, or
            ``other`` not a format with a GGML type.
        ImportError: the gguf package or transformers is missing.
    """
    import torch
    from .nn import QuantizedLinear

    g = _gguf()
    arch = _check_architecture(model)
    config = model.config
    ggml_of = ggml_formats()
    if other is not None and other not in ggml_of.values():
        raise GGUFError(f"other={other!r}: expected one of {sorted(ggml_of.values())} (formats with "
                        "a GGML type) or None")
    n_blocks = int(config.num_hidden_layers)
    tmap = g.get_tensor_name_map(g.MODEL_ARCH.LLAMA, n_blocks)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    plan = []  # (gguf name, source, array, ggml type, how, exact)
    seen = set()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for key, t in model.state_dict(keep_vars=True).items():
        owner, _, leaf = key.rpartition(".")
        if tied and key == "lm_head.weight":
            continue  # llama.cpp uses token_embd when output is absent
        if owner in layers:
            if owner in seen:
                continue
            seen.add(owner)
            layer, key, leaf = layers[owner], owner + ".weight", "weight"
        elif isinstance(t, torch.Tensor) and not t.is_floating_point():
            raise GGUFError(f"{key}: a {t.dtype} tensor outside a QuantizedLinear cannot be written")
        found = tmap.get_type_and_name(key, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise GGUFError(f"{key}: no llama.cpp tensor name for it (gguf tensor map of {arch})")
        kind, gname = found
        if owner in layers and leaf == "weight":
            got = _quantized_array(layer)
            if got is not None:
                arr, ttype, how, exact = *got, "bytes", True
            elif other is not None:
                arr, ttype = _requantize(layer.dequantize_weight(torch.float32), other)
                how, exact = "requantized", False
            else:
                arr, ttype = _float_array(layer.dequantize_weight(torch.float32))
                how, exact = "dequantized", True
        else:
            arr, ttype = _float_array(t)
            how, exact = "float", True
        heads = _row_heads(kind, config)
        if heads is not None:
            arr = _to_gguf_rows(arr, heads)
        plan.append((gname, key, arr, ttype, how, exact))
        if owner in layers and layers[owner].bias is not None:
            bname = gname[: -len(".weight")] + ".bias"
            barr, btype = _float_array(layers[owner].bias)
            if heads is not None:
                barr = _to_gguf_rows(barr, heads)
            plan.append((bname, owner + ".bias", barr, btype, "float", True))

    path = Path(path)
    part = path.with_name(path.name + ".part")  # renamed once complete: no half-written file
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir, tok = _tokenizer_dir(tokenizer, model, tmp)
        w = g.GGUFWriter(str(part), arch)
        src = getattr(config, "_name_or_path", "") or ""
        _add_hparams(w, config, name or (Path(src).name if src else "model"),
                     _file_type([p[3] for p in plan if p[2].ndim == 2]))
        _add_vocab(w, tok_dir, tok, int(config.vocab_size))
        for gname, key, arr, ttype, how, exact in plan:
            if ttype in ("F32", "F16"):
                w.add_tensor(gname, arr)
            else:  # bytes: the writer takes the byte shape and the type
                w.add_tensor(gname, arr.view(np.uint8), raw_dtype=g.GGMLQuantizationType[ttype])
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        except BaseException:
            w.close()
            part.unlink(missing_ok=True)
            raise
        w.close()
    os.replace(part, path)
    return [ExportedTensor(p[0], p[1], p[3], p[4], p[5]) for p in plan]


# -- import ----------------------------------------------------------------------------------

def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def _config(path: Path, reader):
    """The transformers config of a GGUF file (transformers' own GGUF metadata parser)."""
    import transformers
    from transformers import AutoConfig

    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES.values():
        raise GGUFError(f"{path}: architecture {arch!r} is not supported by qformats.gguf "
                        f"(supported: {', '.join(sorted(set(ARCHITECTURES.values())))})")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
    names = {t.name for t in reader.tensors}
    config.tie_word_embeddings = "output.weight" not in names
    # GGUF keeps these as float32: take the shortest decimal that rounds to that float32 (1e-06,
    # as the Hugging Face config had it, not 9.99999997e-07), so the float model computes alike
    for k in ("rms_norm_eps", "rope_theta"):
        v = getattr(config, k, None)
        if isinstance(v, float):
            setattr(config, k, float(str(np.float32(v))))
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and isinstance(rp.get("rope_theta"), float):
        rp["rope_theta"] = float(str(np.float32(rp["rope_theta"])))
    # transformers' parser leaves these at their defaults; the tensors say
    config.attention_bias = "blk.0.attn_q.bias" in names
    config.mlp_bias = "blk.0.ffn_up.bias" in names
    config.architectures = [next(k for k, v in ARCHITECTURES.items() if v == arch)]
    return config


def load(path: Union[str, os.PathLike], *, device: Any = "cpu", dtype: Any = None):
    """A Hugging Face model from a GGUF file, its quantized weights kept as they are stored.

    Tensors of a GGML type that a qformats format holds exactly (``Q4_0``, ``Q8_0``) become the
    packed buffers of :class:`~qformats.nn.QuantizedLinear` layers (the same bytes, rows of
    ``attn_q`` / ``attn_k`` put back in Hugging Face order); F32, F16 and BF16 tensors load
    as they are (converted to ``dtype`` when given).

    Args:
        path: a ``.gguf`` file (llama.cpp architecture ``llama``).
        device: where the model is put.
        dtype: the float parameters' dtype (default: float32).
    Returns:
        a transformers ``LlamaForCausalLM`` in eval mode.
    Raises:
        GGUFError: an unsupported architecture, tensors of GGML types qformats does not hold
            (all named), or tensors that do not fit the model.
        FileNotFoundError: no such file.
        ImportError: gguf or transformers missing.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from .nn import QuantizedLinear
    from .saving import empty_weights

    g = _gguf()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    dtype = torch.float32 if dtype is None else dtype
    reader = g.GGUFReader(str(path))
    config = _config(path, reader)
    with empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    tmap = g.get_tensor_name_map(g.MODEL_ARCH.LLAMA, int(config.num_hidden_layers))
    hf_of = {}
    for key in model.state_dict():
        found = tmap.get_type_and_name(key, try_suffixes=(".weight", ".bias"))
        if found is not None:
            hf_of[found[1]] = (key, found[0])
    fmt_of = ggml_formats()
    float_types = {"F32", "F16", "BF16"}
    bad = [f"{t.name} ({t.tensor_type.name})" for t in reader.tensors
           if t.tensor_type.name not in float_types and t.tensor_type.name not in fmt_of]
    if bad:
        raise GGUFError(f"{path}: GGML types qformats does not hold: {', '.join(bad[:6])}"
                        f"{' ...' if len(bad) > 6 else ''} (supported: "
                        f"{', '.join(sorted(float_types | set(fmt_of)))})")
    unknown = [t.name for t in reader.tensors if t.name not in hf_of]
    if unknown:
        raise GGUFError(f"{path}: tensors with no place in {config.architectures[0]}: {unknown[:6]}")
    for t in reader.tensors:
        key, kind = hf_of[t.name]
        heads = _row_heads(kind, config)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne0 (K) first
        ttype = t.tensor_type.name
        data = np.asarray(t.data)
        owner, _, leaf = key.rpartition(".")
        if ttype in fmt_of:
            fmt = fmt_of[ttype]
            mod = model.get_submodule(owner)
            if leaf != "weight" or not isinstance(mod, torch.nn.Linear):
                raise GGUFError(f"{t.name}: {ttype} data for {key}, which is not a Linear weight")
            (bname, (bdtype, bshape)), = format_module(fmt).expected_buffers(shape, {}).items()
            raw = data.view(np.uint8).reshape(bshape)
            if heads is not None:
                raw = _from_gguf_rows(raw, heads)
            qt = QuantizedTensor(fmt, shape, "float16", {}, {bname: torch.from_numpy(raw.copy())})
            q = QuantizedLinear.from_quantized(qt)
            if mod.bias is not None:
                q.bias = mod.bias
            parent, _, child = owner.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, q)
        else:
            if ttype == "BF16":  # bit patterns, permuted as integers
                arr = data.view(np.uint8).view(np.uint16).reshape(shape)
            else:
                arr = data.reshape(shape)
            if heads is not None:
                arr = _from_gguf_rows(arr, heads)
            tt = torch.from_numpy(np.array(arr))
            if ttype == "BF16":
                tt = tt.view(torch.bfloat16)
            mod = model.get_submodule(owner)
            old = getattr(mod, leaf)
            if tuple(old.shape) != shape:
                raise GGUFError(f"{t.name}: shape {shape}, the model's {key} is {tuple(old.shape)}")
            mod._parameters[leaf] = torch.nn.Parameter(tt.to(dtype), requires_grad=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise GGUFError(f"{path}: no tensor for {missing[:6]}")
    return model.to(device).eval()


def load_tokenizer(path: Union[str, os.PathLike]):
    """The Hugging Face tokenizer of a GGUF file (transformers' GGUF vocabulary converter).

    Raises:
        FileNotFoundError: no such file.
        ImportError: gguf or transformers missing.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
