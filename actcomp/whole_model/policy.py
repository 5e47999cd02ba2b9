"""What whole-model mode keeps per op kind (:class:`RestPolicy`: one :data:`Choice` a kind),
and the presets, which are values of it.

>>> print(RestPolicy.parse("8bit"))
8bit
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from actcomp.core.pipeline import Pipeline, as_pipeline, parse
from actcomp.errors import ActcompError

LOSSY_KINDS = ("activation", "normalization", "attention", "other")
EXACT_KINDS = ("pooling", "dropout")
# Keys of a rest mapping that give some norms' inputs a spec of their own (fields of Lossy).
NORM_REFINEMENTS = ("token_norms", "batch_norms_16bit")


@dataclass(frozen=True)
class KeepAsIs:
    """Every tensor of the kind kept as it is. Prints as the ``rest`` value that asks for it."""

    def __str__(self) -> str:
        return "None"


@dataclass(frozen=True)
class Exact:
    """Only the exact codecs of the kind's ops (ReLU-family masks, pooling window offsets,
    dropout bits); every other tensor of the kind as it is."""

    def __str__(self) -> str:
        return "exact"


@dataclass(frozen=True)
class Lossy:
    """The exact codecs where an op has one, ``pipeline`` for every other tensor of the kind.

    ``query_key_as_is`` keeps fused attention's query and key at 16 bits (attention only; set
    by :func:`actcomp.to_compressed` on a model carrying LoRA adapters, whose gradient moves
    with the attention logits' every rounding): as they are, or in bf16 where the call is run
    again in backward (:mod:`~actcomp.whole_model.attention_recompute`). ``attention_floors``
    (attention only, on by default) keeps fused attention's query and key in 8 bits at least
    where the call is run again in backward, and where it is not (CUDA's kernels, compiled
    graphs) its query and key in bf16 at most and its value and output in 8 bits at least; an
    eager attention's query, key and value in 8 bits at least: a trained language model's sink
    token would turn coarser codes into logit errors of whole units. Off (``rest={...,
    "attention_floors": False}``), they take ``pipeline`` like the kind's other tensors.

    Two refinements of the normalization kind (:data:`NORM_REFINEMENTS`, ``rest={...,
    "token_norms": spec}``; None: ``pipeline``): ``token_norms`` codes the inputs of the norms that
    normalize each token's row (LayerNorm, RMSNorm: ``layer_norm``, ``rms_norm`` and a
    ``...Norm`` module's own ops), ``batch_norms_16bit`` the inputs of BatchNorms held in bf16 or
    fp16 (what autocast makes of a CNN's), and ``pipeline`` every other norm's input."""

    pipeline: Pipeline
    query_key_as_is: bool = False
    attention_floors: bool = True
    token_norms: Pipeline | None = None
    batch_norms_16bit: Pipeline | None = None

    def __str__(self) -> str:
        return self.pipeline.spec

    def refinements(self) -> list[str]:
        """The norms' refinements set here, as a ``rest`` mapping says them.

        >>> Lossy(parse("int8"), batch_norms_16bit=parse("int4:group=64")).refinements()
        ['batch_norms_16bit=int4:group=64']
        """
        return [f"{key}={getattr(self, key).spec}" for key in NORM_REFINEMENTS if getattr(self, key) is not None]


@dataclass(frozen=True)
class Derivative:
    """GELU and SiLU inputs as ``bits``-bit derivative codes
    (:mod:`actcomp.whole_model.derivative_codes`), every other tensor of the kind as ``fallback``
    says (and a GELU/SiLU input holding NaN or inf too). Written ``fewbit`` in a ``rest`` mapping."""

    bits: int
    fallback: KeepAsIs | Exact | Lossy

    def __str__(self) -> str:
        return str(self.fallback)


Choice = KeepAsIs | Exact | Lossy | Derivative
AS_IS, EXACT = KeepAsIs(), Exact()


@dataclass(frozen=True)
class RestPolicy:
    """What whole-model mode keeps per op kind: one :data:`Choice` each. ``str`` prints it
    back as a ``rest`` value would say it.

    >>> print(RestPolicy.parse({"normalization": "int4", "fewbit": 3}))
    activation=int8, normalization=int4, attention=int8, pooling=exact, dropout=exact, other=None, fewbit=3
    >>> RestPolicy.parse("8bit").normalization.batch_norms_16bit
    Pipeline('int4:group=64')
    >>> RestPolicy.parse("4bit").activation.bits, RestPolicy.parse("4bit").normalization.token_norms
    (4, Pipeline('int4:group=16'))
    """

    activation: Choice
    normalization: Choice
    attention: Choice
    pooling: KeepAsIs | Exact
    dropout: KeepAsIs | Exact
    other: Choice = AS_IS

    def is_exact(self) -> bool:
        """Whether every kind is kept exactly (``"exact"`` or as it is): gradients bit for bit.

        >>> RestPolicy.parse("exact").is_exact(), RestPolicy.parse("8bit").is_exact()
        (True, False)
        """
        return all(isinstance(getattr(self, field.name), KeepAsIs | Exact) for field in fields(self))

    @classmethod
    def parse(cls, rest: str | Pipeline | Mapping | RestPolicy) -> RestPolicy:
        """``rest`` as given to :func:`actcomp.to_compressed`: a preset (``"8bit"``, ``"4bit"``,
        ``"exact"``; see :data:`PRESETS`), one spec for activations, norms and attention (plus
        the exact codecs), or a mapping from kinds to specs, ``"exact"`` or None (and
        ``"fewbit"`` to a bit width), overriding the ``"8bit"`` preset."""
        if isinstance(rest, RestPolicy):
            return rest
        if isinstance(rest, str) and rest in PRESETS:
            return PRESETS[rest]
        if isinstance(rest, (str, Pipeline)):
            lossy = Lossy(_rest_pipeline(rest))
            return cls(lossy, lossy, lossy, EXACT, EXACT)
        if not isinstance(rest, Mapping):
            raise ActcompError(
                f"rest must be 'exact', a spec string, a Pipeline or a mapping from op kinds to specs, got "
                f"{type(rest).__name__}: {rest!r}"
            )
        choices = dict(vars(PRESETS["8bit"]))
        for kind, value in rest.items():
            if kind == "attention_floors":
                if not isinstance(value, bool):
                    raise ActcompError(f"rest['attention_floors'] must be True or False, got {value!r}")
            elif kind in NORM_REFINEMENTS:
                continue  # below, once the normalization's own choice is known
            elif kind == "fewbit":
                if value is not None and (type(value) is not int or value not in range(1, 5)):
                    raise ActcompError(f"rest['fewbit'] must be a bit width 1 to 4 (or None), got {value!r}")
            elif kind in LOSSY_KINDS or kind in EXACT_KINDS:
                choices[kind] = _choice(kind, value)
            else:
                raise ActcompError(
                    f"unknown op kind {kind!r} in rest; valid keys: {', '.join(LOSSY_KINDS + EXACT_KINDS)}, fewbit, "
                    f"attention_floors, {', '.join(NORM_REFINEMENTS)} "
                    "(Linear/Conv inputs take the main pipeline argument)"
                )
        for key in NORM_REFINEMENTS:
            if key not in rest:
                continue
            if not isinstance(choices["normalization"], Lossy):
                if rest[key] is None:
                    continue
                raise ActcompError(f"rest[{key!r}] refines a lossy normalization spec; normalization is "
                                   f"{choices['normalization']} here: give rest['normalization'] a spec too")
            refined = None if rest[key] is None else _lossy_pipeline(rest[key], f"rest[{key!r}]")
            choices["normalization"] = replace(choices["normalization"], **{key: refined})
        if rest.get("fewbit") is not None:
            choices["activation"] = Derivative(rest["fewbit"], choices["activation"])
        if rest.get("attention_floors") is False:
            if not isinstance(choices["attention"], Lossy):
                raise ActcompError(f"rest['attention_floors']=False lifts the floors of a lossy attention spec; attention "
                                   f"is {choices['attention']} here: give rest['attention'] a spec too")
            choices["attention"] = replace(choices["attention"], attention_floors=False)
        return cls(**choices)

    def __str__(self) -> str:
        preset = next((name for name, policy in PRESETS.items() if policy == self), None)
        if preset is not None:
            return preset
        text = ", ".join(f"{item.name}={getattr(self, item.name)}" for item in fields(self))
        text += f", fewbit={self.activation.bits}" if isinstance(self.activation, Derivative) else ""
        lifted = isinstance(self.attention, Lossy) and not self.attention.attention_floors
        text += ", attention_floors=False" if lifted else ""
        refined = self.normalization.refinements() if isinstance(self.normalization, Lossy) else []
        return ", ".join([text, *refined])

    def __setstate__(self, state: dict) -> None:
        if "fewbit" in state:
            # Pickled by 0.1.0, whose fields held a Pipeline, "exact" or None, and fewbit apart.
            state = vars(RestPolicy.parse(state))
        for name, value in state.items():
            object.__setattr__(self, name, value)


def _choice(kind: str, value) -> Choice:
    """One kind's choice from its ``rest`` mapping value."""
    if value is None:
        return AS_IS
    if isinstance(value, str) and value == "exact":
        return EXACT
    if kind in EXACT_KINDS:
        raise ActcompError(f"rest[{kind!r}] must be 'exact' or None (its codec is exact), got {value!r}")
    return Lossy(_lossy_pipeline(value, f"rest[{kind!r}]"))


def _rest_pipeline(rest: str | Pipeline) -> Pipeline:
    """``rest`` given as one spec (or pipeline) for every lossy kind."""
    if isinstance(rest, Pipeline):
        return _lossy_pipeline(rest, "rest")
    presets = ", ".join(repr(name) for name in PRESETS)
    near = rest.lower().translate({ord(c): None for c in " -_"})
    if near in PRESETS:
        # Told, not accepted: a spelling the library reads silently would be one more to support.
        raise ActcompError(f"unknown rest preset {rest!r}; did you mean {near!r}? presets: {presets}")
    try:
        return _lossy_pipeline(rest, "rest")
    except ActcompError as error:
        raise ActcompError(f"rest={rest!r} is neither a preset ({presets}) nor a spec whole-model mode can "
                           f"use:\n{error}") from None


def _lossy_pipeline(spec: str | Pipeline, where: str) -> Pipeline:
    pipeline = as_pipeline(spec, where, "a spec string, a Pipeline or None")
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
# "4bit" codes LayerNorm/RMSNorm inputs in groups of 16: a trained LLM's sink token puts its
# outlier channels in groups of 64 with nearly its whole row, whose other channels then round to
# a few steps (eager attention's gradient cosine 0.968 with outliers built in, 0.983 in groups of
# 16; bench_lm_quality.py). BatchNorm's channels have no such rows and keep groups of 64 (groups
# of 16 everywhere cost resnet50 33% more bytes, the Llama 2.7%, ViT-S 8.1%; bench_norm_groups.py).
# "8bit" keeps a bf16/fp16 BatchNorm input (a CNN under autocast) in int4:group=64, a quarter of
# its bytes as int8 keeps of an fp32 one: BatchNorm inputs are over half of what a ResNet keeps
# under autocast, whose int8 codes left resnet50 at 3.10x fewer bytes than plain; int4 gives
# 4.79x at a gradient cosine of 0.9985 with the norms alone lossy (bench_batchnorm_codes.py).
_INT8, _INT4 = Lossy(parse("int8")), Lossy(parse("int4:group=64"))
_INT8_NORMS = Lossy(parse("int8"), batch_norms_16bit=parse("int4:group=64"))
_INT4_NORMS = Lossy(parse("int4:group=64"), token_norms=parse("int4:group=16"))
PRESETS: dict[str, RestPolicy] = {
    "exact": RestPolicy(EXACT, EXACT, EXACT, EXACT, EXACT, EXACT),
    "8bit": RestPolicy(_INT8, _INT8_NORMS, _INT8, EXACT, EXACT),
    "4bit": RestPolicy(Derivative(4, _INT4), _INT4_NORMS, _INT4, EXACT, EXACT),
}
