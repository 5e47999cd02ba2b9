"""The registry of codec implementations (actcomp.core.backends): every registered codec's every
implementation that runs here gives the reference's bytes and values bit for bit; the choice
follows the argument, then use_backend, then the environment, then preference; one warning when
an asked-for kernel cannot take a tensor; the shape-only implementation gives the reference's
shapes; the reference reads nothing back to the host."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from models import HostReads, bits
from torch.utils._python_dispatch import TorchDispatchMode

import actcomp
from actcomp.core import backends, registry
from actcomp.core.backends import use_backend
from actcomp.core.codec import Compressor, Encoded, Hints
from actcomp.whole_model.exact_codecs import BitMask

CODEC_NAMES = sorted(set(registry.list_compressors()) | set(registry.list_codecs()))


@pytest.fixture(autouse=True)
def nothing_asked(monkeypatch):
    monkeypatch.delenv(backends.ENVIRONMENT, raising=False)
    monkeypatch.setattr(actcomp.errors, "WARNED", set())


def codec_named(name: str) -> Compressor:
    klass = registry.compressor_class(name) if name in registry.list_compressors() else registry.codec_class(name)
    return klass(0.9) if klass.takes_rate else klass()


def implementation_names(name: str) -> list[str]:
    klass = type(codec_named(name))
    return sorted(set(backends.implementations(klass, "encode")) | set(backends.implementations(klass, "decode")))


CASES = [(name, implementation) for name in CODEC_NAMES for implementation in implementation_names(name)]


def inputs(codec: Compressor) -> dict[str, torch.Tensor]:
    """The tensors every implementation must agree on: dtypes, odd sizes, a strided view,
    non-finite values, nothing at all."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 131, generator=generator) * 3
    x[0, :5] = torch.tensor([0.0, -0.0, 1e30, -3e38, 0.25])
    if "float" not in codec.takes:
        flag = x > 0
        return {"bool": flag, "odd": flag[:7, :13], "strided": flag.t(), "empty": flag[:0]} if "bool" in codec.takes \
            else {"int": (x * 4).long(), "strided": (x * 4).long().t(), "empty": x[:0].long()}
    special = x.clone()
    special[1, 3], special[5, 7], special[20, 100] = float("nan"), float("inf"), -float("inf")
    cases = {"fp32": x, "bf16": x.bfloat16(), "fp16": x.clamp(-6e4, 6e4).half(), "odd": x[:3, :7].contiguous(),
             "one": x[:1, :1].contiguous(), "strided": x.t(), "bf16 strided": x.bfloat16()[:, ::3],
             "non-finite": special, "bf16 non-finite": special.bfloat16(), "empty": x[:0]}
    if codec.name in _FAILS_EMPTY:
        del cases["empty"]
    return cases


# DropoutMask.encode takes the amax of no values, which raises (exact_codecs.py is another
# branch's to change): its reference fails alike, so no implementation can be compared there.
_FAILS_EMPTY = {"dropout-mask"}


