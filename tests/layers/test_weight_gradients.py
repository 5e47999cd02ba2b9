"""Weight-gradient watchers: what a watched layer's backward hands over recomputes, through any
pipeline, exactly the weight gradient the layer converted with that pipeline computes."""

import pytest
import torch
from torch import nn

import actcomp
from actcomp.layers.weight_gradients import watched, watching_weight_gradients


class _Gpt2Conv1D(nn.Module):
    """transformers' Conv1D as actcomp recognises it (weight (in, out), ``nf`` outputs)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


Conv1D = type("Conv1D", (_Gpt2Conv1D,), {})


def _cases():
    return {
        "linear 3-d": (nn.Linear(24, 12), lambda: torch.randn(4, 5, 24)),
        "linear sliced": (nn.Linear(24, 12), lambda: torch.randn(6, 48)[:, ::2]),
        "linear transposed": (nn.Linear(24, 12), lambda: torch.randn(5, 24, 4).transpose(1, 2)),
        "conv2d": (nn.Conv2d(3, 8, 3, stride=2, padding=1), lambda: torch.randn(2, 3, 9, 9)),
        "conv1d grouped": (nn.Conv1d(4, 8, 3, groups=2), lambda: torch.randn(2, 4, 11)),
        "gpt2 conv1d": (Conv1D(12, 24), lambda: torch.randn(3, 5, 24)),
    }


def _watched_gradient(layer: nn.Module, x: torch.Tensor, spec: str, autocast: bool) -> torch.Tensor:
    """The weight gradient through ``spec`` as a watcher computes it from a ``"mink0"`` layer."""
    model = actcomp.to_compressed(nn.Sequential(layer), "mink0", first_layer=None)
    got = []
    with watching_weight_gradients(lambda call: got.append(call.weight_gradient_through(actcomp.parse(spec)))):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        out.float().square().sum().backward()
    assert len(got) == 1
    return got[0]


def _converted_gradient(layer: nn.Module, x: torch.Tensor, spec: str, autocast: bool) -> torch.Tensor:
    model = actcomp.to_compressed(nn.Sequential(layer), spec, first_layer=None)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().sum().backward()
    return layer.weight.grad


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("spec", ["bf16", "mink0.5", "mink0.9+int8", "int4:group=8"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
def test_weight_gradient_through_equals_the_converted_layers(case, spec, autocast):
    import copy

    torch.manual_seed(0)
    layer, make = _cases()[case]
    x = make()
    expected = _converted_gradient(copy.deepcopy(layer), x, spec, autocast)
    got = _watched_gradient(copy.deepcopy(layer), x, spec, autocast)
    assert got.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.equal(got.to(expected.dtype), expected)


def test_watchers_see_named_layers_once_each_and_leave_when_done():
    torch.manual_seed(0)
    model = actcomp.to_compressed(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), "mink0",
                                  first_layer=None)
    seen = []
    with watching_weight_gradients(lambda call: seen.append(call.name)):
        assert watched()
        model(torch.randn(3, 8)).sum().backward()
    assert not watched()
    assert sorted(seen) == ["0", "2"]
