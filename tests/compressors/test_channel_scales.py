"""int4/int2's per-channel power-of-two scales (``scale="channel"``): an outlier channel no longer
sets the scale of the groups it shares, the scaling is exact and unbiased, it applies only where
the channels are the last axis of a float32-range tensor, and the native kernels give the
eager reference's bytes with it."""

from __future__ import annotations

import math

import pytest
import torch

import actcomp
from actcomp.compressors.affine import Int2, Int4, Int8
from actcomp.core.backends import use_backend
from actcomp.kernels import native_cpu


def outlier_rows(rows: int = 512, channels: int = 256, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with two outlier channels (50x on every row) and a sink row (300x on them)."""
    x = torch.randn(rows, channels, generator=torch.Generator().manual_seed(seed))
    x[:, [7, 100]] *= 50
    x[0, [7, 100]] *= 300
    return x


def round_trip(stage, x: torch.Tensor, channel_dim: int | None = -1) -> torch.Tensor:
    return stage.decompress(stage.compress(x, channel_dim=channel_dim))


@pytest.mark.parametrize("cls", [Int4, Int2])
def test_an_outlier_channel_no_longer_sets_the_other_channels_steps(cls):
    x = outlier_rows()
    others = torch.ones(x.shape[1], dtype=torch.bool)
    others[[7, 100]] = False

    error = {scale: (round_trip(cls(scale=scale), x) - x)[1:, others].abs().mean() for scale in ("channel", "group")}

    # Group scales: each group spans a 50x channel, so the others' steps are ~50x too large.
    assert error["channel"] < error["group"] / 8
    # The outlier channels keep their own precision: relative error as the others'.
    relative = (round_trip(cls(), x) - x).abs().mean(0) / x.abs().mean(0)
    assert relative[[7, 100]].max() < 2 * relative[others].median()


def test_int8_groups_as_before_unless_asked():
    x = outlier_rows()

    assert Int8().scale == "group" and Int4().scale == "channel" and Int2().scale == "channel"
    assert torch.equal(Int8().compress(x, channel_dim=-1).tensors[1], Int8(scale="group").compress(x).tensors[1])
    assert len(actcomp.parse("int8:scale=channel").compress(x, channel_dim=-1).tensors) == 5  # with the finite flag


def test_one_int8_exponent_per_channel_is_kept():
    x = outlier_rows(64, 128)

    channel, group = Int4().compress(x, channel_dim=-1), Int4(scale="group").compress(x, channel_dim=-1)

    exponents = channel.tensors[3]
    assert exponents.dtype == torch.int8 and exponents.shape == (128,)
    assert channel.nbytes == group.nbytes + 128
    # 2**e <= the channel's mean magnitude < 2**(e + 1).
    mean = x.abs().mean(0)
    assert ((2.0 ** exponents.float() <= mean) & (mean < 2.0 ** (exponents.float() + 1))).all()


@pytest.mark.parametrize("x, channel_dim", [
    (torch.randn(4, 8, 5, 5), 1),          # a conv input: channels are not the last axis
    (torch.randn(32, 64).half(), -1),      # float16: the division could leave its range
    (torch.randn(300), -1),                # one axis: no rows of channels
    (torch.randn(32, 64), None),           # no channel axis given
], ids=["conv", "float16", "1d", "no-hint"])
def test_without_last_axis_channels_of_float32_range_the_groups_are_as_before(x, channel_dim):
    channel = Int4().compress(x, channel_dim=channel_dim)
    group = Int4(scale="group").compress(x, channel_dim=channel_dim)

    assert len(channel.tensors) == len(group.tensors) == 4  # the finite flag, offsets, scales, codes
    assert all(torch.equal(a, b) for a, b in zip(channel.tensors, group.tensors))


def test_the_scaled_rounding_stays_unbiased():
    torch.manual_seed(0)
    draws = 2000
    row = outlier_rows(1, 256)[0]
    stage = Int4()

    # Every row is the same, so this is `draws` independent roundings of one row, whose
    # channels all have the exponents of that row.
    packed = stage.compress(row.repeat(draws, 1), channel_dim=-1)
    mean = stage.decompress(packed).mean(dim=0)

    offset, scale, exponents, _ = packed.tensors[1:]
    step = scale[0].float() * 2.0 ** exponents.float()
    assert ((mean - row).abs() <= 5 * step / (2 * math.sqrt(draws))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_channels_stay_finite(dtype):
    x = torch.randn(64, 32)
    x[:, 0] = 0.0                   # a zero channel: exponent -126
    x[:, 1] = 1e-38                 # a channel far below the others
    x[:, 2] = 3e37                  # and far above
    x[:, 3] = x[:, 3] * 3e37        # huge and varied
    x = x.to(dtype)

    y = round_trip(Int4(group=32), x)

    assert y.dtype == dtype and torch.isfinite(y).all()
    # Each channel is coded on its own scale: its error stays within its own magnitude (one
    # int4 step of a group spanning 3e37 would be 4e36 in every channel).
    assert y[:, 0].abs().max() < 1e-36
    for channel in (1, 2, 3, 10, 31):
        assert (y - x)[:, channel].abs().max() <= x[:, channel].abs().max()


def test_a_linear_layer_compresses_its_input_with_channel_scales():
    torch.manual_seed(0)
    layer = actcomp.to_compressed(torch.nn.Linear(256, 32), "int4", first_layer=None)
    reference = torch.nn.Linear(256, 32)
    reference.load_state_dict(layer.state_dict())
    x = outlier_rows(512, 256)

    layer(x).square().sum().backward()
    reference(x).square().sum().backward()

    cosine = torch.nn.functional.cosine_similarity(layer.weight.grad.reshape(-1), reference.weight.grad.reshape(-1), dim=0)
    # 0.98 with group scales on this input.
    assert cosine > 0.999


needs_native = pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler to build the native kernels")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["int4", "int2:group=7", "int8:scale=channel", "int4:group=100"])
@pytest.mark.parametrize("shape", [(1, 5), (3, 999), (300, 1000), (2, 70_001)])
def test_the_native_kernels_give_the_reference_bytes(spec, dtype, shape):
    # (300, 1000) spans several chunks of 8000-value multiples; (2, 70_001) chunks of
    # whole rows longer than the noise's period.
    x = outlier_rows(*shape, seed=shape[1]).to(dtype) if shape[1] > 100 else torch.randn(shape).to(dtype)
    stage = actcomp.parse(spec)
    results = []
    for backend in ("eager", "native"):
        with use_backend(backend):
            packed = stage.compress(x, channel_dim=-1)
            results.append((packed.tensors, stage.decompress(packed)))
    (eager_tensors, eager_out), (native_tensors, native_out) = results

    assert len(eager_tensors) == 5  # the finite flag, offsets, scales, exponents, codes
    for expected, got in zip(eager_tensors, native_tensors, strict=True):
        assert torch.equal(expected.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8))
    assert torch.equal(eager_out.view(torch.uint8), native_out.view(torch.uint8))