def round_trip(codec: Compressor, x: torch.Tensor, backend: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    torch.manual_seed(0)  # random's seed is drawn from torch's generator
    with use_backend(backend):
        packed = codec.compress(x, channel_dim=-1 if x.dim() else None)
        return packed.tensors, codec.decompress(packed)


# On a GPU the same comparison runs on CUDA tensors too (the Triton kernels for real there).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, implementation", CASES)
def test_every_implementation_gives_the_reference_codes_and_values(name, implementation, device):
    codec = codec_named(name)
    for case, x in inputs(codec).items():
        x = x.to(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the asked-for kernel's one fallback warning
            tensors, decoded = round_trip(codec, x, implementation)
        expected_tensors, expected = round_trip(codec, x, "eager")
        assert len(tensors) == len(expected_tensors), case
        if x.is_floating_point() and x.numel() and x.isfinite().all() and expected_tensors[0].dtype == torch.bool \
                and expected_tensors[0].dim() == 0:
            assert tensors[0], case  # the finite flag, where the codec keeps one
        if codec.flags_non_finite and x.is_floating_point() and not x.isfinite().all():
            # The chain's finite flag decodes this tensor to NaN whatever the codes (core/chain.py):
            # a kernel owes the reference its codes for finite inputs only, and the flag (which a
            # kernel may write itself as it encodes) and the all-NaN output.
            assert not tensors[0] and not expected_tensors[0], case
            assert decoded.isnan().all() and expected.isnan().all(), case
            continue
        for got, want in zip(tensors, expected_tensors):
            assert (got.shape, got.dtype) == (want.shape, want.dtype), case
            assert torch.equal(bits(got), bits(want)), case
        assert decoded.shape == expected.shape and decoded.dtype == expected.dtype, case
        assert torch.equal(bits(decoded), bits(expected)), case


# The codecs whose CUDA slot holds a Triton kernel (kernels/triton_*.py).
TRITON_CODECS = {"int8", "int4", "int2", "relu-mask", "leaky-relu-mask", "clamp-mask", "dropout-mask", "pool-offsets",
                 "fewbit", "fp8", "fp16", "bf16", "mesa8", "channel", "rchannel", "mink", "smink", "dropit", "random"}
# Of them, those with a Triton decode only (mesa8's stateful encode is not dispatched; the
# channel selections' encode is a top-k of norms).
TRITON_DECODE_ONLY = {"mesa8", "channel", "rchannel"}
# A one-bit mask whose slot is BitMask's but which the kernels decline (no predicate of theirs,
# a decode of its own): it runs only inlined in compiled graphs, where Inductor writes its loops.
INHERITED_AND_DECLINED = {"comparison-mask"}


def test_every_built_in_codec_has_its_reference_and_the_triton_kernels_their_slot():
    for name in CODEC_NAMES:
        for method in ("encode", "decode"):
            found = backends.implementations(type(codec_named(name)), method)
            has = name in TRITON_CODECS and (method == "decode" or name not in TRITON_DECODE_ONLY)
            if name in INHERITED_AND_DECLINED:
                codec = codec_named(name)
                assert codec.native_predicate is None and type(codec).decode is not BitMask.decode, name
                has = True
            assert found["eager"] is None and ("triton" in found) == has, (name, method)
    assert "triton" in backends.KERNELS and backends.ALIASES["cuda"] == "triton"


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "mink", "smink", "dropit", "relu-mask"])
def test_the_cpu_kernels_are_chosen_by_default_on_cpu_float32(name):
    codec, x, hints = codec_named(name), torch.randn(64, 300), Hints(channel_dim=-1)
    assert backends.choose(codec, "encode", x, hints) == "native"
    assert backends.choose(codec, "encode", x.to("meta"), hints) == "eager"
    assert backends.choose(codec, "encode", x, hints, backend="eager") == "eager"


@dataclass(frozen=True)
class Doubler(Compressor):
    """A codec of the test's own, unregistered by name, with a kernel in both slots."""

    name, kind = "doubler", "quantizer"

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        return Encoded(x * 2, (), None)

    def decode(self, payload: torch.Tensor, saved: tuple, meta) -> torch.Tensor:
        return payload / 2


@pytest.fixture
def doubler_kernels():
    ran = []

    def kernel(name):
        def encode(codec, x, hints):
            ran.append(name)
            return codec.encode(x, hints)
        return encode

    for name in ("native", "triton"):
        backends.register_implementation(Doubler, name, encode=kernel(name), encodes=lambda codec, x, hints: x.is_cpu)
    yield ran
    for name in ("native", "triton"):
        backends.unregister_implementation(Doubler, name)


def test_the_choice_is_argument_then_block_then_environment_then_preference(doubler_kernels, monkeypatch):
    codec, x, hints = Doubler(), torch.ones(3), Hints(channel_dim=None)

    def chosen(**argument):
        return backends.choose(codec, "encode", x, hints, **argument)

    assert chosen() == "triton"  # preference: the first of KERNELS that takes the tensor
    monkeypatch.setenv(backends.ENVIRONMENT, "0")
    assert chosen() == "eager"
    with use_backend("native"):
        assert chosen() == "native"
        assert chosen(backend="cuda") == "triton"
    assert chosen(backend="native") == "native"
    monkeypatch.delenv(backends.ENVIRONMENT)
    backends.encode(codec, x, hints)
    backends.encode(codec, x, hints, backend="native")
    assert doubler_kernels == ["triton", "native"]
    # A kernel that does not take the tensor is passed over, silently when nothing was asked.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.choose(codec, "encode", torch.ones(3, device="meta"), hints) == "eager"


def test_registering_without_a_predicate_or_under_an_unknown_name_is_an_error():
    with pytest.raises(actcomp.ActcompError, match="needs a capability predicate"):
        backends.register_implementation(Doubler, "native", encode=lambda codec, x, hints: x)
    with pytest.raises(actcomp.ActcompError, match="unknown kernel name 'fused' for Doubler; known: triton, native"):
        backends.register_implementation(Doubler, "fused", encode=lambda codec, x, hints: x, encodes=lambda *a: True)


