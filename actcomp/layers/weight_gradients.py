"""Watching converted layers' weight gradients as their backward computes them.

A Linear/Conv layer's input serves only its own weight gradient (DropIT), so what a codec does
to training through that layer is the weight gradient computed from the codec's round trip of
the input, minus the exact one. A watcher sees, for every converted layer's backward, the
layer's output gradient, its (decompressed) input and its op, and can compute that for any
number of codecs from one step: :func:`actcomp.plan_budget` measures every layer under every
rung of its ladder so, where it took one step per rung.

Only calls whose weight is the layer's own (or autocast's cast of it) are named: a layer with
its own forward (timm's ``StdConv2d``) hands the op a weight computed from its parameter, whose
gradient is not the parameter's.

>>> import torch, actcomp
>>> from actcomp.layers.function import compressed_apply
>>> from actcomp.layers.ops import LinearOp
>>> seen = []
>>> x, w = torch.randn(8, 16), torch.randn(4, 16, requires_grad=True)
>>> with watching_weight_gradients(lambda call: seen.append((call.name, call.grad_weight.shape))):
...     compressed_apply(LinearOp(), actcomp.parse("mink0"), x, w, None, name="fc").sum().backward()
>>> seen
[('fc', torch.Size([4, 16]))]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from actcomp.core.pipeline import Pipeline
from actcomp.kernels.layouts import unbroadcast, with_layout_of
from actcomp.layers.ops import Op


@dataclass(frozen=True)
class WeightGradientCall:
    """One converted layer's weight gradient, with what its backward computed it from."""

    name: str | None  # the layer's qualified name, None where the weight is not the layer's own
    op: Op
    grad: torch.Tensor  # the layer's output gradient
    x: torch.Tensor  # the input as the backward read it: decompressed, laid out as the forward's
    weight: torch.Tensor
    x_like: torch.Tensor  # a meta tensor with the forward input's shape, strides and dtype
    x_dtype: torch.dtype
    grad_weight: torch.Tensor

    def weight_gradient(self, x: torch.Tensor) -> torch.Tensor:
        """The weight gradient the layer computes from the input ``x`` instead (laid out as
        ``self.x``)."""
        return self.op.backward(self.grad, x, self.weight, self.x_like, self.x_dtype, (False, True, False))[1]

    def weight_gradient_through(self, pipeline: Pipeline) -> torch.Tensor:
        """The weight gradient the layer computes had it kept its input through ``pipeline``:
        compressed as the layer's forward compresses it, decompressed as its backward does."""
        packed = pipeline.compress(unbroadcast(self.x), channel_dim=self.op.channel_dim)
        return self.weight_gradient(with_layout_of(pipeline.decompress(packed), self.x_like))


_WATCHERS: list[Callable[[WeightGradientCall], None]] = []


@contextlib.contextmanager
def watching_weight_gradients(watcher: Callable[[WeightGradientCall], None]) -> Iterator[None]:
    """Call ``watcher`` with every converted layer's weight gradient computed inside."""
    _WATCHERS.append(watcher)
    try:
        yield
    finally:
        _WATCHERS.remove(watcher)


def watched() -> bool:
    """Whether any watcher is active (the backward's one check when none is)."""
    return bool(_WATCHERS)


def notify(call: WeightGradientCall) -> None:
    for watcher in tuple(_WATCHERS):
        watcher(call)
