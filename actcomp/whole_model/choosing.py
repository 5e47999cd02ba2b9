"""Which codec whole-model mode gives a saved tensor, in both engines: the op table
(:data:`OP_CODECS`: an op's own exact and derivative codecs and how each reads its settings from
the op's call), then the policy's choice for the op's kind (:func:`choose_codec`).

The eager engine (:mod:`~actcomp.whole_model.session`) names the op and kind from the scopes it
watches; the compiled one (:mod:`~actcomp.whole_model.in_graph`) from what the backward graph
does with the tensor. Both hand the same :class:`~actcomp.graph.saved_tensors.Scope` here and
keep what :meth:`CodecChoice.encode` returns. A new exact codec for an op is one registered codec
plus one :func:`register_op_codec` call, from the library or from a user's code.

>>> [entry.codec.name for entry in OP_CODECS["max_pool2d"]]
['pool-offsets', 'shape-only']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from actcomp import host_allocator
from actcomp.core.backends import tracing
from actcomp.core.codec import Compressor
from actcomp.core.pipeline import Packed, Pipeline, parse
from actcomp.core.registry import codec_class
from actcomp.errors import ActcompError
from actcomp.graph.op_kinds import register_function, unregister_function
from actcomp.graph.saved_tensors import Scope
from actcomp.kernels.layouts import dense_strides_like, memory_order, storage_key
from actcomp.torch_compat import view_base
from actcomp.whole_model.derivative_codes import DerivativeCode
from actcomp.whole_model.exact_codecs import (
    ClampMask,
    ComparisonMask,
    DropoutMask,
    LeakyReluMask,
    PoolOffsets,
    ReluMask,
    ShapeOnly,
    clamp_middle,
)
from actcomp.whole_model.kept_forms import Compressed
from actcomp.whole_model.normalized_units import Unit, normalized_unit, row_group
from actcomp.whole_model.policy import Derivative, Exact, KeepAsIs, Lossy, RestPolicy


def argument(call: Scope, index: int, name: str, default: Any) -> Any:
    """Argument ``index`` (by position) or ``name`` (by keyword) of an op's call, else ``default``.

    >>> argument(Scope("activation", op="hardtanh", args=(None, -2.0)), 1, "min_val", -1.0)
    -2.0
    """
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


def _no_settings(call: Scope, tensor: torch.Tensor) -> dict:
    return {}


@dataclass(frozen=True)
class OpCodec:
    """An op-table entry: a registered codec class and ``settings(call, tensor)``, its settings
    read from the op's call (arguments, and the saved tensor's shape and dtype, never its
    values) or None where the codec does not apply to this call. Nothing reads values to
    choose: what depends on them (a NaN, a mask that is not one) is the codec's to encode."""

    codec: type[Compressor]
    settings: Callable[[Scope, torch.Tensor], dict | None] = _no_settings


def _clamp_settings(call: Scope, tensor: torch.Tensor) -> dict | None:
    low, high = (0.0, 6.0) if call.op == "relu6" else (float(argument(call, 1, "min_val", -1.0)),
                                                       float(argument(call, 2, "max_val", 1.0)))
    if clamp_middle(low, high, tensor.dtype) is None:
        return None  # no value of the dtype lies strictly inside: no stand-in for "inside"
    return {"low": low, "high": high}


def _clamp_settings_on_device(call: Scope, tensor: torch.Tensor) -> dict | None:
    """:func:`_clamp_settings`, and the mask's states by the device, never by the values: on a
    CPU, hardtanh's backward answers NaN by code path, so NaN is a third state there (2 bits an
    element); CUDA's kernel and compiled code pass NaN as inside, which the 1-bit mask says."""
    settings = _clamp_settings(call, tensor)
    if settings is not None and tensor.device.type == "cpu":
        settings["states"] = 3
    return settings


def _pair(value) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[-1]))


