"""A check on your own model: its gradient compressed against plain's, where it bends, and what to change.

:func:`check` runs one batch of yours through a copy of the model plain and through copies
converted by :func:`~actcomp.to_compressed`, and reports

- the whole gradient's cosine against plain's, the bytes kept for backward and the step time;
- per op kind of whole-mode (``rest=``): the cosine with that kind compressed alone (every
  other kind and the Linear/Conv inputs exact), and its bytes, plain and kept;
- per converted Linear/Conv layer: the cosine of the layer's weight gradient with the layers
  compressed alone (their input gradients are exact, so each weight gradient bends only by the
  layer's own input);

and flags each row under its floor with the change that would lift it; ``print(report)`` opens
with the verdict, "OK to train" or "N problems" and the change that lifts each. The model is never
modified: the runs use deep copies.

>>> import torch, actcomp
>>> _ = torch.manual_seed(0)
>>> net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
>>> report = actcomp.check(net, torch.randn(64, 32), "int8", rest="8bit", rounds=1)
>>> report.cosine > 0.999, [row.name for row in report.flagged()], str(report).splitlines()[0]
(True, [], 'OK to train: every gradient checked is at or above its floor')
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from actcomp.convert import compressed_layers, to_compressed
from actcomp.core.pipeline import Pipeline, parse
from actcomp.errors import ActcompError
from actcomp.tools.memory import format_bytes
from actcomp.tools.user_batch import UserBatch, copy_model, gradient_cosine
from actcomp.whole_model.policy import Exact, KeepAsIs, Lossy, RestPolicy

# Whole-model kinds whose choice can be lossy; pooling and dropout take exact codecs only.
_LOSSY_KINDS = ("activation", "normalization", "attention", "other")


@dataclass(frozen=True)
class CheckRow:
    """One checked part: an op kind (``kind`` True) or a converted layer, its spec, the gradient
    cosine against plain's (NaN where plain's gradient is zero), its floor, the bytes plain and
    kept (0 where not measured), and for a layer without a gradient the zero-weight norm found
    after it (``zeroed_by``, None if none)."""

    name: str
    spec: str
    cosine: float
    floor: float
    kind: bool
    plain_bytes: int = 0
    kept_bytes: int = 0
    zeroed_by: str | None = None

    @property
    def below(self) -> bool:
        return self.cosine < self.floor

    @property
    def no_gradient(self) -> bool:
        return self.cosine != self.cosine


@dataclass(frozen=True)
class CheckReport:
    """Result of :func:`check`; ``print(report)`` shows the verdict, then the tables and notes.

    ``suggestions`` holds one line per problem, each with the one change that lifts it; empty
    means OK to train. ``together`` is the one call that lifts every flagged layer at once
    (empty unless two or more are flagged).
    """

    pipeline: str
    rest: str | None
    cosine: float
    floor: float
    plain_bytes: int
    kept_bytes: int
    step_time: float
    kinds: list[CheckRow]
    layers: list[CheckRow]
    suggestions: list[str]
    together: str = ""
    # The call checked, as it pastes: a mapping of layer specs or a dict rest as Python writes them.
    call: str = ""

    def flagged(self) -> list[CheckRow]:
        """The rows under their floor."""
        return [row for row in self.kinds + self.layers if row.below]

    @property
    def ok(self) -> bool:
        """No problem: every row and the whole gradient at or above its floor."""
        return not self.suggestions

    def verdict(self) -> list[str]:
        """The lines ``print(report)`` opens with: "OK to train", or the problems and their fixes."""
        if self.ok:
            return ["OK to train: every gradient checked is at or above its floor"]
        count = len(self.suggestions)
        lines = [f"{count} problem{'s' if count > 1 else ''}, each with the change that lifts it:"]
        lines += [f"- {text}" for text in self.suggestions]
        if self.together:
            lines.append(f"  every flagged layer at once: {self.together}")
        return lines

    def __str__(self) -> str:
        rest = "" if self.rest is None else f", rest={self.rest!r}"
        ratio = self.plain_bytes / self.kept_bytes if self.kept_bytes else float("inf")
        lines = [*self.verdict(), "",
                 f"actcomp check: {self.call or f'to_compressed(model, {self.pipeline!r}{rest})'}",
                 f"whole gradient: cosine {self.cosine:.4f} against plain's (floor {self.floor:.3f})"
                 f"{_mark(self.cosine < self.floor)}",
                 f"kept for backward: {format_bytes(self.plain_bytes)} -> {format_bytes(self.kept_bytes)} "
                 f"({ratio:.2f}x fewer); step time {self.step_time:.2f}x plain's", ""]
        # One width for the names of both tables, so a long layer name never shifts its row.
        width = max([len("layer (its weight gradient)")] + [len(row.name) for row in self.kinds + self.layers])
        spec_width = max([22] + [len(row.spec) for row in self.kinds + self.layers])
        if self.kinds:
            lines.append(f"{'op kind (alone)':<{width}} {'spec':<{spec_width}} {'cosine':>8} {'floor':>7} "
                         f"{'plain':>11} {'kept':>11}")
            lines += [f"{row.name:<{width}} {row.spec:<{spec_width}} {_number(row.cosine):>8} {row.floor:>7.3f} "
                      f"{format_bytes(row.plain_bytes):>11} {format_bytes(row.kept_bytes):>11}{_mark(row.below)}"
                      for row in self.kinds]
            lines.append("")
        if self.layers:
            lines.append(f"{'layer (its weight gradient)':<{width}} {'spec':<{spec_width}} {'cosine':>8} {'floor':>7}")
            lines += [f"{row.name:<{width}} {row.spec:<{spec_width}} {_number(row.cosine):>8} "
                      f"{row.floor:>7.3f}{_mark(row.below)}" for row in self.layers]
            lines += _sparsifier_note(self.layers) + _no_gradient_note(self.layers)
        return "\n".join(lines)


def _mark(below: bool) -> str:
    return "  << under the floor" if below else ""


def _number(cosine: float) -> str:
    return "no grad" if cosine != cosine else f"{cosine:.4f}"


def _note(text: str) -> list[str]:
    return textwrap.wrap(text, 100, subsequent_indent="  ")


def _sparsifier_note(layers: list[CheckRow]) -> list[str]:
    """What a sparsifier layer's floor is, and where a Gaussian input sits above it."""
    lines = []
    for spec, row_floor in {row.spec: row.floor for row in layers if not row.spec.startswith("plain")}.items():
        stage = _sparsifier(parse(spec))
        if stage is None or row_floor != _layer_floor(parse(spec), 1.0):  # none, or layer_floor= set another
            continue
        rate = float(stage.drop_rate)
        lines += _note(f"floor {row_floor:.3f} under {spec}: what dropping {rate:.0%} of the "
                       f"values at random keeps ({(1 - rate) ** 0.5:.3f}), less 5%. A Gaussian input keeps "
                       f"{expected_layer_cosine(spec):.3f}; a layer between the two has a less spread input, as "
                       "random weights give (0.42-0.91 measured on an untrained resnet18 and Llama): no problem.")
    return lines


