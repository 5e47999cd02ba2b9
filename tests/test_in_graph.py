"""Compression inside torch.compile'd training (actcomp.compress_in_graph): the exact forms give
the compiled step's own gradients bit for bit, the lossy ones stay close, and the codecs really
run inside the compiled graphs."""

import pytest
import torch
import torch.nn.functional as F

import actcomp
from actcomp.kernels.bitpack import pack_bits
from actcomp.whole_model import in_graph


class ReluMLP(torch.nn.Module):
    """A ReLU (its output also a Linear input), dropout (a bool mask), GELU and LayerNorm."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.last = torch.nn.Linear(64, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)
        self.norm = torch.nn.LayerNorm(256)

    def forward(self, x):
        h = F.dropout(F.relu(self.first(x)), 0.1, training=self.training)
        return self.last(self.norm(F.gelu(self.second(h))))


def gradients(model, step, x, hooks=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout mask in every run
    if hooks is None:
        loss = step(x).square().mean()
    else:
        with actcomp.compress_in_graph(*hooks[:1], rest=hooks[1]):
            loss = step(x).square().mean()
    loss.backward()
    return [parameter.grad.clone() for parameter in model.parameters()]


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = ReluMLP().train()
    return model, torch.compile(model), torch.randn(512, 64)


def test_exact_forms_give_the_compiled_steps_gradients_bit_for_bit(compiled, monkeypatch):
    model, step, x = compiled
    forms = []
    pack = in_graph._pack
    monkeypatch.setattr(in_graph, "_pack", lambda saved, plan: forms.append(pack(saved, plan)[0]) or pack(saved, plan))
    in_graph._hooks.cache_clear()  # new graph modules that call the patched function

    plain = gradients(model, step, x)
    exact = gradients(model, step, x, (None, "exact"))

    assert all(torch.equal(a, b) for a, b in zip(plain, exact, strict=True))
    assert "bits" in forms  # the dropout mask took the 1-bit form: the test saw a codec run
    in_graph._hooks.cache_clear()


def test_int8_inside_the_graph_keeps_the_gradients_close(compiled):
    model, step, x = compiled

    plain = gradients(model, step, x)
    lossy = gradients(model, step, x, ("int8", "8bit"))

    assert not all(torch.equal(a, b) for a, b in zip(plain, lossy))  # something was compressed
    cosines = [F.cosine_similarity(a.flatten(), b.flatten(), 0) for a, b in zip(plain, lossy)]
    assert min(cosines) > 0.999


def test_a_comparison_form_decodes_to_the_same_comparison():
    x = torch.tensor([-1.5, 0.0, 0.25, 3.0, float("nan"), -0.0])
    for name in ("le", "lt", "ge", "gt"):
        bits = pack_bits(getattr(torch, name)(x, 0.0))
        decoded = in_graph._unpack(("compared", name, 0.0, x.shape, x.dtype, bits), "")
        assert torch.equal(getattr(torch, name)(decoded, 0.0), getattr(torch, name)(x, 0.0)), name


def test_a_spec_that_cannot_compile_is_refused():
    with pytest.raises(actcomp.ActcompError, match="cannot run inside a compiled graph"):
        actcomp.compress_in_graph("mink0.9:rice=1")


def test_the_same_arguments_give_the_same_hooks():
    """Dynamo guards on the hooks' identity: new ones each step would recompile each step."""
    assert in_graph._hooks(in_graph._plan("int8", "8bit")) is in_graph._hooks(in_graph._plan("int8", "8bit"))


def test_eager_code_under_the_hooks_keeps_its_tensors():
    """A loss computed outside the compiled model runs eagerly under the hooks: kept as is."""
    layer = torch.nn.Linear(128, 128)
    x = torch.randn(64, 128)
    with actcomp.compress_in_graph("int8", rest="8bit"):
        y = F.gelu(layer(x))
    y.sum().backward()
    reference = torch.autograd.grad(F.gelu(layer(x)).sum(), layer.weight)[0]
    assert torch.equal(layer.weight.grad, reference)
