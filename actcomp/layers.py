"""The thin module layer: a compressed twin of Linear / Conv1d/2d/3d / GPT-2 Conv1D.

Conversion swaps a module's class for a subclass of its own class that adds only a
``forward``: parameters stay the same objects, state_dict keys and values are unchanged,
and ``isinstance(m, nn.Linear)`` still holds. The subclass is created once per base class;
pickling records the base class, so a pickled model loads wherever actcomp is importable.

>>> import torch, actcomp
>>> layer = torch.nn.Linear(4, 2)
>>> compress_layer(layer, actcomp.parse("mink0.5"))
>>> type(layer).__name__, isinstance(layer, torch.nn.Linear)
('CompressedLinear', True)
>>> layer
CompressedLinear(in_features=4, out_features=2, bias=True, compress='mink0.5')
"""

from __future__ import annotations

import torch
from torch import nn

from actcomp.autograd import compressed_apply
from actcomp.ops import ConvOp, GPT2Conv1DOp, LinearOp
from actcomp.pipeline import Pipeline

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


def _conv_op(module: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> ConvOp:
    """Mirror ``_ConvNd._conv_forward``: non-zero padding modes and odd 'same' pad first."""
    dims = len(module.kernel_size)
    padding, pre_pad, pre_pad_mode = module.padding, (), "constant"
    if module.padding_mode != "zeros":
        pre_pad, pre_pad_mode = tuple(module._reversed_padding_repeated_twice), module.padding_mode
        padding = (0,) * dims
    elif padding == "valid":
        padding = (0,) * dims
    elif padding == "same":
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        # As torch does for 'same': pad the odd extra element on the right, then symmetrically.
        if any(total % 2 for total in totals):
            pre_pad = tuple(side for total in reversed(totals) for side in (0, total % 2))
        padding = tuple(total // 2 for total in totals)
    stride, dilation = tuple(module.stride), tuple(module.dilation)
    return ConvOp(stride, tuple(padding), dilation, module.groups, pre_pad, pre_pad_mode)


class CompressedLayer:
    """Mixin placed in front of the original class; see :func:`compress_layer`."""

    actcomp_pipeline: Pipeline
    actcomp_base: type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Eval and no_grad run the plain op: nothing is saved, so there is no overhead to pay.
        # A frozen weight still goes through the Function when the input needs a gradient:
        # plain convolution would keep the whole input, the Function keeps none of it.
        # Meta tensors (deferred init, shape inference) hold no values to compress: the plain op
        # gives the same shapes and saves nothing of size.
        if x.is_meta or not (self.training and torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)):
            return super().forward(x)  # type: ignore[misc]
        return _compressed_forward(self, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compress={self.actcomp_pipeline.spec!r}"  # type: ignore[misc]

    def __reduce_ex__(self, protocol):
        # Pickle as the plain base class plus state; unpickling re-applies the subclass.
        return _rebuild_compressed, (type(self).actcomp_base,), self.__getstate__()


def _skip_forward_frame_under_compile() -> None:
    # After the graph break at _compressed_forward, torch.compile would otherwise compile
    # CompressedLayer.forward as a frame of its own, guarded on each layer's weight shape,
    # and hit its recompile limit on any real model. Skipping that frame keeps it eager while
    # still letting dynamo inline it (eval mode compiles to one graph). Private API: if it
    # moves, compile still works, with recompile warnings.
    try:
        from torch._dynamo.eval_frame import skip_code

        skip_code(CompressedLayer.forward.__code__)
    except (ImportError, AttributeError):
        pass


_skip_forward_frame_under_compile()


@torch.compiler.disable
def _compressed_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Compression has data-dependent sizes (how many values a sparsifier keeps), so under
    # torch.compile this is one graph break per compressed layer; the rest still compiles.
    weight, bias = module.weight, module.bias
    if isinstance(module, _CONVS):
        if x.dim() == len(module.kernel_size) + 1:
            # Unbatched input, which plain convolutions accept: add the batch axis around it.
            return _compressed_forward(module, x.unsqueeze(0)).squeeze(0)
        op = _conv_op(module)
    elif isinstance(module, nn.Linear):
        op = LinearOp()
    else:
        op = GPT2Conv1DOp()
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # Do what autocast does for linear/conv (cast all floating inputs to its dtype; the
        # input is cast inside the Function), with autocast off so nothing is cast twice.
        dtype = torch.get_autocast_dtype(device_type)
        weight = weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return compressed_apply(op, module.actcomp_pipeline, x, weight, bias, dtype)
    return compressed_apply(op, module.actcomp_pipeline, x, weight, bias)


_SUBCLASSES: dict[type, type] = {}


def compressed_class(base: type) -> type:
    """The (cached) compressed subclass of ``base``."""
    if base not in _SUBCLASSES:
        namespace = {"__module__": __name__, "actcomp_base": base}
        _SUBCLASSES[base] = type(f"Compressed{base.__name__}", (CompressedLayer, base), namespace)
    return _SUBCLASSES[base]


def compress_layer(module: nn.Module, pipeline: Pipeline) -> None:
    """Make ``module`` (a supported layer) save ``pipeline``-compressed inputs, in place.

    A module that is already compressed just gets the new pipeline.
    """
    if not isinstance(module, CompressedLayer):
        module.__class__ = compressed_class(type(module))
    module.actcomp_pipeline = pipeline


def uncompress_layer(module: nn.Module) -> None:
    """Undo :func:`compress_layer`."""
    if isinstance(module, CompressedLayer):
        module.__class__ = type(module).actcomp_base
        del module.actcomp_pipeline


def _rebuild_compressed(base: type) -> nn.Module:
    module = base.__new__(base)
    module.__class__ = compressed_class(base)
    return module
