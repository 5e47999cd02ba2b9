"""The one autograd Function: exact forward, compressed input saved, exact input gradient.

``compressed_apply(op, pipeline, x, weight, bias)`` runs ``op.forward`` on the full input,
keeps only ``pipeline.compress(x)`` (through ``ctx.save_for_backward``, so saved-tensor
hooks, checkpointing and ``retain_graph`` see every byte), and in backward decompresses it
for the weight gradient only. Input and bias gradients never read the input, so they are
exact whatever the pipeline.

>>> import torch, actcomp
>>> from actcomp.ops import LinearOp
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

from actcomp.errors import ActcompError
from actcomp.pipeline import Packed, Pipeline


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() in (4, 5) and not x.is_contiguous():
        channels_last = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        if x.is_contiguous(memory_format=channels_last):
            return channels_last
    return torch.contiguous_format


class CompressedInputFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x, weight, bias, op, pipeline: Pipeline):  # type: ignore[override]
        out = op.forward(x, weight, bias)
        needs_weight = ctx.needs_input_grad[1]
        ctx.op, ctx.pipeline, ctx.x_shape = op, pipeline, x.shape
        ctx.layout = None
        # The weight is a parameter (or autocast's cached cast of it): saving it costs nothing
        # extra, and convolution backward needs it even for the weight gradient alone.
        saved = [weight]
        if needs_weight:
            packed = pipeline.compress(x, channel_dim=op.channel_dim)
            ctx.layout = packed.layout
            ctx.memory_format = _memory_format(x)
            saved.extend(packed.tensors)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise ActcompError(
                "double backward (create_graph=True) through a compressed layer is not supported: its "
                "weight gradient comes from a lossy copy of the input. Convert the model back with "
                "actcomp.from_compressed(model), or leave this layer out of to_compressed"
            )
        needs = ctx.needs_input_grad[:3]
        weight, *packed_tensors = ctx.saved_tensors
        x = None
        if ctx.layout is not None:
            x = ctx.pipeline.decompress(Packed(tuple(packed_tensors), ctx.layout))
            # Same strides as the forward input, so the backward kernels match plain PyTorch.
            x = x.contiguous(memory_format=ctx.memory_format)
        grad_input, grad_weight, grad_bias = ctx.op.backward(grad, x, weight, ctx.x_shape, needs)
        return grad_input, grad_weight, grad_bias, None, None


def compressed_apply(op, pipeline: Pipeline, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Apply ``op`` to ``(x, weight, bias)`` keeping only a compressed copy of ``x``."""
    return CompressedInputFunction.apply(x, weight, bias, op, pipeline)
