"""Pure forward/backward of the layers actcomp compresses: Linear, Conv1d/2d/3d, GPT-2 Conv1D.

Each op runs exactly the computation of the plain layer in forward, and in backward the
same aten calls, on tensors of the same shapes and strides, that autograd makes for the plain
layer, so with an uncompressed input the gradients are bit-identical to plain PyTorch on any
input layout. That means following autograd's paths: ``F.linear`` runs ``addmm`` on a 2-d or
contiguous input (through a flattened view) but ``matmul`` plus a broadcast bias add on others,
folding a non-contiguous input into one ``mm`` only when the weight needs a gradient and into
``bmm`` otherwise; the bias gradient is summed over whichever tensor the bias was added to; and
``mm``'s backward transposes its products when an operand is column-major. The weight gradient
is the only one that reads the input. ``tests/layers/test_layouts.py`` checks this on CPU for every
layout it makes; where the input had gaps (a slice) it comes back dense in the same axis order
(see :mod:`actcomp.layers.function`), so a Linear's BLAS call sees a smaller leading dimension than
plain's, which changed no bit on the CPU BLAS tested.

``backward(grad, x, weight, x_like, x_dtype, needs)``: ``x`` is the (decompressed) input laid
out as the forward's was, or None when only the input gradient is wanted; ``x_like`` is a meta
tensor with the shape, strides and dtype of the input the op saw in forward; ``x_dtype`` the
dtype of the input before any autocast cast (the input gradient is returned in it, as
autograd's cast node would); ``needs`` which of the input, weight and bias gradients to compute.

>>> import torch
>>> op = LinearOp()
>>> x, w = torch.randn(3, 4), torch.randn(2, 4)
>>> g = torch.ones(3, 2)
>>> torch.equal(op.backward(g, x, w, x.to("meta"), x.dtype, (False, True, False))[1], g.t() @ x)
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actcomp.kernels.layouts import empty_with_layout_of

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _mm_first_grad(grad: torch.Tensor, second: torch.Tensor, first_like: torch.Tensor) -> torch.Tensor:
    """Gradient of ``first`` in ``first @ second``, as autograd's ``mm`` backward computes it: a
    column-major ``first`` gets a column-major gradient, from the transposed product."""
    if first_like.stride() == (1, first_like.shape[0]):
        return second.mm(grad.t()).t()
    return grad.mm(second.t())


def _mm_second_grad(grad: torch.Tensor, first: torch.Tensor, second_like: torch.Tensor) -> torch.Tensor:
    """Gradient of ``second`` in ``first @ second``, as autograd's ``mm`` backward computes it."""
    if second_like.stride() == (1, second_like.shape[0]):
        return grad.t().mm(first).t()
    return first.t().mm(grad)


