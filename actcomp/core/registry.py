"""The one registry of codec names (pipeline stages and whole-model codecs), and building
stages from parsed specs.

>>> import actcomp
>>> "mink" in actcomp.list_compressors(), "relu-mask" in actcomp.list_codecs("exact")
(True, True)
"""

from __future__ import annotations

import re
from typing import Any

from actcomp.core.codec import KINDS, STAGE_KINDS, Compressor
from actcomp.core.grammar import StageSpec, spec_error
from actcomp.errors import ActcompError

_REGISTRY: dict[str, type] = {}
_STAGE_NAME = re.compile(r"[a-z][a-z0-9_]*")
# A whole-model codec never appears in a spec, so its name may hold '-' too ("relu-mask").
_CODEC_NAME = re.compile(r"[a-z][a-z0-9_-]*")


def register_compressor(cls: type | None = None, *, replace: bool = False):
    """Class decorator adding a pipeline stage (a :class:`~actcomp.core.codec.Compressor` of
    kind ``sparsifier`` or ``quantizer``) under ``cls.name``.

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
    return _register(cls, STAGE_KINDS, replace)


def register_codec(cls: type | None = None, *, replace: bool = False):
    """Class decorator adding a codec of any kind (:data:`~actcomp.core.codec.KINDS`) under
    ``cls.name``; whole-model codecs (``exact``, ``derivative``) then serve an op through
    :func:`actcomp.register_op_codec`. docs/codecs.md shows a whole example.

    >>> import dataclasses, actcomp
    >>> from actcomp.whole_model.exact_codecs import BitMask
    >>> @actcomp.register_codec
    ... @dataclasses.dataclass(frozen=True)
    ... class Positive(BitMask):
    ...     name = "positive-mask"
    ...     def predicate(self, part):
    ...         return part > 0
    >>> "positive-mask" in actcomp.list_codecs("exact")
    True
    >>> actcomp.unregister_codec("positive-mask")
    """
    return _register(cls, KINDS, replace)


def _register(cls: type | None, kinds: tuple[str, ...], replace: bool):
    function = "register_compressor" if kinds == STAGE_KINDS else "register_codec"

    def add(klass: type) -> type:
        if not (isinstance(klass, type) and issubclass(klass, Compressor)):
            raise ActcompError(f"{function} expects a Compressor subclass, got {klass!r}")
        name = klass.name
        pattern = _STAGE_NAME if klass.kind in STAGE_KINDS else _CODEC_NAME
        if not isinstance(name, str) or not pattern.fullmatch(name):
            extra = "" if pattern is _STAGE_NAME else ", '-'"
            raise ActcompError(
                f"compressor name {name!r} of {klass.__name__} is not valid: use lowercase letters, "
                f"digits and '_'{extra}, starting with a letter"
            )
        if klass.kind not in kinds:
            raise ActcompError(f"compressor {name!r} has kind {klass.kind!r}; valid kinds: {', '.join(kinds)}")
        klass.rules()  # a setting that could not be written in a spec fails here, not at first use
        if name in _REGISTRY and not replace:
            raise ActcompError(f"a compressor named {name!r} is already registered; pass replace=True to override")
        _REGISTRY[name] = klass
        return klass

    return add if cls is None else add(cls)


def unregister_compressor(name: str) -> None:
    """Remove a user-registered compressor (built-ins may be removed too, at your risk)."""
    if name not in list_compressors():
        raise ActcompError(f"no compressor named {name!r}; known: {', '.join(list_compressors())}")
    del _REGISTRY[name]


def unregister_codec(name: str) -> None:
    """Remove a user-registered codec of any kind (built-ins may be removed too, at your risk)."""
    if name not in _REGISTRY:
        raise ActcompError(f"no codec named {name!r}; known: {', '.join(list_codecs())}")
    del _REGISTRY[name]


def list_compressors() -> list[str]:
    """Sorted names of every registered pipeline stage (what a spec may name)."""
    return sorted(name for name, cls in _REGISTRY.items() if cls.kind in STAGE_KINDS)


def list_codecs(kind: str | None = None) -> list[str]:
    """Sorted names of every registered codec, or of those of one ``kind``: ``"sparsifier"`` and
    ``"quantizer"`` (pipeline stages), ``"exact"`` (the backward reads bit-identical gradients
    from the decoded tensor) and ``"derivative"`` (a derivative within a stated error).

    >>> import actcomp
    >>> actcomp.list_codecs("derivative"), actcomp.codec_class("relu-mask").kind
    (['fewbit'], 'exact')
    """
    if kind is not None and kind not in KINDS:
        raise ActcompError(f"unknown codec kind {kind!r}; kinds: {', '.join(KINDS)}")
    return sorted(name for name, cls in _REGISTRY.items() if kind is None or cls.kind == kind)


def codec_class(name: str) -> type:
    """The registered class of the codec called ``name``; its ``kind`` says what it is."""
    if name not in _REGISTRY:
        raise ActcompError(f"unknown codec {name!r}; known: {', '.join(list_codecs())}")
    return _REGISTRY[name]


def compressor_class(name: str) -> type:
    if name not in list_compressors():
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
