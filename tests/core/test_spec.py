"""The spec grammar: valid strings, canonical round trips, and one error test per malformed spec.

``actcomp.core.grammar`` is torch-free string work; ``actcomp.parse`` adds the registry (names, options,
rates) and the pipeline order rules on top of it.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import actcomp
from actcomp import ActcompError, Pipeline, parse
from actcomp.compressors import (
    Bf16,
    ChannelMinK,
    DropITReference,
    Fp8,
    Fp16,
    Int2,
    Int4,
    Int8,
    Mesa8,
    MinK,
    ParallelMinK,
    RandomChannels,
    RandomDrop,
)
from actcomp.core.grammar import StageSpec, format_spec, parse_spec
from actcomp.core.registry import compressor_class

NAMES = ["mink", "pmink", "int8", "int4"]


# --- the torch-free grammar -------------------------------------------------------------------


def test_parse_spec_splits_stages_into_frozen_values():
    stages = parse_spec("pmink0.9:block=4096+int4:group=64", NAMES)

    assert stages == (
        StageSpec("pmink", 0.9, (("block", "4096"),)),
        StageSpec("int4", None, (("group", "64"),)),
    )
    with pytest.raises(AttributeError):
        stages[0].rate = 0.5  # frozen


def test_parse_spec_picks_the_longest_known_name():
    # "min" also prefixes "mink0.5"; the longest known name wins.
    assert parse_spec("mink0.5", ["min", "mink"]) == (StageSpec("mink", 0.5),)
    assert parse_spec("min0.5", ["min", "mink"]) == (StageSpec("min", 0.5),)
    # A bit width is part of the name, so "int8" carries no rate.
    assert parse_spec("int8", NAMES) == (StageSpec("int8", None),)


@pytest.mark.parametrize("rate_text, rate", [
    ("0.9", 0.9), (".9", 0.9), ("0.90", 0.9), ("9e-1", 0.9), ("0", 0.0), ("1e-05", 1e-05),
])
def test_parse_spec_reads_rates_as_floats(rate_text, rate):
    assert parse_spec("mink" + rate_text, NAMES) == (StageSpec("mink", rate),)


def test_parse_spec_keeps_options_raw_and_in_order():
    (stage,) = parse_spec("pmink0.5:block=64:foo=-1.5e3", ["pmink"])

    assert stage.options == (("block", "64"), ("foo", "-1.5e3"))


def test_format_spec_inverts_parse_spec():
    spec = "pmink0.9:block=4096+int4:group=64"

    assert format_spec(parse_spec(spec, NAMES)) == spec


def test_spec_module_imports_no_torch():
    # Load actcomp.core.grammar without running actcomp/__init__.py (which imports torch).
    package = Path(actcomp.__file__).parent
    code = (
        "import sys, types\n"
        f"package = types.ModuleType('actcomp'); package.__path__ = [{str(package)!r}]\n"
        "sys.modules['actcomp'] = package\n"
        "from actcomp.core.grammar import parse_spec\n"
        "assert parse_spec('mink0.9+int8', ['mink', 'int8'])[0].rate == 0.9\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    assert result.stdout.strip() == "[]"


# --- valid specs through the registry ---------------------------------------------------------


@pytest.mark.parametrize("spec, stages", [
    ("mink0.9", (MinK(0.9),)),
    ("mink0.9+int8", (MinK(0.9), Int8())),
    ("pmink0.9:block=4096+int4:group=64", (ParallelMinK(0.9, block=4096), Int4(group=64))),
    ("random0.5+int2", (RandomDrop(0.5), Int2())),
    ("channel0.75:dim=-1+fp16", (ChannelMinK(0.75, dim=-1), Fp16())),
    ("rchannel0.5+bf16", (RandomChannels(0.5), Bf16())),
    ("dropit0.9", (DropITReference(0.9),)),
    ("mesa8:groups=4:momentum=0.5", (Mesa8(groups=4, momentum=0.5),)),
    ("fp8", (Fp8(),)),
    ("int8:group=64", (Int8(group=64),)),
    ("mink0+fp16", (MinK(0.0), Fp16())),
])
def test_parse_builds_the_described_stages(spec, stages):
    assert parse(spec).stages == stages


@pytest.mark.parametrize("pipeline, spec", [
    (Pipeline(MinK(0.9), Int8()), "mink0.9+int8"),
    (Pipeline(ParallelMinK(0.9, block=4096), Int4(group=64)), "pmink0.9:block=4096+int4:group=64"),
    (Pipeline(ParallelMinK(drop_rate=0.9)), "pmink0.9"),
    (Pipeline(ChannelMinK(0.5, dim=1), Int2(group=32)), "channel0.5:dim=1+int2:group=32"),
    (Pipeline(RandomChannels(0.25)), "rchannel0.25"),
    (Pipeline(RandomDrop(0.5), Mesa8(momentum=0.8)), "random0.5+mesa8:momentum=0.8"),
    (Pipeline(MinK(0)), "mink0.0"),
    (Pipeline(Fp8()), "fp8"),
])
def test_python_api_equals_string_api(pipeline, spec):
    parsed = parse(spec)

    assert pipeline == parsed
    assert hash(pipeline) == hash(parsed)
    assert str(pipeline) == str(parsed) == spec
    assert repr(parsed) == f"Pipeline({spec!r})"


def test_pipelines_with_different_specs_differ():
    assert parse("mink0.9+int8") != parse("mink0.8+int8")
    assert parse("mink0.9+int8") != parse("mink0.9+int4")
    assert parse("int8") != parse("int8:group=64")
    assert parse("mink0.9") != "mink0.9"


def test_parse_returns_a_new_pipeline_each_time():
    pipeline = parse("mink0.9+mesa8")

    copy = parse(pipeline)
    assert copy == pipeline
    assert copy is not pipeline
    assert copy.stages[1] is not pipeline.stages[1]
    assert copy.states[1] is not pipeline.states[1]


@pytest.mark.parametrize("spec, canonical", [
    ("mink0.90", "mink0.9"),
    ("mink.9", "mink0.9"),
    ("mink9e-1", "mink0.9"),
    ("mink0", "mink0.0"),
    ("mink1e-05", "mink1e-05"),
    ("int8:group=256", "int8"),  # the default is dropped
    ("int8:group=0064", "int8:group=64"),
    ("pmink0.9:block=16384", "pmink0.9"),
    ("pmink0.9:block=4096+int4:group=64", "pmink0.9:block=4096+int4:group=64"),
    ("channel0.5:dim=None", "channel0.5"),
    ("channel0.5:dim=-1", "channel0.5:dim=-1"),
    ("mesa8:momentum=.5:groups=2", "mesa8:groups=2:momentum=0.5"),  # field order
    ("mesa8:momentum=0.9", "mesa8"),
    ("random0.123456789+int2:group=8", "random0.123456789+int2:group=8"),
])
def test_str_is_canonical_and_round_trips(spec, canonical):
    pipeline = parse(spec)

    assert str(pipeline) == canonical
    assert parse(str(pipeline)) == pipeline
    assert str(parse(canonical)) == canonical


def test_integer_valued_float_option_round_trips():
    pipeline = Pipeline(Mesa8(momentum=0))

    assert parse(str(pipeline)) == pipeline


# --- settings: every registered stage, every setting -----------------------------------------


def settings_of_every_stage() -> list[tuple[str, str]]:
    """(stage name, field) for the drop rate and each option of every registered stage."""
    return [(name, field) for name in actcomp.list_compressors() for field in compressor_class(name).rules()]


SETTINGS = settings_of_every_stage()


def valid_values(rule) -> list:
    """Its minimum, a value inside its range, one just below its bound; None if allowed; or
    every choice of a setting that is one of a few words."""
    if rule.kind is str:
        return list(rule.choices)
    low = rule.minimum if rule.minimum is not None else -3
    if rule.kind is int:
        values = [low, low + 1, low + 63]
    else:
        values = [low, low + 0.25, low + 1e6 if rule.below is None else rule.below - 1e-3]
    return [v for v in values if rule.below is None or v < rule.below] + [None] * rule.optional


def invalid_values(rule) -> list:
    """Bools, text, out-of-range and (for floats) non-finite values; None unless allowed."""
    if rule.kind is str:
        return [True, 3, "abc", rule.choices[0].upper(), None]
    values = [True, False, "3", [3]]
    if rule.kind is int:
        values += [2.5, 3.0]
    else:
        values += [float("nan"), float("inf"), -float("inf"), 10**400]
    if rule.minimum is not None:
        values.append(rule.minimum - (1 if rule.kind is int else 0.5))
    if rule.below is not None:
        values.append(rule.below)
    return values + [None] * (not rule.optional)


def invalid_texts(rule) -> list[str]:
    """The same as spec text: what must not parse into a valid setting."""
    if rule.kind is str:
        return ["True", "3", "abc", rule.choices[0].upper(), "None"]
    texts = ["True", "False", "abc", "1e999"]
    texts += ["2.5", "3.0", "1e3"] if rule.kind is int else ["nan", "inf", "-inf"]
    if rule.minimum is not None:
        texts.append(str(rule.minimum - (1 if rule.kind is int else 0.5)))
    if rule.below is not None:
        texts.append(str(rule.below))
    return texts + ["None"] * (not rule.optional)


def stage_with(name: str, field: str, value):
    """Stage ``name`` with ``field`` set to ``value`` (and a rate if it needs one)."""
    cls = compressor_class(name)
    kwargs = {"drop_rate": 0.5} if cls.takes_rate else {}
    return cls(**{**kwargs, field: value})


def spec_with(name: str, field: str, text: str) -> str:
    """Spec text of stage ``name`` with ``field`` written as ``text``."""
    if field == "drop_rate":
        return f"{name}{text}"
    rate = "0.5" if compressor_class(name).takes_rate else ""
    return f"{name}{rate}:{field}={text}"


def expected_problem(name: str, field: str) -> str:
    label = "drop rate" if field == "drop_rate" else field
    return f"{label} of {name!r} must be {compressor_class(name).rules()[field].describe()}, got "


@pytest.mark.parametrize("name, field", SETTINGS, ids=[f"{n}-{f}" for n, f in SETTINGS])
def test_every_valid_setting_prints_a_spec_that_parses_back_equal(name, field):
    rule = compressor_class(name).rules()[field]

    for value in valid_values(rule):
        pipeline = Pipeline(stage_with(name, field, value))
        parsed = parse(str(pipeline))

        assert parsed == pipeline, value
        assert parsed.stages[0] == pipeline.stages[0]
        assert getattr(parsed.stages[0], field) == value
        assert type(getattr(parsed.stages[0], field)) is type(getattr(pipeline.stages[0], field))


@pytest.mark.parametrize("name, field", SETTINGS, ids=[f"{n}-{f}" for n, f in SETTINGS])
def test_every_invalid_setting_is_rejected_in_python_and_in_a_spec(name, field):
    rule = compressor_class(name).rules()[field]

    for value in invalid_values(rule):
        with pytest.raises(ActcompError) as error:
            stage_with(name, field, value)
        assert str(error.value) == expected_problem(name, field) + repr(value)
    for text in invalid_texts(rule):
        spec = spec_with(name, field, text)
        with pytest.raises(ActcompError, match=re.escape(f"in spec {spec!r}")) as error:
            parse(spec)
        message = str(error.value)
        if field == "drop_rate":
            # The grammar itself refuses rates that are not numbers.
            assert expected_problem(name, field) in message or "bad drop rate" in message, message
            assert underlined(message, spec) in (spec, text)
        else:
            assert expected_problem(name, field) in message, message
            assert underlined(message, spec) == f"{field}={text}"


@pytest.mark.parametrize("build, problem", [
    # bool is an int: these used to be accepted and printed specs that did not parse back.
    (lambda: Int8(group=True), "group of 'int8' must be an integer >= 1, got True"),
    (lambda: ParallelMinK(0.5, block=True), "block of 'pmink' must be an integer >= 1, got True"),
    (lambda: Mesa8(momentum=False), "momentum of 'mesa8' must be a number in [0, 1), got False"),
    (lambda: ChannelMinK(0.5, dim=1.0), "dim of 'channel' must be an integer or None, got 1.0"),
])
def test_bools_and_floats_are_not_integers(build, problem):
    with pytest.raises(ActcompError) as error:
        build()

    assert str(error.value) == problem


# --- malformed specs --------------------------------------------------------------------------


def underlined(message: str, spec: str) -> str:
    """The part of ``spec`` that the caret line of an error message points at."""
    lines = message.splitlines()
    quoted = lines.index("    " + spec)
    carets = lines[quoted + 1]
    start = carets.index("^") - 4
    return spec[start:start + carets.count("^")]


@pytest.mark.parametrize("spec, pointed_at, explains", [
    ("mnk0.9+int8", "mnk0.9", "known stages: bf16, channel, dropit, fp16, fp8, int2, int4, int8, mesa8"),
    ("mink1.0", "mink1.0", "drop rate of 'mink' must be a number in [0, 1), got 1.0"),
    ("mink1.5", "mink1.5", "must be a number in [0, 1), got 1.5"),
    ("mink-0.1", "mink-0.1", "must be a number in [0, 1), got -0.1"),
    ("mink", "mink", "needs a drop rate"),
    ("int80.5", "int80.5", "write just 'int8'"),
    ("int3", "int3", "supported integer quantizers: int2, int4, int8"),
    ("int16", "int16", "supported integer quantizers: int2, int4, int8"),
    ("mink0.9x", "0.9x", "a drop rate is a number in [0, 1)"),
    ("mink 0.9", " 0.9", "a drop rate is a number in [0, 1)"),
    ("int8:foo=1", "foo=1", "valid options: group"),
    ("mink0.9:block=4096", "block=4096", "valid options: rice"),
    ("pmink0.9:block=abc", "block=abc", "block of 'pmink' must be an integer >= 1, got 'abc'"),
    ("pmink0.9:block=0", "block=0", "must be an integer >= 1, got 0"),
    ("int8:group=-4", "group=-4", "group of 'int8' must be an integer >= 1, got -4"),
    ("mesa8:momentum=1", "momentum=1", "momentum of 'mesa8' must be a number in [0, 1), got 1.0"),
    ("channel0.5:dim=x", "dim=x", "dim of 'channel' must be an integer or None, got 'x'"),
    ("mink0.9:block", "block", "options are written ':key=value'"),
    ("int8:group=64:group=32", "group=32", "option 'group' given twice"),
    ("mink0.9++int8", "+", "stages are joined by single '+' signs"),
    ("+int8", "+", "stages are joined by single '+' signs"),
    ("int8+", "", "stages are joined by single '+' signs"),
    ("", "", "empty spec"),
    ("   ", "   ", "empty spec"),
    (" mink0.9", " mink0.9", "whitespace in stage"),
    ("mink0.9+pmink0.5", "pmink0.5", "a second sparsifier is meaningless"),
    ("int8+int4", "int4", "a second quantizer is meaningless"),
    ("int8+mink0.9", "mink0.9", "a sparsifier after a quantizer"),
])
def test_malformed_spec_raises_an_error_that_quotes_points_and_explains(spec, pointed_at, explains):
    with pytest.raises(ActcompError, match=re.escape(f"in spec {spec!r}")) as error:
        parse(spec)

    message = str(error.value)
    assert underlined(message, spec) == pointed_at
    assert explains in message


def test_ordering_errors_suggest_the_valid_shape():
    with pytest.raises(ActcompError, match=r"a pipeline is \[sparsifier\]\[\+quantizer\]"):
        parse("int8+mink0.9")


def test_unknown_stage_lists_every_registered_name():
    with pytest.raises(ActcompError) as error:
        parse("mnk0.9+int8")

    known = str(error.value).splitlines()[-1]
    assert known == "known stages: " + ", ".join(actcomp.list_compressors())


@pytest.mark.parametrize("spec", [None, 0.9, b"mink0.9", ["mink0.9"]])
def test_non_string_spec_is_rejected(spec):
    with pytest.raises(ActcompError, match=f"a spec must be a string, got {type(spec).__name__}"):
        parse(spec)


@pytest.mark.parametrize("build, problem", [
    (lambda: MinK(1.0), "drop rate of 'mink' must be a number in [0, 1), got 1.0"),
    (lambda: MinK(-0.1), "drop rate of 'mink' must be a number in [0, 1), got -0.1"),
    (lambda: MinK(True), "drop rate of 'mink' must be a number in [0, 1), got True"),
    (lambda: ParallelMinK(0.5, block=0), "block of 'pmink' must be an integer >= 1, got 0"),
    (lambda: Int4(group=2.5), "group of 'int4' must be an integer >= 1, got 2.5"),
    (lambda: Mesa8(groups=0), "groups of 'mesa8' must be an integer >= 1, got 0"),
    (lambda: Pipeline(), "a pipeline needs at least one stage"),
    (lambda: Pipeline(Int8(), MinK(0.9)), "a sparsifier after a quantizer would sparsify codes in pipeline 'int8+mink0.9'"),
    (lambda: Pipeline(MinK(0.9), RandomDrop(0.5)), "a second sparsifier is meaningless"),
    (lambda: Pipeline("mink0.9"), "pipeline stages must be Compressor instances, got 'mink0.9'"),
])
def test_python_api_rejects_what_the_grammar_rejects(build, problem):
    with pytest.raises(ActcompError) as error:
        build()

    assert problem in str(error.value)


def test_actcomp_error_is_a_value_error():
    assert issubclass(ActcompError, ValueError)
    with pytest.raises(ValueError):
        parse("mnk0.9")
