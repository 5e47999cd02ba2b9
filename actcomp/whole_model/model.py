"""Whole-model mode: compress every tensor autograd keeps, not only Linear/Conv inputs.

``to_compressed(model, "mink0.9+int8", rest="8bit")`` converts the Linear/Conv layers as always
and makes the model's forward run under saved-tensor hooks that choose, per saved tensor, by the
kind of op saving it (:mod:`actcomp.graph.op_kinds`):

==============  ================================================  =========
kind            kept as                                           exact?
==============  ================================================  =========
activation      ReLU / ReLU6 / Hardtanh / LeakyReLU: 1-bit mask   yes
                GELU, SiLU: the ``rest`` spec ("8bit": int8), or  no
                few-bit derivative codes ("4bit": 4 bits)
                Sigmoid, Tanh, Mish, ...: the ``rest`` spec        no
normalization   Batch/Layer/Group/RMS norm inputs: ``rest`` spec,  no
                in groups inside each normalized unit
attention       softmax, SDPA q/k/v/out: ``rest`` spec             no
                SDPA's own dropout mask (CPU): 1-bit mask         yes
pooling         MaxPool2d: window offsets, input shape only       yes
dropout         1-bit mask (and any saved bool tensor)            yes
linear          the layer's own pipeline (never these hooks)      as today
other           as is, unless ``rest={"other": spec}``            yes
==============  ================================================  =========

Parameters, buffers, autocast's weight copies, the model's own inputs and small statistics (a
norm's mean and rstd, attention's log-sum-exp) are always kept as they are. A tensor saved by
several ops gets one compressed form per saver, so no full-size copy survives; a tensor saved
twice under the same :class:`Codec` (function and every setting it reads: a clamp's range,
GELU's approximation, a norm's unit) is compressed once. Norm inputs are laid out in rows
inside the unit the norm normalizes (:mod:`actcomp.whole_model.normalized_units`) and quantized in groups
that divide a row: a group spanning a tiny-spread row and a wide one would round the tiny one
away, and the norm's backward multiplies that error by ``1/std``.

Why saved-tensor hooks and not one autograd Function per op: the forward and the backward stay
PyTorch's own kernels (cuDNN batch norm, flash attention, fused dropout), so a 1-bit mask gives
bit-identical gradients and functional calls inside timm and transformers blocks are covered
without re-deriving any backward formula. The hooks run only in training with grad enabled; in
a ``torch.utils.checkpoint`` region checkpoint's own hooks win (nothing is stored there).

The model's forward is not the only way in: ``model.forward_head(model.forward_features(x))``, a
wrapper calling ``model.blocks(...)`` or ``model.blocks[0](h)`` compress the same. Each submodule
carries a forward pre-hook that starts a whole-model forward when none is running and a forward
hook that ends it when that call returns (also on an exception); there, the submodule's inputs
without autograd history (the caller's data) are kept as they are. Under ``torch.compile`` only the
model's own forward does this (eagerly): a compiled training call entering through a submodule
warns once.

>>> import torch, actcomp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> actcomp.to_compressed(model, "int8", rest="8bit")
CompressedSequential(
  rest='8bit'
  (0): CompressedLinear(in_features=8, out_features=8, bias=True, compress='int8')
  (1): ReLU()
  (2): CompressedLinear(in_features=8, out_features=2, bias=True, compress='int8')
)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from actcomp.core.pipeline import Packed, Pipeline, parse
from actcomp.errors import ActcompError
from actcomp.graph.model_inputs import record_model_inputs, tensors_in
from actcomp.graph.saved_tensors import (
    SavedEvent,
    announce,
    checkpoint_hooks_on_top,
    enter_running_module,
    in_compressed_layer,
    innermost_kind,
    is_parameter,
    is_parameter_copy,
    listened,
    tracking_scopes,
)
from actcomp.kernels.layouts import dense_strides_like, local_part, restride, storage_key
from actcomp.whole_model.derivative_codes import derivative_code
from actcomp.whole_model.exact_codecs import (
    Kept,
    dropout_mask,
    hardtanh_mask,
    leaky_relu_mask,
    pool_offsets,
    relu_mask,
    shape_only,
)
from actcomp.whole_model.normalized_units import Unit, normalized_unit, row_group

LOSSY_KINDS = ("activation", "normalization", "attention", "other")
EXACT_KINDS = ("pooling", "dropout")


EXACT = "exact"


@dataclass(frozen=True)
class RestPolicy:
    """What whole-model mode keeps per op kind: a pipeline, ``"exact"`` (only the exact codecs:
    ReLU-family masks for activations, window offsets for pooling, bits for dropout; every other
    tensor of the kind as is) or None (the kind's tensors as they are). ``str`` prints it back.

    >>> print(RestPolicy.parse({"normalization": "int4", "fewbit": 3}))
    activation=int8, normalization=int4, attention=int8, pooling=exact, dropout=exact, other=None, fewbit=3
    >>> print(RestPolicy.parse("int8"))
    8bit
    >>> print(RestPolicy.parse({"normalization": "int4", "fewbit": 4}))
    activation=int8, normalization=int4, attention=int8, pooling=exact, dropout=exact, other=None, fewbit=4
    """

    activation: Pipeline | str | None
    normalization: Pipeline | str | None
    attention: Pipeline | str | None
    pooling: str | None
    dropout: str | None
    other: Pipeline | str | None = None
    # GELU and SiLU inputs as few-bit derivative codes (actcomp.whole_model.derivative_codes) instead of
    # the activation pipeline; None: they follow ``activation``.
    fewbit: int | None = None

    @classmethod
    def parse(cls, rest: str | Pipeline | Mapping | RestPolicy) -> RestPolicy:
        """``rest`` as given to :func:`actcomp.to_compressed`: a preset (``"8bit"``, ``"4bit"``,
        ``"exact"``; see :data:`PRESETS`), one spec for activations, norms and attention (plus
        the exact codecs), or a mapping from kinds to specs, ``"exact"`` or None, overriding
        the ``"8bit"`` preset."""
        if isinstance(rest, RestPolicy):
            return rest
        if isinstance(rest, str) and rest in PRESETS:
            return cls.parse(PRESETS[rest])
        if isinstance(rest, str):
            presets = ", ".join(repr(name) for name in PRESETS)
            near = rest.lower().translate({ord(c): None for c in " -_"})
            if near in PRESETS:
                # Told, not accepted: a spelling the library reads silently would be one more to support.
                raise ActcompError(f"unknown rest preset {rest!r}; did you mean {near!r}? presets: {presets}")
            try:
                pipeline = _lossy_pipeline(rest, "rest")
            except ActcompError as error:
                raise ActcompError(f"rest={rest!r} is neither a preset ({presets}) nor a spec whole-model mode can "
                                   f"use:\n{error}") from None
            return cls(pipeline, pipeline, pipeline, EXACT, EXACT)
        if isinstance(rest, Pipeline):
            pipeline = _lossy_pipeline(rest, "rest")
            return cls(pipeline, pipeline, pipeline, EXACT, EXACT)
        if not isinstance(rest, Mapping):
            raise ActcompError(
                f"rest must be 'exact', a spec string, a Pipeline or a mapping from op kinds to specs, got "
                f"{type(rest).__name__}: {rest!r}"
            )
        values = vars(cls.parse("8bit")).copy()
        for kind, spec in rest.items():
            if kind in EXACT_KINDS:
                if spec not in (EXACT, None):
                    raise ActcompError(f"rest[{kind!r}] must be 'exact' or None (its codec is exact), got {spec!r}")
                values[kind] = spec
            elif kind == "fewbit":
                if spec is not None and (type(spec) is not int or spec not in range(1, 5)):
                    raise ActcompError(f"rest['fewbit'] must be a bit width 1 to 4 (or None), got {spec!r}")
                values[kind] = spec
            elif kind in LOSSY_KINDS:
                values[kind] = spec if spec in (EXACT, None) else _lossy_pipeline(spec, f"rest[{kind!r}]")
            else:
                raise ActcompError(
                    f"unknown op kind {kind!r} in rest; valid keys: {', '.join(LOSSY_KINDS + EXACT_KINDS)}, fewbit "
                    "(Linear/Conv inputs take the main pipeline argument)"
                )
        return cls(**values)

    def pipeline(self, kind: str) -> Pipeline | None:
        """The lossy pipeline for ``kind``'s tensors, None when they are kept as is."""
        value = getattr(self, kind)
        return value if isinstance(value, Pipeline) else None

    def __str__(self) -> str:
        preset = next((name for name in PRESETS if RestPolicy.parse(name) == self), None)
        if preset is not None:
            return preset
        parts = []
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name != "fewbit" or value is not None:
                parts.append(f"{item.name}={value.spec if isinstance(value, Pipeline) else value}")
        return ", ".join(parts)


def _lossy_pipeline(spec: str | Pipeline, where: str) -> Pipeline:
    if isinstance(spec, Pipeline):
        pipeline = spec
    elif isinstance(spec, str):
        pipeline = parse(spec)
    else:
        raise ActcompError(f"{where}: expected a spec string, a Pipeline or None, got {type(spec).__name__}: {spec!r}")
    # Stochastic rounding has generators of its own; a stage drawing from the global one would
    # shift every later random op of the forward (dropout masks) away from plain PyTorch's.
    random = [stage.name for stage in pipeline.stages if stage.draws_global_random]
    if random:
        raise ActcompError(
            f"{where}: {pipeline.spec!r} uses {random[0]!r}, which draws from torch's global random generator "
            "in the middle of the forward and would change the dropout masks that follow; use min-k or a quantizer"
        )
    stateful = [stage.name for stage in pipeline.stages if stage.initial_state() is not None]
    if stateful:
        raise ActcompError(
            f"{where}: {pipeline.spec!r} uses {stateful[0]!r}, which keeps running ranges per layer; one pipeline "
            "serves every op of a kind here, so use a stateless quantizer (int8, int4, int2, fp8, fp16, bf16)"
        )
    return pipeline


# The one-switch choices. "4bit" keeps GELU/SiLU inputs as 4-bit derivative codes: the bytes
# of int4, a derivative within 0.044 (int4 codes of a deep SiLU net's inputs drift further:
# EfficientNet-B0's gradient cosine 0.93 against 0.98). "8bit" keeps them in int8: 3-bit codes
# (rest={"fewbit": 3}) take 0.375 bytes an element instead of 1, at cosine 0.95 on EfficientNet.
PRESETS: dict[str, RestPolicy | Mapping | str] = {
    "exact": RestPolicy(EXACT, EXACT, EXACT, EXACT, EXACT, EXACT),
    "8bit": "int8",
    "4bit": {"activation": "int4:group=64", "normalization": "int4:group=64", "attention": "int4:group=64", "fewbit": 4},
}


class _AsIs:
    """A saved tensor kept as it is; unpacking checks it was not modified in place since."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        # Detached: a tensor autograd saves is often its op's own output, whose grad_fn holds
        # this object; holding the tensor itself would close a reference cycle through C++ that
        # the garbage collector cannot see, leaking the whole graph of a forward that never runs
        # backward. The detached alias shares the storage and the version counter, and autograd
        # re-attaches the grad_fn when it unpacks.
        self.tensor, self.version = tensor.detach(), tensor._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise ActcompError(
                f"a tensor of shape {tuple(self.tensor.shape)} saved for backward was modified by an in-place "
                f"operation after it was saved (version {self.version}, now {self.tensor._version}); plain PyTorch "
                "raises here too: make the in-place op out of place"
            )
        return self.tensor


class _Session:
    """One training forward of a whole-model: chooses and applies codecs as tensors are saved."""

    def __init__(self, policy: RestPolicy, excluded: Iterable[torch.Tensor]):
        self.policy = policy
        # Buffers and the caller's data stay alive anyway: a compressed copy would only add bytes.
        self.excluded = {storage_key(t) for t in excluded}
        self.excluded.discard(None)
        # (id of the saved tensor, codec) -> (weak reference, version, Kept): one tensor saved
        # twice under one codec (RMSNorm's input, by pow and by mul) is compressed once.
        self.cache: dict[tuple[int, str], tuple[weakref.ref, int, Kept]] = {}

    def close(self) -> None:
        """Forget the forward's tensors: the saved variables alone now decide what stays alive."""
        self.cache.clear()
        self.excluded.clear()

    def pack(self, tensor: torch.Tensor):
        # Compressing must not record autograd history (nor save tensors of its own).
        with torch.no_grad():
            kind, kept = self.choose(tensor)
        holder = _AsIs(tensor) if kept is None else kept
        if listened():
            announce(SavedEvent(tensor, (tensor,) if kept is None else kept.tensors, kind,
                                None if kept is None else kept.codec))
        return holder

    def choose(self, tensor: torch.Tensor) -> tuple[str, Kept | None]:
        if in_compressed_layer():
            return "linear", None
        if type(tensor) is not torch.Tensor:
            return "other", None  # tensor subclasses (DTensor activations, ...) keep their own semantics
        if is_parameter(tensor) or storage_key(local_part(tensor)) in self.excluded or is_parameter_copy(tensor):
            return "kept", None
        scope = innermost_kind()
        kind = "other" if scope is None else scope.kind
        if kind == "linear" or not _frees_memory(tensor):
            return kind, None
        return kind, self.cached(tensor, kind, scope)

    def cached(self, tensor: torch.Tensor, kind: str, scope) -> Kept | None:
        codec = choose_codec(self.policy, tensor, kind, scope)
        if codec is None:
            return None
        # The key is everything the codec reads besides the tensor's values (its function and
        # settings: a clamp's range, GELU's approximation, a norm's unit), so two saves of one
        # tensor under one op with other arguments never share a code.
        key = (id(tensor), codec)
        hit = self.cache.get(key)
        if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
            return hit[2]
        kept = codec.encode(tensor)
        if kept is not None:
            self.cache[key] = (weakref.ref(tensor), tensor._version, kept)
        return kept


@dataclass(frozen=True)
class Codec:
    """A codec function and every setting it reads: ``encode(t)`` is ``function(t, *settings)``.

    Frozen and hashable: whole-model mode shares one encoding between saves of one tensor
    only when their ``Codec`` values are equal.

    >>> x = torch.randn(4, 8)
    >>> Codec(hardtanh_mask, (-1.0, 1.0)) == Codec(hardtanh_mask, (0.0, 0.5))
    False
    >>> Codec(hardtanh_mask, (-1.0, 1.0)).encode(x)
    Kept('clamp-mask', 4 bytes)
    """

    function: object
    settings: tuple = ()

    def encode(self, tensor: torch.Tensor) -> Kept | None:
        return self.function(tensor, *self.settings)


def choose_codec(policy: RestPolicy, tensor: torch.Tensor, kind: str, scope) -> Codec | None:
    """The codec whole-model mode applies to ``tensor``, saved by an op of ``kind`` in
    ``scope``, under ``policy``; None to keep it as it is. Reads the tensor's metadata only
    (its values are the codec's business), so choosing costs nothing per element."""
    op = scope.op if scope is not None else None
    if tensor.dtype == torch.bool:
        return Codec(dropout_mask) if policy.dropout else None
    if not tensor.is_floating_point():
        if kind == "pooling" and op == "max_pool2d" and policy.pooling:
            input_shape = tuple(_argument(scope, 0, "input", None).shape)
            return Codec(pool_offsets, (input_shape, *(_hashable(value) for value in _pool_settings(scope))))
        return None
    if kind == "activation":
        if policy.activation is None:
            return None
        if op == "relu":
            return Codec(relu_mask)
        if op == "leaky_relu":
            return Codec(leaky_relu_mask)
        if op in ("hardtanh", "relu6"):
            return Codec(hardtanh_mask, _clamp_range(scope))
        if op in ("gelu", "silu") and policy.fewbit is not None and tensor.numel() == scope.reference:
            approximate = _argument(scope, 1, "approximate", "none") if op == "gelu" else "none"
            return Codec(_derivative_or_lossy, (op, approximate, policy.fewbit, policy.pipeline("activation")))
    if kind == "dropout":
        return Codec(dropout_mask) if policy.dropout else None
    if kind == "pooling":
        return Codec(shape_only) if op == "max_pool2d" and policy.pooling else None
    if kind == "attention" and op == "sdpa" and policy.dropout and _sdpa_dropout_mask(tensor, scope):
        # SDPA's math path (CPU) multiplies by a 0-or-1/(1-p) tensor it drew and saves it: a
        # dropout mask, one exact bit an element, or the pipeline if it is not of that form.
        return Codec(_dropout_or_lossy, (policy.pipeline("attention"),))
    pipeline = policy.pipeline(kind)
    if pipeline is None or (scope is not None and tensor.numel() * 4 < scope.reference):
        return None  # kept as is, or a statistic (a norm's mean and rstd, a log-sum-exp)
    unit = _normalized_unit(tensor, scope) if kind == "normalization" else None
    return Codec(_lossy, (pipeline, unit))


def _hashable(value):
    return tuple(value) if isinstance(value, (list, torch.Size)) else value


def _sdpa_dropout_mask(tensor: torch.Tensor, scope) -> bool:
    """Whether ``tensor``, saved inside ``F.scaled_dot_product_attention``, can be its dropout
    mask: dropout is on and the tensor is not on autograd's path (the mask needs no gradient)."""
    return float(_argument(scope, 4, "dropout_p", 0.0)) > 0 and tensor.grad_fn is None and not tensor.requires_grad


def _normalized_unit(tensor: torch.Tensor, scope) -> Unit | None:
    op = scope.op if scope is not None and scope.op is not None else None
    if scope is None or (op is None and scope.module is None):
        return None
    setting = None
    if op in ("layer_norm", "rms_norm"):
        setting = _hashable(_argument(scope, 1, "normalized_shape", None))
    elif op == "group_norm":
        setting = _argument(scope, 1, "num_groups", None)
    return normalized_unit(op, tensor.shape, setting)


def _frees_memory(tensor: torch.Tensor) -> bool:
    """Whether compressing ``tensor`` can free memory: not for an expanded (broadcast) view, whose
    compressed form at full size can outweigh its small storage. A small slice of a large
    storage (a head reading ``x[:, 0]``) does qualify: kept as is, it would pin the storage."""
    return tensor.numel() > 0 and all(stride != 0 or size == 1 for size, stride in zip(tensor.shape, tensor.stride()))


def _all_finite(tensor: torch.Tensor) -> bool:
    # Derivative codes have no code for NaN or inf; such a tensor goes to the pipeline, which
    # keeps them exactly. One reduction: any non-finite element makes the sum non-finite.
    return bool(tensor.sum(dtype=torch.float32).isfinite())


def _derivative_or_lossy(tensor: torch.Tensor, function: str, approximate: str, bits: int,
                         fallback: Pipeline | None) -> Kept | None:
    if _all_finite(tensor):
        return derivative_code(tensor, function, approximate, bits=bits)
    return None if fallback is None else _lossy(tensor, fallback, None)


def _dropout_or_lossy(tensor: torch.Tensor, fallback: Pipeline | None) -> Kept | None:
    kept = dropout_mask(tensor)
    if kept is not None or fallback is None:
        return kept
    return _lossy(tensor, fallback, None)


_REGROUPED: dict[tuple[Pipeline, int], Pipeline] = {}


def _grouped_by_rows(pipeline: Pipeline, row: int) -> Pipeline | None:
    """``pipeline`` with its quantizer's groups dividing rows of ``row`` elements (cached), or
    None when rows do not apply: a sparsifier first (its kept values have lost their rows) or
    a quantizer without groups (fp8, fp16, bf16 scale nothing across elements)."""
    stages = pipeline.stages
    if len(stages) != 1 or not any(item.name == "group" for item in fields(stages[0])):
        return None
    group = row_group(row, stages[0].group)
    if group == stages[0].group:
        return pipeline
    key = (pipeline, group)
    if key not in _REGROUPED:
        _REGROUPED[key] = Pipeline(replace(stages[0], group=group))
    return _REGROUPED[key]


def _lossy(tensor: torch.Tensor, pipeline: Pipeline, unit: Unit | None) -> Kept | None:
    """``tensor`` through ``pipeline``; with a normalized ``unit``, laid out in its rows and
    quantized in groups that never straddle two rows. None when that would not save memory
    (rows of a few elements, each with a range of its own)."""
    # The rebuild closure must not capture ``tensor``: that would keep the full tensor alive.
    # The pipeline works a chunk at a time, so its temporaries stay small (actcomp.tools.temporaries).
    # Rebuilt dense in the tensor's own axis order (a slice's gaps closed), as Linear/Conv
    # inputs are: backward kernels choose by strides.
    stride, permutation = dense_strides_like(tensor), None
    values = tensor.detach()
    if unit is not None:
        grouped = _grouped_by_rows(pipeline, unit.row)
        if grouped is not None:
            pipeline, permutation = grouped, unit.permutation
            if permutation is not None:
                values = values.permute(permutation)
    packed = pipeline.compress(values.reshape(-1))
    if unit is not None and packed.nbytes >= tensor.numel() * tensor.element_size():
        return None
    layout, laid_out = packed.layout, values.shape
    inverse = None if permutation is None else tuple(sorted(range(len(permutation)), key=permutation.__getitem__))

    def rebuild(tensors: tuple) -> torch.Tensor:
        out = pipeline.decompress(Packed(tensors, layout)).view(laid_out)
        if inverse is not None:
            out = out.permute(inverse)  # back to the tensor's dimension order
        return restride(out, stride)

    return Kept(pipeline.spec, packed.tensors, rebuild)


def _argument(scope, index: int, name: str, default):
    if len(scope.args) > index:
        return scope.args[index]
    return scope.kwargs.get(name, default)


def _clamp_range(scope) -> tuple[float, float]:
    if scope.op == "relu6":
        return 0.0, 6.0
    return float(_argument(scope, 1, "min_val", -1.0)), float(_argument(scope, 2, "max_val", 1.0))


def _pool_settings(scope) -> tuple:
    kernel = _argument(scope, 1, "kernel_size", None)
    stride = _argument(scope, 2, "stride", None)
    padding = _argument(scope, 3, "padding", 0)
    dilation = _argument(scope, 4, "dilation", 1)
    return kernel, stride, padding, dilation


# A backward called inside a torch.compile'd step runs these unpack calls with dynamo's frame
# hook on: it would compile _unpack once per holder type, closure and size (recompiling until
# its limit, 110 frames for a resnet18 step) for tensors that are mostly bit operations.
@torch.compiler.disable
def _unpack(holder) -> torch.Tensor:
    if isinstance(holder, _AsIs):
        return holder.unpack()
    if torch.is_grad_enabled():
        raise ActcompError(
            "double backward (create_graph=True) through a whole-model compressed tensor is not supported: the "
            "saved tensor is rebuilt from its compressed form, without its autograd history. Convert the model "
            "back with actcomp.from_compressed(model) for this computation"
        )
    return holder.unpack()


_WARNED_FOREIGN: set = set()


class CompressedModel:
    """Mixin placed in front of the root model's class; see :func:`compress_whole_model`."""

    actcomp_rest: RestPolicy
    actcomp_base: type

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            # Eval and no_grad save nothing: the plain forward, no saved-tensor hooks.
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        return _whole_model_forward(self, args, kwargs)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        rest = f"rest={str(self.actcomp_rest)!r}"
        return f"{base}, {rest}" if base else rest

    def __reduce_ex__(self, protocol):
        return _rebuild_compressed_model, (type(self).actcomp_base,), self.__getstate__()


class _Running(threading.local):
    """The whole-model forward running in this thread, if any: ``owner`` is the module whose call
    started it (a converted root's forward, or a submodule called from outside it), ``close`` ends
    its session (None where it declined: under checkpoint or other saved-tensor hooks) and
    ``reentered`` counts calls of ``owner`` inside its own call, whose end must not close it."""

    owner: nn.Module | None = None
    close: contextlib.ExitStack | None = None
    reentered: int = 0


_RUNNING = _Running()


# Storage keys, saved-tensor hooks and the op-kind mode are not traceable: under torch.compile a
# whole-model forward runs eagerly (one graph break at the model's entry).
@torch.compiler.disable
def _whole_model_forward(module: nn.Module, args: tuple, kwargs: dict):
    forward = super(CompressedModel, module).forward  # type: ignore[misc]
    if _RUNNING.owner is not None:
        return forward(*args, **kwargs)  # a whole-model inside another: the outer one's hooks decide
    try:
        _start(module, module.actcomp_rest, [*module.buffers(), *tensors_in((args, kwargs))],
               type(module).actcomp_base)
        return forward(*args, **kwargs)
    finally:
        _finish()


def _start(owner: nn.Module, policy: RestPolicy, excluded: list, model_class: type, entered: tuple | None = None):
    """Start a whole-model forward owned by ``owner``: a session compressing what is saved until
    :func:`_finish`, unless checkpoint's or someone else's saved-tensor hooks are on top.
    ``entered``: the arguments of a submodule whose pre-hook starts it (its own scope opens too)."""
    _RUNNING.owner, _RUNNING.reentered = owner, 0
    if checkpoint_hooks_on_top():
        return  # checkpoint recomputes these tensors: nothing is stored
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None and not getattr(top[0], "actcomp_observer", False):
        _warn_foreign_hooks(model_class, top[0])
        return
    session = _Session(policy, excluded)
    close = contextlib.ExitStack()
    # Autograd keeps the pack hook (this session) with every saved variable until backward
    # releases the last one. Holding the compressed tensors in the cache past the forward
    # would keep every one of them alive to the end of backward instead of freeing each as
    # its node runs: on ViT-S at batch 32 that was the whole kept size on top of the peak.
    close.callback(session.close)
    close.enter_context(tracking_scopes())
    if entered is not None:
        enter_running_module(owner, entered)
    close.enter_context(torch.autograd.graph.saved_tensors_hooks(session.pack, _unpack))
    _RUNNING.close = close


def _finish() -> None:
    close = _RUNNING.close
    _RUNNING.owner, _RUNNING.close, _RUNNING.reentered = None, None, 0
    if close is not None:
        close.close()


def _warn_foreign_hooks(model_class: type, pack) -> None:
    if model_class not in _WARNED_FOREIGN:
        _WARNED_FOREIGN.add(model_class)
        warnings.warn(
            f"whole-model compression is off for this forward: other saved-tensor hooks ({getattr(pack, '__qualname__', pack)}) "
            "are active and would be overridden; Linear/Conv layers are still compressed",
            stacklevel=4,
        )


# Entry points other than the root's forward. A converted model's submodules can be called from
# outside it: timm's ``model.forward_head(model.forward_features(x))``, a wrapper calling
# ``model.blocks(...)``, ``model.blocks[0](x)``. Each submodule carries a pre-hook that starts a
# whole-model forward when none is running (training, grad enabled) and a post-hook that ends
# the one its module started. Inside a running one (the root's forward, or an outer submodule's)
# both return at once.


def _enter_submodule(policy: RestPolicy, model_class: type, module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():
        # Dynamo traces module hooks into the graph, where no session can run: an eval forward
        # compiles as before; a compiled training call that enters here is told once.
        if module.training and torch.is_grad_enabled() and not _COMPILED_ENTRY_WARNED:
            _warn_compiled_entry(model_class)
        return
    owner = _RUNNING.owner
    if owner is not None:
        if owner is module:
            _RUNNING.reentered += 1
        return
    # Eval and no_grad save nothing. In backward (a reentrant checkpoint recomputing a region)
    # the root's forward would not be running either: run as it would.
    if not (module.training and torch.is_grad_enabled()) or torch._C._current_graph_task_id() != -1:
        return
    # Inputs without autograd history are the caller's data (an image, a cached feature): kept
    # anyway, as the root's inputs are. An input with history is an activation of the caller's
    # graph (forward_features' output reaching forward_head, the patch embedding a wrapper hands
    # to ``blocks``), which the caller rarely holds past the call: compressed, its saved copies
    # free it, as inside the root's forward; excluded, every entry would keep one more tensor
    # whole (on ViT-tiny via forward_features, the first block's and the final norm's inputs).
    data = [tensor for tensor in tensors_in((args, kwargs)) if tensor.grad_fn is None]
    # They are the model's inputs for first_layer="auto" too: the layer reading the image runs
    # plain, as when the root's forward is called, instead of dropping elements of raw data.
    record_model_inputs(data)
    try:
        _start(module, policy, [*module.buffers(), *data], model_class, args)
    except BaseException:
        _finish()
        raise


def _leave_submodule(module: nn.Module, args: tuple, output) -> None:
    if torch.compiler.is_compiling() or _RUNNING.owner is not module:
        return
    if _RUNNING.reentered:
        _RUNNING.reentered -= 1
        return
    _finish()


# Read by the traced pre-hook: dynamo guards on its value, so after the one warning (and one
# recompilation) compiled code calls the warning no more; a call each time would be a graph break
# at every submodule.
_COMPILED_ENTRY_WARNED = False


@torch.compiler.disable
def _warn_compiled_entry(model_class: type) -> None:
    global _COMPILED_ENTRY_WARNED
    _COMPILED_ENTRY_WARNED = True
    warnings.warn(
        f"whole-model compression is off for a {model_class.__name__} submodule called inside torch.compile: "
        "only the model's own forward runs whole-model mode there (eagerly); Linear/Conv layers are still "
        "compressed",
        stacklevel=2,
    )


_MODEL_CLASSES: dict[type, type] = {}


def compressed_model_class(base: type) -> type:
    """The (cached) whole-model subclass of ``base``."""
    if base not in _MODEL_CLASSES:
        namespace = {"__module__": __name__, "actcomp_base": base, "forward": _forward_like(base)}
        _MODEL_CLASSES[base] = type(f"Compressed{base.__name__}", (CompressedModel, base), namespace)
    return _MODEL_CLASSES[base]


def _forward_like(base: type):
    """:meth:`CompressedModel.forward` with ``base.forward``'s docstring and signature.

    Callers read the signature: Hugging Face's Trainer passes on only the batch keys that
    ``forward`` names and finds the label names there; ``(*args, **kwargs)`` would make it drop
    every input. A copy of the function, not a wrapper: a wrapper would be one more frame for
    torch.compile to trace and break in.
    """
    shared = CompressedModel.forward
    forward = types.FunctionType(shared.__code__, shared.__globals__, "forward", shared.__defaults__, shared.__closure__)
    forward.__qualname__ = f"Compressed{base.__name__}.forward"
    forward.__doc__ = base.forward.__doc__
    forward.__signature__ = inspect.signature(base.forward)
    return forward


def check_whole_model_root(model: nn.Module) -> None:
    """Raise if ``model`` cannot take whole-model mode: a bare Linear/Conv layer is its own root."""
    from actcomp.layers.compressed_layer import is_supported

    if is_supported(model):
        base = getattr(type(model), "actcomp_base", type(model))
        raise ActcompError(
            f"rest= needs a model that contains layers; this model is a single {base.__name__}, "
            "whose input the main pipeline already compresses"
        )


def compress_whole_model(model: nn.Module, policy: RestPolicy) -> None:
    """Make ``model``'s training forward compress every saved tensor per ``policy``, in place,
    and its submodules' too when they are called from outside it."""
    check_whole_model_root(model)
    if not isinstance(model, CompressedModel):
        model.__class__ = compressed_model_class(type(model))
    model.actcomp_rest = policy
    _remove_entry_hooks(model)  # a root was maybe a submodule of another converted model
    enter = functools.partial(_enter_submodule, policy, type(model).actcomp_base)
    for module in _entry_modules(model):
        _remove_entry_hooks(module)  # converting again replaces the policy, never adds hooks
        module.register_forward_pre_hook(enter, with_kwargs=True)
        # always_call: a submodule that raises still ends the forward it started.
        module.register_forward_hook(_leave_submodule, always_call=True)


def uncompress_whole_model(model: nn.Module) -> None:
    """Undo :func:`compress_whole_model`."""
    if isinstance(model, CompressedModel):
        for module in _entry_modules(model):
            _remove_entry_hooks(module)
        model.__class__ = type(model).actcomp_base
        model.__dict__.pop("actcomp_rest", None)


def _entry_modules(model: nn.Module):
    """``model``'s submodules, but not those of a converted model inside it, which answer to
    their own root's policy (that root's forward starts its whole-model forwards)."""
    for child in model.children():
        if not isinstance(child, CompressedModel):
            yield child
            yield from _entry_modules(child)


def _remove_entry_hooks(module: nn.Module) -> None:
    # Found by identity rather than through kept handles: handles do not follow the model through
    # deepcopy or pickle, the hooks themselves do.
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if getattr(hook, "func", None) is _enter_submodule:
            del module._forward_pre_hooks[hook_id]
            module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook is _leave_submodule:
            del module._forward_hooks[hook_id]
            module._forward_hooks_always_called.pop(hook_id, None)


def _rebuild_compressed_model(base: type) -> nn.Module:
    module = base.__new__(base)
    module.__class__ = compressed_model_class(base)
    return module
