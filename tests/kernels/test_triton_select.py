"""The Triton selection kernels of mink, smink, dropit and random (actcomp.kernels.triton_select)
under Triton's interpreter: codes and decoded values bit for bit those of the eager reference,
over sizes that are not multiples of a block, dtypes, ties, all-equal values, mostly zeros
(smink's empty slots), a strided input, and NaN and inf with the chain's finite flag (which the
kernels write and apply) or without it; the launches each encode and decode takes; no read back
to the host outside the kernels."""

from __future__ import annotations

import pytest
import torch
from models import HostReads

import actcomp
from actcomp.compressors.elements import DropITReference, MinK, RandomDrop, SampledMinK
from actcomp.core import backends, chain
from actcomp.core.backends import use_backend
from actcomp.core.codec import Hints
from actcomp.kernels import triton_runtime

triton_select = pytest.importorskip("actcomp.kernels.triton_select", reason="needs triton")

pytestmark = pytest.mark.skipif(not triton_runtime.runs_on(torch.device("cpu")),
                                reason="needs triton and TRITON_INTERPRET=1 (tests/conftest.py)")


def round_trip(codec, x, backend):
    torch.manual_seed(0)  # random's seed is drawn from torch's generator
    with use_backend(backend):
        packed = codec.compress(x)
        return packed.tensors, codec.decompress(packed)