def _no_gradient_note(layers: list[CheckRow]) -> list[str]:
    """Why a row says ``no grad``: plain PyTorch gives that layer a zero weight gradient."""
    rows = [row for row in layers if row.no_gradient]
    if not rows:
        return []
    many = len(rows) > 1
    norms = list(dict.fromkeys(row.zeroed_by for row in rows if row.zeroed_by))
    if norms:
        shown = ", ".join(norms[:3]) + (f" and {len(norms) - 3} more" if len(norms) > 3 else "")
        cause = (f"a norm after {'each' if many else 'it'} starts with all-zero weights ({shown}; timm's "
                 f"zero_init_last does this to each residual block's last norm), so no gradient reaches "
                 f"{'them' if many else 'it'} before the first optimizer step")
    else:
        cause = (f"nothing after {'them' if many else 'it'} passes a gradient back at these weights (a weight "
                 "or norm that starts at zero), or the loss does not reach it")
    return _note(f"no grad ({len(rows)} layer{'s' if many else ''}): the weight gradient is zero in plain PyTorch "
                 f"too, so there is nothing to compare: {cause}. {'They are' if many else 'It is'} checked once the "
                 "model has trained a step.")


def check(model: nn.Module, batch: Any, pipeline: str | Pipeline | Mapping = "mink0.9+int8", *, rest: Any = "8bit",
          loss_fn: Callable[[Any], torch.Tensor] | None = None, floor: float = 0.99, layer_floor: float | None = None,
          rounds: int = 3, seed: int = 0) -> CheckReport:
    """Check ``to_compressed(model, pipeline, rest=rest)`` on one ``batch``: a tensor, a tuple
    of the forward's positional arguments, or a dict of its keyword arguments (a Hugging Face
    model's ``{"input_ids": ids, "labels": ids}``).

    The loss is ``loss_fn(output)`` if given, else the output's ``.loss`` (a Hugging Face model
    called with ``labels=``), else a fixed random projection of its first float tensor. Every
    run seeds torch with ``seed`` before its forward, so dropout draws alike.

    Floors, one per row, each the one that row is judged by: ``floor`` for each op kind and for a
    layer under a quantizer alone. A sparsifier drops most of a layer's input by design (DropIT
    trains to plain's accuracy with 90% dropped), so its layers are held to what dropping as many
    values at random keeps, ``sqrt(1 - rate)``, less 5% for the measurement's spread: min-k keeps
    the largest values, so it keeps at least that much of any input's energy, and falls under it
    only where the gradient depends on the very values it drops. Above that floor a layer's
    cosine says how spread its input is (a Gaussian's under ``mink0.9``: 0.663,
    :func:`expected_layer_cosine`; on random weights of an untrained model 0.4-0.9), not that
    training suffers, so untrained models' noise is not flagged. ``layer_floor`` sets one floor
    for every layer instead. The Linear/Conv inputs together and the whole gradient are held to
    the lowest floor among the converted layers' and ``floor``: with a sparsifier on the layers
    they bend by design too.

    A layer whose weight gradient is zero in plain PyTorch (a zero-initialised norm after it,
    timm's ``zero_init_last``) has a NaN cosine, under no floor; ``zeroed_by`` names that norm.
    ``rounds`` interleaved steps time plain against converted (the median ratio).
    """
    if compressed_layers(model) or getattr(model, "actcomp_rest", None) is not None:
        raise ActcompError("check takes the plain model (it converts copies itself); this one is converted already: "
                           "pass the model before to_compressed, or actcomp.from_compressed(model)")
    if not 0 < floor <= 1 or (layer_floor is not None and not 0 < layer_floor <= 1):
        raise ActcompError(f"floor and layer_floor must be in (0, 1], got {floor} and {layer_floor}")
    if rounds < 1:
        raise ActcompError(f"rounds must be at least 1, got {rounds}")
    plain = copy_model(model)
    run = UserBatch(batch, loss_fn, seed)
    reference = run.gradients(plain)

    converted = to_compressed(copy_model(model), pipeline, rest=rest)
    whole = gradient_cosine(run.gradients(converted), reference)
    plain_report, kept_report = run.memory(plain), run.memory(converted)
    step_time = run.step_time(plain, converted, rounds)
    policy = getattr(converted, "actcomp_rest", None)

    layers_only = converted if policy is None else to_compressed(copy_model(model), pipeline, loss="plain")
    layer_gradients = run.gradients(layers_only)
    # A layer that reads the model's input runs plain (first_layer="auto"): the caller keeps it anyway.
    plain_on_input = set((kept_report if layers_only is converted else run.memory(layers_only)).plain_on_input)
    zero_norms, order = _zero_weight_norms(plain), [name for name, _ in plain.named_modules()]
    layer_rows = []
    for name, layer in compressed_layers(layers_only).items():
        if f"{name}.weight" not in reference:
            continue
        cosine = gradient_cosine({"w": layer_gradients[f"{name}.weight"]}, {"w": reference[f"{name}.weight"]})
        if name in plain_on_input:  # it runs as plain does, so it is held to the quantizers' floor
            spec, row_floor = "plain (model input)", floor
        else:
            spec, row_floor = layer.spec, layer_floor if layer_floor is not None else _layer_floor(layer, floor)
        layer_rows.append(CheckRow(name, spec, cosine, row_floor, False,
                                   zeroed_by=_norm_after(name, order, zero_norms) if cosine != cosine else None))

    kept = {row.kind: row for row in kept_report.kinds}
    kind_rows = []
    # With a sparsifier on the Linear/Conv inputs, their gradient and the whole one bend by design:
    # their floor is the layers' (the lowest, under a mapping), never above `floor`.
    linear_floor = min([row.floor for row in layer_rows if not row.spec.startswith("plain")], default=floor)
    whole_floor = min(floor, linear_floor)
    if layer_rows:
        row = kept.get("linear")
        kind_rows.append(CheckRow("linear (Linear/Conv inputs)", spec_summary(pipeline),
                                  gradient_cosine(layer_gradients, reference), linear_floor, True,
                                  row.plain_bytes if row else 0, row.kept_bytes if row else 0))
    if policy is not None:
        exact = RestPolicy.parse("exact")
        for kind in _LOSSY_KINDS:
            choice = getattr(policy, kind)
            if isinstance(choice, (KeepAsIs, Exact)) or kind not in kept:
                continue
            alone = to_compressed(copy_model(model), "mink0", rest=replace(exact, **{kind: choice}), loss="plain")
            row = kept[kind]
            kind_rows.append(CheckRow(kind, _choice_text(choice), gradient_cosine(run.gradients(alone), reference),
                                      floor, True, row.plain_bytes, row.kept_bytes))
    problems, together = _problems(kind_rows, layer_rows, pipeline, whole, whole_floor)
    return CheckReport(_spec_text(pipeline), None if rest is None else str(rest), whole, whole_floor,
                       plain_report.total_bytes, kept_report.total_bytes, step_time, kind_rows, layer_rows,
                       problems, together, _call_text(pipeline, rest))