def _pool_settings(call: Scope, tensor: torch.Tensor) -> dict | None:
    kernel = _pair(argument(call, 1, "kernel_size", None))
    stride = argument(call, 2, "stride", None)
    if kernel[0] * kernel[1] > 256 or tensor.dim() < 2:
        return None  # a byte per offset would be no saving
    return {"kernel": kernel, "stride": _pair(stride if stride else kernel),
            "padding": _pair(argument(call, 3, "padding", 0)), "dilation": _pair(argument(call, 4, "dilation", 1)),
            "width": int(argument(call, 0, "input", None).shape[-1]), "out_size": tuple(tensor.shape[-2:])}


def _derivative_settings(call: Scope, tensor: torch.Tensor) -> dict | None:
    if tensor.numel() != call.reference:
        return None  # not the activation's input
    approximate = argument(call, 1, "approximate", "none") if call.op == "gelu" else "none"
    return {"function": call.op, "approximate": approximate}


def _sdpa_mask_settings(call: Scope, tensor: torch.Tensor) -> dict | None:
    """SDPA's math path (CPU) multiplies by a 0-or-1/(1-p) tensor it drew and saves it: with
    dropout on, a saved tensor off autograd's path (the mask needs no gradient) may be it."""
    # Only on a CPU, and only in the attention weights' shape: CUDA's fused kernels save no mask
    # (they redraw it from a Philox seed) but do save tensors off autograd's path, the
    # logsumexp and an additive bias, which this codec would turn to NaN (the GPU check's zoo run
    # of stop 41). A mask CUDA's math path saves is then kept as it is: correct, uncompressed.
    query, key = argument(call, 0, "query", None), argument(call, 1, "key", None)
    weights_shape = (*query.shape[:-1], key.shape[-2]) if query is not None and key is not None else None
    if (float(argument(call, 4, "dropout_p", 0.0)) > 0 and tensor.grad_fn is None and not tensor.requires_grad
            and tensor.device.type == "cpu" and tuple(tensor.shape) == weights_shape):
        # Checked on the device as it is coded: a tensor not all 0 or one scale decodes to NaN.
        return {"other_values": "nan"}
    return None


def _comparison_settings(call: Scope, tensor: torch.Tensor) -> dict | None:
    comparison, threshold = call.args
    return {"comparison": comparison, "threshold": threshold}


OP_CODECS: dict[str, tuple[OpCodec, ...]] = {
    "relu": (OpCodec(ReluMask),),
    "leaky_relu": (OpCodec(LeakyReluMask),),
    "hardtanh": (OpCodec(ClampMask, _clamp_settings_on_device),),
    "relu6": (OpCodec(ClampMask, _clamp_settings_on_device),),
    "gelu": (OpCodec(DerivativeCode, _derivative_settings),),
    "silu": (OpCodec(DerivativeCode, _derivative_settings),),
    # Every float tensor a dropout op saves is its 0-or-scale mask (alpha dropout's too).
    "dropout": (OpCodec(DropoutMask),),
    "max_pool2d": (OpCodec(PoolOffsets, _pool_settings), OpCodec(ShapeOnly)),
    # avg_pool and adaptive_avg_pool (1-3d) save their input for its shape and layout alone.
    "avg_pool": (OpCodec(ShapeOnly),),
    "sdpa": (OpCodec(DropoutMask, _sdpa_mask_settings),),
    # Named by the compiled engine, which sees a tensor the backward only compares with one
    # constant (ReLU's output, tested ``<= 0``) rather than the op that saved it.
    "compared": (OpCodec(ComparisonMask, _comparison_settings),),
}


