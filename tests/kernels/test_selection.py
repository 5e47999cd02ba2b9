"""Min-k without sorting: the exact threshold (mink, dropit) and the one-pass sampled one (smink)."""

import math

import pytest
import torch

import actcomp
from actcomp.kernels.chunks import CPU_CHUNK
from actcomp.kernels.thresholds import SAMPLE, exact_threshold, magnitude_keys

# smink's documented tolerance on the kept fraction.
TOLERANCE = 0.01


def distributions(count: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    gaussian = torch.randn(count, generator=generator)
    channels = torch.randn(count // 384, 384, generator=generator) * torch.logspace(-3, 1, 384)
    return {
        "gaussian": gaussian,
        "heavy tail": torch.distributions.StudentT(1.5).sample((count,)),
        "relu (half zeros)": gaussian.clamp(min=0),
        "bf16 ties": torch.randn(count, generator=generator).to(torch.bfloat16),
        "channel scales": channels.view(-1),  # structured: a sample that aliased would be off
        "sorted": gaussian.abs().sort().values,
    }


def kept_of(spec: str, x: torch.Tensor) -> torch.Tensor:
    stage = actcomp.parse(spec)
    y = stage.decompress(stage.compress(x))
    kept = y != 0
    assert torch.equal(y[kept], x[kept])  # kept values are exact
    return kept


@pytest.mark.parametrize("count", [1000, 3 * CPU_CHUNK + 17])
@pytest.mark.parametrize("name", ["gaussian", "heavy tail", "relu (half zeros)", "bf16 ties", "channel scales", "sorted"])
def test_mink_keeps_exactly_k_and_only_the_largest(name, count):
    x = distributions(1152)[name][:count] if count < 1152 else distributions(count - count % 384)[name]
    kept_target = x.numel() - math.floor(0.9 * x.numel())

    stage = actcomp.parse("mink0.9")
    packed = stage.compress(x)
    y = stage.decompress(packed)
    # Exactly k positions kept (zeros among them come back as zeros, so count positions).
    assert packed.layout.stages[0][1].capacity == kept_target
    kept = y != 0
    assert torch.equal(y[kept], x[kept])
    magnitude = x.abs().float()
    dropped = (y == 0) & (x != 0)
    if dropped.any() and kept.any():
        assert float(magnitude[dropped].max()) <= float(magnitude[kept].min())


def test_mink_breaks_ties_by_position():
    x = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.5, 2.0, 3.0, 0.1])
    y = actcomp.parse("mink0.5").decompress(actcomp.parse("mink0.5").compress(x))

    assert y.tolist() == [0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 3.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("kept", [1, 999, 1000, 70_000, 4 * SAMPLE])
def test_radix_select_finds_the_kept_th_largest_magnitude_and_its_ties(kept, dtype):
    x = torch.randn(4 * SAMPLE, generator=torch.Generator().manual_seed(kept)).to(dtype)
    x[::7] = x[3]  # a mass of ties

    found = exact_threshold(x, kept)

    magnitude = x.abs().double()
    expected = torch.topk(magnitude, kept).values[-1]
    assert magnitude_keys(x)[magnitude == expected].unique().tolist() == [int(found.key)]
    assert int((magnitude > expected).sum() + found.ties) == kept
    assert 1 <= int(found.ties) <= int((magnitude == expected).sum())


@pytest.mark.parametrize("name", ["gaussian", "heavy tail", "bf16 ties", "channel scales", "sorted"])
@pytest.mark.parametrize("rate", [0.5, 0.9, 0.99])
def test_smink_keeps_the_target_fraction_within_its_tolerance(name, rate):
    x = distributions(768 * 1024)[name]

    kept = kept_of(f"smink{rate}", x)

    assert abs(float(kept.float().mean()) - (1 - rate)) <= TOLERANCE
    # What it keeps is the largest: nothing dropped beats anything kept.
    magnitude = x.abs().float()
    assert float(magnitude[~kept].max()) <= float(magnitude[kept].min())


def test_smink_keeps_only_non_zeros_when_zeros_are_more_than_the_drop_rate():
    x = torch.randn(768 * 1024).clamp(min=0)  # half zeros
    x[torch.rand(x.numel(), generator=torch.Generator().manual_seed(0)) < 0.45] = 0  # ~72% zeros

    kept = kept_of("smink0.5", x)

    assert torch.equal(kept, x != 0)


def test_smink_on_a_small_tensor_is_exact_mink():
    x = torch.randn(SAMPLE)
    stage, exact = actcomp.parse("smink0.9"), actcomp.parse("mink0.9")

    assert torch.equal(stage.decompress(stage.compress(x)), exact.decompress(exact.compress(x)))


def test_smink_is_registered_and_chains():
    assert "smink" in actcomp.list_compressors()
    x = torch.randn(768 * 1024)
    packed = actcomp.parse("smink0.9+int8").compress(x)
    y = actcomp.parse("smink0.9+int8").decompress(packed)

    assert packed.nbytes < 0.05 * x.numel() * 4
    assert abs(float((y != 0).float().mean()) - 0.1) <= TOLERANCE