def _choice_text(choice) -> str:
    """A kind's choice as a row says it: its spec, and the norms' refinements where set
    (``"8bit"``'s normalization: ``int8, batch_norms_16bit=int4:group=64``)."""
    return ", ".join([str(choice), *(choice.refinements() if isinstance(choice, Lossy) else [])])


def expected_layer_cosine(pipeline: str | Pipeline, floor: float = 0.99) -> float:
    """The weight-gradient cosine a layer gets under ``pipeline``'s sparsifier when its input is
    Gaussian: the square root of the share of the input's energy kept. Min-k (and its sampled
    and parallel forms) keep the values above the threshold t that a fraction 1 - rate exceeds,
    ``2 (t phi(t) + 1 - Phi(t))`` of the energy; random and channel selections keep 1 - rate of
    it. ``floor`` for a pipeline without a sparsifier (a quantizer must keep the gradient).

    >>> round(expected_layer_cosine("mink0.9+int8"), 3), round(expected_layer_cosine("random0.75"), 3)
    (0.663, 0.5)
    """
    sparsifiers = [stage for stage in parse(pipeline).stages if stage.kind == "sparsifier"]
    if not sparsifiers:
        return floor
    stage = sparsifiers[0]
    kept = 1.0 - float(stage.drop_rate)
    if kept >= 1.0:
        return floor
    if stage.name in ("mink", "smink", "pmink", "dropit"):
        normal = torch.distributions.Normal(0.0, 1.0)
        threshold = normal.icdf(torch.tensor(1.0 - kept / 2, dtype=torch.float64))
        density = normal.log_prob(threshold).exp()
        energy = 2 * (threshold * density + 1 - normal.cdf(threshold))
        return float(energy.sqrt())
    return kept ** 0.5


