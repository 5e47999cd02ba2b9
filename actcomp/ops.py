"""Pure forward/backward of the layers actcomp compresses: Linear, Conv1d/2d/3d, GPT-2 Conv1D.

Each op runs exactly the computation of the plain layer in forward, and in backward the
same aten calls autograd would make, so with an uncompressed input the gradients are
bit-identical to plain PyTorch. The weight gradient is the only one that reads the input.
``backward`` returns the input gradient in ``x_dtype``, the dtype of the input before any
autocast cast, as autograd's cast node would.

>>> import torch
>>> op = LinearOp()
>>> x, w = torch.randn(3, 4), torch.randn(2, 4)
>>> g = torch.ones(3, 2)
>>> torch.equal(op.backward(g, x, w, x.shape, x.dtype, (False, True, False))[1], g.t() @ x)
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass(frozen=True)
class LinearOp:
    """``y = x @ W.T + b`` with W shaped (out, in), as ``nn.Linear``."""

    channel_dim = -1

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def backward(self, grad, x: torch.Tensor | None, weight: torch.Tensor, x_shape, x_dtype, needs) -> Grads:
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_input = grad.matmul(weight).to(x_dtype) if needs[0] else None
        grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1])) if needs[1] else None
        grad_bias = grad_2d.sum(0) if needs[2] else None
        return grad_input, grad_weight, grad_bias


@dataclass(frozen=True)
class GPT2Conv1DOp:
    """``y = b + x @ W`` with W shaped (in, out), as ``transformers.pytorch_utils.Conv1D``."""

    channel_dim = -1

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x_2d = x.reshape(-1, x.shape[-1])
        out = torch.addmm(bias, x_2d, weight) if bias is not None else x_2d.mm(weight)
        return out.view(*x.shape[:-1], weight.shape[1])

    def backward(self, grad, x: torch.Tensor | None, weight: torch.Tensor, x_shape, x_dtype, needs) -> Grads:
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_input = grad_2d.mm(weight.t()).view(x_shape).to(x_dtype) if needs[0] else None
        grad_weight = x.reshape(-1, x.shape[-1]).t().mm(grad_2d) if needs[1] else None
        grad_bias = grad_2d.sum(0) if needs[2] else None
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

    def backward(self, grad, x: torch.Tensor | None, weight: torch.Tensor, x_shape, x_dtype, needs) -> Grads:
        padded_shape = list(x_shape)
        for axis, (before, after) in enumerate(zip(self.pre_pad[::2], self.pre_pad[1::2])):
            padded_shape[-1 - axis] += before + after
        if x is None:
            # Only the input gradient is wanted: it reads x's shape, never its values
            # (this is how torch.nn.grad.conv*_input call it too).
            x = grad.new_empty(1).expand(padded_shape)
        else:
            x = self._pad(x)
        bias_sizes = [weight.shape[0]] if needs[2] else None
        grads = torch.ops.aten.convolution_backward(
            grad, x, weight, bias_sizes, self.stride, self.padding, self.dilation,
            False, [0] * len(self.stride), self.groups, list(needs),
        )
        grad_input, grad_weight, grad_bias = (g if need else None for g, need in zip(grads, needs))
        if grad_input is not None:
            # Cast first, then undo the padding: under autocast plain PyTorch pads in the
            # input's dtype, so its padding backward accumulates in that dtype too.
            grad_input = grad_input.to(x_dtype)
            if self.pre_pad:
                grad_input = self._unpad_grad(grad_input, x_shape)
        return grad_input, grad_weight, grad_bias

    def _unpad_grad(self, grad_padded: torch.Tensor, x_shape) -> torch.Tensor:
        # The padding's own backward kernel, run through autograd on a stand-in of the input:
        # it reads only the input's shape, and gives the same values as plain autograd.
        with torch.enable_grad():
            stand_in = grad_padded.new_zeros(()).expand(x_shape).requires_grad_()
            (grad_input,) = torch.autograd.grad(self._pad(stand_in), stand_in, grad_padded)
        return grad_input


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
    pre_pad, pre_pad_mode = (), "constant"
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