def register_op_codec(function: Callable, codec: str | type[Compressor],
                      settings: Callable[[Scope, torch.Tensor], dict | None] = _no_settings, *,
                      kind: str = "activation", op: str | None = None, replace: bool = False) -> None:
    """Keep what ``function`` saves for backward with the registered whole-model ``codec`` (its
    class or name; kind ``exact`` or ``derivative``) in whole-model mode, where the policy keeps
    ``kind`` compressed. ``settings(call, tensor)`` reads the codec's settings from the call
    (``call.args``, ``call.kwargs``; :func:`argument` helps) and the saved tensor's shape and
    dtype: a dict, or None where the codec does not apply. A whole example is in docs/codecs.md.

    >>> import torch, actcomp
    >>> actcomp.register_op_codec(torch.nn.functional.threshold, "relu-mask", op="zero_threshold",
    ...                           settings=lambda call, tensor: {} if argument(call, 1, "threshold", 0) == 0 else None)
    >>> actcomp.unregister_op_codec(torch.nn.functional.threshold)
    """
    klass = codec_class(codec) if isinstance(codec, str) else codec
    if getattr(klass, "kind", None) not in ("exact", "derivative"):
        raise ActcompError(f"register_op_codec expects a registered codec of kind 'exact' or 'derivative', got {codec!r}")
    op = op or getattr(function, "__name__", None)
    if not op:
        raise ActcompError(f"name the op of {function!r}: pass op='...'")
    if op in OP_CODECS and not replace:
        raise ActcompError(f"op {op!r} has codecs already ({', '.join(e.codec.name for e in OP_CODECS[op])}); "
                           "pass replace=True to override")
    register_function(function, kind, op)
    OP_CODECS[op] = (OpCodec(klass, settings),)
    _USER_OPS[function] = op


_USER_OPS: dict[Callable, str] = {}


def unregister_op_codec(function: Callable) -> None:
    """Undo :func:`register_op_codec` for ``function``."""
    if function not in _USER_OPS:
        raise ActcompError(f"no op codec was registered for {function!r}")
    OP_CODECS.pop(_USER_OPS.pop(function), None)
    unregister_function(function)


# ---------------------------------------------------------------------------------------------
# Choosing a codec


@dataclass(frozen=True)
class CodecChoice:
    """What whole-model mode does with one saved tensor: ``codec`` on it, laid out in
    ``unit``'s rows (a norm's input).

    Frozen and hashable: whole-model mode shares one encoding between saves of one tensor
    only when their choices are equal.

    >>> CodecChoice(ClampMask(-1.0, 1.0)) == CodecChoice(ClampMask(0.0, 0.5))
    False
    >>> CodecChoice(ReluMask()).encode(torch.randn(4, 8)).packed
    Packed('relu-mask', float32[4, 8] on cpu, 4 of 128 bytes (3.1%): uint8[4])
    """

    codec: Compressor | Pipeline
    unit: Unit | None = None

    def encode(self, tensor: torch.Tensor) -> Compressed | None:
        """``tensor`` packed flat, in its unit's rows, to be rebuilt in its own axis order and
        dense strides (backward kernels choose by strides); None when this would not save
        memory (a norm's rows of a few elements, each with a range of its own)."""
        codec = self.codec
        # A unit's rows (a norm's), else the order the tensor lies in memory: a transposed
        # tensor (attention's output) then reads flat without a copy, a slice of a wider one
        # (attention's q, k, v of one qkv projection) with one that closes the gaps, and both
        # decode straight into their own strides.
        stages = codec.stages if isinstance(codec, Pipeline) else (codec,)
        if self.unit is not None:
            permutation = self.unit.permutation
        else:
            permutation = None if any(stage.reads_positions for stage in stages) else memory_order(tensor)
        values = tensor.detach() if permutation is None else tensor.detach().permute(permutation)
        packed = codec.compress(_flat(values))
        if self.unit is not None and packed.nbytes >= tensor.numel() * tensor.element_size():
            return None
        layout = replace(packed.layout, shape=tensor.shape, permutation=permutation,
                         strides=dense_strides_like(tensor))
        return Compressed(codec, Packed(packed.tensors, layout))


def _flat(values: torch.Tensor) -> torch.Tensor:
    """``values.reshape(-1)``; where that copies (gaps to close, or a norm's rows to gather: a
    BatchNorm input's channels) on a CPU outside a traced graph, into
    :func:`~actcomp.host_allocator.empty_for_copying`'s buffer, reused while nothing keeps it (a
    fresh one faults its pages in: 370 against 27 µs for a ViT-S query at batch 4)."""
    if values.is_contiguous() or values.device.type != "cpu" or tracing(values):
        return values.reshape(-1)
    flat = host_allocator.empty_for_copying(values.numel(), values.dtype)
    flat.view(values.shape).copy_(values)
    return flat


