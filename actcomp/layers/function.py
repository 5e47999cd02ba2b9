"""The one autograd Function: exact forward, compressed input saved, exact input gradient.

``compressed_apply(op, pipeline, x, weight, bias, compute_dtype)`` casts ``x`` to
``compute_dtype`` (autocast's dtype, or None for no cast), runs ``op.forward`` on it,
keeps only ``pipeline.compress(x)`` (through ``ctx.save_for_backward``, so saved-tensor
hooks, checkpointing and ``retain_graph`` see every byte), and in backward decompresses it
for the weight gradient only. Input and bias gradients never read the input, so they are
exact whatever the pipeline.

The decompressed input is laid out as ``x`` was: the same strides where ``x`` is dense,
broadcast (stride 0) where ``x`` is, and dense in ``x``'s axis order where ``x`` has gaps (a
slice). Only the broadcast values are compressed, once each. Backward kernels choose their
algorithm from the layout, so with a lossless pipeline every gradient is bit-identical to
plain autograd's (see :mod:`actcomp.layers.ops`).

>>> import torch, actcomp
>>> from actcomp.layers.ops import LinearOp
>>> x = torch.randn(8, 16, requires_grad=True)
>>> w = torch.randn(4, 16, requires_grad=True)
>>> y = compressed_apply(LinearOp(), actcomp.parse("mink0.9"), x, w, None)
>>> torch.equal(y, x @ w.t())
True
>>> y.sum().backward()
>>> torch.equal(x.grad, torch.ones(8, 4) @ w)
True
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

from actcomp.core.chain import pack
from actcomp.core.packed import PackedLayout
from actcomp.core.pipeline import Packed, Pipeline
from actcomp.errors import ActcompError, warn_once
from actcomp.graph.saved_tensors import (
    TensorCache,
    refuse_double_backward,
    saves_dropped_by_checkpoint,
    saving_compressed_layer,
    unseen_by_scopes,
)
from actcomp.kernels.layouts import is_subclass_tensor, unbroadcast, with_layout_of
from actcomp.layers.ops import Op
from actcomp.layers.weight_gradients import WeightGradientCall, notify, watched

# Layers that read one tensor with one pipeline (a ResNet block input read by conv1 and the
# downsample conv; BERT's query, key and value projections) share one compressed copy of the
# (uncast) input, held only while that tensor lives unmodified.
_SHARED = TensorCache()


def _compress_once(pipeline: Pipeline, uncast: torch.Tensor, x: torch.Tensor, channel_dim: int | None) -> Packed:
    """``pipeline.compress(x)``, reusing the packed copy made for the same input and spec."""
    if any(stage.draws_global_random for stage in pipeline.stages) or any(s is not None for s in pipeline.states):
        return pipeline.compress(x, channel_dim=channel_dim)
    key = (pipeline.spec, x.dtype, channel_dim)
    packed = _SHARED.get(uncast, key)
    if packed is None:
        packed = pipeline.compress(x, channel_dim=channel_dim)
        _SHARED.put(uncast, key, packed)
    return packed


def _kept_input(pipeline: Pipeline, uncast: torch.Tensor, x: torch.Tensor,
                channel_dim: int | None) -> tuple[PackedLayout, tuple[torch.Tensor, ...]]:
    """What the layer saves of its input: ``pipeline.compress(x)``'s layout and tensors, or,
    where non-reentrant checkpoint drops what is saved now and recomputes it in backward, the
    layout and memoryless stand-ins of the tensors a compression of this input made before.

    Checkpoint compares each recomputed tensor's shape, dtype and device with what the forward
    saved, and the backward decodes the recomputed tensors with the layout kept here: the
    stand-ins carry the one, and only pipelines whose every stage compiles take them (a compiled
    graph needs sizes that are a function of the input's shape alone: ``mink0.9:rice=1``'s
    Rice-coded positions, whose size depends on the values, compress twice as before). Such a
    pipeline whose layout changed from one compression to the next raises rather than let a
    backward decode with the wrong one. Without the stand-ins a checkpointed block compressed
    its Linear inputs twice (ViT-S: half again the kernel calls)."""
    x = unbroadcast(x)
    if not all(stage.compiles() for stage in pipeline.stages):
        with unseen_by_scopes():
            packed = _compress_once(pipeline, uncast, x, channel_dim)
        return packed.layout, packed.tensors
    key = (pipeline.spec, x.shape, x.stride(), x.dtype, x.device, channel_dim)
    known = _LAYOUTS.get(key)
    if known is not None and saves_dropped_by_checkpoint():
        layout, metadata = known
        return layout, tuple(torch.empty((), dtype=dtype, device=x.device).expand(shape) for shape, dtype in metadata)
    with unseen_by_scopes():  # the codec's operations are not the model's
        packed = _compress_once(pipeline, uncast, x, channel_dim)
    if known is not None and known[0] != packed.layout:
        raise ActcompError(f"the packed layout of {pipeline.spec!r} for a {tuple(x.shape)} input changed from one "
                           f"compression to the next ({known[0]} then {packed.layout}); a checkpointed block's "
                           "backward would decode its recomputed codes with the first")
    if known is None:
        if len(_LAYOUTS) >= _META_LIKE_LIMIT:
            _LAYOUTS.clear()  # shapes that vary without end (variable sequence lengths)
        _LAYOUTS[key] = (packed.layout, tuple((t.shape, t.dtype) for t in packed.tensors))
    return packed.layout, packed.tensors


# The layout and the kept tensors' shapes and dtypes of each compression made so far, by
# (spec, input shape, strides, dtype, device, channel axis): what a checkpointed forward saves.
_LAYOUTS: dict[tuple, tuple[PackedLayout, tuple[tuple[torch.Size, torch.dtype], ...]]] = {}


# Meta tensors by (shape, strides, dtype): a layer sees the same few every step, and making one
# is a dispatcher call. They hold no memory and are only read (shapes, strides, reshapes).
_META_LIKE: dict[tuple, torch.Tensor] = {}
_META_LIKE_LIMIT = 4096


def _meta_like(x: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``x``'s shape, strides and dtype (shared: never write to it)."""
    if torch.compiler.is_compiling():
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    key = (x.shape, x.stride(), x.dtype)
    like = _META_LIKE.get(key)
    if like is None:
        if len(_META_LIKE) >= _META_LIKE_LIMIT:
            _META_LIKE.clear()  # shapes that vary without end (variable sequence lengths)
        like = _META_LIKE[key] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return like


