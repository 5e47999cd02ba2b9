"""A GPT-2-shaped model without depending on transformers, shared by the benchmark scripts.

GPT-2 small's widths (768 wide, 12 heads, the 50257-token vocabulary, a tied LM head) with four
blocks instead of twelve: compression ratios are per block, the runtime is not. Token ids go to
an embedding, so no layer reads the raw model input: convert it with ``first_layer=None``.

>>> model = GPT2Model(GPT2Config(vocab_size=100, width=48, heads=4, blocks=1))
>>> tuple(model(gpt2_tokens(GPT2Config(vocab_size=100), batch=2, seq_len=5)).shape)
(2, 5, 100)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GPT2 = "gpt2"  # the name the benchmarks' --models flag takes for this model


class Conv1D(nn.Module):
    """GPT-2's linear layer with its weight stored (in, out), like ``transformers.pytorch_utils.Conv1D``.

    actcomp recognises it by its class name and ``nf`` attribute.
    """

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.shape[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = Conv1D(3 * width, width)
        self.c_proj = Conv1D(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.c_attn(x).split(width, dim=2))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(attended.transpose(1, 2).reshape(batch, length, width))


class GPT2MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * width, width)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = Conv1D(width, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), GPT2Attention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), GPT2MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2 small's widths, with fewer blocks: the ratios are per block, the runtime is not."""

    vocab_size: int = 50257
    max_positions: int = 1024
    width: int = 768
    heads: int = 12
    blocks: int = 4


class GPT2Model(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.width)
        self.wpe = nn.Embedding(config.max_positions, config.width)
        self.h = nn.ModuleList(GPT2Block(config.width, config.heads) for _ in range(config.blocks))
        self.ln_f = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2_tokens(config: GPT2Config, batch: int, seq_len: int) -> torch.Tensor:
    """A batch of random token ids (draws from the global RNG)."""
    return torch.randint(0, config.vocab_size, (batch, seq_len))
