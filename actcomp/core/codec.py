"""The codec interface: every pipeline stage and every whole-model codec implements it.

A codec is a frozen dataclass of its settings with an ``encode``/``decode`` pair, registered by
name (:mod:`actcomp.core.registry`). Pipeline stages (kinds ``sparsifier`` and ``quantizer``)
chain in a spec; whole-model codecs (kinds ``exact`` and ``derivative``) each keep one saved
tensor for the op that saved it (:mod:`actcomp.whole_model.session`). A stage turns a tensor into a
*payload* tensor (handed to the next stage) plus the tensors
and small metadata it needs to undo itself. Because everything a stage keeps is a tensor or
plain Python, a caller can route the tensors through ``ctx.save_for_backward`` (and so
through saved-tensor hooks) and keep only the metadata on the side. What a stage is given
(:class:`Hints`) and gives back (:class:`Encoded`) are defined with the loop that runs the
stages, in :mod:`actcomp.core.packed`, which sits below this module.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal

import torch

from actcomp.core.chain import pack, unpack
from actcomp.core.grammar import StageSpec, format_rate
from actcomp.core.packed import Encoded, Hints, Packed
from actcomp.errors import ActcompError


@dataclass(frozen=True)
class Rule:
    """The values a setting accepts: a real int (never a bool) or a finite number, maybe
    None, and an optional range (``minimum`` included, ``below`` excluded); or a tuple of such
    ints (a pool's kernel size, written ``2x3`` in a spec); or one of a few strings (``choices``).

    >>> Rule(int, minimum=1).describe(), Rule(float, minimum=0, below=1).describe()
    ('an integer >= 1', 'a number in [0, 1)')
    >>> Rule(int, optional=True).parse("None"), Rule(int).parse("64"), Rule(int).parse("2.5")
    (None, 64, '2.5')
    >>> Rule(tuple, minimum=0).parse("2x3"), Rule(str, choices=("none", "tanh")).describe()
    ((2, 3), "one of 'none', 'tanh'")
    """

    kind: type
    optional: bool = False
    minimum: float | None = None
    below: float | None = None
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind is str:
            return "one of " + ", ".join(map(repr, self.choices))
        bounded = self.minimum is not None and self.below is not None
        text = {int: "an integer", tuple: "a tuple of integers"}.get(self.kind) or (
            "a number" if bounded else "a finite number")
        if bounded:
            text += f" in [{self.minimum}, {self.below})"
        elif self.minimum is not None:
            text += f" >= {self.minimum}"
        elif self.below is not None:
            text += f" < {self.below}"
        return text + " or None" if self.optional else text

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.kind is str:
            return isinstance(value, str) and value in self.choices
        if self.kind is tuple:
            return isinstance(value, tuple) and all(self._in_range(item, int) for item in value)
        return self._in_range(value, self.kind)

    def _in_range(self, value: Any, kind: type) -> bool:
        # bool is an int subclass, but True would print a spec that does not parse back.
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            return False
        # NaN, +-inf and ints too large for a float are not finite numbers.
        if kind is float and not abs(value) <= sys.float_info.max:
            return False
        return (self.minimum is None or value >= self.minimum) and (self.below is None or value < self.below)

    def parse(self, text: str) -> Any:
        """Spec text as this rule's type; text that is not one comes back as is, for the
        constructor to reject with the same message as a bad Python value."""
        if text == "None" and self.optional:
            return None
        try:
            if self.kind is tuple:
                return tuple(int(item) for item in text.split("x"))
            return self.kind(text)
        except ValueError:
            return text


_DROP_RATE = Rule(float, minimum=0, below=1)


def setting(default: Any, *, minimum: float | None = None, below: float | None = None) -> Any:
    """A codec option as a dataclass field: the constructor and the spec parser accept only
    values of its annotated type in ``[minimum, below)``: int, float (or either ``| None``),
    ``tuple[int, ...]`` (each item in range) or a ``Literal`` of strings.

    >>> @dataclass(frozen=True)
    ... class Blur(Compressor):
    ...     name, kind = "blur", "quantizer"
    ...     radius: int = setting(2, minimum=1)
    >>> Blur(radius=True)
    Traceback (most recent call last):
    ...
    actcomp.errors.ActcompError: radius of 'blur' must be an integer >= 1, got True
    """
    return dataclasses.field(default=default, metadata={"minimum": minimum, "below": below})


@dataclass(frozen=True)
class Compressor:
    """Base class of every codec. Subclasses are frozen dataclasses of their settings.

    Subclasses set ``name`` (registry name), ``kind`` (one of :data:`KINDS`) and
    ``takes_rate`` (whether the spec carries a drop rate, stored in the ``drop_rate``
    field, always in [0, 1)), and implement :meth:`encode` / :meth:`decode`. Dataclass
    fields other than ``drop_rate`` are the settings (see :func:`setting`); a codec holds
    nothing else, and what it must remember between calls lives with the pipeline (see
    :meth:`initial_state`). Everything :meth:`decode` reads is in the tensors :meth:`encode`
    kept and its metadata (plain values), so a packed tensor needs no closure to come back.

    ``takes`` names the input dtypes a codec accepts ("float", "bool", "int"). By default the
    chain keeps a finite flag beside the codes and decodes a tensor that held NaN or +-inf to
    NaN everywhere (:mod:`actcomp.core.chain`), so :meth:`encode` need not care what it makes
    of them; a codec that keeps every one of them itself (an exact mask must: a NaN decides a
    branch of the backward; a cast does) sets ``flags_non_finite = False``, and a lossless one
    (:meth:`lossless`) is not flagged either.

    >>> import torch, actcomp
    >>> stage = actcomp.compressors.MinK(0.5)
    >>> packed = stage.compress(torch.tensor([1.0, -4.0, 2.0, 0.5]))
    >>> stage.decompress(packed)
    tensor([ 0., -4.,  2.,  0.])
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    takes_rate: ClassVar[bool] = False
    takes: ClassVar[frozenset[str]] = frozenset({"float"})
    flags_non_finite: ClassVar[bool] = True
    # Whether encode draws from torch's global generator (a random choice of what to keep): then
    # two compressions of one tensor differ, and each must really run.
    draws_global_random: ClassVar[bool] = False
    # Whether encode reads what an element's place means (a max pool's argmax positions, plane
    # by plane): whole-model mode then hands it the tensor in its own axis order, never in
    # memory order.
    reads_positions: ClassVar[bool] = False

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        raise NotImplementedError

    def lossless(self) -> bool:
        """Whether decoding gives back every value exactly: a sparsifier that drops nothing
        (``mink0``). False by default: a codec of unknown loss counts as lossy."""
        return self.takes_rate and getattr(self, "drop_rate", None) == 0

    def compiles(self) -> bool:
        """Whether :mod:`~actcomp.core.backends` may run this codec compiled: not a stage with
        runtime state, nor one that draws from torch's generator (compiled code draws other
        numbers). A setting that makes sizes depend on the data says no too."""
        return self.initial_state() is None and not self.draws_global_random

    def initial_state(self) -> Any:
        """Runtime state for one pipeline's use of this stage; None (the default): it keeps none.

        A stage that returns state is called as ``encode(x, hints, state)`` and updates the
        state in place. Each pipeline holds its own, fresh from :meth:`Pipeline.fresh
        <actcomp.core.pipeline.Pipeline.fresh>` and :func:`actcomp.parse`, so every converted layer
        has its own; a stage used alone starts from this state on every call.
        """
        return None

    def __post_init__(self) -> None:
        for name, rule in self.rules().items():
            value = getattr(self, name)
            if not rule.accepts(value):
                label = "drop rate" if name == "drop_rate" else name
                raise ActcompError(f"{label} of {self.name!r} must be {rule.describe()}, got {value!r}")
            # An int given for a float setting becomes a float, so it prints back as one
            # ("momentum=0" would otherwise round-trip to a different spec than "momentum=0.0").
            if rule.kind is float and value is not None:
                object.__setattr__(self, name, float(value))

    @classmethod
    def rules(cls) -> dict[str, Rule]:
        """What the drop rate (for stages that take one) and each setting accept, by field name."""
        # Read once per class: whole-model mode builds a codec per saved tensor.
        if "_rules" not in cls.__dict__:
            cls._rules = cls._read_rules()
        return cls._rules

    @classmethod
    def _read_rules(cls) -> dict[str, Rule]:
        hints = typing.get_type_hints(cls)
        rules = {}
        if cls.takes_rate:
            if "drop_rate" not in {f.name for f in dataclasses.fields(cls)}:
                raise ActcompError(f"compressor {cls.name!r} takes a rate but has no 'drop_rate: float' field")
            rules["drop_rate"] = _DROP_RATE
        for f in cls.settings():
            rule = _rule_of(hints[f.name], f.metadata.get("minimum"), f.metadata.get("below"))
            if rule is None:
                raise ActcompError(
                    f"setting {f.name!r} of compressor {cls.name!r} is annotated {hints[f.name]}; a setting is "
                    "int, float, int | None, float | None, tuple[int, ...] or a Literal of strings"
                )
            rules[f.name] = rule
        return rules

    @classmethod
    def settings(cls) -> list[dataclasses.Field]:
        """The dataclass fields that are spec options (all but the rate)."""
        return [f for f in dataclasses.fields(cls) if f.name != "drop_rate"]

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

    @property
    def label(self) -> str:
        """What the packed form and the memory report call this codec: its spec by default."""
        return str(self)

    # A codec is usable on its own, packing as a one-stage pipeline would.
    def compress(self, x: torch.Tensor, *, channel_dim: int | None = None) -> Packed:
        return pack((self,), self.label, x, channel_dim=channel_dim)

    def decompress(self, packed: Packed) -> torch.Tensor:
        return unpack((self,), self.label, packed)


# The kinds of codec: pipeline stages, then whole-model codecs (exact: the backward computes
# bit-identical gradients from what decode gives back; derivative: within a stated error).
STAGE_KINDS = ("sparsifier", "quantizer")
KINDS = (*STAGE_KINDS, "exact", "derivative")


def _rule_of(annotation: Any, minimum: float | None, below: float | None) -> Rule | None:
    """The rule for a setting annotated ``annotation``, None when a setting cannot be so typed."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal and arguments and all(isinstance(item, str) for item in arguments):
        return Rule(str, choices=arguments)
    if origin is tuple:
        return Rule(tuple, minimum=minimum, below=below) if arguments == (int, ...) else None
    kinds = set(arguments or (annotation,))
    optional = type(None) in kinds
    kinds.discard(type(None))
    if kinds not in ({int}, {float}):
        return None
    return Rule(kinds.pop(), optional, minimum, below)


def _format_option(value: Any) -> str:
    if isinstance(value, float):
        return format_rate(value)
    if isinstance(value, tuple):
        return "x".join(map(str, value))
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
