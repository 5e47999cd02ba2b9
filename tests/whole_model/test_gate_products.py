"""Gated MLPs in whole-model mode: the product of two activations is found by what it is and
compressed as an activation; products that are no gate stay as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import record_unpacks
from torch import nn

import actcomp


class FeedForward(nn.Module):
    """A SwiGLU MLP (Llama's), or with chunk=True one projection cut in two halves (EVA's)."""

    def __init__(self, width=64, hidden=176, chunk=False):
        super().__init__()
        self.chunk = chunk
        self.gate = nn.Linear(width, 2 * hidden if chunk else hidden)
        self.up = None if chunk else nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        if self.chunk:
            gate, up = self.gate(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(F.silu(gate) * up)


class Net(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.block = block
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def kinds(model, x):
    report = actcomp.memory_report(model, x)
    return {row.kind: (row.plain_bytes, row.kept_bytes) for row in report.kinds}, report.total_bytes


@pytest.mark.parametrize("chunk", [False, True])
def test_a_gated_mlps_product_is_compressed_as_an_activation(chunk):
    torch.manual_seed(0)
    model, x = Net(FeedForward(chunk=chunk)), torch.randn(16, 24, 32)
    before, plain_total = kinds(model, x)
    actcomp.to_compressed(model, "int8", rest="8bit")
    after, kept_total = kinds(model, x)
    # The product's two operands (16 x 24 x 176 fp32 each) count as activations (before: "other",
    # kept as they were), beside the SiLU's input.
    assert before["activation"][0] >= 3 * 16 * 24 * 176 * 4 and "other" not in before
    assert "other" not in after
    assert after["activation"][0] > after["activation"][1] * 3.5  # int8, its scales aside
    assert plain_total > 3.5 * kept_total


def gradients_plain_and_converted(rest):
    """The gated net's parameter gradients of one step, plain and converted (Linear inputs exact)."""
    torch.manual_seed(0)
    model, x = Net(FeedForward()), torch.randn(16, 24, 32)
    grads = []
    for convert in (False, True):
        if convert:
            actcomp.to_compressed(model, "mink0", rest=rest)
        model.zero_grad()
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def test_the_gradient_stays_close_to_plains():
    expected, got = gradients_plain_and_converted("8bit")  # only the rest is lossy
    cosine = F.cosine_similarity(torch.cat([g.view(-1) for g in got]), torch.cat([g.view(-1) for g in expected]), dim=0)
    assert cosine > 0.999, cosine


class LayerScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.gamma = nn.Parameter(torch.full((64,), 0.1))
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        h = self.inp(x)
        mask = (torch.arange(64) % 2).float()  # a broadcast constant, not an activation
        return self.out(torch.tanh(h) * self.gamma * mask)


class SelfAttention(nn.Module):
    """A product inside an attention module stays attention's."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.q(x) * self.k(x)


def test_products_that_are_no_gate_are_not_taken_for_one():
    from actcomp.graph.op_kinds import is_gate_product

    a = torch.randn(4, 8, requires_grad=True)
    assert not is_gate_product(torch.mul, (a, nn.Parameter(torch.randn(4, 8))))  # a scale
    assert not is_gate_product(torch.mul, (a, torch.randn(4, 8)))  # a constant
    assert not is_gate_product(torch.mul, (a, torch.randn(8, requires_grad=True)))  # broadcast
    assert not is_gate_product(torch.add, (a, torch.randn(4, 8, requires_grad=True)))
    torch.manual_seed(0)
    model, x = LayerScale(), torch.randn(16, 32)
    # The activations are tanh's output alone: the product with gamma is a layer scale's (a
    # norm's: below), the product with the mask "other".
    assert kinds(model, x)[0]["activation"][0] == 16 * 64 * 4
    model, x = nn.Sequential(SelfAttention(), nn.Linear(32, 4)), torch.randn(16, 32)
    assert "activation" not in kinds(model, x)[0]


def test_rest_exact_keeps_the_product_exact():
    expected, got = gradients_plain_and_converted("exact")
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


class GeGLU(nn.Module):
    """Gemma's MLP: GELU (tanh approximation) of the gate times up."""

    def __init__(self, width=64, hidden=176):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(width, hidden), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


