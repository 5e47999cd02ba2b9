"""Layers with a forward of their own: run it unchanged, compress the op that uses the weight.

timm's ``StdConv2d`` standardises its weight, ``Conv2dSame`` pads TF-style, QAT layers fake-
quantize: their ``forward`` decides what the convolution sees. Replacing it with the plain
layer's forward trains a different model. Instead the layer's own forward runs as written under a
:class:`~torch.overrides.TorchFunctionMode` that catches the ``linear`` / ``conv{1,2,3}d`` calls
whose weight is the layer's weight or computed from it (weight standardisation, fake quant) and
runs them through the compressed Function: same output, same input gradient, only the tensor the
op saves is compressed. Other calls (a child module's, a ``linear`` on another weight) pass through.

>>> import torch, actcomp
>>> class Doubled(torch.nn.Linear):
...     def forward(self, x):
...         return torch.nn.functional.linear(x, 2 * self.weight, self.bias)
>>> layer = Doubled(4, 3)
>>> _ = actcomp.to_compressed(layer, "mink0.5", first_layer=None)
>>> x = torch.randn(5, 4)
>>> torch.equal(layer(x), torch.nn.functional.linear(x, 2 * layer.weight, layer.bias))
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from actcomp.layers.ops import ConvOp, LinearOp, conv_op

_CONV_FUNCTIONS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
# How far back through the autograd graph a weight is traced to the parameter (standardise,
# reshape, cast, fake-quant and scale are a handful of nodes).
_MAX_WEIGHT_NODES = 64


def derives_from(tensor: torch.Tensor, parameter: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``parameter`` or was computed from it (searched in the autograd graph).

    >>> w = torch.nn.Parameter(torch.randn(3))
    >>> derives_from((w * 2).view(3, 1), w), derives_from(torch.randn(3), w)
    (True, False)
    """
    if tensor is parameter:
        return True
    pending, seen = [tensor.grad_fn], set[object]()
    while pending and len(seen) < _MAX_WEIGHT_NODES:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "variable", None) is parameter:
            return True
        pending.extend(next_node for next_node, _ in node.next_functions)
    return False


class OwnForwardMode(TorchFunctionMode):
    """Routes the weight's ``linear``/``conv`` calls inside ``layer.forward`` to ``apply``.

    ``apply(op, x, weight, bias)`` runs the compressed op; ``calls`` counts the routed calls.
    """

    def __init__(self, layer: torch.nn.Module, apply):
        super().__init__()
        self.layer, self.apply, self.calls = layer, apply, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op_and_args = self._match(func, args, kwargs)
        if op_and_args is None:
            return func(*args, **kwargs)
        self.calls += 1
        return self.apply(*op_and_args)

    def _match(self, func, args, kwargs):
        if func is F.linear:
            values = dict(zip(("input", "weight", "bias"), args), **kwargs)
            op = LinearOp()
        elif func in _CONV_FUNCTIONS:
            values = {**_CONV_DEFAULTS, **dict(zip(_CONV_ARGS, args)), **kwargs}
        else:
            return None
        weight = values.get("weight")
        if not isinstance(weight, torch.Tensor) or not derives_from(weight, self.layer.weight):
            return None
        if func in _CONV_FUNCTIONS:
            kernel_size = weight.shape[2:]
            op: ConvOp | LinearOp = conv_op(kernel_size, values["stride"], values["padding"], values["dilation"],
                                            values["groups"])
        return op, values["input"], weight, values.get("bias")
