"""Stochastic rounding's noise: a counter-based hash of (seed, element index), uniform, reproducible,
and without torch's global generator."""

import copy

import pytest
import torch
from torch import nn

import actcomp
from actcomp.kernels.chunks import CPU_CHUNK
from actcomp.kernels.noise import FINGERPRINT_SAMPLE, PERIOD, RoundingNoise, noise_at, noise_seed
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

    noise = RoundingNoise(x.t()).slice(0, 3072)

    assert torch.equal(noise, RoundingNoise(x.t().contiguous()).slice(0, 3072))
    # A changed sampled value gives unrelated noise: correlation about 0 (std 1/sqrt(3072) ~ 0.02).
    other = RoundingNoise(nudged.t()).slice(0, 3072)
    assert abs(torch.corrcoef(torch.stack([noise, other]))[0, 1]) < 0.1


def test_the_fingerprint_reads_a_sample_not_every_value():
    # The price of a fingerprint that costs nothing: values outside the sample do not reseed.
    x = torch.randn(FINGERPRINT_SAMPLE * 8)
    nudged = x.clone()
    nudged[1] += 1.0

    assert torch.equal(RoundingNoise(x).slice(0, 4096), RoundingNoise(nudged).slice(0, 4096))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_the_seed_is_an_int64_scalar_on_the_device_from_the_global_seed_and_the_values(dtype, device):
    x = torch.randn(5000, device=device).to(dtype)
    seeds = []
    for seed, values in ((0, x), (0, x.clone()), (1, x), (0, x * 2)):
        torch.manual_seed(seed)
        seeds.append(noise_seed(values))

    assert (seeds[0].dtype, seeds[0].shape, seeds[0].device.type) == (torch.int64, torch.Size([]), device)
    assert bool(seeds[0] == seeds[1]) and not bool(seeds[0] == seeds[2]) and not bool(seeds[0] == seeds[3])
    assert all(0 <= int(seed) < 2**32 for seed in seeds)


@pytest.mark.parametrize("start, count", [(0, 1), (0, 3 * PERIOD), (PERIOD - 5, 10), (12345, 2 * PERIOD + 7),
                                          (2**31 - 100, 300), (2**32 - PERIOD // 2, PERIOD), (2**40 + 3, 1000)])
def test_a_slice_of_the_table_is_the_per_element_hash(start, count):
    # The eager table path and the per-element hash (compiled code's) are one function of the
    # index, also above 2**31 and across periods.
    noise = RoundingNoise(torch.randn(100))
    index = torch.arange(start, start + count)

    assert torch.equal(noise.slice(start, count), noise_at(noise.seed, index))


def test_the_noise_is_uniform_on_0_1_with_mean_one_half_and_variance_one_twelfth():
    # One tensor's noise takes PERIOD distinct draws (each period a rotation of them): with
    # n = 65536 independent U[0, 1) draws the mean's std is 0.0011, the variance's 0.0003 and a
    # 64-bin chi-square has mean 63 and std 11; the floors are five of those stds away.
    noise = RoundingNoise(torch.randn(1000)).slice(0, 4 * PERIOD)
    table = noise[:PERIOD]

    assert float(noise.min()) >= 0 and float(noise.max()) < 1 and noise.dtype == torch.float32
    assert abs(float(table.double().mean()) - 0.5) < 0.0055
    assert abs(float(table.double().var()) - 1 / 12) < 0.0015
    counts = torch.histc(table, bins=64, min=0, max=1)
    assert float(((counts - PERIOD / 64) ** 2 / (PERIOD / 64)).sum()) < 63 + 5 * 11
    # Every draw is a multiple of 2**-24: 24 bits of the hash, none lost to rounding.
    assert torch.equal(noise * 2**24, (noise * 2**24).floor())


@pytest.mark.parametrize("lag", [1, 2, 8, 256, 384, 197 * 384, PERIOD - 1, PERIOD, PERIOD + 1, 3 * PERIOD])
def test_no_pattern_follows_the_shape(lag):
    # Elements a channel, a token, an image or a period apart: uncorrelated noise (std of the
    # correlation ~ 1/sqrt(n), n = PERIOD distinct draws), and almost never the very same draw.
    noise = RoundingNoise(torch.randn(1000)).slice(0, 16 * PERIOD)
    first, second = noise[:-lag], noise[lag:]

    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 5 / PERIOD**0.5
    assert float((first == second).double().mean()) < 0.001


def test_rounding_the_same_values_twice_gives_the_same_codes_and_other_values_new_noise():
    # A checkpointed layer recomputes its input and must round it as the forward did.
    torch.manual_seed(0)
    x = torch.randn(8, 1000)
    stage = actcomp.parse("int2")

    first, second = stage.compress(x), stage.compress(x.clone())

    assert all(map(torch.equal, first.tensors, second.tensors))
    assert not torch.equal(RoundingNoise(x).slice(0, 8000), RoundingNoise(x + 1e-3).slice(0, 8000))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group", [256, 100])
def test_chunked_stages_round_exactly_as_one_whole_tensor_call(bits, group):
    # Several chunks and a partial last group: the stage's codes, offsets and scales equal the
    # pure function's on the whole tensor with the whole noise (with group 100 a chunk starts
    # inside a period).
    x = torch.randn(2 * CPU_CHUNK + 1000)
    stage = actcomp.parse(f"int{bits}:group={group}")
    shape = grouped_shape(x.numel(), group)

    packed = stage.compress(x)
    noise = RoundingNoise(x).slice(0, shape[0] * group).view(shape)
    codes, offset, scale = quantize_affine(x, bits, group, noise)

    assert [torch.equal(a, b) for a, b in zip(packed.tensors[1:], (offset, scale, codes), strict=True)] == [True] * 3
