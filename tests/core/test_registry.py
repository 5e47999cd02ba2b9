"""The registry: users add stages under new names without editing the library."""

import dataclasses

import pytest
import torch

import actcomp
from actcomp import ActcompError, Pipeline, parse
from actcomp.compressors import Compressor, Encoded, Int8, MinK, setting

BUILTINS = actcomp.list_compressors()


@pytest.fixture
def registry():
    """``register_compressor`` that undoes itself: the registry is restored after the test."""
    before = actcomp.list_compressors()
    added = []

    def register(cls, **kwargs):
        actcomp.register_compressor(cls, **kwargs)
        added.append(cls.name)
        return cls

    yield register
    for name in set(added) - set(before):
        if name in actcomp.list_compressors():
            actcomp.unregister_compressor(name)
    assert actcomp.list_compressors() == before


def make_stage(name: str, kind: str = "quantizer", takes_rate: bool = False):
    """A frozen-dataclass Compressor called ``name``: halves precision, or keeps every other element."""

    if kind == "quantizer":
        @dataclasses.dataclass(frozen=True)
        class Halve(Compressor):
            factor: float = 1.0

            def encode(self, x, hints):
                return Encoded((x * self.factor).half(), (), x.dtype)

            def decode(self, payload, saved, meta):
                return payload.to(meta) / self.factor

        cls = Halve
    else:
        @dataclasses.dataclass(frozen=True)
        class EveryOther(Compressor):
            drop_rate: float = 0.5

            def encode(self, x, hints):
                flat = x.reshape(-1)
                return Encoded(flat[::2].clone(), (), flat.numel())

            def decode(self, payload, saved, meta):
                out = payload.new_zeros(meta)
                out[::2] = payload
                return out

        cls = EveryOther
    cls.name, cls.kind, cls.takes_rate = name, kind, takes_rate
    return cls


def test_builtins_are_listed_sorted():
    assert BUILTINS == sorted(BUILTINS)
    assert set(BUILTINS) >= {
        "mink", "pmink", "random", "channel", "rchannel", "dropit",
        "int8", "int4", "int2", "mesa8", "fp16", "bf16", "fp8",
    }


def test_a_registered_quantizer_is_listed_parsed_and_round_trips(registry):
    halve = registry(make_stage("halve"))

    assert "halve" in actcomp.list_compressors()
    assert actcomp.list_compressors() == sorted(BUILTINS + ["halve"])
    pipeline = parse("mink0.5+halve:factor=2.0")
    assert pipeline == Pipeline(MinK(0.5), halve(factor=2.0))
    assert str(pipeline) == "mink0.5+halve:factor=2.0"
    assert str(parse("halve:factor=1.0")) == "halve"  # default dropped

    x = torch.tensor([1.0, -4.0, 2.0, 0.5])
    packed = pipeline.compress(x)
    assert torch.equal(pipeline.decompress(packed), torch.tensor([0.0, -4.0, 2.0, 0.0]))
    assert packed.nbytes == 2 * 2 + 1 + 1  # two fp16 values, a 4-element bitmask, the finite flag


def test_a_registered_sparsifier_takes_a_rate_and_chains(registry):
    every_other = registry(make_stage("everyother", kind="sparsifier", takes_rate=True))

    pipeline = parse("everyother0.5+int8")
    assert pipeline == Pipeline(every_other(0.5), Int8())
    y = pipeline.decompress(pipeline.compress(torch.full((6,), 3.0)))
    assert torch.equal(y, torch.tensor([3.0, 0.0, 3.0, 0.0, 3.0, 0.0]))
    with pytest.raises(ActcompError, match="needs a drop rate"):
        parse("everyother+int8")
    with pytest.raises(ActcompError, match="a second sparsifier is meaningless"):
        parse("mink0.9+everyother0.5")


def test_registered_names_join_the_error_listing(registry):
    registry(make_stage("halve"))

    with pytest.raises(ActcompError, match="known stages: .*halve"):
        parse("halv")


def test_register_works_as_a_decorator_with_options(registry):
    cls = make_stage("halve")
    actcomp.register_compressor(replace=False)(cls)
    registry(cls, replace=True)  # tracked for clean-up; replacing itself is allowed

    assert "halve" in actcomp.list_compressors()


