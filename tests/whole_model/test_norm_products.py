"""Norms written out in elementwise ops (Hugging Face's RMSNorm): the normalized ``x * rstd`` that
the gain's product saves is rebuilt from the code of ``x`` the norm saved already, not coded a
second time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import record_unpacks
from torch import nn

import actcomp
from actcomp.graph.saved_tensors import listening


class LlamaRMSNorm(nn.Module):
    """Hugging Face's, as its Llama, Mistral and Qwen2 write it (named so the kind is found)."""

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(dtype)


class GemmaRMSNorm(LlamaRMSNorm):
    """Gemma's: the statistic first, the gain ``1 + weight`` in float32, the cast last."""

    def forward(self, x):
        output = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps) * x.float()
        return (output * (1.0 + self.weight.float())).type_as(x)


class ScaledNorm(LlamaRMSNorm):
    """A ``...Norm`` whose product is with a whole tensor, no per-row statistic: not rebuilt."""

    def forward(self, x):
        return self.weight * (x * torch.sigmoid(x))


class Net(nn.Module):
    def __init__(self, norm=LlamaRMSNorm, width=64):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(32, width), norm(width), nn.Linear(width, 10)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


def normalization_saves(model, x) -> tuple[list[str | None], int]:
    """The codec (or rebuild) of each tensor the norm saved, in saving order, and the report's
    normalization bytes."""
    specs = []
    with listening(lambda event: specs.append(event.codec) if event.kind == "normalization" else None):
        model(x).square().mean().backward()
    kinds = {row.kind: row.kept_bytes for row in actcomp.memory_report(model, x).kinds}
    return specs, kinds["normalization"]


def converted(norm=LlamaRMSNorm, dtype=torch.float32, rest="8bit"):
    torch.manual_seed(0)
    model, x = Net(norm).to(dtype), torch.randn(16, 24, 32, dtype=dtype)
    return actcomp.to_compressed(model, "mink0", rest=rest), x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [LlamaRMSNorm, GemmaRMSNorm])
def test_the_normalized_input_is_rebuilt_from_the_inputs_code(norm, dtype, monkeypatch):
    from actcomp.whole_model import session

    model, x = converted(norm, dtype)
    specs, kept = normalization_saves(model, x)
    assert "rescaled kept input" in specs, specs
    monkeypatch.setattr(session._Session, "rescaled", lambda self, tensor: None)
    specs, coded = normalization_saves(model, x)
    assert "rescaled kept input" not in specs
    # The rebuild saves one int8 code of the 16 x 24 x 64 normalized values: a byte an element,
    # a range per row of 64 (an offset in the values' dtype, a bf16 scale) and the finite flag.
    normalized = torch.float32 if norm is GemmaRMSNorm else dtype  # Gemma casts after its gain
    assert coded - kept == 16 * 24 * 64 + 16 * 24 * (normalized.itemsize + 2) + 1, (coded, kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rebuilt_product_is_that_of_the_decoded_input(dtype, monkeypatch):
    # The gain's backward reads decoded x * rstd, cast as the forward cast it: equal to the product
    # computed by hand from the same code and the statistic the norm kept.
    from actcomp.whole_model import kept_forms

    model, x = converted(dtype=dtype)
    rebuilt = record_unpacks(kept_forms.Rescaled, monkeypatch)
    model(x).square().mean().backward()
    (holder, value), = rebuilt
    decoded = holder.source.unpack()
    assert decoded.dtype == torch.float32 and value.dtype == dtype
    rstd = torch.rsqrt(x_norm_input(model, x).float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(holder.statistic, rstd)
    assert torch.equal(value, (decoded * rstd).to(dtype))


def x_norm_input(model, x):
    with torch.no_grad():
        return model.inp(x)


def gradients(norm, rest, rebuild=True, monkeypatch=None):
    """One step's parameter gradients of the net, plain and converted (Linear inputs exact)."""
    torch.manual_seed(0)
    model, x = Net(norm), torch.randn(16, 24, 32)
    if not rebuild:
        from actcomp.whole_model import session

        monkeypatch.setattr(session._Session, "rescaled", lambda self, tensor: None)
    grads = []
    for convert in (False, True):
        if convert:
            actcomp.to_compressed(model, "mink0", rest=rest)
        model.zero_grad()
        model(x).square().mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return grads


@pytest.mark.parametrize("norm", [LlamaRMSNorm, GemmaRMSNorm])
def test_rest_exact_keeps_the_norm_bit_for_bit(norm):
    expected, got = gradients(norm, "exact")
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rest", ["8bit", "4bit"])
def test_the_gradient_with_the_rebuild_is_as_close_as_with_a_code_of_its_own(rest, monkeypatch):
    expected, rebuilt = gradients(LlamaRMSNorm, rest)
    _, coded = gradients(LlamaRMSNorm, rest, rebuild=False, monkeypatch=monkeypatch)
    with_rebuild, own_code = (F.cosine_similarity(g, expected, dim=0) for g in (rebuilt, coded))
    assert with_rebuild > (0.999 if rest == "8bit" else 0.99) and with_rebuild > own_code - 1e-4, (with_rebuild, own_code)


def test_a_product_with_no_row_statistic_keeps_a_code_of_its_own():
    model, x = converted(ScaledNorm)
    specs, _ = normalization_saves(model, x)
    assert specs and "rescaled kept input" not in specs, specs


def test_no_rebuild_where_the_input_is_kept_as_it_is():
    # rest={"normalization": None}: the norm's tensors stay as they are, so nothing is rebuilt.
    model, x = converted(rest={"normalization": None})
    specs, _ = normalization_saves(model, x)
    assert specs and all(spec is None for spec in specs), specs