def test_triton_is_accepted_and_falls_back_to_the_reference_with_one_warning():
    x = torch.randn(8, 300)
    expected = {spec: round_trip(actcomp.parse(spec), x, "eager") for spec in ("channel0.9", "int4")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for spec, (tensors, decoded) in expected.items():
                got_tensors, got = round_trip(actcomp.parse(spec), x, "triton")
                assert all(torch.equal(a, b) for a, b in zip(got_tensors, tensors, strict=True))
                assert torch.equal(got, decoded)
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith("actcomp: backend 'triton' cannot run 'channel' encode on a torch.float32 tensor of "
                                  "(8, 300) on cpu (its triton kernel is not registered for it); the eager reference")


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("shape", [(5, 7, 96), (1000,), (0, 4)])
def test_the_shape_only_implementation_gives_the_reference_shapes(name, shape):
    codec = codec_named(name)
    if name in _FAILS_EMPTY and 0 in shape:
        pytest.skip("its reference raises on an empty tensor")
    x = torch.randn(shape)
    if "float" not in codec.takes:
        x = x > 0 if "bool" in codec.takes else x.long()
    for dtype in ((torch.float32, torch.bfloat16, torch.float16) if x.is_floating_point() else (x.dtype,)):
        hints = Hints(channel_dim=-1)
        state = codec.initial_state()
        torch.manual_seed(0)
        payload, saved, meta = codec.encode(x.to(dtype), hints, *(() if state is None else (codec.initial_state(),)))
        shapes = backends.encoded_shapes(codec, x.to(dtype), hints) if state is None else None
        if shapes is None:
            continue  # a stateful stage is encoded by the chain, not dispatched
        assert [(t.shape, t.dtype) for t in (shapes.payload, *shapes.saved)] == \
            [(t.shape, t.dtype) for t in (payload, *saved)]
        assert all(t.device.type == "meta" for t in (shapes.payload, *shapes.saved))
        assert shapes.meta == meta


def reference_round_trip(codec: Compressor, x: torch.Tensor) -> None:
    """Encode ``x`` and decode it with the reference implementations (a stateful codec from its
    initial state), channels on the last axis."""
    state = codec.initial_state()
    with use_backend("eager"):
        if state is None:
            payload, saved, meta = backends.encode(codec, x, Hints(channel_dim=-1))
        else:
            payload, saved, meta = backends.reference(codec, "encode", x, Hints(channel_dim=-1), state)
        backends.decode(codec, payload, saved, meta)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_the_reference_reads_nothing_back_to_the_host(name):
    codec = codec_named(name)
    x = inputs(codec)["strided" if "float" not in codec.takes else "fp32"]
    x = torch.cat([x] * 20)  # large enough for every CPU shortcut to apply, were it on
    with HostReads() as reads:
        reference_round_trip(codec, x)
    assert not reads.counts, dict(reads.counts)


class _DivisionsByNumbers(TorchDispatchMode):
    """Counts float true divisions whose divisor is a Python number (an integer division is
    exact on every device)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1].startswith("div") and len(args) > 1 \
                and isinstance(args[1], (int, float)) and args[0].is_floating_point() \
                and (kwargs or {}).get("rounding_mode") is None:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_the_reference_never_divides_by_a_python_number(name):
    # CUDA's ATen kernel divides by a Python number as a product with its reciprocal (rounded
    # twice); the CPU's and the Triton kernels divide truly. The H200 run of stop 44 found an int4
    # step one bf16 step apart on CUDA (60000 / 15), so the references divide by a device tensor
    # (kernels.device_constants.true_divide). A CPU cannot show the two roundings; this checks the
    # form. Not for the CPU-only shortcuts, which never see a CUDA tensor.
    codec = codec_named(name)
    x = inputs(codec)["strided" if "float" not in codec.takes else "fp32"]
    with _DivisionsByNumbers() as divisions:
        reference_round_trip(codec, x)
    assert divisions.count == 0


def test_a_traced_tensor_runs_the_reference_not_a_kernel():
    # AOTAutograd traces compress_in_graph's hooks with fake tensors, which have no memory: a
    # Triton kernel there failed on the H100 ("Cannot access data pointer of Tensor").
    from torch._subclasses.fake_tensor import FakeTensorMode

    from actcomp.kernels import triton_runtime

    codec = codec_named("int8")
    launched = sum(triton_runtime.LAUNCHES.values())
    with FakeTensorMode() as mode, use_backend("triton"):
        x = mode.from_tensor(torch.randn(4, 300))
        assert backends.tracing(x)
        packed = actcomp.parse("int8").compress(x)
        codec.decompress(codec.compress(x))
    assert sum(triton_runtime.LAUNCHES.values()) == launched
    assert packed.tensors[-1].shape == (1200,)