def saved_specs(model, x) -> list[str | None]:
    """The spec (or recomputation) each saved activation got, in saving order."""
    from actcomp.graph.saved_tensors import listening

    specs = []
    with listening(lambda event: specs.append(event.codec) if event.kind == "activation" else None):
        model(x).square().mean().backward()
    return specs


@pytest.mark.parametrize(("block", "op"), [(FeedForward, "silu"), (lambda: FeedForward(chunk=True), "silu"),
                                           (GeGLU, "gelu")], ids=["swiglu", "chunked", "geglu"])
def test_the_activations_output_is_recomputed_from_its_kept_input(block, op):
    torch.manual_seed(0)
    model, x = Net(block()), torch.randn(16, 24, 32)
    actcomp.to_compressed(model, "mink0", rest="8bit")
    # The activation's input in int8, and the product's operands: up in int8, act(gate) rebuilt
    # from that input's code.
    specs = saved_specs(model, x)
    assert specs[0] == "int8" and sorted(specs[1:]) == sorted([f"{op} of a kept input", "int8"])
    # The product's act(gate) costs nothing of its own: the activations keep two int8 codes.
    kept = kinds(model, x)[0]["activation"][1]
    assert 2 * 16 * 24 * 176 <= kept < 2.1 * 16 * 24 * 176


@pytest.mark.parametrize("block", [FeedForward, GeGLU], ids=["swiglu", "geglu"])
def test_the_recomputed_activation_is_that_of_the_decoded_input(block, monkeypatch):
    # The product's backward reads act(decoded gate), with the forward's approximation: its
    # gradient for up equals one computed by hand from the same decoded gate.
    from actcomp.whole_model import kept_forms

    torch.manual_seed(0)
    model, x = Net(block()), torch.randn(16, 24, 32)
    actcomp.to_compressed(model, "mink0", rest="8bit")
    rebuilt = record_unpacks(kept_forms.Recomputed, monkeypatch)
    model(x).square().mean().backward()
    (holder, value), = rebuilt
    gate = holder.source.unpack()
    expected = F.silu(gate) if block is FeedForward else F.gelu(gate, approximate="tanh")
    assert torch.equal(value, expected)
    assert holder.approximate == ("none" if block is FeedForward else "tanh")


@pytest.mark.parametrize("rest", ["exact", "4bit"])
def test_no_recomputation_where_the_input_keeps_no_values(rest):
    # rest="exact" keeps both as they are (bit for bit); "4bit" keeps SiLU's input as derivative
    # codes, which cannot give the values back: the product's act(gate) gets a code of its own.
    torch.manual_seed(0)
    model, x = Net(FeedForward()), torch.randn(16, 24, 32)
    actcomp.to_compressed(model, "mink0", rest=rest)
    assert not any(spec and "kept input" in spec for spec in saved_specs(model, x))


def test_the_gradient_with_recomputation_stays_as_close_as_a_code_of_its_own(monkeypatch):
    from actcomp.whole_model import session

    expected, got = gradients_plain_and_converted("8bit")
    monkeypatch.setattr(session._Session, "recomputed", lambda self, tensor: None)
    _, coded = gradients_plain_and_converted("8bit")
    flat = [torch.cat([g.view(-1) for g in grads]) for grads in (expected, got, coded)]
    recomputed, own_code = (F.cosine_similarity(f, flat[0], dim=0) for f in flat[1:])
    assert recomputed > 0.999 and recomputed > own_code - 1e-4, (recomputed, own_code)


