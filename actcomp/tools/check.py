"""A check on your own model: its gradient compressed against plain's, where it bends, and what to change.

:func:`check` runs one batch of yours through a copy of the model plain and through copies
converted by :func:`~actcomp.to_compressed`, and reports

- the whole gradient's cosine against plain's, the bytes kept for backward and the step time;
- per op kind of whole-mode (``rest=``): the cosine with that kind compressed alone (every
  other kind and the Linear/Conv inputs exact), and its bytes, plain and kept;
- per converted Linear/Conv layer: the cosine of the layer's weight gradient with the layers
  compressed alone (their input gradients are exact, so each weight gradient bends only by the
  layer's own input);

and flags each row under its floor with the change that would lift it. The model is never
modified: the runs use deep copies.

>>> import torch, actcomp
>>> _ = torch.manual_seed(0)
>>> net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
>>> report = actcomp.check(net, torch.randn(64, 32), "int8", rest="8bit", rounds=1)
>>> report.cosine > 0.999, [row.name for row in report.flagged()]
(True, [])
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from actcomp.convert import compressed_layers, to_compressed
from actcomp.core.pipeline import Pipeline, parse
from actcomp.errors import ActcompError
from actcomp.tools.memory import format_bytes, memory_report
from actcomp.whole_model.policy import Exact, KeepAsIs, RestPolicy

# Whole-model kinds whose choice can be lossy; pooling and dropout take exact codecs only.
_LOSSY_KINDS = ("activation", "normalization", "attention", "other")


@dataclass(frozen=True)
class CheckRow:
    """One checked part: an op kind (``kind`` True) or a converted layer, its spec, the gradient
    cosine against plain's, its floor, and the bytes plain and kept (0 where not measured)."""

    name: str
    spec: str
    cosine: float
    floor: float
    kind: bool
    plain_bytes: int = 0
    kept_bytes: int = 0

    @property
    def below(self) -> bool:
        return self.cosine < self.floor


@dataclass(frozen=True)
class CheckReport:
    """Result of :func:`check`; ``print(report)`` shows the tables, the flags and the fixes."""

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

    def flagged(self) -> list[CheckRow]:
        """The rows under their floor."""
        return [row for row in self.kinds + self.layers if row.below]

    def __str__(self) -> str:
        rest = "" if self.rest is None else f", rest={self.rest!r}"
        ratio = self.plain_bytes / self.kept_bytes if self.kept_bytes else float("inf")
        lines = [f"actcomp check: to_compressed(model, {self.pipeline!r}{rest})",
                 f"whole gradient: cosine {self.cosine:.4f} against plain's (floor {self.floor:.3f})"
                 f"{_mark(self.cosine < self.floor)}",
                 f"kept for backward: {format_bytes(self.plain_bytes)} -> {format_bytes(self.kept_bytes)} "
                 f"({ratio:.2f}x fewer); step time {self.step_time:.2f}x plain's", ""]
        if self.kinds:
            lines.append(f"{'op kind (alone)':<28} {'spec':<22} {'cosine':>8} {'floor':>7} {'plain':>11} {'kept':>11}")
            lines += [f"{row.name:<28} {row.spec:<22} {_number(row.cosine):>8} {row.floor:>7.3f} "
                      f"{format_bytes(row.plain_bytes):>11} {format_bytes(row.kept_bytes):>11}{_mark(row.below)}"
                      for row in self.kinds]
            lines.append("")
        if self.layers:
            lines.append(f"{'layer (its weight gradient)':<28} {'spec':<22} {'cosine':>8} {'floor':>7}")
            lines += [f"{row.name:<28} {row.spec:<22} {_number(row.cosine):>8} {row.floor:>7.3f}{_mark(row.below)}"
                      for row in self.layers]
            lines.append("")
        if self.suggestions:
            lines += ["to lift what is flagged:"] + [f"- {text}" for text in self.suggestions]
        else:
            lines.append("nothing under its floor")
        return "\n".join(lines)


def _mark(below: bool) -> str:
    return "  << under the floor" if below else ""


def _number(cosine: float) -> str:
    return "no grad" if cosine != cosine else f"{cosine:.4f}"


