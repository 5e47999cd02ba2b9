"""The registry of stage names, and building stages from parsed specs.

>>> import actcomp
>>> "mink" in actcomp.list_compressors()
True
"""

from __future__ import annotations

import re
from typing import Any

from actcomp.core.codec import Compressor
from actcomp.core.grammar import StageSpec, spec_error
from actcomp.errors import ActcompError

_REGISTRY: dict[str, type] = {}
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_KINDS = ("sparsifier", "quantizer")


def register_compressor(cls: type | None = None, *, replace: bool = False):
    """Class decorator adding a :class:`~actcomp.core.codec.Compressor` under ``cls.name``.

    >>> import dataclasses, torch, actcomp
    >>> from actcomp.compressors import Compressor, Encoded
    >>> @actcomp.register_compressor
    ... @dataclasses.dataclass(frozen=True)
    ... class Halve(Compressor):
    ...     name = "halve"
    ...     kind = "quantizer"
    ...     def encode(self, x, hints):
    ...         return Encoded(x.half(), (), x.dtype)
    ...     def decode(self, payload, saved, meta):
    ...         return payload.to(meta)
    >>> actcomp.parse("mink0.5+halve")
    Pipeline('mink0.5+halve')
    >>> actcomp.unregister_compressor("halve")
    """
    def add(klass: type) -> type:
        if not (isinstance(klass, type) and issubclass(klass, Compressor)):
            raise ActcompError(f"register_compressor expects a Compressor subclass, got {klass!r}")
        name = klass.name
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ActcompError(
                f"compressor name {name!r} of {klass.__name__} is not valid: use lowercase letters, "
                "digits and '_', starting with a letter"
            )
        if klass.kind not in _KINDS:
            raise ActcompError(f"compressor {name!r} has kind {klass.kind!r}; valid kinds: {', '.join(_KINDS)}")
        klass.rules()  # a setting that could not be written in a spec fails here, not at first use
        if name in _REGISTRY and not replace:
            raise ActcompError(f"a compressor named {name!r} is already registered; pass replace=True to override")
        _REGISTRY[name] = klass
        return klass

    return add if cls is None else add(cls)


def unregister_compressor(name: str) -> None:
    """Remove a user-registered compressor (built-ins may be removed too, at your risk)."""
    if name not in _REGISTRY:
        raise ActcompError(f"no compressor named {name!r}; known: {', '.join(list_compressors())}")
    del _REGISTRY[name]


def list_compressors() -> list[str]:
    """Sorted names of every registered stage."""
    return sorted(_REGISTRY)


def compressor_class(name: str) -> type:
    if name not in _REGISTRY:
        raise ActcompError(f"unknown compressor {name!r}; known: {', '.join(list_compressors())}")
    return _REGISTRY[name]


def build_stage(stage: StageSpec, spec: str):
    """Instantiate the stage a :class:`StageSpec` describes; errors point into ``spec``."""
    cls = compressor_class(stage.name)
    start, length = stage.span

    def fail(problem: str, valid: str = "", key: str | None = None) -> ActcompError:
        # Point at the option itself when there is one, else at the whole stage.
        at, size = start, length
        if key is not None:
            text = spec[start:start + length]
            found = text.find(f":{key}=")
            if found >= 0:
                end = text.find(":", found + 1)
                at, size = start + found + 1, (len(text) if end < 0 else end) - found - 1
        return spec_error(problem, spec, at, size, valid)

    kwargs: dict[str, Any] = {}
    if cls.takes_rate:
        if stage.rate is None:
            raise fail(f"stage {stage.name!r} needs a drop rate", f"write it after the name, e.g. '{stage.name}0.9'")
        kwargs["drop_rate"] = stage.rate
    elif stage.rate is not None:
        raise fail(f"stage {stage.name!r} takes no drop rate", f"write just '{stage.name}'")
    rules = cls.rules()
    options = [f.name for f in cls.settings()]
    for key, text in stage.options:
        if key not in options:
            raise fail(f"unknown option {key!r} for stage {stage.name!r}", f"valid options: {', '.join(options) or 'none'}", key)
        kwargs[key] = rules[key].parse(text)
    # The constructor validates, so a spec and Python code accept exactly the same values.
    try:
        return cls(**kwargs)
    except ActcompError as error:
        bad_option = next((key for key, _ in stage.options if str(error).startswith(f"{key} of ")), None)
        raise fail(str(error), key=bad_option) from None
