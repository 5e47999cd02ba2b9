"""The thin module layer: a compressed twin of Linear / Conv1d/2d/3d / GPT-2 Conv1D.

Conversion swaps a module's class for a subclass of its own class that adds only a
``forward`` (:mod:`actcomp.graph.module_surgery`, shared with whole-model mode): parameters stay the
same objects, state_dict keys and values are unchanged, and ``isinstance(m, nn.Linear)`` still
holds.

>>> import torch, actcomp
>>> layer = torch.nn.Linear(4, 2)
>>> compress_layer(layer, actcomp.parse("mink0.5"))
>>> type(layer).__name__, isinstance(layer, torch.nn.Linear)
('CompressedLinear', True)
>>> layer
CompressedLinear(in_features=4, out_features=2, bias=True, compress='mink0.5')
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from actcomp.core.pipeline import Pipeline
from actcomp.errors import ActcompError, warn_once
from actcomp.graph.model_inputs import is_model_input
from actcomp.graph.module_surgery import SwappedModule, rebuild_swapped, swap_class, unswap_class
from actcomp.graph.not_compiled import LAYER_FALLBACK, not_compiled, warn_if_leaving_graph
from actcomp.graph.saved_tensors import call_unseen
from actcomp.kernels.layouts import is_subclass_tensor
from actcomp.layers.function import compressed_apply
from actcomp.layers.ops import ConvOp, GPT2Conv1DOp, LinearOp, Op, conv_op
from actcomp.layers.own_forward import OwnForwardMode
from actcomp.torch_compat import conv_padding_for_mode, skip_frame_but_inline

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_gpt2_conv1d(module: nn.Module) -> bool:
    """Duck-typed check for ``transformers.pytorch_utils.Conv1D`` (no transformers import)."""
    weight = getattr(module, "weight", None)
    return (
        # By name through subclasses: actcomp's CompressedConv1D, FSDP2's FSDPConv1D.
        any(cls.__name__ == "Conv1D" for cls in type(module).__mro__)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[1] == getattr(module, "nf", None)
    )


def is_supported(module: nn.Module) -> bool:
    """Whether :func:`compress_layer` can convert ``module``."""
    return isinstance(module, (nn.Linear, *_CONVS)) or is_gpt2_conv1d(module)


def _has_own_forward(base: type[nn.Module]) -> bool:
    """Whether ``base`` overrides the forward of the layer it derives from (timm's
    ``StdConv2d``, ``Conv2dSame``, QAT layers, a user's subclass)."""
    for plain in (nn.Linear, *_CONVS):
        if issubclass(base, plain):
            return base.forward is not plain.forward
    # GPT-2's Conv1D (found by name): its forward is the one GPT2Conv1DOp reproduces.
    conv1d = next(cls for cls in base.__mro__ if cls.__name__ == "Conv1D")
    return base.forward is not conv1d.forward


class InGraphLinear:
    """The pipeline ``compress_in_graph``'s hooks give a Linear layer's input while a converted
    whole-model forward compiles under them, or None. A converted ``nn.Linear`` of that pipeline
    then runs its plain op and leaves its input to the hooks, which code it the same way: the
    compiled partitioner then sees the input itself, and where it rebuilds it in backward (a
    norm's or GELU's output) the weight gradient reads the rebuilt value, not a second code of
    it (``torch.compile(to_compressed(...))`` keeps what ``compress_in_graph`` keeps)."""

    spec: str | None = None


IN_GRAPH_LINEAR = InGraphLinear()


def traces_into_graphs(module: nn.Module) -> bool:
    """Whether ``module`` is a converted layer whose compressed forward compiles into graphs."""
    return isinstance(module, CompressedLayer) and _traces(module)


class CompressedLayer(SwappedModule):
    """Mixin placed in front of the original class; see :func:`compress_layer`."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    actcomp_pipeline: Pipeline
    actcomp_own_forward: bool
    # Set by to_compressed: the qualified name (for errors) and whether a call that receives
    # the model's own input runs plain (first_layer="auto").
    actcomp_name: str = ""
    actcomp_plain_on_model_input: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Eval and no_grad run the plain op: nothing is saved, so there is no overhead to pay.
        # A frozen weight still goes through the Function when the input needs a gradient:
        # plain convolution would keep the whole input, the Function keeps none of it.
        # Meta tensors (deferred init, shape inference) hold no values to compress: the plain op
        # gives the same shapes and saves nothing of size.
        if x.is_meta or not (self.training and torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)):
            return super().forward(x)
        if torch.compiler.is_compiling() and _traces(self):
            if isinstance(self, nn.Linear) and IN_GRAPH_LINEAR.spec == self.actcomp_pipeline.spec:
                return super().forward(x)  # the hooks code its input, with this pipeline
            return _forward(self, x, _reads_data_under_compile(self, x))
        return _compressed_forward(self, x, _data_under_compile(self, x))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compress={self.actcomp_pipeline.spec!r}"

    @classmethod
    def swapped_attributes(cls, base: type[nn.Module]) -> dict[str, bool]:
        return {"actcomp_own_forward": _has_own_forward(base)}


# After a graph break at _compressed_forward, torch.compile would otherwise compile
# CompressedLayer.forward as a frame of its own, guarded on each layer's weight shape, and hit
# its recompile limit on any real model. Skipping that frame keeps it eager while still letting
# dynamo inline it (eval mode, and codecs that trace, compile into one graph).
skip_frame_but_inline(CompressedLayer.forward.__code__)


def _reads_data_under_compile(module: CompressedLayer, x: torch.Tensor) -> bool:
    # Storage addresses cannot be read while dynamo traces, and the model-input hook records
    # none there: the caller's data is an input with no autograd history (a ViT's image).
    return module.actcomp_plain_on_model_input and not x.requires_grad


def _data_under_compile(module: CompressedLayer, x: torch.Tensor) -> bool | None:
    """Whether ``x`` is the caller's data, where a compiled caller runs; None elsewhere. Called
    from the forward's frame, which runs eagerly under a compiled caller (see above): dynamo
    then compiles this function as a frame of its own, and says once that the layer left the graph."""
    if not torch.compiler.is_compiling():
        return None
    warn_if_leaving_graph(LAYER_FALLBACK)
    return _reads_data_under_compile(module, x)


def _traces(module: CompressedLayer) -> bool:
    """Whether ``module``'s compressed forward can be traced into a compiled graph: stages that
    compile (``int8``, ``fp8``, ``mink0.9+int8``; not Rice-coded positions, whose size depends on
    the data, nor running state or global random draws) and the layer's plain forward (an own
    forward runs under a torch-function mode)."""
    return not module.actcomp_own_forward and all(stage.compiles() for stage in module.actcomp_pipeline.stages)


def _forward(module: CompressedLayer, x: torch.Tensor, on_model_input: bool) -> torch.Tensor:
    """The training forward; ``on_model_input``: ``x`` is the caller's data and the layer runs
    plain on it (``first_layer="auto"``)."""
    pipeline: Pipeline | None = module.actcomp_pipeline
    if on_model_input:
        if x.requires_grad or not autocast_casts(x):
            return super(CompressedLayer, module).forward(x)
        # Plain autocast would keep its low-precision copy of the caller's data; keep the data
        # itself (the caller does anyway) and cast it again in backward: exact, and no copy kept.
        pipeline = None
    if module.actcomp_own_forward:
        return _own_forward(module, x, pipeline)
    op: Op
    if isinstance(module, _CONVS):
        op = conv_op(module.kernel_size, module.stride, module.padding, module.dilation, module.groups,
                     module.padding_mode, conv_padding_for_mode(module))
    elif isinstance(module, nn.Linear):
        op = LinearOp()
    else:
        op = GPT2Conv1DOp()
    return _apply(module, op, x, module.weight, module.bias, pipeline)


@not_compiled
def _compressed_forward(module: CompressedLayer, x: torch.Tensor, on_model_input: bool | None) -> torch.Tensor:
    """:func:`_forward` run eagerly: always outside torch.compile, and under it where the codec's
    sizes depend on the data (Rice-coded positions): one graph break per such layer, the rest
    still compiles. ``on_model_input=None``: the model-input registry says."""
    bias = module.bias
    if module.actcomp_own_forward or is_subclass_tensor(x) or is_subclass_tensor(module.weight) \
            or (bias is not None and is_subclass_tensor(bias)):
        # Its own forward pushes a torch-function mode; a subclass has a __torch_function__:
        # both need the torch calls dispatched as they are.
        return _eager_forward(module, x, on_model_input)
    # Whole-model mode's scope tracking would see every torch call in here, the layer's business.
    return call_unseen(_eager_forward, module, x, on_model_input)


def _eager_forward(module: CompressedLayer, x: torch.Tensor, on_model_input: bool | None) -> torch.Tensor:
    if on_model_input is None:
        on_model_input = module.actcomp_plain_on_model_input and is_model_input(x)
    return _forward(module, x, on_model_input)


def autocast_casts(x: torch.Tensor) -> bool:
    """Whether autocast is on for ``x``'s device and would cast ``x`` for a linear/conv."""
    device_type = x.device.type
    return (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
            and x.is_floating_point() and x.dtype != torch.get_autocast_dtype(device_type))