class _Context(FunctionCtx):
    """What the Function keeps on its autograd context (for type checking: autograd makes the
    context, this class only names its attributes)."""

    needs_input_grad: tuple[bool, ...]
    saved_tensors: tuple[torch.Tensor, ...]
    op: Op
    pipeline: Pipeline | None
    x_dtype: torch.dtype
    compute_dtype: torch.dtype | None
    where: str
    # The layer's name for weight-gradient watchers; None where the weight is not the layer's own.
    name: str | None
    x_like: torch.Tensor
    # The input's packed layout; None when no packed copy is kept (no weight gradient, or recast).
    layout: PackedLayout | None
    # Whether the uncast input itself is kept, to be cast again in backward.
    recast: bool


class CompressedInputFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Context, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, op: Op,
                pipeline: Pipeline | None, compute_dtype: torch.dtype | None, where: str,
                name: str | None) -> torch.Tensor:
        ctx.op, ctx.pipeline, ctx.x_dtype, ctx.where, ctx.name = op, pipeline, x.dtype, where, name
        ctx.compute_dtype = compute_dtype
        uncast = x
        # The cast happens in here, not before, so the input gradient is cast back before the
        # op's own padding backward runs, exactly as in plain autocast.
        if compute_dtype is not None:
            x = x.to(compute_dtype)
        # The input's shape and strides, without its memory: the op's backward follows the
        # path plain autograd takes for this layout.
        ctx.x_like = _meta_like(x)
        out = op.forward(x, weight, bias)
        needs_weight = ctx.needs_input_grad[1]
        ctx.layout, ctx.recast = None, False
        # The weight is a parameter (or autocast's cached cast of it): saving it costs nothing
        # extra, and convolution backward needs it even for the weight gradient alone.
        saved = [weight]
        if needs_weight and is_subclass_tensor(uncast):
            # A tensor subclass (a DTensor activation under tensor parallelism): the codecs read a
            # plain tensor's memory, so it is kept as it is, and its layer computes exactly.
            warn_once("subclass input", f"actcomp: layer {where} reads a {type(uncast).__name__}; tensor "
                      "subclasses (DTensor activations under tensor parallelism) are kept as they are, not "
                      "compressed", stacklevel=4)
            ctx.recast = True
            saved.append(uncast)
        elif needs_weight and pipeline is None:
            # Recast mode: ``uncast`` is data the caller keeps anyway (the model's input); keeping
            # it costs nothing, and casting it again in backward gives autocast's copy exactly.
            ctx.recast = True
            saved.append(uncast)
        elif needs_weight and pipeline is not None and torch.compiler.is_compiling():
            # The finite flag reads nothing back: the compiled layer keeps eager's packed form.
            packed = pack(pipeline.stages, pipeline.spec, unbroadcast(x), channel_dim=op.channel_dim)
            ctx.layout = packed.layout
            saved.extend(packed.tensors)
        elif needs_weight and pipeline is not None:
            ctx.layout, kept = _kept_input(pipeline, uncast, x, op.channel_dim)
            saved.extend(kept)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: _Context, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        refuse_double_backward("a compressed layer", "its weight gradient comes from a lossy copy of the input",
                               "Convert the model back with actcomp.from_compressed(model), or leave this layer out "
                               "of to_compressed")
        needs = ctx.needs_input_grad[:3]
        weight, *packed_tensors = ctx.saved_tensors
        x = None
        if ctx.recast:
            x = packed_tensors[0] if ctx.compute_dtype is None else packed_tensors[0].to(ctx.compute_dtype)
        elif ctx.layout is not None and ctx.pipeline is not None:
            try:
                x = ctx.pipeline.decompress(Packed(tuple(packed_tensors), ctx.layout))
            except ActcompError as error:
                raise ActcompError(f"in the backward of layer {ctx.where}: {error}") from None
            x = with_layout_of(x, ctx.x_like)
        grad_input, grad_weight, grad_bias = ctx.op.backward(grad, x, weight, ctx.x_like, ctx.x_dtype, needs)
        if watched() and x is not None and grad_weight is not None:
            notify(WeightGradientCall(ctx.name, ctx.op, grad, x, weight, ctx.x_like, ctx.x_dtype, grad_weight))
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def compressed_apply(op: Op, pipeline: Pipeline | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     compute_dtype: torch.dtype | None = None, where: str = "(unnamed)", name: str | None = None):
    """Apply ``op`` to ``(x, weight, bias)`` keeping only a compressed copy of ``x``.

    ``pipeline=None`` keeps ``x`` itself, before the cast to ``compute_dtype`` (for data the
    caller keeps anyway: autocast's low-precision copy of it is then never stored).

    ``where`` names the layer in errors raised during backward; ``name`` is the layer's name for
    weight-gradient watchers (:mod:`actcomp.layers.weight_gradients`), given only where ``weight``
    is the layer's own.
    """
    # What the Function saves is already its compressed form: whole-model hooks leave it alone.
    with saving_compressed_layer():
        return CompressedInputFunction.apply(x, weight, bias, op, pipeline, compute_dtype, where, name)
