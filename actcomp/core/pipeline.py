"""Pipelines: stages chained left to right, as a spec string names them.

A pipeline packs through :mod:`actcomp.core.packed`, which also keeps every NaN and +-inf out of
the stages and puts them back exactly.

>>> import torch, actcomp
>>> pipeline = actcomp.parse("mink0.9+int8")
>>> x = torch.randn(4096)
>>> packed = pipeline.compress(x)
>>> packed.nbytes < 0.06 * x.numel() * x.element_size()
True
>>> pipeline.decompress(packed).shape
torch.Size([4096])
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence

import torch

from actcomp.core.chain import pack, unpack
from actcomp.core.codec import Compressor
from actcomp.core.grammar import format_spec, parse_spec, spec_error
from actcomp.core.packed import Packed
from actcomp.core.registry import build_stage, list_compressors
from actcomp.errors import ActcompError


class Pipeline:
    """Stages applied left to right: at most one sparsifier, then at most one quantizer.

    ``stages`` are immutable settings; ``states`` holds, per stage, what it remembers between
    calls (mesa8's running range, None for most), owned by this pipeline alone.

    >>> from actcomp.compressors import MinK, Int8
    >>> Pipeline(MinK(0.9), Int8()) == parse("mink0.9+int8")
    True
    """

    def __init__(self, *stages: Compressor):
        for stage in stages:
            if not isinstance(stage, Compressor):
                raise ActcompError(f"pipeline stages must be Compressor instances, got {stage!r}")
        _check_order(stages, lambda index, why: ActcompError(
            f"{why} in pipeline {format_spec(s.stage_spec for s in stages)!r}"))
        self.stages = tuple(stages)
        # State changes as the pipeline compresses, so it lives here, not in the stages, and
        # never counts in equality (the spec does).
        self.states = tuple(stage.initial_state() for stage in self.stages)
        # Filled now, not at the first read: code that torch.compile traces reads it as a plain
        # attribute (dynamo cannot enter cached_property's lock). Pickles without it compute it.
        self.spec = format_spec(stage.stage_spec for stage in self.stages)

    @functools.cached_property
    def spec(self) -> str:
        """The canonical spec string; ``parse(p.spec) == p``. Computed once: the stages are
        immutable, and compressed layers key their shared copies by it on every call."""
        return format_spec(stage.stage_spec for stage in self.stages)

    def __str__(self) -> str:
        return self.spec

    def __repr__(self) -> str:
        return f"Pipeline({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def lossless(self) -> bool:
        """Whether every stage gives its input back exactly.

        >>> parse("mink0").lossless(), parse("mink0.9").lossless(), parse("mink0+int8").lossless()
        (True, False, False)
        """
        return all(stage.lossless() for stage in self.stages)

    def fresh(self) -> Pipeline:
        """Same spec, fresh per-stage state (each converted layer gets its own).

        The stages are copied too, so a fresh pipeline shares no object with this one.
        """
        return Pipeline(*(copy.copy(stage) for stage in self.stages))

    def compress(self, x: torch.Tensor, *, channel_dim: int | None = None) -> Packed:
        """Compress ``x``; ``channel_dim`` names its channel axis for channel-wise stages."""
        return pack(self.stages, self.spec, x, channel_dim=channel_dim, states=self.states)

    def decompress(self, packed: Packed) -> torch.Tensor:
        """The tensor :meth:`compress` was given, up to the stages' loss."""
        return unpack(self.stages, self.spec, packed)


def parse(spec: str | Pipeline) -> Pipeline:
    """A new pipeline from a spec string (or a fresh copy of a pipeline).

    >>> parse("pmink0.9:block=4096+int4:group=64")
    Pipeline('pmink0.9:block=4096+int4:group=64')
    """
    if isinstance(spec, Pipeline):
        return spec.fresh()
    stage_specs = parse_spec(spec, list_compressors())
    stages = [build_stage(stage, spec) for stage in stage_specs]
    # Checked here first, where the error can point at the stage in the spec text.
    _check_order(stages, lambda index, why: spec_error(
        why, spec, *stage_specs[index].span, "a pipeline is [sparsifier][+quantizer], e.g. 'mink0.9+int8'"))
    return Pipeline(*stages)


def as_pipeline(spec: object, where: str, expected: str = "a spec string or Pipeline") -> Pipeline:
    """``spec`` as a pipeline: a :class:`Pipeline` as it is, a string parsed. Anything else is
    an error naming ``where`` (the argument) and what it ``expected``.

    >>> as_pipeline("int8", "rest")
    Pipeline('int8')
    >>> as_pipeline(8, "rest")
    Traceback (most recent call last):
    actcomp.errors.ActcompError: rest: expected a spec string or Pipeline, got int: 8
    """
    if isinstance(spec, Pipeline):
        return spec
    if isinstance(spec, str):
        return parse(spec)
    raise ActcompError(f"{where}: expected {expected}, got {type(spec).__name__}: {spec!r}")


def _check_order(stages: Sequence[Compressor], error: Callable[[int, str], ActcompError]) -> None:
    """Raise ``error(index, why)`` for the first stage that breaks [sparsifier][+quantizer]."""
    if not stages:
        raise error(0, "a pipeline needs at least one stage")
    seen: set[str] = set()
    for index, stage in enumerate(stages):
        if stage.kind in seen:
            raise error(index, f"a second {stage.kind} is meaningless")
        if stage.kind == "sparsifier" and "quantizer" in seen:
            raise error(index, "a sparsifier after a quantizer would sparsify codes")
        seen.add(stage.kind)
