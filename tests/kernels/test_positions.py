"""Sparsifiers in their static form, over the registry: the kept count and every stored size
follow from the input's shape and the settings, decoding puts the kept values back bit for bit,
and encode and decode compile to the same codes."""

import math

import pytest
import torch

import actcomp
from actcomp.compressors import drop_count, elements
from actcomp.core.packed import Hints
from actcomp.core.registry import compressor_class
from actcomp.kernels import eager_select
from actcomp.kernels.chunks import CPU_CHUNK
from actcomp.kernels.eager_cpu import static_path_only
from actcomp.kernels.positions import EliasFano, encode_kept, static_form
from actcomp.kernels.thresholds import kept_count

SPARSIFIERS = [name for name in actcomp.list_compressors() if compressor_class(name).kind == "sparsifier"]
CHANNEL_STAGES = [name for name in SPARSIFIERS if name in ("channel", "rchannel")]
ELEMENT_STAGES = [name for name in SPARSIFIERS if name not in CHANNEL_STAGES]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Each of these keeps exactly k elements; smink keeps at most k.
EXACT_COUNT = {"mink", "pmink", "random", "dropit"}


def distinct(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Non-zero values whose magnitudes differ (as far as the dtype can tell them apart)."""
    count = math.prod(shape)
    generator = torch.Generator().manual_seed(seed)
    magnitudes = (torch.randperm(count, generator=generator).double() + 1) / count * 8
    signs = torch.randint(0, 2, (count,), generator=generator).double() * 2 - 1
    return (magnitudes * signs).to(dtype).view(shape)


def round_trip(name: str, x: torch.Tensor, rate: float = 0.9):
    stage = actcomp.parse(f"{name}{rate}")
    torch.manual_seed(0)
    packed = stage.compress(x, channel_dim=1)
    return packed, stage.decompress(packed)


def static_position_bytes(count: int, kept: int) -> int:
    """The positions module's table: none when all are kept, else the smaller of a bitmask and
    Elias-Fano (ceil(k b / 8) + ceil((k + (n >> b) + 1) / 8) at the best b of 1 to 8)."""
    if kept == count:
        return 0
    elias_fano = min(math.ceil(kept * b / 8) + math.ceil((kept + (count >> b) + 1) / 8) for b in range(1, 9))
    return min(math.ceil(count / 8), elias_fano)


def capacity(name: str, count: int, rate: float) -> int:
    """An element sparsifier's k: ceil((1 - rate) n); pmink's per block of 2**14."""
    if name == "pmink":
        block = 2**14
        return count // block * kept_count(block, rate) + kept_count(count % block, rate)
    return kept_count(count, rate)


FLAG_BYTES = 1  # the chain's finite flag, a 0-d bool, beside every float pipeline's codes


def expected_bytes(name: str, shape: tuple[int, ...], dtype: torch.dtype, rate: float) -> int:
    """Every sparsifier's stored bytes as its docstring says, from the shape and settings."""
    count, size = math.prod(shape), dtype.itemsize
    if name in CHANNEL_STAGES:
        channels = shape[1]
        kept = kept_count(channels, rate)
        return kept * (count // channels) * size + 2 * kept  # int16 channel ids
    kept = capacity(name, count, rate)
    if kept == count:
        return count * size
    if name == "random":
        return kept * size + 8  # the seed, one int64
    if name == "dropit":
        return kept * (size + 4)  # int32 indices
    return kept * size + static_position_bytes(count, kept)


SHAPES = [(4, 6, 5, 3), (3, 70), (2, 16, 3 * CPU_CHUNK // 32 + 13)]  # the last: several chunks, a ragged end


@pytest.mark.parametrize("rate", [0.5, 0.9])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SPARSIFIERS)
def test_kept_values_come_back_bit_exactly_at_their_positions_and_zeros_elsewhere(name, dtype, shape, rate):
    x = distinct(shape, dtype)

    packed, y = round_trip(name, x, rate)

    kept = y != 0
    assert (y.shape, y.dtype) == (x.shape, x.dtype)
    assert torch.equal(y[kept], x[kept])
    assert torch.equal(y[~kept].view(torch.int16), torch.zeros_like(y[~kept]).view(torch.int16))  # +0.0
    if name in CHANNEL_STAGES:
        channel_kept = kept.transpose(0, 1).reshape(shape[1], -1)
        assert channel_kept.all(1).sum() == kept_count(shape[1], rate) and (channel_kept.all(1) | ~channel_kept.any(1)).all()
        return
    # The payload holds the kept values in position order (smink: then zeros in the slots left over).
    payload = packed.tensors[-1]
    count = int(kept.sum())
    assert torch.equal(payload[:count], x.reshape(-1)[kept.reshape(-1)])
    assert not payload[count:].any()
    assert payload.numel() == capacity(name, math.prod(shape), rate)
    assert count == payload.numel() if name in EXACT_COUNT else count <= payload.numel()


@pytest.mark.parametrize("rate", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SPARSIFIERS)
def test_stored_bytes_are_the_docstring_formula_of_shape_and_settings(name, dtype, shape, rate):
    x = distinct(shape, dtype)

    packed, _ = round_trip(name, x, rate)

    assert packed.nbytes == expected_bytes(name, shape, dtype, rate) + FLAG_BYTES


@pytest.mark.parametrize("count", [1003, 1000, 70_001])
def test_elias_fano_empty_slots_leave_the_last_partial_bucket_alone(count):
    """A writer that leaves slots empty (smink) must not decode them onto a real position: with
    ``count`` not a multiple of 2**b, the last bucket's first position is a real element."""
    capacity = count // 10
    form = static_form(count, capacity)
    assert isinstance(form, EliasFano)
    full = (count >> form.low_bits) << form.low_bits
    x = torch.arange(1.0, count + 1)
    mask = torch.zeros(count, dtype=torch.bool)
    mask[[5, count // 2, full if full < count else count - 1]] = True

    values, saved, form = encode_kept(x, lambda part, start: mask[start:start + part.numel()], capacity, form)

    assert torch.equal(form.scatter(values, saved), x * mask)


@pytest.mark.parametrize("name", ELEMENT_STAGES)
def test_element_stages_keep_the_static_count_whatever_the_values(name):
    """The payload's length is k for zeros, ties, a constant and random values alike."""
    shape = (8, 4096)
    inputs = [torch.zeros(shape), torch.ones(shape), torch.randn(shape).to(torch.bfloat16).float(),
              torch.randn(shape).clamp(min=0), torch.randn(shape)]
    kept = capacity(name, math.prod(shape), 0.9)

    lengths = {round_trip(name, x)[0].tensors[-1].numel() for x in inputs}

    assert lengths == {kept}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SPARSIFIERS)
def test_non_contiguous_input_gives_the_codes_of_a_contiguous_copy(name, dtype):
    x = distinct((6, 20, CPU_CHUNK // 100), dtype).transpose(0, 2)
    assert not x.is_contiguous()

    (packed, y), (copy_packed, copy_y) = round_trip(name, x), round_trip(name, x.contiguous())

    assert torch.equal(y, copy_y)
    assert all(torch.equal(a, b) for a, b in zip(packed.tensors, copy_packed.tensors, strict=True))


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.29, 0.5, 0.57, 0.9, 0.95, 0.999, 0.99999, 1e-05, 0.123456789])
def test_kept_count_is_what_drop_count_leaves(rate):
    for count in [0, 1, 2, 3, 7, 10, 100, 1000, 12_345, 10**8, 3 * 10**8 + 1]:
        assert kept_count(count, rate) == count - drop_count(count, rate), count


@pytest.mark.parametrize("spec", ["mink0.9", "mink0.9+int8", "smink0.9:rice=1+int8", "pmink0.5:block=64:rice=1"])
def test_specs_print_back_as_written(spec):
    assert str(actcomp.parse(spec)) == spec


@pytest.mark.parametrize("name", ["mink", "smink", "pmink"])
def test_rice_keeps_the_same_elements_in_fewer_bytes_at_a_high_drop_rate(name):
    x = torch.randn(4, 70_000, generator=torch.Generator().manual_seed(0))

    static_packed, static_y = round_trip(name, x)
    stage = actcomp.parse(f"{name}0.9:rice=1")
    rice_packed = stage.compress(x)

    assert torch.equal(stage.decompress(rice_packed), static_y)
    assert rice_packed.nbytes < static_packed.nbytes


def compile_pair(stage):
    return (torch.compile(stage.encode, fullgraph=True, dynamic=True),
            torch.compile(stage.decode, fullgraph=True, dynamic=True))


@pytest.mark.parametrize("name", SPARSIFIERS)
def test_every_sparsifier_compiles_to_its_eager_codes(name, monkeypatch):
    # Random stages draw their seed from the global generator: compiled code draws as eager does.
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    torch._dynamo.reset()
    stage = compressor_class(name)(0.9)
    encode, decode = compile_pair(stage)
    for shape in [(30, 100), (3, 2 * CPU_CHUNK // 3 + 5)]:  # one chunk; several, ragged
        x = distinct(shape, torch.float32, seed=shape[0])
        hints = Hints(channel_dim=1)

        torch.manual_seed(0)
        eager = stage.encode(x, hints)
        torch.manual_seed(0)
        compiled = encode(x, hints)

        assert torch.equal(compiled.payload, eager.payload)
        assert all(torch.equal(a, b) for a, b in zip(compiled.saved, eager.saved, strict=True))
        assert compiled.meta == eager.meta
        assert torch.equal(decode(*eager), stage.decode(*eager))


def test_rice_refuses_to_compile_and_says_why():
    torch._dynamo.reset()
    encode, _ = compile_pair(compressor_class("mink")(0.9, rice=1))

    # Under fullgraph, dynamo wraps the error; its message quotes ours.
    with pytest.raises(Exception, match=r"ActcompError\('Rice-coded positions \(rice=1\) .* cannot be compiled"):
        encode(torch.randn(1000), Hints())


def inputs_of(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Values with distinct magnitudes, many ties, all zeros, or mostly zeros."""
    shape = (4, 3 * CPU_CHUNK // 8 + 5)
    if kind == "distinct":
        return distinct(shape, dtype)
    generator = torch.Generator().manual_seed(1)
    if kind == "ties":
        return torch.randint(-3, 4, shape, generator=generator).to(dtype)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=generator).clamp(min=1.5).sub(1.5).to(dtype)  # ~93% zeros


@pytest.mark.parametrize("rate", [0.9, 0.99, 0.5, 0.8])
@pytest.mark.parametrize("kind", ["distinct", "ties", "zeros", "mostly_zeros"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ELEMENT_STAGES)
def test_the_eager_cpu_path_gives_the_static_paths_codes(name, dtype, kind, rate):
    x = inputs_of(kind, dtype)

    packed, y = round_trip(name, x, rate)
    with static_path_only():
        static_packed, static_y = round_trip(name, x, rate)

    assert packed.layout == static_packed.layout
    assert all(torch.equal(a, b) for a, b in zip(packed.tensors, static_packed.tensors, strict=True))
    assert torch.equal(y.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                       static_y.view(torch.int16 if dtype.itemsize == 2 else torch.int32))


@pytest.mark.parametrize("name, rate", [("mink", 0.9), ("smink", 0.9), ("dropit", 0.9), ("pmink", 0.9),
                                        ("mink", 0.5), ("mink", 0.3), ("mink", 0.8)])
def test_min_k_on_cpu_takes_the_eager_path_without_the_static_pass(name, rate, monkeypatch):
    """The comparison above means something only if the eager path runs."""
    def static_pass(*args, **kwargs):
        raise AssertionError("the static chunk pass ran")

    monkeypatch.setattr(elements, "encode_kept", static_pass)
    x = distinct((4, CPU_CHUNK), torch.float32)

    actcomp.parse(f"{name}{rate}").compress(x)


def test_a_sample_that_misses_hands_the_tensor_to_the_static_path(monkeypatch):
    x = distinct((4, CPU_CHUNK), torch.float32)
    with static_path_only():
        expected = actcomp.parse("mink0.9").compress(x)
    # A margin below the quantile: fewer candidates than kept elements, every time.
    monkeypatch.setattr(eager_select, "_MARGIN_SIGMAS", -50.0)
    assert eager_select.exact_kept_positions(x.reshape(-1), kept_count(x.numel(), 0.9)) is None

    packed = actcomp.parse("mink0.9").compress(x)

    assert all(torch.equal(a, b) for a, b in zip(packed.tensors, expected.tensors, strict=True))
