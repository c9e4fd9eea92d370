"""``torch.nn`` modules with quantized weights.

:class:`QuantizedLinear` replaces ``torch.nn.Linear``: it keeps the weight packed in any
qformats format (the QuantizedTensor's buffers are the module's buffers, so ``.to(device)``,
``state_dict()`` and ``load_state_dict()`` carry them) plus a float bias, and computes
``x @ W^T + b``: in eager inference straight through the format's native kernel, bound to the
weight once (:meth:`QuantizedLinear.prepare`), otherwise through
:func:`qformats.ops.linear_packed` (a ``torch.library`` operator: autograd, and
``torch.compile(fullgraph=True)`` traces it).

Use::

    import torch
    from qformats.nn import QuantizedLinear

    lin = torch.nn.Linear(256, 64)
    qlin = QuantizedLinear.from_linear(lin, format="int4", group_size=64)
    y = qlin(torch.randn(3, 256))          # [3, 64] float32
    qlin.quantized_weight                  # QuantizedTensor view of the packed buffers
"""
from __future__ import annotations

import json
from typing import Any, Optional

import torch
from torch import nn

from . import crossover, ops
from ._core import QuantizedTensor, check_quantized, float_dtype, format_module, format_spec

__all__ = ["QuantizedLinear", "quantized_linears"]


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class QuantizedLinear(nn.Module):
    """A Linear layer ``y = x W^T + b`` whose weight ``W`` ``[out_features, in_features]`` is
    stored packed in a qformats format.

    Attributes:
        in_features, out_features: the sizes (ints).
        format: format name (``"int4"``, ``"nf4"``, ...).
        params: the weight's QuantizedTensor params (JSON-serializable dict, as the format's
            ``quantize`` recorded them; e.g. mixed2bit's include ``n4`` and ``n_out``).
        weight_dtype: the dtype the weight was quantized from (``"float32"``, ``"float16"``
            or ``"bfloat16"``): what :meth:`dequantize_weight` returns by default.
        buffer_names: the packed buffers' names, in the format's order; each is a registered
            buffer of this module (e.g. int4: ``qweight``, ``scales``, ``zeros``).
        bias: ``nn.Parameter`` ``[out_features]`` or None.

    ``.to(device)`` moves the packed buffers; dtype conversions (``.half()``,
    ``.to(torch.bfloat16)``) apply to the bias only: the packed buffers keep their dtypes
    (their bytes are the format). Forward takes float32, float16 or bfloat16 activations
    ``[..., in_features]`` on the module's device and returns ``[..., out_features]`` in the
    activation's dtype.

    Check once, run many: the weight is validated and bound to its format's native kernel
    (:meth:`prepare`) when the layer is built from a weight, loaded (``load_state_dict``) or
    moved (``.to()``); tensors the kernel reads besides the packed bytes (nf4's decoded absmax,
    mixed2bit's CUDA chunk index) are made then, as non-persistent buffers, never inside a
    forward. An eager forward without autograd on x then costs one native call for few
    activation rows (the format's weight-only kernel), and for more rows one native decode of
    the weight into a temporary of x's dtype plus ``F.linear`` (the operator's numbers, without
    its per-call checks). Autograd through x or the bias, ``torch.compile`` and devices without
    a bound kernel take the ``qformats::linear`` operator.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 format: str, params: Optional[dict] = None, weight_dtype: str = "float32",
                 device: Any = None, dtype: Any = None):
        """An uninitialized layer with empty packed buffers of the right shapes (to fill with
        :meth:`load_state_dict`; ``device="meta"`` allocates nothing).

        Args:
            in_features, out_features: the weight is ``[out_features, in_features]``.
            bias: whether the layer has a bias.
            format: a qformats format name.
            params: the QuantizedTensor params (see the format's ``expected_buffers``; they
                fix the buffers' shapes, so they are the stored params, not only the
                arguments to ``quantize``).
            weight_dtype: the original weight dtype (float32 / float16 / bfloat16).
            device: where to allocate buffers and bias.
            dtype: the bias dtype (default: ``torch.get_default_dtype()``).
        Raises:
            ValueError: unknown format, params that do not fit the format or the shape, sizes
                < 1, or a format buffer name that collides with a module attribute.
            TypeError: a bad weight_dtype.
        """
        super().__init__()
        in_features, out_features = int(in_features), int(out_features)
        if in_features < 1 or out_features < 1:
            raise ValueError(f"in_features and out_features must be >= 1, got {in_features}, {out_features}")
        mod = format_module(format)
        params = dict(params or {})
        try:
            expected = mod.expected_buffers((out_features, in_features), params)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{format} parameters {params} do not fit a [{out_features}, "
                             f"{in_features}] weight: {e}") from e
        self.in_features, self.out_features = in_features, out_features
        self.format = format
        self.params = params
        self.weight_dtype = float_dtype(weight_dtype)
        self.buffer_names = tuple(expected)
        for name, (bdtype, shape) in expected.items():
            if name in ("bias", "weight") or hasattr(type(self), name) or name in self.__dict__:
                raise ValueError(f"{format} buffer name {name!r} collides with a module attribute")
            self.register_buffer(name, torch.empty(tuple(shape), dtype=_torch_dtype(bdtype),
                                                   device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.derived_names: tuple = ()
        self._kernel = None        # the bound native kernel (LinearKernel.run), or None
        self._watch = ()           # (name, tensor, version) of what it was bound to
        self._kernel_rows = 0      # activation rows it takes on its device
        self._tune_rows = 0        # rows up to which it may win, measured (qformats.crossover)
        self._kernel_device = -2   # its device as Tensor.get_device() gives it (-1: CPU)
        self._bias_cast = None     # {dtype: the bias in that dtype} for the bound kernel's paths
        self._filled = False       # buffers hold a weight (built from one, or loaded)
        self._refresh_meta()

    def _refresh_meta(self) -> None:
        """The operator's weight description (a constant string for torch.compile)."""
        self._meta = json.dumps({"format": self.format, "shape": [self.out_features, self.in_features],
                                 "dtype": self.weight_dtype, "params": self.params,
                                 "buffers": list(self.buffer_names), "derived": list(self.derived_names)},
                                sort_keys=True)

    def _stale(self) -> bool:
        """Whether a tensor the kernel was bound to was replaced or modified in place since."""
        bufs, params = self._buffers, self._parameters
        for name, t, version in self._watch:
            cur = bufs[name] if name != "bias" else params["bias"]
            if cur is not t or (t is not None and t._version != version):
                return True
        return False

    def prepare(self) -> None:
        """Bind the packed weight to its format's native kernel on the buffers' device (the
        format's ``SPEC.make_linear``), making the tensors that kernel reads besides the packed
        bytes as non-persistent buffers (``derived_names``). Called when the layer is built from
        a weight, loaded and moved; call it after modifying the buffers by hand. A format or
        device without a kernel leaves the layer on the operator path.

        Raises:
            ValueError: buffers that contradict their params (e.g. a mixed2bit group_map
                marking another number of 4-bit groups than ``n4``).
        """
        for n in self.derived_names:
            self._buffers.pop(n, None)
        self.derived_names = ()
        self._kernel = self._bias_cast = None
        self._watch = ()
        self._kernel_rows = self._tune_rows = 0
        self._kernel_device = -2
        spec = format_spec(self.format)
        dev = self._buffers[self.buffer_names[0]].device
        if spec.make_linear is not None and dev.type in spec.linear_rows:
            bound = spec.make_linear(self.quantized_weight)
            if bound is not None:
                for n, t in bound.derived.items():
                    self.register_buffer(n, t, persistent=False)
                self.derived_names = tuple(bound.derived)
                self._kernel = bound.run
                self._kernel_rows = spec.linear_rows[dev.type]
                self._tune_rows = spec.tune_rows.get(dev.type, 0)
                self._kernel_device = dev.index if dev.type == "cuda" else -1
        self._refresh_meta()
        self._watch = tuple((n, self._buffers[n], self._buffers[n]._version)
                            for n in self.buffer_names + self.derived_names)
        self._watch += (("bias", self.bias, self.bias._version if self.bias is not None else 0),)
        self._filled = True

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_quantized(cls, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None) -> "QuantizedLinear":
        """A layer holding ``qweight`` (a 2-D QuantizedTensor ``[out, in]``; numpy buffers
        become CPU tensors, torch buffers are used as they are, without a copy) and a copy of
        ``bias`` (``[out]`` or None) on the buffers' device.

        Raises:
            TypeError: qweight is not a QuantizedTensor.
            ValueError: not 2-D, invalid for its format, bias of the wrong shape.
        """
        check_quantized(qweight, getattr(qweight, "format", None))
        if len(qweight.shape) != 2:
            raise ValueError(f"qweight: expected a 2-D weight [out, in], got shape {qweight.shape}")
        out_f, in_f = qweight.shape
        if bias is not None and tuple(bias.shape) != (out_f,):
            raise ValueError(f"bias: expected shape ({out_f},), got {tuple(bias.shape)}")
        bufs = {k: (torch.from_numpy(v) if not isinstance(v, torch.Tensor) else v)
                for k, v in qweight.buffers.items()}
        dev = next(iter(bufs.values())).device
        layer = cls(in_f, out_f, bias is not None, format=qweight.format, params=qweight.params,
                    weight_dtype=qweight.dtype, device="meta",
                    dtype=bias.dtype if bias is not None else None)
        for name in layer.buffer_names:
            layer._buffers[name] = bufs[name]
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(dev).clone(), requires_grad=bias.requires_grad)
        layer.prepare()
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str, **params) -> "QuantizedLinear":
        """Quantize ``linear.weight`` with ``qformats.<format>.quantize(weight, **params)``
        (round to nearest; on the weight's device and from its dtype) and keep a copy of the
        bias.

        Args:
            linear: a ``torch.nn.Linear`` (weight float32 / float16 / bfloat16).
            format: a qformats format name.
            **params: the format's quantize arguments (e.g. ``group_size=64``).
        Returns:
            a new QuantizedLinear on the weight's device; ``linear`` is not modified.
        Raises:
            TypeError: not an nn.Linear, or a parameter of the wrong type.
            ValueError: unknown format or parameter, in_features not a multiple of the
                format's block, NaN/Inf in the weight.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected a torch.nn.Linear, got {type(linear).__name__}")
        return cls.from_weight(linear.weight, linear.bias, format, **params)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], format: str,
                    **params) -> "QuantizedLinear":
        """:meth:`from_linear` for a bare weight ``[out_features, in_features]`` (float32 /
        float16 / bfloat16) and bias (``[out_features]`` or None), e.g. tensors read from a
        checkpoint without building the Linear (:mod:`qformats.streaming`). Same result.

        Raises:
            TypeError: ``weight`` or ``bias`` not a torch.Tensor, or a parameter of the wrong
                type.
            ValueError: as :meth:`from_linear`, and a bias of the wrong shape.
        """
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        mod = format_module(format)
        w = weight.detach()
        if not w.is_contiguous():
            w = w.contiguous()
        qt = mod.quantize(w, **params)
        return cls.from_quantized(qt, bias)

    # -- the weight -------------------------------------------------------------------------
    @property
    def quantized_weight(self) -> QuantizedTensor:
        """The packed weight as a QuantizedTensor (its buffers are this module's tensors,
        not copies)."""
        return QuantizedTensor(self.format, (self.out_features, self.in_features), self.weight_dtype,
                               dict(self.params), {n: getattr(self, n) for n in self.buffer_names})

    def dequantize_weight(self, dtype: Any = None) -> torch.Tensor:
        """The decoded weight ``[out_features, in_features]`` in ``dtype`` (default: the
        original weight dtype) on the module's device."""
        dt = _torch_dtype(float_dtype(self.weight_dtype if dtype is None else dtype))
        # self._meta names the derived tensors too (nf4's decoded absmax...): pass them along
        names = self.buffer_names + self.derived_names
        return ops.dequantize_packed(self._meta, [getattr(self, n) for n in names], dt)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight (every buffer; the bias not included)."""
        return int(sum(getattr(self, n).numel() * getattr(self, n).element_size()
                       for n in self.buffer_names))

    @property
    def avg_bits(self) -> float:
        """Stored bits per weight value: 8 * nbytes / (in_features * out_features)."""
        return 8.0 * self.nbytes / (self.in_features * self.out_features)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + bias`` for x float32 / float16 / bfloat16 ``[..., in_features]``;
        returns ``[..., out_features]`` in ``x.dtype``. Raises TypeError / ValueError for
        another dtype, a wrong last dimension or x on another device."""
        y = self._fast_forward(x)
        return y if y is not None else self._operator(x)

    def _fast_forward(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The bound kernel's result where it applies (eager, no autograd through x or the bias,
        a float tensor on the weight's device, which is the current one): its product for few
        rows, for more its decode + ``F.linear`` (the operator's numbers without the operator's
        per-call overhead); else None (the operator path)."""
        run = self._kernel
        if run is None or not isinstance(x, torch.Tensor) or torch.compiler.is_compiling():
            return None
        K = self.in_features
        if x.dtype not in ops.FLOAT_DTYPES or x.ndim < 1 or x.shape[-1] != K:
            return None
        rows = x.numel() // K
        if rows <= 0 or x.get_device() != self._kernel_device:
            return None
        grad = torch.is_grad_enabled()
        if grad and x.requires_grad:
            return None
        cuda = self._kernel_device >= 0
        if not ops.kernels_on("cuda" if cuda else "cpu"):
            return None
        if cuda and self._kernel_device != torch.cuda.current_device():
            return None
        if self._stale():  # a buffer or the bias replaced or modified in place
            self.prepare()
            return self._fast_forward(x)
        bias = self.bias
        if bias is not None and grad and bias.requires_grad:  # the operator's autograd formula
            return None
        if rows > max(self._kernel_rows, self._tune_rows):
            return ops.run_dense(run, x, self._bias_as(x.dtype))
        kbias = self._bias_as(x.dtype if cuda else torch.float32)
        if rows > self._kernel_rows:  # the kernel only where it measured faster, here
            key = (self._meta, x.dtype, self._kernel_device, bias is not None, crossover.bucket(rows))
            if not crossover.decide(key, lambda: ops.run_linear(run, x, kbias, self.out_features),
                                    lambda: ops.run_dense(run, x, self._bias_as(x.dtype))):
                return ops.run_dense(run, x, self._bias_as(x.dtype))
        return ops.run_linear(run, x, kbias, self.out_features)

    def _bias_as(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The bias detached, contiguous and in ``dtype`` (cached per dtype until the next
        :meth:`prepare`), or None."""
        bias = self.bias
        if bias is None:
            return None
        cache = self._bias_cast
        if cache is None:
            cache = self._bias_cast = {}
        b = cache.get(dtype)
        if b is None:
            b = cache[dtype] = bias.detach().to(dtype).contiguous()
        return b

    def _operator(self, x: torch.Tensor) -> torch.Tensor:
        """The operator path (:func:`qformats.ops.linear_packed`): above the kernel's rows,
        dequantize + ``F.linear``."""
        return ops.linear_packed(x, self._meta, [self._buffers[n] for n in self.buffer_names + self.derived_names],
                                 self.bias)

    def extra_repr(self) -> str:
        p = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.format}, params={{{p}}}, "
                f"bits={self.avg_bits:.3f}")

    # -- conversions and state --------------------------------------------------------------
    def __getstate__(self):
        # copy.deepcopy / pickle: the bound native kernel is not picklable; drop it (and what
        # refers to it) and bind again in __setstate__
        state = self.__dict__.copy()
        state.update(_kernel=None, _watch=(), _bias_cast=None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if self._filled and all(self._buffers.get(n) is not None and self._buffers[n].device.type != "meta"
                                for n in self.buffer_names):
            self.prepare()

    def _apply(self, fn, recurse=True):
        # Packed buffers get only the device part of `fn`: apply it to a uint8 view (which
        # no dtype conversion touches) and view the result back, so .half() / .to(dtype)
        # cast the bias but never the format's bytes, while .to(device), .cuda(),
        # .to_empty(device=...) move them. Derived tensors are dropped and made again by
        # prepare() on the new device (to_empty leaves the buffers unfilled: no prepare).
        packed = {n: self._buffers.get(n) for n in self.buffer_names}
        for n in self.buffer_names:
            self._buffers[n] = None
        for n in self.derived_names:
            self._buffers.pop(n, None)
        self.derived_names = ()
        self._kernel = self._bias_cast = None
        self._watch = ()
        try:
            super()._apply(fn, recurse)
        finally:
            for n, b in packed.items():
                if b is None:
                    self._buffers[n] = None
                    continue
                shape, dt = b.shape, b.dtype
                flat = b.reshape(-1) if b.is_contiguous() else b.contiguous().reshape(-1)
                moved = fn(flat.view(torch.uint8))
                self._buffers[n] = moved.view(dt).reshape(shape)
        self._refresh_meta()
        if self._filled and all(self._buffers[n] is not None and self._buffers[n].device.type != "meta"
                                for n in self.buffer_names):
            try:
                self.prepare()
            except ValueError:  # to_empty(): unfilled buffers; load_state_dict prepares again
                self._filled = False
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # The default loader would cast a tensor of another dtype into a packed buffer
        # (corrupting its bytes): refuse dtype mismatches instead.
        n_errors = len(error_msgs)
        for n in self.buffer_names:
            key = prefix + n
            if key in state_dict:
                src, dst = state_dict[key], self._buffers[n]
                if isinstance(src, torch.Tensor) and dst is not None and src.dtype != dst.dtype:
                    error_msgs.append(f"dtype mismatch for {key}: the {self.format} buffer is "
                                      f"{dst.dtype}, the state dict has {src.dtype}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if len(error_msgs) == n_errors and all(prefix + n in state_dict for n in self.buffer_names) \
                and self._buffers[self.buffer_names[0]].device.type != "meta":
            try:
                self.prepare()
            except (TypeError, ValueError) as e:
                error_msgs.append(f"{prefix}: the loaded {self.format} weight is inconsistent: {e}")

    def config(self) -> dict:
        """What rebuilds this layer's skeleton (JSON-serializable): ``format``, ``params``,
        ``in_features``, ``out_features``, ``bias``, ``weight_dtype``, and ``buffers``
        ``{name: [dtype, shape]}``."""
        return {"format": self.format, "params": self.params, "in_features": self.in_features,
                "out_features": self.out_features, "bias": self.bias is not None,
                "weight_dtype": self.weight_dtype,
                "buffers": {n: [str(getattr(self, n).dtype).removeprefix("torch."),
                                list(getattr(self, n).shape)] for n in self.buffer_names}}

    @classmethod
    def from_config(cls, cfg: dict, device: Any = None, dtype: Any = None) -> "QuantizedLinear":
        """An empty layer (see ``__init__``) from :meth:`config` output; ``dtype`` is the bias
        dtype. Raises ValueError for a malformed config, an unknown format or params that do
        not fit, and for recorded buffer shapes/dtypes that differ from the format's."""
        if not isinstance(cfg, dict):
            raise ValueError(f"layer config: expected a JSON object, got {type(cfg).__name__}")
        try:
            layer = cls(int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg["bias"]),
                        format=cfg["format"], params=cfg["params"],
                        weight_dtype=cfg.get("weight_dtype", "float32"), device=device, dtype=dtype)
        except KeyError as e:
            raise ValueError(f"layer config: missing key {e}") from e
        except TypeError as e:
            raise ValueError(f"layer config: {e}") from e
        rec = cfg.get("buffers")
        if rec is not None:
            mine = layer.config()["buffers"]
            if {k: [v[0], list(v[1])] for k, v in dict(rec).items()} != mine:
                raise ValueError(f"layer config: recorded buffers {rec} differ from what the "
                                 f"{layer.format} format expects: {mine}")
        return layer


def quantized_linears(model: nn.Module) -> list[tuple[str, QuantizedLinear]]:
    """``[(name, module)]`` of the QuantizedLinear modules of ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