def choose_codec(policy: RestPolicy, tensor: torch.Tensor, kind: str, scope: Scope | None) -> CodecChoice | None:
    """The codec whole-model mode applies to ``tensor``, saved by an op of ``kind`` in
    ``scope``, under ``policy``; None to keep it as it is. The op's entries in
    :data:`OP_CODECS` first, then the kind's own choice. Reads the tensor's metadata only (its
    values are the codec's business), so choosing costs nothing per element."""
    if tensor.dtype == torch.bool:
        # Any saved bool tensor is a mask: dropout's on CUDA.
        return CodecChoice(DropoutMask()) if isinstance(policy.dropout, Exact) else None
    choice = getattr(policy, kind)
    if isinstance(choice, KeepAsIs):
        return None
    fallback = _kind_codec(choice, tensor, kind, scope)
    category = "float" if tensor.is_floating_point() else "int"
    for entry in OP_CODECS.get(scope.op if scope is not None else None, ()):
        derivative = entry.codec.kind == "derivative"
        # Derivative codes need a Derivative choice; exact codecs any choice but keeping as is
        # (rest={"activation": None, "fewbit": 3} keeps ReLU outputs as they are).
        wanted = isinstance(choice, Derivative) if derivative else not isinstance(
            choice.fallback if isinstance(choice, Derivative) else choice, KeepAsIs)
        if category not in entry.codec.takes or not wanted:
            continue
        settings = entry.settings(scope, tensor)
        if settings is not None:
            codec = entry.codec(**settings, bits=choice.bits) if derivative else entry.codec(**settings)
            return CodecChoice(codec)
    return fallback


def _kind_codec(choice, tensor: torch.Tensor, kind: str, scope: Scope | None) -> CodecChoice | None:
    """The kind's own choice for a tensor no op codec takes: its lossy pipeline, if any."""
    if isinstance(choice, Derivative):
        choice = choice.fallback
    if not isinstance(choice, Lossy) or not tensor.is_floating_point():
        return None
    if scope is not None and tensor.numel() * 4 < scope.reference:
        return None  # a statistic (a norm's mean and rstd, a log-sum-exp)
    pipeline = choice.pipeline
    if kind == "attention" and scope is not None and scope.op == "sdpa":
        role = attention_role(tensor, scope)
        if role in ("mask", "statistic"):
            return None
        if not choice.attention_floors:
            return CodecChoice(pipeline)
        if role == "query or key":
            return _LOGIT_SAFE if tensor.dtype == torch.float32 and not choice.query_key_as_is else None
        if _under_8_bits(pipeline):
            return _SDPA_VALUES
    elif kind == "attention" and choice.attention_floors and scope is not None and scope.op is None \
            and _under_8_bits(pipeline):
        return _SDPA_VALUES  # an eager attention's query, key or value (below)
    unit = _normalized_unit(tensor, scope) if kind == "normalization" else None
    if unit is not None:
        pipeline = _norm_pipeline(choice, pipeline, tensor, scope)
        grouped = grouped_by_rows(pipeline, unit.row)
        if grouped is None:
            unit = None
        else:
            pipeline = grouped
    return CodecChoice(pipeline, unit)


# Fused attention's backward recomputes the probabilities as exp(q.k / sqrt(d) - lse) against the
# log-sum-exp the forward saved: an error in q or k is multiplied by k or q there, and a trained
# LLM's sink token (keys 100-1000x the rest) turns int8's range-wide steps into logit errors of
# whole units, probabilities that no longer sum to 1 (one step's gradient cosine 0.67 with
# outliers built in; bench_lm_quality.py). A float format errs relative to each element: bf16
# kept it at 0.999. So query and key get bf16 at most.
_LOGIT_SAFE = CodecChoice(parse("bf16"))
# Value and output meet in dS = P * (dO.v - rowsum(dO * out)): on a row that attends to the sink
# almost only, two near-equal sums are subtracted, and int4's errors (7% of a group's range)
# swamp the difference (cosine 0.60; 0.993 with int8). They take the kind's spec, 8 bits at least.
_SDPA_VALUES = CodecChoice(parse("int8"))
# An attention written out (matmul, softmax, matmul: HF's "eager") saves its query, key and value
# inside the attention module (op None here) and its probabilities by softmax. With outliers
# built in, int4 on all of them gave 0.950 (bench_lm_quality.py; floor 0.97); the probabilities
# in int8 alone 0.957, query, key and value in int8 with the probabilities in int4 0.976. So the
# same floor as SDPA's value: 8 bits at least, the probabilities (most of the bytes) the spec.


