"""Stochastic rounding draws its noise without moving torch's global generator, reproducibly."""

import copy

import pytest
import torch
from torch import nn

import actcomp
from actcomp.compressors.noise import rounding_noise

INT_STAGES = ["int8", "int4", "int2"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def global_states(device: str) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device == "cuda":
        states.append(torch.cuda.get_rng_state())
    return states


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", INT_STAGES)
def test_int_stages_leave_the_global_generator_alone(name, device):
    x = torch.randn(4, 300, device=device)
    before = global_states(device)

    actcomp.parse(name).compress(x)

    assert all(map(torch.equal, global_states(device), before))


def test_a_dropout_after_a_compressed_layer_draws_plain_pytorchs_mask():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    converted = actcomp.to_compressed(copy.deepcopy(plain), "int8", first_layer=None)
    x = torch.randn(8, 32, requires_grad=True)

    outputs = []
    for model in (plain, converted):
        torch.manual_seed(1)
        outputs.append(model(x))

    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", INT_STAGES)
def test_the_global_seed_reproduces_the_codes_and_another_seed_changes_them(name, device):
    x = torch.randn(4, 300, device=device)
    codes = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        codes.append(actcomp.parse(name).compress(x).tensors[-1])

    assert torch.equal(codes[0], codes[1])
    assert not torch.equal(codes[0], codes[2])


def test_noise_follows_the_values_not_their_layout():
    x = torch.randn(64, 48)
    nudged = x.clone()
    nudged[5, 7] += 1e-3

    noise = rounding_noise(x.t(), (12, 256))

    assert torch.equal(noise, rounding_noise(x.t().contiguous(), (12, 256)))
    # One changed value gives unrelated noise: correlation about 0 (std 1/sqrt(3072) ~ 0.02).
    other = rounding_noise(nudged.t(), (12, 256))
    assert abs(torch.corrcoef(torch.stack([noise.view(-1), other.view(-1)]))[0, 1]) < 0.1