class LayerScaled(nn.Module):
    """A residual branch scaled by a parameter, as timm's LayerScale (``x * gamma``) and
    ConvNeXt (``x.mul(gamma.reshape(1, -1, 1, 1))``, a view of it) write it."""

    def __init__(self, view: bool):
        super().__init__()
        self.view = view
        self.branch = nn.Linear(64, 64)
        self.gamma = nn.Parameter(torch.full((64,), 0.01))

    def forward(self, h):
        gamma = self.gamma.reshape(1, 1, 64) if self.view else self.gamma
        return h + self.branch(F.gelu(h)) * gamma


@pytest.mark.parametrize("view", [False, True], ids=["parameter", "view"])
def test_a_layer_scales_input_is_coded_as_a_norms(view):
    """The product saves the branch's output for gamma's gradient alone; it was "other", kept as
    it was: 37-43% of what "8bit" kept of ConvNeXt-T, DeiT-III and DINOv2's ViT-S."""
    torch.manual_seed(0)
    model, x = Net(LayerScaled(view)), torch.randn(16, 24, 32)
    plain, _ = kinds(model, x)
    scaled = 16 * 24 * 64 * 4  # the branch's output, fp32
    assert "other" not in plain and plain["normalization"][0] == scaled
    reference = [torch.autograd.grad(model(x).square().mean(), model.parameters())]
    actcomp.to_compressed(model, "mink0", rest="8bit")
    after, _ = kinds(model, x)
    assert "other" not in after and after["normalization"][1] < scaled / 3.5  # int8, its scales aside
    got = torch.autograd.grad(model(x).square().mean(), model.parameters())
    gamma = F.cosine_similarity(got[-3].reshape(-1), reference[0][-3].reshape(-1), dim=0)
    assert gamma > 0.9999, gamma  # gamma's gradient, the one the coded input serves
    exact = actcomp.to_compressed(actcomp.from_compressed(model), "mink0", rest="exact")
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(exact(x).square().mean(), exact.parameters()),
                                                  reference[0], strict=True))


class SqueezeExcited(nn.Module):
    """A squeeze-excitation block: the activation times a per-row gate computed from it (timm's
    SEModule: ``x * sigmoid(fc2(relu(fc1(mean(x)))))``), and a constant mask product beside it."""

    def __init__(self):
        super().__init__()
        self.reduce, self.expand = nn.Linear(64, 16), nn.Linear(16, 64)

    def forward(self, h):
        x = F.gelu(h)
        gate = torch.sigmoid(self.expand(F.relu(self.reduce(x.mean(1, keepdim=True)))))
        mask = (torch.arange(64) % 3 > 0).float()  # no grad: a mask, not a scale
        return x * gate * mask


def test_a_squeeze_excitations_input_is_coded_as_a_norms():
    """The product saves the activation for the gate's gradient alone; it was "other", kept as it
    was until stop 64 (EfficientNet-B0: 71 MiB of the 180 MiB "8bit" kept at batch 8)."""
    torch.manual_seed(0)
    model, x = Net(SqueezeExcited()), torch.randn(16, 24, 32)
    plain, _ = kinds(model, x)
    excited = 16 * 24 * 64 * 4  # GELU's output, fp32
    assert plain["normalization"][0] == excited
    reference = torch.autograd.grad(model(x).square().mean(), model.parameters())
    actcomp.to_compressed(model, "mink0", rest="8bit")
    after, _ = kinds(model, x)
    assert after["normalization"][1] < excited / 3  # int8 in rows of 64, with their scales
    got = torch.autograd.grad(model(x).square().mean(), model.parameters())
    flat = [torch.cat([g.reshape(-1) for g in grads]) for grads in (got, reference)]
    assert F.cosine_similarity(*flat, dim=0) > 0.9999
    exact = actcomp.to_compressed(actcomp.from_compressed(model), "mink0", rest="exact")
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(exact(x).square().mean(), exact.parameters()),
                                                  reference, strict=True))
