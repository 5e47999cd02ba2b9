"""Stochastic rounding draws its noise without moving torch's global generator, reproducibly."""

import copy

import pytest
import torch
from torch import nn

import actcomp
from actcomp.kernels.chunks import CPU_CHUNK
from actcomp.kernels.noise import FINGERPRINT_SAMPLE, RoundingNoise
from actcomp.kernels.quantize import grouped_shape, quantize_affine

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
    nudged[0, 0] += 1e-3  # the first element is always in the fingerprint's sample

    noise = RoundingNoise(x.t(), 256).slice(0, 3072)

    assert torch.equal(noise, RoundingNoise(x.t().contiguous(), 256).slice(0, 3072))
    # A changed sampled value gives unrelated noise: correlation about 0 (std 1/sqrt(3072) ~ 0.02).
    other = RoundingNoise(nudged.t(), 256).slice(0, 3072)
    assert abs(torch.corrcoef(torch.stack([noise, other]))[0, 1]) < 0.1


def test_the_fingerprint_reads_a_sample_not_every_value():
    # The price of a fingerprint that costs nothing: values outside the sample do not reseed.
    x = torch.randn(FINGERPRINT_SAMPLE * 8)
    nudged = x.clone()
    nudged[1] += 1.0

    assert torch.equal(RoundingNoise(x, 256).slice(0, 4096), RoundingNoise(nudged, 256).slice(0, 4096))


def test_periods_read_the_table_at_unrelated_offsets():
    # Elements a period apart (or a multiple of a channel count apart) do not share their draw:
    # each period reads the table rotated by its own offset.
    noise = RoundingNoise(torch.randn(10), 256)
    periods = noise.slice(0, 8 * noise.period).view(8, noise.period)

    assert len({noise.offset(k) for k in range(8)}) == 8
    assert (periods[1:] != periods[0]).float().mean() > 0.99
    assert abs(float(periods.mean()) - 0.5) < 0.01 and float(periods.min()) >= 0 and float(periods.max()) < 1


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_chunked_stages_round_exactly_as_one_whole_tensor_call(bits):
    # Several chunks and a partial last group: the stage's codes, offsets and scales equal the
    # pure function's on the whole tensor with the whole noise.
    x = torch.randn(2 * CPU_CHUNK + 1000)
    stage = actcomp.parse(f"int{bits}")
    shape = grouped_shape(x.numel(), 256)

    packed = stage.compress(x)
    noise = RoundingNoise(x, 256).slice(0, shape[0] * 256).view(shape)
    codes, offset, scale = quantize_affine(x, bits, 256, noise)

    assert [torch.equal(a, b) for a, b in zip(packed.tensors, (offset, scale, codes))] == [True] * 3