def check(model: nn.Module, batch: Any, pipeline: str | Pipeline | Mapping = "mink0.9+int8", *, rest: Any = "8bit",
          loss_fn: Callable[[Any], torch.Tensor] | None = None, floor: float = 0.99, layer_floor: float | None = None,
          rounds: int = 3, seed: int = 0) -> CheckReport:
    """Check ``to_compressed(model, pipeline, rest=rest)`` on one ``batch``: a tensor, a tuple
    of the forward's positional arguments, or a dict of its keyword arguments (a Hugging Face
    model's ``{"input_ids": ids, "labels": ids}``).

    The loss is ``loss_fn(output)`` if given, else the output's ``.loss`` (a Hugging Face model
    called with ``labels=``), else a fixed random projection of its first float tensor. Every
    run seeds torch with ``seed`` before its forward, so dropout draws alike. ``floor`` is the
    lowest gradient cosine accepted for the whole model and for each op kind. ``layer_floor`` is
    that of a layer's weight gradient; by default (None) it depends on the layer's spec: a
    sparsifier drops most of a layer's input by design (DropIT trains to plain's accuracy with
    90% dropped), so a layer is flagged when it bends more than a Gaussian input would under its
    spec (:func:`expected_layer_cosine`, less 5%); a quantizer alone must reach ``floor``.
    ``rounds`` interleaved steps time plain against converted (the median ratio).
    """
    if compressed_layers(model) or getattr(model, "actcomp_rest", None) is not None:
        raise ActcompError("check takes the plain model (it converts copies itself); this one is converted already: "
                           "pass the model before to_compressed, or actcomp.from_compressed(model)")
    if not 0 < floor <= 1 or (layer_floor is not None and not 0 < layer_floor <= 1):
        raise ActcompError(f"floor and layer_floor must be in (0, 1], got {floor} and {layer_floor}")
    if rounds < 1:
        raise ActcompError(f"rounds must be at least 1, got {rounds}")
    inputs, kwargs = ((), dict(batch)) if isinstance(batch, Mapping) else (
        tuple(batch) if isinstance(batch, (tuple, list)) else (batch,), {})
    plain = _copy(model)
    run = _Runner(inputs, kwargs, loss_fn, seed)
    reference = run.gradients(plain)

    converted = to_compressed(_copy(model), pipeline, rest=rest)
    whole = _cosine(run.gradients(converted), reference)
    plain_report, kept_report = run.memory(plain), run.memory(converted)
    step_time = run.step_time(plain, converted, rounds)
    policy = getattr(converted, "actcomp_rest", None)

    layers_only = converted if policy is None else to_compressed(_copy(model), pipeline, loss="plain")
    layer_gradients = run.gradients(layers_only)
    # A layer that reads the model's input runs plain (first_layer="auto"): the caller keeps it anyway.
    plain_on_input = set((kept_report if layers_only is converted else run.memory(layers_only)).plain_on_input)
    layer_rows = [CheckRow(name, "plain (model input)" if name in plain_on_input else layer.spec,
                           _cosine({"w": layer_gradients[f"{name}.weight"]}, {"w": reference[f"{name}.weight"]}),
                           layer_floor if layer_floor is not None else _layer_floor(layer, floor), False)
                  for name, layer in compressed_layers(layers_only).items() if f"{name}.weight" in reference]

    kept = {row.kind: row for row in kept_report.kinds}
    kind_rows = []
    # With a sparsifier on the Linear/Conv inputs, their gradient and the whole one bend by design:
    # their floor is the layers' (one spec: its expected cosine; a mapping: the lowest layer's).
    linear_floor = min([row.floor for row in layer_rows if not row.spec.startswith("plain")], default=floor)
    whole_floor = min(floor, linear_floor)
    if layer_rows:
        row = kept.get("linear")
        kind_rows.append(CheckRow("linear (Linear/Conv inputs)", _spec_text(pipeline), _cosine(layer_gradients, reference),
                                  linear_floor, True, row.plain_bytes if row else 0, row.kept_bytes if row else 0))
    if policy is not None:
        exact = RestPolicy.parse("exact")
        for kind in _LOSSY_KINDS:
            choice = getattr(policy, kind)
            if isinstance(choice, (KeepAsIs, Exact)) or kind not in kept:
                continue
            alone = to_compressed(_copy(model), "mink0", rest=replace(exact, **{kind: choice}), loss="plain")
            row = kept[kind]
            kind_rows.append(CheckRow(kind, str(choice), _cosine(run.gradients(alone), reference), floor, True,
                                      row.plain_bytes, row.kept_bytes))
    return CheckReport(_spec_text(pipeline), None if rest is None else str(rest), whole, whole_floor,
                       plain_report.total_bytes, kept_report.total_bytes, step_time, kind_rows, layer_rows,
                       _suggestions(kind_rows, layer_rows, pipeline, whole, whole_floor))


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


def _layer_floor(pipeline: Pipeline, floor: float) -> float:
    """A layer's default floor: 5% under a Gaussian input's cosine with a sparsifier, else ``floor``."""
    if not any(stage.kind == "sparsifier" and float(stage.drop_rate) > 0 for stage in pipeline.stages):
        return floor
    return 0.95 * expected_layer_cosine(pipeline, floor)


