"""Fused attention run again in backward from its coded inputs (``actcomp.whole_model.attention_recompute``).

With lossless codes (``mink0``, the floors off) the recomputed output and log-sum-exp are the
forward's bit for bit, so the gradients must be plain's bit for bit: that checks the mechanism
(which save is which, the call's settings, the order of unpacking) apart from any rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actcomp
from actcomp.whole_model import attention_recompute

pytestmark = pytest.mark.usefixtures("single_thread")

# Every input as it is, through the recomputing path: the attention spec takes q, k and v.
LOSSLESS = {"activation": None, "normalization": None, "attention": "mink0", "attention_floors": False}


class Attention(nn.Module):
    """A projection to query, key and value, then one SDPA call as ``call`` makes it."""

    def __init__(self, call, heads: int = 4, kv_heads: int = 4, width: int = 64, dtype=torch.float32):
        super().__init__()
        self.call, self.heads, self.kv_heads, self.head = call, heads, kv_heads, width // heads
        self.project = nn.Linear(width, (heads + 2 * kv_heads) * self.head, dtype=dtype)
        self.out = nn.Linear(width, width, dtype=dtype)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.project(x).split([self.heads * self.head, self.kv_heads * self.head,
                                         self.kv_heads * self.head], dim=-1)
        q, k, v = (part.unflatten(-1, (-1, self.head)).transpose(1, 2) for part in (q, k, v))
        return self.out(self.call(q, k, v).transpose(1, 2).flatten(2))


def causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def grouped(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def float_mask(q, k, v):
    mask = torch.randn(q.shape[-2], k.shape[-2], generator=torch.Generator().manual_seed(3))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def bool_mask(q, k, v):
    mask = torch.rand(q.shape[-2], k.shape[-2], generator=torch.Generator().manual_seed(3)) > 0.3
    mask.fill_diagonal_(True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def scaled(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=0.37)


def self_attention(q, k, v):
    return F.scaled_dot_product_attention(q, q, q)


CALLS = {"causal": (causal, 4), "grouped": (grouped, 2), "float mask": (float_mask, 4),
         "bool mask": (bool_mask, 4), "scale": (scaled, 4), "sdpa(x, x, x)": (self_attention, 4)}


def gradients(model: nn.Module, x: torch.Tensor, rest, retain: bool = False) -> list[torch.Tensor]:
    converted = actcomp.to_compressed(model, "mink0", rest=rest, first_layer=None)
    converted.zero_grad()
    loss = converted(x).square().sum()
    loss.backward(retain_graph=retain)
    first = [p.grad.clone() for p in converted.parameters()]
    if retain:
        converted.zero_grad()
        loss.backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(first, converted.parameters()))
    return first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CALLS))
def test_lossless_codes_recompute_plain_gradients_bit_for_bit(name, dtype, monkeypatch):
    call, kv_heads = CALLS[name]
    runs = []
    original = attention_recompute.recompute_attention
    monkeypatch.setattr(attention_recompute, "recompute_attention", lambda *a: runs.append(1) or original(*a))
    torch.manual_seed(0)
    model = Attention(call, kv_heads=kv_heads, dtype=dtype)
    x = torch.randn(2, 24, 64, dtype=dtype)
    plain = gradients(model, x, "exact")
    assert runs == []
    recomputed = gradients(model, x, LOSSLESS, retain=True)
    assert runs == [1, 1]  # once a backward (twice over the retained graph)
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))


def test_the_output_and_log_sum_exp_keep_nothing_and_the_inputs_take_their_codes():
    torch.manual_seed(0)
    model = actcomp.to_compressed(Attention(causal), "mink0", rest="8bit", first_layer=None)
    report = actcomp.memory_report(model, torch.randn(2, 24, 64))
    (row,) = [row for row in report.kinds if row.kind == "attention"]
    # Plain: query, key, value and output, 2 x 4 x 24 x 16 fp32 each, and the log-sum-exp.
    assert row.plain_bytes == 4 * 3072 * 4 + 2 * 4 * 24 * 4
    # Kept: query, key and value as int8 codes with an fp32 offset and a bf16 scale a row of 16,
    # and a finite flag each; nothing of the output and log-sum-exp.
    assert row.codecs == ("int8:group=16",) and row.kept_bytes == 3 * (3072 + 192 * (4 + 2) + 1)


def test_dropout_is_not_recomputed(monkeypatch):
    # Dropout's mask cannot be drawn again: the kind's codecs as before, no recomputation.
    monkeypatch.setattr(attention_recompute, "recompute_attention", lambda *a: pytest.fail("recomputed"))

    def dropped(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    torch.manual_seed(0)
    model = actcomp.to_compressed(Attention(dropped), "mink0", rest="8bit", first_layer=None)
    model(torch.randn(2, 24, 64)).sum().backward()


def test_a_kernel_that_cannot_be_run_again_keeps_its_statistics_and_warns(monkeypatch):
    monkeypatch.setattr(attention_recompute, "recomputable_attention", lambda node: None)
    monkeypatch.setattr(attention_recompute, "_WARNED", set())
    torch.manual_seed(0)
    model = Attention(causal)
    x = torch.randn(2, 24, 64)
    plain = gradients(model, x, "exact")
    with pytest.warns(RuntimeWarning, match="cannot recompute in backward"):
        kept = gradients(model, x, LOSSLESS)
    # Lossless inputs, its own log-sum-exp and output: still plain's gradients.
    assert all(torch.equal(a, b) for a, b in zip(plain, kept))