def test_duplicate_name_is_rejected_unless_replacing(registry):
    registry(make_stage("halve"))

    with pytest.raises(ActcompError, match="a compressor named 'halve' is already registered; pass replace=True"):
        actcomp.register_compressor(make_stage("halve"))
    replacement = registry(make_stage("halve"), replace=True)
    assert parse("halve").stages[0].__class__ is replacement


def test_a_builtin_name_cannot_be_taken_by_accident():
    with pytest.raises(ActcompError, match="'mink' is already registered"):
        actcomp.register_compressor(make_stage("mink", kind="sparsifier", takes_rate=True))

    assert parse("mink0.5").stages[0] == MinK(0.5)


@pytest.mark.parametrize("name", ["Halve", "9lives", "half-precision", "half.precision", "", "my stage", "x0.5"])
def test_bad_names_are_rejected(name, registry):
    with pytest.raises(ActcompError, match="is not valid: use lowercase letters, digits and '_'"):
        registry(make_stage(name))

    assert name not in actcomp.list_compressors()


@pytest.mark.parametrize("name", ["q", "my_stage", "int16", "quant_"])
def test_good_names_are_accepted(name, registry):
    registry(make_stage(name))

    assert name in actcomp.list_compressors()
    assert str(parse(name)) == name


@pytest.mark.parametrize("name", ["my_q8", "q8a8"])
def test_names_ending_in_digits_after_an_underscore_are_accepted(name, registry):
    registry(make_stage(name))

    assert name in actcomp.list_compressors()


def test_non_compressors_and_bad_kinds_are_rejected():
    with pytest.raises(ActcompError, match="expects a Compressor subclass"):
        actcomp.register_compressor(object)
    with pytest.raises(ActcompError, match="expects a Compressor subclass"):
        actcomp.register_compressor(Int8())
    with pytest.raises(ActcompError, match="has kind 'codec'; valid kinds: sparsifier, quantizer"):
        actcomp.register_compressor(make_stage("codec_stage", kind="codec"))

    assert "codec_stage" not in actcomp.list_compressors()


def test_a_registered_stage_settings_are_validated_like_the_builtins(registry):
    @dataclasses.dataclass(frozen=True)
    class Scale(Compressor):
        name, kind = "scale", "quantizer"
        factor: float = setting(2.0, minimum=1)
        shift: int | None = None

        def encode(self, x, hints):
            return Encoded(x * self.factor, (), None)

        def decode(self, payload, saved, meta):
            return payload / self.factor

    registry(Scale)

    assert parse("scale:factor=4:shift=-1").stages == (Scale(4.0, -1),)
    assert str(Scale(factor=3)) == "scale:factor=3.0"
    with pytest.raises(ActcompError, match=r"factor of 'scale' must be a finite number >= 1, got 0.5"):
        Scale(factor=0.5)
    with pytest.raises(ActcompError, match=r"factor of 'scale' must be a finite number >= 1, got inf"):
        parse("scale:factor=inf")
    with pytest.raises(ActcompError, match=r"shift of 'scale' must be an integer or None, got True"):
        Scale(shift=True)


@pytest.mark.parametrize("annotation", [bool, str, "int | str", list])
def test_settings_that_a_spec_cannot_write_are_refused_at_registration(annotation, registry):
    cls = dataclasses.make_dataclass(
        "Flagged", [("flag", annotation, dataclasses.field(default=None))], bases=(make_stage("flagged"),), frozen=True,
    )

    with pytest.raises(ActcompError, match="setting 'flag' of compressor 'flagged' is annotated .*; a setting is int, float"):
        registry(cls)

    assert "flagged" not in actcomp.list_compressors()


def test_a_stage_that_takes_a_rate_needs_a_drop_rate_field(registry):
    with pytest.raises(ActcompError, match="compressor 'halve' takes a rate but has no 'drop_rate: float' field"):
        registry(make_stage("halve", takes_rate=True))


def test_unregister_removes_the_name(registry):
    registry(make_stage("halve"))

    actcomp.unregister_compressor("halve")

    assert actcomp.list_compressors() == BUILTINS
    with pytest.raises(ActcompError, match="unknown stage 'halve'"):
        parse("halve")


def test_unregistering_an_unknown_name_is_an_error():
    with pytest.raises(ActcompError, match="no compressor named 'halve'; known: bf16, channel"):
        actcomp.unregister_compressor("halve")