def _under_8_bits(pipeline: Pipeline) -> bool:
    return any(getattr(stage, "bits", 8) < 8 for stage in pipeline.stages)


class AttentionScope(Scope):
    """An attention op's scope that knows which of its arguments the saved tensor is
    (``role``: ``"query or key"``, ``"mask"``, or None for the others), as the compiled engine
    reads it off the backward graph; the eager engine's :class:`Scope` finds it by storage."""

    __slots__ = ("role",)

    def __init__(self, role: str | None, reference: int | None) -> None:
        super().__init__("attention", op="sdpa", reference=reference)
        self.role = role


def attention_role(tensor: torch.Tensor, scope: Scope) -> str | None:
    """Which of an SDPA call's arguments ``tensor`` is, as far as the codec cares: ``"mask"``
    (kept as it is), ``"statistic"`` (kept as it is), ``"query or key"`` (a float format at most),
    or None (the kind's spec)."""
    if isinstance(scope, AttentionScope):
        return scope.role
    if _is_attention_mask(tensor, scope):
        return "mask"
    if _is_statistic(tensor, scope):
        return "statistic"
    return "query or key" if _is_query_or_key(tensor, scope) else None


def _is_attention_mask(tensor: torch.Tensor, scope: Scope) -> bool:
    """Whether ``tensor`` is the additive mask or bias an SDPA call was given, as its fused
    kernel saves it: CUDA's memory-efficient attention keeps it broadcast to the attention
    weights' shape (an expanded view of the mask, or of a copy padded to aligned rows).

    A mask holds -inf or the dtype's lowest value where attention is off: any finite-range code
    turns it to NaN (the finite flag) or steps of 1e36 over the unmasked logits, and the
    backward, which recomputes the probabilities with it, gave NaN gradients (the H200 zoo run
    of stop 44: gpt2, bert, t5, maxvit; a padded batch of an HF Llama on CPU until stop 53, whose
    boolean mask the CPU kernel saves converted, in its own (batch, 1, query, key) shape). Kept
    as it is, it costs its storage only, mostly the caller's own small tensor. A tensor in that
    shape (or one it broadcasts to) which is neither a view nor the mask's own storage and is on
    autograd's path (the math path's probabilities) is not the mask."""
    mask = argument(scope, 3, "attn_mask", None)
    query, key = argument(scope, 0, "query", None), argument(scope, 1, "key", None)
    if not isinstance(mask, torch.Tensor) or query is None or key is None:
        return False
    shared = storage_key(tensor)
    if shared is not None and shared == storage_key(mask):  # None for a mask with no storage (a subclass)
        return True
    weights_shape = (*query.shape[:-1], key.shape[-2])
    # Broadcast to it, or not yet: the CPU kernel saves a boolean mask converted to -inf and 0
    # in the mask's own shape (one head for all: HF's padding masks are (batch, 1, query, key)).
    shape = tuple(tensor.shape)
    if len(shape) != len(weights_shape) or shape[-2:] != weights_shape[-2:] or any(
            size not in (1, full) for size, full in zip(shape, weights_shape)) or _is_query_or_key(tensor, scope):
        return False
    value = argument(scope, 2, "value", None)
    if isinstance(value, torch.Tensor) and tensor.data_ptr() == value.data_ptr():
        return False
    return view_base(tensor) is not None or tensor.grad_fn is None