def _sparsifier(pipeline: Pipeline):
    """The pipeline's first sparsifier that drops something, or None."""
    return next((stage for stage in pipeline.stages if stage.kind == "sparsifier" and float(stage.drop_rate) > 0),
                None)


def _layer_floor(pipeline: Pipeline, floor: float) -> float:
    """A layer's default floor: with a sparsifier, 95% of what dropping as many values at random
    keeps (``sqrt(1 - rate)``); else ``floor``.

    >>> round(_layer_floor(parse("mink0.9+int8"), 0.99), 3), _layer_floor(parse("int8"), 0.99)
    (0.3, 0.99)
    """
    stage = _sparsifier(pipeline)
    if stage is None:
        return floor
    return 0.95 * (1.0 - float(stage.drop_rate)) ** 0.5


# Norm layers by class name (BatchNorm2d, LayerNorm, GroupNorm, LlamaRMSNorm, timm's LayerNorm2d...),
# so no model library need be imported to recognise its own.
def _zero_weight_norms(model: nn.Module) -> set[str]:
    """Names of the norm modules whose weight is all zeros."""
    return {name for name, module in model.named_modules()
            if "norm" in type(module).__name__.lower() and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.numel() and not module.weight.detach().any()}


def _norm_after(layer: str, order: list[str], zero_norms: set[str]) -> str | None:
    """The zero-weight norm that cuts ``layer`` off from the loss: the first after it in module
    order (``order``) within the same parent, as a residual block's last norm is; else None.

    >>> _norm_after("layer1.0.conv1", ["layer1.0.conv1", "layer1.0.bn1", "layer1.0.conv2", "layer1.0.bn2",
    ...                                "layer1.1.conv1", "layer1.1.bn2"], {"layer1.0.bn2", "layer1.1.bn2"})
    'layer1.0.bn2'
    """
    parent = layer.rpartition(".")[0]
    prefix = f"{parent}." if parent else ""
    after = order[order.index(layer) + 1:] if layer in order else []
    return next((name for name in after if name in zero_norms and name.startswith(prefix)), None)