class _Runner:
    """The user's batch, loss and seed: gradients, memory and step time of one model."""

    def __init__(self, inputs: Sequence, kwargs: dict, loss_fn: Callable | None, seed: int):
        self.inputs, self.kwargs, self.loss_fn, self.seed = inputs, kwargs, loss_fn, seed

    def step(self, model: nn.Module) -> None:
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)
        _loss(model(*self.inputs, **self.kwargs), self.loss_fn, self.seed).backward()

    def gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        self.step(model)
        return {name: p.grad.detach().double().reshape(-1).clone()
                for name, p in model.named_parameters() if p.grad is not None}

    def memory(self, model: nn.Module):
        torch.manual_seed(self.seed)
        return memory_report(model, *self.inputs, **self.kwargs)

    def step_time(self, plain: nn.Module, converted: nn.Module, rounds: int) -> float:
        """Median over ``rounds`` of converted's step time over plain's, each round one step of
        each in turn (after one untimed step of each)."""
        ratios = []
        for round_ in range(rounds + 1):
            seconds = []
            for model in (plain, converted):
                started = time.perf_counter()
                self.step(model)
                seconds.append(time.perf_counter() - started)
            if round_:
                ratios.append(seconds[1] / seconds[0])
        return statistics.median(ratios)


def _copy(model: nn.Module) -> nn.Module:
    try:
        return copy.deepcopy(model)
    except Exception as error:  # noqa: BLE001 - any failure to copy has the same remedy
        raise ActcompError(f"check needs a deep copy of the model and copy.deepcopy failed ({type(error).__name__}: "
                           f"{error}); build the model twice and compare by hand, or make it copyable") from error


def _loss(output: Any, loss_fn: Callable | None, seed: int) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output)
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensor = _first_float_tensor(output)
    if tensor is None:
        raise ActcompError(f"the model's output ({type(output).__name__}) holds no float tensor to take a loss of; "
                           "pass loss_fn=lambda output: ...")
    # A fixed random direction: every output element gets a gradient, the same in every run.
    weights = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed)).to(tensor.device)
    return (tensor.float() * weights).sum()


def _first_float_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = _first_float_tensor(value)
        if found is not None:
            return found
    return None


def _cosine(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    names = [name for name in expected if name in got]
    if not names:
        raise ActcompError("no parameter got a gradient in both runs: does the loss depend on the parameters?")
    a, b = (torch.cat([grads[name] for name in names]) for grads in (got, expected))
    if not b.norm():
        # No gradient in plain (a random-init ResNet block whose last BatchNorm starts at zero):
        # nothing to compare; NaN is under no floor.
        return float("nan")
    return float(F.cosine_similarity(a, b, dim=0))


def _spec_text(pipeline: str | Pipeline | Mapping) -> str:
    if isinstance(pipeline, Mapping):
        return ", ".join(f"{pattern}: {spec}" for pattern, spec in pipeline.items())
    return parse(pipeline).spec if isinstance(pipeline, str) else pipeline.spec


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


def _suggestions(kinds: list[CheckRow], layers: list[CheckRow], pipeline, whole: float, floor: float) -> list[str]:
    texts = []
    for row in kinds:
        if not row.below or row.name.startswith("linear"):
            continue
        lighter = _lighter(row.spec) if row.spec not in ("exact", "None") else None
        texts.append(f"{row.name} (cosine {row.cosine:.4f} < {row.floor}): rest={{..., {row.name!r}: {lighter!r}}}"
                     + ("" if lighter else " keeps it as it is"))
    low = [row for row in layers if row.below and not row.spec.startswith("plain")]
    converted = [row for row in layers if not row.spec.startswith("plain")]
    if len(low) > 4 and 2 * len(low) >= len(converted) and not isinstance(pipeline, Mapping):
        lighter = _lighter(_spec_text(pipeline))
        texts.append(f"{len(low)} of {len(converted)} layers under their floor: a lighter spec for all, "
                     f"to_compressed(model, {lighter!r}, ...)")
    elif low:
        rules = {row.name: _lighter(row.spec) for row in low}
        # The first matching pattern wins: the fixes go first, the call's own rules after.
        for pattern, spec in (dict(pipeline) if isinstance(pipeline, Mapping) else {"*": _spec_text(pipeline)}).items():
            rules.setdefault(pattern, spec)
        names = ", ".join(f"{row.name} ({row.cosine:.3f})" for row in low)
        texts.append(f"layers under their floor: {names}: to_compressed(model, {rules!r}, ...) "
                     "(the first pattern that matches a layer's name wins; None leaves it plain)")
    linear = next((row for row in kinds if row.name.startswith("linear") and row.below), None)
    if linear is not None and not low:
        lighter = _lighter(linear.spec) if not isinstance(pipeline, Mapping) else None
        texts.append(f"Linear/Conv inputs together (cosine {linear.cosine:.4f} < {linear.floor}): "
                     + (f"to_compressed(model, {lighter!r}, ...)" if lighter else "a lighter spec per layer"))
    if whole < floor and not texts:
        texts.append(f"the whole gradient (cosine {whole:.4f} < {floor}) with no single part under its floor: "
                     "lighten the kinds or layers with the lowest cosines above")
    return texts