def _is_statistic(tensor: torch.Tensor, scope: Scope) -> bool:
    """Whether ``tensor`` is a fused attention's per-row statistic (its log-sum-exp): the
    query's shape less its last two dimensions, then one for the rows. CUDA's memory-efficient
    attention pads it to rows of 32 and writes +inf past the sequence, so on short sequences or
    small heads it outgrows the size test that keeps statistics (a quarter of the largest
    argument), and any finite-range code decoded it to NaN: NaN gradients on gpt2, bert, t5 and
    maxvit in the H100 zoo run of stop 50. The backward recomputes the probabilities from it, so
    it is kept as it is.

    Fewer dimensions alone is not a statistic: SDPA's math path (a CPU call with dropout, as
    BERT's and GPT-2's attention dropout trains) saves its query, key, value and probabilities
    with batch and heads flattened to one dimension, and until stop 64 kept them all as they
    were: BERT-base's attention kept 49-62% of plain's bytes under ``"8bit"``."""
    query = argument(scope, 0, "query", None)
    return (isinstance(query, torch.Tensor) and tensor.dim() == query.dim() - 1
            and tensor.shape[:-1] == query.shape[:-2])


def _is_query_or_key(tensor: torch.Tensor, scope: Scope) -> bool:
    return bool({"query", "key"} & set(sdpa_roles(tensor, scope)))


SDPA_INPUTS = ("query", "key", "value")


def sdpa_inputs(scope: Scope) -> tuple[Any, Any, Any]:
    """An SDPA call's query, key and value, as it was given them."""
    return tuple(argument(scope, index, name, None) for index, name in enumerate(SDPA_INPUTS))


def sdpa_roles(tensor: torch.Tensor, scope: Scope) -> tuple[str, ...]:
    """Which of an SDPA call's inputs ``tensor`` is (all three for ``sdpa(x, x, x)``), by storage and shape."""
    return tuple(role for role, given in zip(SDPA_INPUTS, sdpa_inputs(scope))
                 if isinstance(given, torch.Tensor) and given.data_ptr() == tensor.data_ptr()
                 and given.shape == tensor.shape)


def _hashable(value):
    return tuple(value) if isinstance(value, (list, torch.Size)) else value


def _norm_pipeline(choice: Lossy, pipeline: Pipeline, tensor: torch.Tensor, scope: Scope) -> Pipeline:
    """A norm input's pipeline: the normalization choice's own, or one of its refinements."""
    if choice.token_norms is not None and _normalizes_tokens(scope):
        return choice.token_norms
    if choice.batch_norms_16bit is not None and scope.op == "batch_norm" and tensor.dtype in _16_BITS:
        return choice.batch_norms_16bit
    return pipeline


_16_BITS = (torch.bfloat16, torch.float16)


def _normalizes_tokens(scope: Scope) -> bool:
    """Whether a norm's scope normalizes each token's row (LayerNorm, RMSNorm, a ``...Norm``
    module's own ops), where a trained language model's sink token and outlier channels share
    the rows; batch, group and instance norms normalize channels, which have no such rows."""
    return scope.op in ("layer_norm", "rms_norm", None)


def _normalized_unit(tensor: torch.Tensor, scope: Scope | None) -> Unit | None:
    op = scope.op if scope is not None and scope.op is not None else None
    if scope is None or (op is None and scope.module is None):
        return None
    setting = None
    if op in ("layer_norm", "rms_norm"):
        setting = _hashable(argument(scope, 1, "normalized_shape", None))
    elif op == "group_norm":
        setting = argument(scope, 1, "num_groups", None)
    return normalized_unit(op, tensor.shape, setting)


def frees_memory(tensor: torch.Tensor) -> bool:
    """Whether compressing ``tensor`` can free memory: not for an expanded (broadcast) view, whose
    compressed form at full size can outweigh its small storage. A small slice of a large
    storage (a head reading ``x[:, 0]``) does qualify: kept as is, it would pin the storage."""
    strides = tensor.stride()
    # No zero stride (the usual case) answers without looking at the sizes.
    return tensor.numel() > 0 and (0 not in strides or all(stride != 0 or size == 1
                                                           for size, stride in zip(tensor.shape, strides)))


_REGROUPED: dict[tuple[Pipeline, int], Pipeline] = {}


def grouped_by_rows(pipeline: Pipeline, row: int) -> Pipeline | None:
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


# A backward called inside a torch.compile'd step runs these unpack calls with dynamo's frame
# hook on: it would compile _unpack once per holder type, closure and size (recompiling until
# its limit, 110 frames for a resnet18 step) for tensors that are mostly bit operations.
