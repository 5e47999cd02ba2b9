"""What whole-model mode keeps per op kind (:class:`RestPolicy`), and the presets.

>>> print(RestPolicy.parse("8bit"))
8bit
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from actcomp.core.pipeline import Pipeline, parse
from actcomp.errors import ActcompError

LOSSY_KINDS = ("activation", "normalization", "attention", "other")
EXACT_KINDS = ("pooling", "dropout")


EXACT = "exact"


@dataclass(frozen=True)
class RestPolicy:
    """What whole-model mode keeps per op kind: a pipeline, ``"exact"`` (only the exact codecs:
    ReLU-family masks for activations, window offsets for pooling, bits for dropout; every other
    tensor of the kind as is) or None (the kind's tensors as they are). ``str`` prints it back.

    >>> print(RestPolicy.parse({"normalization": "int4", "fewbit": 3}))
    activation=int8, normalization=int4, attention=int8, pooling=exact, dropout=exact, other=None, fewbit=3
    >>> print(RestPolicy.parse("int8"))
    8bit
    >>> print(RestPolicy.parse({"normalization": "int4", "fewbit": 4}))
    activation=int8, normalization=int4, attention=int8, pooling=exact, dropout=exact, other=None, fewbit=4
    """

    activation: Pipeline | str | None
    normalization: Pipeline | str | None
    attention: Pipeline | str | None
    pooling: str | None
    dropout: str | None
    other: Pipeline | str | None = None
    # GELU and SiLU inputs as few-bit derivative codes (actcomp.whole_model.derivative_codes) instead of
    # the activation pipeline; None: they follow ``activation``.
    fewbit: int | None = None

    @classmethod
    def parse(cls, rest: str | Pipeline | Mapping | RestPolicy) -> RestPolicy:
        """``rest`` as given to :func:`actcomp.to_compressed`: a preset (``"8bit"``, ``"4bit"``,
        ``"exact"``; see :data:`PRESETS`), one spec for activations, norms and attention (plus
        the exact codecs), or a mapping from kinds to specs, ``"exact"`` or None, overriding
        the ``"8bit"`` preset."""
        if isinstance(rest, RestPolicy):
            return rest
        if isinstance(rest, str) and rest in PRESETS:
            return cls.parse(PRESETS[rest])
        if isinstance(rest, str):
            presets = ", ".join(repr(name) for name in PRESETS)
            near = rest.lower().translate({ord(c): None for c in " -_"})
            if near in PRESETS:
                # Told, not accepted: a spelling the library reads silently would be one more to support.
                raise ActcompError(f"unknown rest preset {rest!r}; did you mean {near!r}? presets: {presets}")
            try:
                pipeline = _lossy_pipeline(rest, "rest")
            except ActcompError as error:
                raise ActcompError(f"rest={rest!r} is neither a preset ({presets}) nor a spec whole-model mode can "
                                   f"use:\n{error}") from None
            return cls(pipeline, pipeline, pipeline, EXACT, EXACT)
        if isinstance(rest, Pipeline):
            pipeline = _lossy_pipeline(rest, "rest")
            return cls(pipeline, pipeline, pipeline, EXACT, EXACT)
        if not isinstance(rest, Mapping):
            raise ActcompError(
                f"rest must be 'exact', a spec string, a Pipeline or a mapping from op kinds to specs, got "
                f"{type(rest).__name__}: {rest!r}"
            )
        values = vars(cls.parse("8bit")).copy()
        for kind, spec in rest.items():
            if kind in EXACT_KINDS:
                if spec not in (EXACT, None):
                    raise ActcompError(f"rest[{kind!r}] must be 'exact' or None (its codec is exact), got {spec!r}")
                values[kind] = spec
            elif kind == "fewbit":
                if spec is not None and (type(spec) is not int or spec not in range(1, 5)):
                    raise ActcompError(f"rest['fewbit'] must be a bit width 1 to 4 (or None), got {spec!r}")
                values[kind] = spec
            elif kind in LOSSY_KINDS:
                values[kind] = spec if spec in (EXACT, None) else _lossy_pipeline(spec, f"rest[{kind!r}]")
            else:
                raise ActcompError(
                    f"unknown op kind {kind!r} in rest; valid keys: {', '.join(LOSSY_KINDS + EXACT_KINDS)}, fewbit "
                    "(Linear/Conv inputs take the main pipeline argument)"
                )
        return cls(**values)

    def pipeline(self, kind: str) -> Pipeline | None:
        """The lossy pipeline for ``kind``'s tensors, None when they are kept as is."""
        value = getattr(self, kind)
        return value if isinstance(value, Pipeline) else None

    def __str__(self) -> str:
        preset = next((name for name in PRESETS if RestPolicy.parse(name) == self), None)
        if preset is not None:
            return preset
        parts = []
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name != "fewbit" or value is not None:
                parts.append(f"{item.name}={value.spec if isinstance(value, Pipeline) else value}")
        return ", ".join(parts)


def _lossy_pipeline(spec: str | Pipeline, where: str) -> Pipeline:
    if isinstance(spec, Pipeline):
        pipeline = spec
    elif isinstance(spec, str):
        pipeline = parse(spec)
    else:
        raise ActcompError(f"{where}: expected a spec string, a Pipeline or None, got {type(spec).__name__}: {spec!r}")
    # Stochastic rounding has generators of its own; a stage drawing from the global one would
    # shift every later random op of the forward (dropout masks) away from plain PyTorch's.
    random = [stage.name for stage in pipeline.stages if stage.draws_global_random]
    if random:
        raise ActcompError(
            f"{where}: {pipeline.spec!r} uses {random[0]!r}, which draws from torch's global random generator "
            "in the middle of the forward and would change the dropout masks that follow; use min-k or a quantizer"
        )
    stateful = [stage.name for stage in pipeline.stages if stage.initial_state() is not None]
    if stateful:
        raise ActcompError(
            f"{where}: {pipeline.spec!r} uses {stateful[0]!r}, which keeps running ranges per layer; one pipeline "
            "serves every op of a kind here, so use a stateless quantizer (int8, int4, int2, fp8, fp16, bf16)"
        )
    return pipeline


# The one-switch choices. "4bit" keeps GELU/SiLU inputs as 4-bit derivative codes: the bytes
# of int4, a derivative within 0.044 (int4 codes of a deep SiLU net's inputs drift further:
# EfficientNet-B0's gradient cosine 0.93 against 0.98). "8bit" keeps them in int8: 3-bit codes
# (rest={"fewbit": 3}) take 0.375 bytes an element instead of 1, at cosine 0.95 on EfficientNet.
PRESETS: dict[str, RestPolicy | Mapping | str] = {
    "exact": RestPolicy(EXACT, EXACT, EXACT, EXACT, EXACT, EXACT),
    "8bit": "int8",
    "4bit": {"activation": "int4:group=64", "normalization": "int4:group=64", "attention": "int4:group=64", "fewbit": 4},
}


