"""The compressor interface every stage implements, independent of any layer type.

A stage turns a tensor into a *payload* tensor (handed to the next stage) plus the tensors
and small metadata it needs to undo itself. Because everything a stage keeps is a tensor or
plain Python, a caller can route the tensors through ``ctx.save_for_backward`` (and so
through saved-tensor hooks) and keep only the metadata on the side.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, NamedTuple

import torch

from actcomp.errors import ActcompError
from actcomp.spec import StageSpec, format_rate


@dataclass(frozen=True)
class Hints:
    """What a caller knows about the tensor that the tensor itself does not say.

    ``channel_dim`` is the channel axis: 1 for (N, C, ...) conv inputs, -1 for (..., C)
    linear inputs, None when the tensor has no channel structure.
    """

    channel_dim: int | None = None


class Encoded(NamedTuple):
    """One stage's output: the payload for the next stage, what it keeps, and metadata."""

    payload: torch.Tensor
    saved: tuple[torch.Tensor, ...]
    meta: Any


@dataclass(frozen=True)
class Compressor:
    """Base class of every stage. Subclasses are frozen dataclasses of their settings.

    Subclasses set ``name`` (registry name), ``kind`` ("sparsifier" or "quantizer") and
    ``takes_rate`` (whether the spec carries a drop rate, stored in the ``drop_rate``
    field), and implement :meth:`encode` / :meth:`decode`. Dataclass fields other than
    ``drop_rate`` are the spec options; a field named with a leading underscore is
    runtime state, not a setting.

    >>> import torch, actcomp
    >>> stage = actcomp.compressors.MinK(0.5)
    >>> packed = stage.compress(torch.tensor([1.0, -4.0, 2.0, 0.5]))
    >>> stage.decompress(packed)
    tensor([ 0., -4.,  2.,  0.])
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    takes_rate: ClassVar[bool] = False

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        raise NotImplementedError

    def fresh(self) -> Compressor:
        """A copy with the same settings and fresh runtime state (one per layer)."""
        return dataclasses.replace(self)

    def check(self) -> None:
        """Validate settings; raise ActcompError naming the bad one and what is valid."""
        if self.takes_rate:
            rate = self.drop_rate  # type: ignore[attr-defined]
            if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate < 1:
                raise ActcompError(f"drop rate of {self.name!r} must be in [0, 1), got {rate!r}")

    def __post_init__(self) -> None:
        # An int given for a float setting becomes a float, so it prints back as one
        # ("momentum=0" would otherwise round-trip to a different spec than "momentum=0.0").
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if hints.get(f.name) is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
        self.check()

    @classmethod
    def settings(cls) -> list[dataclasses.Field]:
        """The dataclass fields that are spec options (not the rate, not runtime state)."""
        return [f for f in dataclasses.fields(cls) if f.name != "drop_rate" and not f.name.startswith("_")]

    @property
    def stage_spec(self) -> StageSpec:
        """Canonical parsed form: options that differ from their defaults, in field order."""
        options = tuple(
            (f.name, _format_option(getattr(self, f.name)))
            for f in self.settings()
            if getattr(self, f.name) != f.default
        )
        rate = float(self.drop_rate) if self.takes_rate else None  # type: ignore[attr-defined]
        return StageSpec(self.name, rate, options)

    def __str__(self) -> str:
        return str(self.stage_spec)

    # A stage is usable on its own: it is then a one-stage pipeline.
    def compress(self, x: torch.Tensor, *, channel_dim: int | None = None):
        from actcomp.pipeline import Pipeline

        return Pipeline(self).compress(x, channel_dim=channel_dim)

    def decompress(self, packed) -> torch.Tensor:
        from actcomp.pipeline import Pipeline

        return Pipeline(self).decompress(packed)


def _format_option(value: Any) -> str:
    if isinstance(value, float):
        return format_rate(value)
    return str(value)


def drop_count(n: int, drop_rate: float) -> int:
    """How many of ``n`` elements a drop rate removes: floor(rate * n).

    The rate is taken as the decimal it prints as, so binary rounding never loses an
    element: 0.29 * 100 is 28.999999999999996 in floats, but 29 are dropped (and 29000000
    of 10**8). The kept count ``n - drop_count(n, rate)`` is therefore ceil((1 - rate) * n),
    and at least one element survives whenever n > 0 and rate < 1.

    >>> drop_count(100, 0.29), drop_count(10**8, 0.29), drop_count(10, 0.95), drop_count(0, 0.5)
    (29, 29000000, 9, 0)
    """
    return min(math.floor(Fraction(repr(float(drop_rate))) * n), max(n - 1, 0))


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied if it is a view into a larger storage, so nbytes are what is kept."""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()