def _spec_text(pipeline: str | Pipeline | Mapping) -> str:
    if isinstance(pipeline, Mapping):
        return ", ".join(f"{pattern}: {spec}" for pattern, spec in pipeline.items())
    return parse(pipeline).spec if isinstance(pipeline, str) else pipeline.spec


def spec_summary(pipeline: str | Pipeline | Mapping) -> str:
    """The Linear/Conv row's spec: the spec, or for a mapping its distinct specs, three at most
    (the layer table lists every layer's).

    >>> spec_summary({"fc": "int8", "conv1": None, "*": "int4"})
    'per layer: int8, None, int4'
    """
    if not isinstance(pipeline, Mapping):
        return _spec_text(pipeline)
    specs = list(dict.fromkeys(str(spec) for spec in pipeline.values()))
    return "per layer: " + ", ".join(specs[:3]) + (f" and {len(specs) - 3} more" if len(specs) > 3 else "")


def _call_text(pipeline: str | Pipeline | Mapping, rest: Any) -> str:
    """``to_compressed``'s call for ``pipeline`` and ``rest`` as it pastes.

    >>> _call_text({"fc": "int8", "*": "int4"}, {"activation": "int8"})
    "to_compressed(model, {'fc': 'int8', '*': 'int4'}, rest={'activation': 'int8'})"
    """
    layers = dict(pipeline) if isinstance(pipeline, Mapping) else _spec_text(pipeline)
    rest_text = "" if rest is None else f", rest={dict(rest) if isinstance(rest, Mapping) else str(rest)!r}"
    return f"to_compressed(model, {layers!r}{rest_text})"