def _flatten(x: torch.Tensor, x_like: torch.Tensor, flat_like: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` folded to 2-d, laid out as the fold of the forward's input was (``flat_like``, that
    fold of ``x_like``, where the caller has it)."""
    rows = math.prod(x_like.shape[:-1])
    flat = x if x.dim() == 2 else x.reshape(rows, x_like.shape[-1])
    if flat_like is None:
        flat_like = x_like.reshape(rows, x_like.shape[-1])
    if flat_like.is_contiguous():
        # Where the forward's fold had to copy (a contiguous copy), x may fold into a view of
        # another order: x is rebuilt dense in the input's axis order, without its gaps.
        flat = flat.contiguous()
    return flat


@dataclass(frozen=True)
class LinearOp:
    """``y = x @ W.T + b`` with W shaped (out, in), as ``nn.Linear``."""

    channel_dim = -1

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def backward(self, grad, x: torch.Tensor | None, weight: torch.Tensor, x_like: torch.Tensor, x_dtype,
                 needs) -> Grads:
        outputs, weight_t = weight.shape[0], weight.t()
        if x_like.dim() > 2 and not (x_like.is_contiguous() or needs[1] or x_like.numel() == 0):
            return self._batched_backward(grad, weight_t, x_like, x_dtype, needs)
        # One mm on the input folded to 2-d: F.linear's addmm (2-d or contiguous input) and
        # matmul's folded mm (any other input, when the weight needs a gradient).
        # A 2-d input is its own fold: no reshapes (each a dispatcher call, meta ones included).
        folded = x_like.dim() == 2
        rows = x_like.shape[0] if folded else math.prod(x_like.shape[:-1])
        flat_like = x_like if folded else x_like.reshape(rows, x_like.shape[-1])
        grad_2d = grad if grad.dim() == 2 else grad.reshape(rows, outputs)
        grad_input = grad_weight = grad_bias = None
        if needs[0]:
            grad_input = _mm_first_grad(grad_2d, weight_t, flat_like)
            grad_input = grad_input if folded else grad_input.reshape(x_like.shape)
            grad_input = grad_input if grad_input.dtype == x_dtype else grad_input.to(x_dtype)
        if needs[1]:
            grad_weight = _mm_second_grad(grad_2d, _flatten(x, x_like, flat_like), weight_t).t()
        if needs[2]:
            # addmm adds the bias to the 2-d product; matmul's N-d (or 1-d) result gets it added
            # after. (A 1-d gradient is then the bias gradient itself: no sum, so -0.0 stays.)
            added_to = grad_2d if x_like.dim() == 2 or x_like.is_contiguous() else grad
            grad_bias = added_to.sum_to_size(outputs)
        return grad_input, grad_weight, grad_bias

    @staticmethod
    def _batched_backward(grad, weight_t: torch.Tensor, x_like: torch.Tensor, x_dtype, needs) -> Grads:
        # matmul's bmm path (a non-contiguous input and a weight that needs no gradient): the
        # weight is broadcast over the batch axes and each matrix of the batch multiplied apart.
        batch, rows = x_like.shape[:-2], x_like.shape[-2]
        count, (features, outputs) = math.prod(batch), weight_t.shape
        grad_input = grad_bias = None
        if needs[0]:
            weight_batched = weight_t.expand(*batch, features, outputs).reshape(count, features, outputs)
            grad_3d = grad.reshape(count, rows, outputs)
            grad_input = grad_3d.bmm(weight_batched.transpose(1, 2)).reshape(x_like.shape).to(x_dtype)
        if needs[2]:
            grad_bias = grad.sum_to_size(outputs)
        return grad_input, None, grad_bias


@dataclass(frozen=True)
class GPT2Conv1DOp:
    """``y = b + x @ W`` with W shaped (in, out), as ``transformers.pytorch_utils.Conv1D``."""

    channel_dim = -1

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x_2d = x.reshape(-1, x.shape[-1])
        out = torch.addmm(bias, x_2d, weight) if bias is not None else x_2d.mm(weight)
        return out.view(*x.shape[:-1], weight.shape[1])

    def backward(self, grad, x: torch.Tensor | None, weight: torch.Tensor, x_like: torch.Tensor, x_dtype,
                 needs) -> Grads:
        rows, outputs = math.prod(x_like.shape[:-1]), weight.shape[1]
        grad_2d = grad.reshape(rows, outputs)
        grad_input = grad_weight = grad_bias = None
        if needs[0]:
            flat_like = x_like.reshape(rows, x_like.shape[-1])
            grad_input = _mm_first_grad(grad_2d, weight, flat_like).reshape(x_like.shape).to(x_dtype)
        if needs[1]:
            grad_weight = _mm_second_grad(grad_2d, _flatten(x, x_like), weight)
        if needs[2]:
            grad_bias = grad_2d.sum_to_size(outputs)
        return grad_input, grad_weight, grad_bias


@dataclass(frozen=True)
class ConvOp:
    """N-d convolution of a batched input with numeric symmetric zero padding, after an
    optional explicit ``pre_pad`` (``F.pad`` arguments) for other padding modes and for
    asymmetric 'same' padding.

    The pre-padding happens inside the op, so only the unpadded input is kept (compressed):
    an ``F.pad`` in front of the op would keep the whole input for its own backward.
    """

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    pre_pad: tuple[int, ...] = ()
    pre_pad_mode: str = "constant"

    channel_dim = 1

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, self.pre_pad, mode=self.pre_pad_mode) if self.pre_pad else x

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        conv = (F.conv1d, F.conv2d, F.conv3d)[len(self.stride) - 1]
        return conv(self._pad(x), weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def backward(self, grad, x: torch.Tensor | None, weight: torch.Tensor, x_like: torch.Tensor, x_dtype,
                 needs) -> Grads:
        if x is None:
            # Only the input gradient is wanted: it reads x's shape and layout (the layout picks
            # the kernels, channels_last or not), never its values.
            x = empty_with_layout_of(x_like, x_like.dtype, grad.device)
        bias_sizes = [weight.shape[0]] if needs[2] else None
        grads = torch.ops.aten.convolution_backward(
            grad, self._pad(x), weight, bias_sizes, self.stride, self.padding, self.dilation,
            False, [0] * len(self.stride), self.groups, list(needs),
        )
        grad_input, grad_weight, grad_bias = (g if need else None for g, need in zip(grads, needs))
        if grad_input is not None:
            # Cast first, then undo the padding: under autocast plain PyTorch pads in the
            # input's dtype, so its padding backward accumulates in that dtype too.
            grad_input = grad_input.to(x_dtype)
            if self.pre_pad:
                grad_input = self._unpad_grad(grad_input, x_like, x_dtype)
        return grad_input, grad_weight, grad_bias

    def _unpad_grad(self, grad_padded: torch.Tensor, x_like: torch.Tensor, x_dtype) -> torch.Tensor:
        # The padding's own backward kernel, run through autograd on a stand-in of the input:
        # it reads only the input's shape and layout, and gives the same values as plain autograd.
        with torch.enable_grad():
            stand_in = empty_with_layout_of(x_like, x_dtype, grad_padded.device).requires_grad_()
            (grad_input,) = torch.autograd.grad(self._pad(stand_in), stand_in, grad_padded)
        return grad_input


# Every op the compressed Function runs.
Op = LinearOp | GPT2Conv1DOp | ConvOp


def _per_axis(value: int | Sequence[int], dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, Sequence) else (value,) * dims


def conv_op(kernel_size: Sequence[int], stride, padding, dilation, groups: int, padding_mode: str = "zeros",
            reversed_padding: Sequence[int] = ()) -> ConvOp:
    """The :class:`ConvOp` of a convolution, as ``nn.ConvNd`` or ``F.conv{1,2,3}d`` would run it.

    Mirrors ``_ConvNd._conv_forward``: a non-zero ``padding_mode`` pads explicitly by
    ``reversed_padding`` (the module's ``_reversed_padding_repeated_twice``) first, and
    ``padding="same"`` with an odd total pads the extra element on the right first.

    >>> conv_op((3, 3), 1, "same", 2, 1)
    ConvOp(stride=(1, 1), padding=(2, 2), dilation=(2, 2), groups=1, pre_pad=(), pre_pad_mode='constant')
    """
    dims = len(kernel_size)
    stride, dilation = _per_axis(stride, dims), _per_axis(dilation, dims)
    pre_pad: tuple[int, ...] = ()
    pre_pad_mode = "constant"
    if padding_mode != "zeros":
        pre_pad, pre_pad_mode = tuple(reversed_padding), padding_mode
        padding = (0,) * dims
    elif padding == "valid":
        padding = (0,) * dims
    elif padding == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        # As torch does for 'same': pad the odd extra element on the right, then symmetrically.
        if any(total % 2 for total in totals):
            pre_pad = tuple(side for total in reversed(totals) for side in (0, total % 2))
        padding = tuple(total // 2 for total in totals)
    return ConvOp(stride, _per_axis(padding, dims), dilation, groups, pre_pad, pre_pad_mode)