def _own_forward(module: CompressedLayer, x: torch.Tensor, pipeline: Pipeline | None) -> torch.Tensor:
    """Run the layer's own forward; its weight's linear/conv calls go through :func:`_apply`."""
    mode = OwnForwardMode(module, lambda op, x, weight, bias: _apply(module, op, x, weight, bias, pipeline))
    with mode:
        out = super(CompressedLayer, module).forward(x)
    # A frozen weight hides where it came from (no autograd graph), so only the weight itself is
    # matched then; nothing is lost by not compressing: correctness never depends on it.
    if mode.calls == 0 and module.weight.requires_grad:
        warn_once(
            ("uncompressed own forward", type(module), module.actcomp_name),
            f"layer {_describe(module)} has its own forward, and it made no linear/conv call on a weight "
            "computed from the layer's (trainable) weight: it ran unchanged and nothing was compressed",
            stacklevel=3,
        )
    return out


def _describe(module: CompressedLayer) -> str:
    kind = type(module).actcomp_base.__qualname__
    return f"{module.actcomp_name!r} ({kind})" if module.actcomp_name else f"of type {kind}"


def _apply(module: CompressedLayer, op: Op, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           pipeline: Pipeline | None) -> torch.Tensor:
    """Run ``op`` through the compressed Function, as autocast would run it; errors name the layer.
    ``pipeline=None`` keeps ``x`` itself (the caller's data, under autocast)."""
    if isinstance(op, ConvOp) and x.dim() == len(op.stride) + 1:
        # Unbatched input, which plain convolutions accept: add the batch axis around it.
        return _apply(module, op, x.unsqueeze(0), weight, bias, pipeline).squeeze(0)
    device_type, where = x.device.type, _describe(module)
    # Weight-gradient watchers see the layer by name where the weight is its own parameter.
    name = None if module.actcomp_own_forward else module.actcomp_name
    try:
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            # Do what autocast does for linear/conv (cast all floating inputs to its dtype; the
            # input is cast inside the Function), with autocast off so nothing is cast twice.
            dtype = torch.get_autocast_dtype(device_type)
            weight = weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
            with torch.autocast(device_type, enabled=False):
                return compressed_apply(op, pipeline, x, weight, bias, dtype, where=where, name=name)
        return compressed_apply(op, pipeline, x, weight, bias, where=where, name=name)
    except ActcompError as error:
        raise ActcompError(f"in layer {where}, input of shape {tuple(x.shape)} {x.dtype}: {error}") from None


def compress_layer(module: nn.Module, pipeline: Pipeline) -> None:
    """Make ``module`` (a supported layer) save ``pipeline``-compressed inputs, in place.

    A module that is already compressed just gets the new pipeline.
    """
    swap_class(module, CompressedLayer).actcomp_pipeline = pipeline


def uncompress_layer(module: nn.Module) -> None:
    """Undo :func:`compress_layer`."""
    unswap_class(module, CompressedLayer, ("actcomp_pipeline", "actcomp_name", "actcomp_plain_on_model_input"))


# Pickles made before the class swap was shared name this (with the base class as argument).
_rebuild_compressed = functools.partial(rebuild_swapped, CompressedLayer)