def assert_same(codec, x):
    triton_runtime.LAUNCHES.clear()
    tensors, decoded = round_trip(codec, x, "triton")
    if codec.kept_count(x.numel()) < x.numel():
        assert sum(triton_runtime.LAUNCHES.values()) > 0  # the kernels ran
    expected_tensors, expected = round_trip(codec, x, "eager")
    assert len(tensors) == len(expected_tensors)
    for got, want in zip(tensors, expected_tensors):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    assert torch.equal(decoded.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


def values(count: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    x = torch.randn(count, generator=torch.Generator().manual_seed(count)) * 3
    if kind == "ties":
        x = x.round()  # few distinct magnitudes: many ties at the threshold
    elif kind == "equal":
        x = torch.full((count,), -1.5)
    elif kind == "zeros":
        x[: count * 19 // 20] = 0.0  # more zeros than the drop rate: smink keeps only the non-zero ones
    elif kind == "narrow":
        x = 1 + x * 1e-5  # the keys share their upper digits: the threshold is found in the last
    elif kind == "wide":
        x = x * torch.logspace(-30, 30, count)  # the keys spread over the upper digits
    return x.to(dtype)


@pytest.mark.parametrize("count", [1, 7, 1000, 4099, 20000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_selection_gives_the_reference_codes(count, dtype):
    x = values(count, dtype, "random")
    codecs = [MinK(0.9), SampledMinK(0.9, sample=512), RandomDrop(0.9)]
    if count < 20000:  # the interpreter runs programs one by one: the largest size for three only
        codecs += [MinK(0.5), DropITReference(0.9), RandomDrop(0.5)]
    for codec in codecs:
        assert_same(codec, x)


@pytest.mark.parametrize("kind", ["ties", "equal", "zeros", "narrow", "wide"])
@pytest.mark.parametrize("rate", [0.5, 0.9])
def test_ties_equal_values_and_zeros_give_the_reference_codes(kind, rate):
    for dtype in (torch.float32, torch.bfloat16):
        x = values(4099, dtype, kind)
        for codec in (MinK(rate), SampledMinK(rate, sample=256)):
            assert_same(codec, x)
    assert_same(DropITReference(rate), values(4099, torch.float32, kind))


def test_a_strided_input_gives_the_reference_codes():
    x = torch.randn(60, 70, generator=torch.Generator().manual_seed(1))
    for codec in (MinK(0.9), SampledMinK(0.9, sample=256)):
        assert_same(codec, x.t())


def packed_and_decoded(codec, x, backend, flag_non_finite):
    torch.manual_seed(0)
    with use_backend(backend):
        packed = chain.pack([codec], "x", x, flag_non_finite=flag_non_finite)
        return packed.tensors, chain.unpack([codec], "x", packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("count", [7, 4099])
def test_nan_and_inf_give_the_reference_codes_flagged_or_not(dtype, count):
    x = values(count, dtype, "random")
    x[[1, count // 2, count - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    only_inf = values(count, dtype, "random")
    only_inf[count - 1] = float("inf")  # met by the last block alone: its program clears the flag
    for case in (x, only_inf, values(count, dtype, "random")):
        for codec in (MinK(0.9), MinK(0.5), SampledMinK(0.9, sample=256), DropITReference(0.9), RandomDrop(0.9)):
            for flag_non_finite in (True, False):
                tensors, decoded = packed_and_decoded(codec, case, "triton", flag_non_finite)
                want_tensors, want = packed_and_decoded(codec, case, "eager", flag_non_finite)
                assert len(tensors) == len(want_tensors)
                for got, expected in zip(tensors, want_tensors):
                    assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
                assert torch.equal(decoded.view(torch.uint8), want.view(torch.uint8)), (codec, flag_non_finite)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # int8's group arithmetic on -inf, in the interpreter's numpy
def test_a_flagged_pipeline_decodes_to_nan_everywhere():
    pipeline = actcomp.parse("mink0.9+int8")
    for dtype in (torch.float32, torch.bfloat16):
        x = values(4099, dtype, "random")
        x[3000] = -float("inf")
        with use_backend("triton"):
            packed = pipeline.compress(x)
            assert not bool(packed.tensors[0])
            assert bool(pipeline.decompress(packed).isnan().all())


@pytest.mark.parametrize("codec, dtype, encode_launches", [(MinK(0.9), torch.float32, 5), (MinK(0.9), torch.bfloat16, 3),
                                                           (SampledMinK(0.9, sample=256), torch.float32, 5),
                                                           (SampledMinK(0.9, sample=256), torch.bfloat16, 3),
                                                           (DropITReference(0.9), torch.float32, 5)])
def test_launches_per_encode_and_decode(codec, dtype, encode_launches):
    x = values(4099, dtype, "random")
    with use_backend("triton"):
        triton_runtime.LAUNCHES.clear()
        packed = codec.compress(x)
        # A histogram pass a digit but the last (8, 8, 8 and 7 bits of fp32's keys, 8 and 8 of
        # bf16's), then count (the last digit's pass, of smink's sample too) and write: the count
        # pass sets the chain's finite flag and the write pass clears it, no launch of its own.
        assert sum(triton_runtime.LAUNCHES.values()) == encode_launches
        assert "_finite_kernel" not in triton_runtime.LAUNCHES
        triton_runtime.LAUNCHES.clear()
        codec.decompress(packed)
        # Popcount (Elias-Fano's fills the output) and expand or scatter; indices: fill and
        # scatter; each applying the flag.
        assert sum(triton_runtime.LAUNCHES.values()) == 2


def test_random_encodes_and_decodes_in_three_launches_each():
    codec, x = RandomDrop(0.9), values(4099, torch.float16, "random")
    with use_backend("triton"):
        triton_runtime.LAUNCHES.clear()
        packed = codec.compress(x)
        # An 8-bit pass over the 16-bit keys, count, write (which also writes the finite flag).
        assert sum(triton_runtime.LAUNCHES.values()) == 3
        triton_runtime.LAUNCHES.clear()
        codec.decompress(packed)
        assert sum(triton_runtime.LAUNCHES.values()) == 3  # the same passes, the write gathering instead


@pytest.mark.parametrize("chunk", [2048, 2])
def test_past_one_vector_of_blocks_the_offsets_come_from_prefix_sums(monkeypatch, chunk):
    # Past _SCAN blocks one launch sums the threshold's column of the blocks' counts (each program
    # would read them all), _OFFSETS_CHUNK blocks a step (2: two steps for 3 blocks).
    monkeypatch.setattr(triton_select, "_SCAN", 2)
    monkeypatch.setattr(triton_select, "_OFFSETS_CHUNK", chunk)
    x = values(4099, torch.float32, "ties")  # 3 blocks
    x[5] = float("nan")
    for codec in (MinK(0.9), MinK(0.5), SampledMinK(0.9, sample=256), DropITReference(0.9), RandomDrop(0.9)):
        assert_same(codec, x)
        assert_same(codec, x.bfloat16())
    assert_same(MinK(0.9), values(20000, torch.float32, "random"))  # Elias-Fano's high stream in 3 blocks


def test_smink_drops_the_last_when_more_than_its_slots_lie_above_a_missed_threshold():
    x = torch.full((4099,), 5.0)
    x[1::7] = -7.0
    x[::13] = 0.01  # smink's sample (every 13th of 4099 at sample=256) sees only the small ones
    assert_same(SampledMinK(0.9, sample=256), x)


def test_the_wrappers_read_nothing_back_to_the_host(monkeypatch):
    # The launches left out: under the interpreter they copy to numpy, on a GPU they read nothing back.
    monkeypatch.setattr(triton_select, "launch", lambda *args, **meta: None)
    x = values(4099, torch.float32, "random")
    for codec in (MinK(0.9), MinK(0.5), SampledMinK(0.9, sample=256), DropITReference(0.9), RandomDrop(0.9)):
        with use_backend("triton"):
            assert backends.choose(codec, "encode", x, Hints()) == "triton"
        with use_backend("triton"), HostReads() as reads:  # the stage alone: on a CPU the chain reads its flag
            encoded = backends.encode(codec, x, Hints())
            backends.decode(codec, encoded.payload, encoded.saved, encoded.meta)
        assert not reads.counts, (codec, reads.counts)
