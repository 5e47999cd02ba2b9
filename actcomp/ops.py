"""Pure forward/backward of the layers actcomp compresses: Linear, Conv1d/2d/3d, GPT-2 Conv1D.

Each op runs exactly the computation of the plain layer in forward, and in backward the
same aten calls autograd would make, so with an uncompressed input the gradients are
bit-identical to plain PyTorch. The weight gradient is the only one that reads the input.

>>> import torch
>>> op = LinearOp()
>>> x, w = torch.randn(3, 4), torch.randn(2, 4)
>>> g = torch.ones(3, 2)
>>> torch.equal(op.backward(g, x, w, x.shape, (False, True, False))[1], g.t() @ x)
True
"""

from __future__ import annotations

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

    def backward(self, grad: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, x_shape, needs) -> Grads:
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_input = grad.matmul(weight) if needs[0] else None
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

    def backward(self, grad: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, x_shape, needs) -> Grads:
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_input = grad_2d.mm(weight.t()).view(x_shape) if needs[0] else None
        grad_weight = x.reshape(-1, x.shape[-1]).t().mm(grad_2d) if needs[1] else None
        grad_bias = grad_2d.sum(0) if needs[2] else None
        return grad_input, grad_weight, grad_bias


@dataclass(frozen=True)
class ConvOp:
    """N-d convolution with numeric, symmetric zero padding (other modes are padded first)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    channel_dim = 1

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        conv = (F.conv1d, F.conv2d, F.conv3d)[len(self.stride) - 1]
        return conv(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def backward(self, grad: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, x_shape, needs) -> Grads:
        if x is None:
            # Only the input gradient is wanted: it reads x's shape, never its values
            # (this is how torch.nn.grad.conv*_input call it too).
            x = grad.new_empty(1).expand(x_shape)
        bias_sizes = [weight.shape[0]] if needs[2] else None
        grads = torch.ops.aten.convolution_backward(
            grad, x, weight, bias_sizes, self.stride, self.padding, self.dilation,
            False, [0] * len(self.stride), self.groups, list(needs),
        )
        return tuple(g if need else None for g, need in zip(grads, needs))  # type: ignore[return-value]
