"""Stored sizes of a model: what :func:`qformats.save_quantized` writes, by tensor."""
from __future__ import annotations

import math

import torch
from torch import nn

from .nn import QuantizedLinear

__all__ = ["model_size"]


def model_size(model: nn.Module) -> dict:
    """Stored size of a model: what :func:`qformats.save_quantized` writes.

    Counts every tensor of ``model.state_dict()`` once (tied parameters once): the packed
    buffers of :class:`~qformats.nn.QuantizedLinear` layers as "quantized", everything else
    (float Linears, embeddings, norms, biases, persistent buffers) as "other", at its current
    dtype.

    Returns:
        dict with ``quantized_bytes``, ``other_bytes``, ``total_bytes`` (bytes),
        ``quantized_layers`` (count), ``quantized_values`` (weight values they hold),
        ``avg_bits`` (8 * quantized_bytes / quantized_values; NaN when none) and
        ``size_mb`` (total_bytes / 10^6).
    """
    qnames = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            for b in m.buffer_names:
                qnames[f"{name}.{b}" if name else b] = m
    seen: set = set()
    qbytes = obytes = qvalues = 0
    layers = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        nb = t.numel() * t.element_size()
        if key in qnames:
            qbytes += nb
            m = qnames[key]
            if id(m) not in layers:
                layers.add(id(m))
                qvalues += m.in_features * m.out_features
        else:
            obytes += nb
    return {"quantized_bytes": qbytes, "other_bytes": obytes, "total_bytes": qbytes + obytes,
            "quantized_layers": len(layers), "quantized_values": qvalues,
            "avg_bits": 8.0 * qbytes / qvalues if qvalues else math.nan,
            "size_mb": (qbytes + obytes) / 1e6}
