"""The spec grammar: ``"pmink0.9:block=4096+int4:group=64"`` as plain frozen values.

Torch-free on purpose: parsing is pure string work and is tested on its own.

Grammar::

    spec    := stage ("+" stage)*
    stage   := head (":" option)*
    head    := NAME [RATE]          e.g. "mink0.9", "int8"
    option  := KEY "=" VALUE        e.g. "block=4096", "dim=-1"

A head is split into the longest known stage name that prefixes it and the rest, which must
be a number (the drop rate). Knowing the names is what makes ``int8`` (a name) and
``mink0.9`` (name + rate) unambiguous without forcing a separator on users.

>>> parse_spec("pmink0.9:block=4096+int4", ["pmink", "int4", "mink"])
(StageSpec(name='pmink', rate=0.9, options=(('block', '4096'),)), StageSpec(name='int4', rate=None, options=()))
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from actcomp.errors import ActcompError

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_KEY = re.compile(r"[a-z_][a-z0-9_]*")
_VALUE = re.compile(r"[-+.a-zA-Z0-9_]+")
_BIT_WIDTH = re.compile(r"int(\d+)")


@dataclass(frozen=True)
class StageSpec:
    """One parsed stage: its name, optional drop rate and raw ``key=value`` options."""

    name: str
    rate: float | None = None
    options: tuple[tuple[str, str], ...] = ()
    # Where the stage sits in the spec text, so later checks can point at it.
    span: tuple[int, int] = field(default=(0, 0), compare=False, repr=False)

    def __str__(self) -> str:
        rate = "" if self.rate is None else format_rate(self.rate)
        return self.name + rate + "".join(f":{key}={value}" for key, value in self.options)


def format_rate(rate: float) -> str:
    """Shortest text that parses back to the same float (``0.9`` -> ``"0.9"``)."""
    return repr(float(rate))


def spec_error(problem: str, spec: str, start: int, length: int, valid: str = "") -> ActcompError:
    """An error quoting the spec with a caret line under the bad token."""
    caret = " " * start + "^" * max(length, 1)
    lines = [f"{problem} in spec {spec!r}", f"    {spec}", f"    {caret}"]
    if valid:
        lines.append(valid)
    return ActcompError("\n".join(lines))


def parse_spec(spec: str, names: Iterable[str]) -> tuple[StageSpec, ...]:
    """Split ``spec`` into stages, given the known stage ``names``; raises ActcompError."""
    if not isinstance(spec, str):
        raise ActcompError(f"a spec must be a string, got {type(spec).__name__}: {spec!r}")
    known = sorted(set(names), key=len, reverse=True)
    known_text = "known stages: " + ", ".join(sorted(known))
    if not spec.strip():
        raise spec_error("empty spec", spec, 0, len(spec), known_text)
    stages = []
    start = 0
    for token in spec.split("+"):
        stages.append(_parse_stage(token, spec, start, known, known_text))
        start += len(token) + 1
    return tuple(stages)


def _parse_stage(token: str, spec: str, start: int, known: list[str], known_text: str) -> StageSpec:
    if not token:
        raise spec_error("empty stage", spec, start, 1, "stages are joined by single '+' signs")
    if token != token.strip():
        raise spec_error(f"whitespace in stage {token!r}", spec, start, len(token))
    head, *raw_options = token.split(":")
    name = next((n for n in known if head.startswith(n)), None)
    if name is None:
        width = _BIT_WIDTH.fullmatch(head)
        if width is not None:
            supported = ", ".join(sorted(n for n in known if _BIT_WIDTH.fullmatch(n)))
            raise spec_error(
                f"unsupported bit width {width.group(1)} in stage {head!r}",
                spec, start, len(head), f"supported integer quantizers: {supported}",
            )
        raise spec_error(f"unknown stage {head!r}", spec, start, len(head), known_text)
    rate_text = head[len(name):]
    rate = None
    if rate_text:
        if not _NUMBER.fullmatch(rate_text):
            raise spec_error(
                f"bad drop rate {rate_text!r} after stage name {name!r}",
                spec, start + len(name), len(rate_text),
                "a drop rate is a number in [0, 1), e.g. 'mink0.9'; " + known_text,
            )
        rate = float(rate_text)
    options = []
    offset = start + len(head) + 1
    for raw in raw_options:
        key, sep, value = raw.partition("=")
        if not sep or not _KEY.fullmatch(key) or not _VALUE.fullmatch(value):
            raise spec_error(
                f"bad option {raw!r} in stage {token!r}", spec, offset, len(raw),
                "options are written ':key=value', e.g. 'pmink0.9:block=4096'",
            )
        if any(key == seen for seen, _ in options):
            raise spec_error(f"option {key!r} given twice", spec, offset, len(raw))
        options.append((key, value))
        offset += len(raw) + 1
    return StageSpec(name, rate, tuple(options), span=(start, len(token)))


def format_spec(stages: Iterable[StageSpec]) -> str:
    """Inverse of :func:`parse_spec`: ``"+"``-joined stage texts."""
    return "+".join(str(stage) for stage in stages)