def _lighter(spec: str) -> str | None:
    """A spec that keeps more of the values: the quantizer alone for a sparsifier, 8 bits for
    fewer, bf16 for 8, None (as it is) for a float format."""
    stages = parse(spec).stages
    quantizers = [stage for stage in stages if stage.kind == "quantizer"]
    if len(quantizers) < len(stages):
        return str(quantizers[0]) if quantizers else None
    bits = getattr(quantizers[0], "bits", None) if quantizers else None
    if bits is not None and bits < 8:
        return "int8"
    if bits == 8 or (quantizers and quantizers[0].name == "fp8"):
        return "bf16"
    return None


def _problems(kinds: list[CheckRow], layers: list[CheckRow], pipeline, whole: float,
              floor: float) -> tuple[list[str], str]:
    """One line per problem with the one change that lifts it, and the one call that lifts every
    flagged layer at once ("" unless two or more are)."""
    texts = []
    for row in kinds:
        if not row.below or row.name.startswith("linear"):
            continue
        lighter = _lighter(row.spec) if row.spec not in ("exact", "None") else None
        texts.append(f"{row.name} (cosine {row.cosine:.4f} < floor {row.floor:.3f}): "
                     f"rest={{..., {row.name!r}: {lighter!r}}}" + ("" if lighter else " keeps it as it is"))
    low = [row for row in layers if row.below and not row.spec.startswith("plain")]
    converted = [row for row in layers if not row.spec.startswith("plain")]
    # The call's own rules go after the fixes: the first pattern that matches a layer's name wins.
    own_rules = dict(pipeline) if isinstance(pipeline, Mapping) else {"*": _spec_text(pipeline)}
    together = ""
    if len(low) > 4 and 2 * len(low) >= len(converted) and not isinstance(pipeline, Mapping):
        lowest = min(low, key=lambda row: row.cosine)
        texts.append(f"{len(low)} of {len(converted)} layers under their floor (lowest {lowest.name}: "
                     f"{lowest.cosine:.4f} < {lowest.floor:.3f}): a lighter spec for all, "
                     f"to_compressed(model, {_lighter(_spec_text(pipeline))!r}, ...)")
    else:
        for row in low:
            rules = {row.name: _lighter(row.spec), **{k: v for k, v in own_rules.items() if k != row.name}}
            texts.append(f"layer {row.name} (weight-gradient cosine {row.cosine:.4f} < floor {row.floor:.3f}): "
                         f"to_compressed(model, {rules!r}, ...) (None leaves it plain)")
        if len(low) > 1:
            rules = {row.name: _lighter(row.spec) for row in low}
            rules.update({k: v for k, v in own_rules.items() if k not in rules})
            together = f"to_compressed(model, {rules!r}, ...)"
    linear = next((row for row in kinds if row.name.startswith("linear") and row.below), None)
    if linear is not None and not low:
        lighter = _lighter(linear.spec) if not isinstance(pipeline, Mapping) else None
        texts.append(f"Linear/Conv inputs together (cosine {linear.cosine:.4f} < floor {linear.floor:.3f}): "
                     + (f"to_compressed(model, {lighter!r}, ...)" if lighter else "a lighter spec for the "
                        "layers with the lowest cosines above"))
    if whole < floor and not texts:
        closest = min(kinds + converted, key=lambda row: row.cosine / row.floor if row.cosine == row.cosine else 2)
        texts.append(f"the whole gradient (cosine {whole:.4f} < floor {floor:.3f}) with no single part under its "
                     f"floor: lighten the part closest to its floor, {closest.name} ({closest.cosine:.4f}, floor "
                     f"{closest.floor:.3f})")
    return texts, together
