"""The codec backends: native by default, eager or compiled when asked, eager with one warning when a
compile fails, and compiled codes equal to the eager ones (full tier: compiling is slow)."""

from __future__ import annotations

import warnings

import pytest
import torch

import actcomp
from actcomp.core import backends
from actcomp.core.backends import active_backend, use_backend
from actcomp.errors import ActcompError


@pytest.fixture(autouse=True)
def fresh_backends(monkeypatch):
    monkeypatch.delenv(backends.ENVIRONMENT, raising=False)
    monkeypatch.setattr(backends, "_compiled", {})
    monkeypatch.setattr(backends, "_failed", set())


def forbid_compiling(monkeypatch):
    def refuse(klass, method):
        raise AssertionError(f"{klass.__name__}.{method} was compiled")
    monkeypatch.setattr(backends, "_compiled_method", refuse)


def test_the_default_is_native_and_the_environment_or_a_block_chooses(monkeypatch):
    assert active_backend() == "native"
    monkeypatch.setenv("ACTCOMP_COMPILE", "1")
    assert active_backend() == "compiled"
    with use_backend("eager"):
        assert active_backend() == "eager"
    monkeypatch.setenv("ACTCOMP_COMPILE", "0")
    assert active_backend() == "eager"


def test_bad_choices_are_clear_errors(monkeypatch):
    with pytest.raises(ActcompError, match="unknown codec backend 'fused'; known: eager, native, triton, compiled \\(and cuda"):
        with use_backend("fused"):
            pass
    monkeypatch.setenv("ACTCOMP_COMPILE", "yes")
    with pytest.raises(ActcompError, match="ACTCOMP_COMPILE='yes' is not valid; use 0"):
        active_backend()


def test_eager_runs_nothing_compiled(monkeypatch):
    forbid_compiling(monkeypatch)
    pipeline = actcomp.parse("mink0.9+int8")
    x = torch.randn(1000)
    assert pipeline.decompress(pipeline.compress(x)).shape == x.shape


@pytest.mark.parametrize("spec", ["mink0.9:rice=1", "smink0.9:rice=1", "random0.5", "mesa8"])
def test_codecs_that_cannot_compile_run_eagerly_when_compiled_is_asked(spec, monkeypatch):
    forbid_compiling(monkeypatch)
    pipeline = actcomp.parse(spec)
    x = torch.randn(4, 300)
    with use_backend("compiled"), warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeline.decompress(pipeline.compress(x))


def test_a_failed_compile_warns_once_and_runs_the_eager_reference(monkeypatch):
    def broken(klass, method):
        def run(*args):
            raise RuntimeError("no C++ compiler found\nmore lines")
        return run
    monkeypatch.setattr(backends, "_compiled_method", broken)
    monkeypatch.setattr(actcomp.errors, "WARNED", set())
    pipeline = actcomp.parse("int8")
    x = torch.randn(4, 300)
    expected = pipeline.compress(x).tensors
    with use_backend("compiled"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            packed = pipeline.compress(x)
            pipeline.decompress(packed)
    messages = [str(warning.message) for warning in caught]
    assert messages == ["actcomp: compiling codec 'int8' failed (RuntimeError: no C++ compiler found); it runs "
                        "eagerly from now on (ACTCOMP_COMPILE=0 skips compiling)"]
    assert all(torch.equal(a, b) for a, b in zip(packed.tensors, expected))


# Full tier. A quantizer and a sparsifier through the dispatch (tests/compressors/test_quantizers.py and
# tests/kernels/test_positions.py compile every codec): each method compiles at most twice per tensor
# rank (dynamo guards a tensor's rank; the packed layout's shape, plain integers, turns dynamic
# the first time it changes), plus once for a size torch specialises (a group count of 1 is
# never symbolic), and never again for a new size.
COMPILED_SPECS = ["int8", "smink0.9"]
FIRST_SHAPES = [(3, 700), (5, 1000), (2, 3, 50, 7), (3, 4, 60, 9), (129,), (4096,)]
NEW_SHAPES = [(64, 33), (7, 7, 9, 11), (4099,), (100, 77), (3, 5, 64, 65)]


def _graphs_compiled_over(pipeline, shapes):
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for shape in shapes:
        x = torch.randn(shape)
        eager = pipeline.compress(x)
        with use_backend("compiled"):
            compiled = pipeline.compress(x)
            restored = pipeline.decompress(compiled)
        assert compiled.layout == eager.layout
        assert all(torch.equal(a, b) for a, b in zip(compiled.tensors, eager.tensors)), shape
        assert torch.equal(restored, pipeline.decompress(eager)), shape
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize("spec", COMPILED_SPECS)
def test_compiled_backend_gives_the_eager_codes_and_compiles_once_over_shapes(spec):
    torch._dynamo.reset()
    pipeline = actcomp.parse(spec)
    ranks = len({len(shape) for shape in FIRST_SHAPES})

    first = _graphs_compiled_over(pipeline, FIRST_SHAPES)
    again = _graphs_compiled_over(pipeline, NEW_SHAPES)

    stages = len(pipeline.stages)
    assert first <= 2 * (2 * ranks + 1) * stages, f"{first} graphs for {stages} stage(s) over {FIRST_SHAPES}"
    assert again == 0, f"{again} more graphs for new sizes of the same ranks: {NEW_SHAPES}"


def test_a_kernel_that_writes_the_finite_flag_gets_it_without_applying_it():
    # writes_finite_flag alone (the native quantizers) must reach the encode: it was dropped
    # unless applies_finite_flag was given too, and the chain then ran its own reduction.
    from actcomp.compressors.casts import Fp16

    calls = []

    def encode(codec, x, hints, finite=None):
        calls.append(finite)
        finite.fill_(True)
        return codec.encode(x, hints)

    backends.register_implementation(Fp16, "triton", encode=encode, encodes=lambda codec, x, hints: True,
                                     writes_finite_flag=True)
    try:
        assert backends._applies_finite_flag(Fp16(), "encode", "triton")
        _, flag = backends.encode_flagged(Fp16(), torch.ones(4), None, lambda x: torch.tensor(False),
                                          backend="triton")
        assert len(calls) == 1 and calls[0] is flag and bool(flag)  # the kernel's flag, not the reduction's
    finally:
        backends.unregister_implementation(Fp16, "triton")
    from actcomp.compressors.affine import GroupQuant
    assert backends._applies_finite_flag(GroupQuant(), "encode", "native")
    assert not backends._applies_finite_flag(GroupQuant(), "decode", "native")
