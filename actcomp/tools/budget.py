"""A memory budget instead of a spec: the codecs that keep at most a fraction of plain's bytes
with the least gradient error, measured on one batch of yours.

:func:`plan_budget` measures the way :func:`actcomp.check` does (deep copies, your batch, your
loss, one seed), in three steps:

1. **bytes**: what each part keeps under each rung of a ladder of codecs, one forward per rung
   (and one of plain layers beside the op kinds' first lossy rung: a layer's input that a
   kind's codec stops keeping, as fused attention's output, is then the layer's to free), on a
   quarter of a batch of 8 rows or more, or on the errors' rows (step 2) where fewer (a
   language model's sequences, those rows or every row of a batch of fewer: a quarter of their
   tokens too, where what it saves grows as their count), scaled to the whole
   (:meth:`_Search._probe_rows`).
   The parts are the converted Linear/Conv layers (their inputs) and whole-model mode's lossy
   op kinds (activation, normalization, attention, other: what their ops save); pooling and
   dropout always take their exact codecs.
2. **error**: the squared gradient error each part adds alone, ``|g - g_plain|^2 / |g_plain|^2``.
   A Linear/Conv layer's input serves only its own weight gradient, so one step measures every
   layer on every rung: each layer's backward recomputes its weight gradient through each rung's
   round trip of its input (:mod:`actcomp.layers.weight_gradients`). An op kind bends the
   gradient flowing back through it, so a kind's rung takes a backward of its own, run only when
   a choice in step 3 wants that rung (until then it counts as bending the gradient no less than
   the kind's lighter rungs); the rungs one choice wants share one forward, packed under each
   rung's policy at once (:func:`~actcomp.whole_model.session.several_policies`). Every error
   is measured on as many of a batch's rows as save 5.7 MB of plain's bytes, one at least,
   whatever the batch's size (8 of vit_tiny's 5-token rows, one of ViT-S's at 224 px), or a
   language model's sequences on as many of their first tokens as save as much, a quarter of
   them if fewer, 64 at least (:meth:`_Search._error_rows`), against plain's gradient there.
3. **choice**: one rung per part minimising the summed error within the budget (an exact
   multiple-choice knapsack over the bytes), then one run of the plan itself to measure what it
   keeps and its gradient cosine (one step on the whole batch); a plan that misses the budget by
   the parts' overlaps is re-solved against what it kept.

A Hugging Face causal LM is measured with its loss routed through the chunked cross-entropy,
as the plan's own call routes it: that loss's saved hidden states are kind "other".

The search costs two steps on the whole batch (plain's, the plan's), one on the rows the errors
are measured on (watching every layer's rungs: about four steps' compute), there a forward per
round of kind rungs the choices wanted and a backward per rung, a forward per rung of the longer
ladder where the bytes are counted, and a forward per plan solved again (``BudgetPlan.steps``,
``.backwards``, ``.forwards``); the docs quote what that is on our models. The plan prints as
the call that pins it.

>>> import torch, actcomp
>>> _ = torch.manual_seed(0)
>>> net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
...                           torch.nn.Linear(256, 10))
>>> plan = actcomp.plan_budget(net, torch.randn(128, 64), budget=0.3)
>>> plan.kept_fraction <= 0.3, plan.cosine > 0.99
(True, True)
>>> net = plan.apply(net)  # the same as pasting print(plan)'s call
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import math
import statistics
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from actcomp.convert import compressed_layers, to_compressed
from actcomp.core.pipeline import as_pipeline
from actcomp.errors import ActcompError
from actcomp.graph.adapters import adapter_pipeline
from actcomp.layers.weight_gradients import WeightGradientCall, watching_weight_gradients
from actcomp.losses.causal_lm import has_routable_loss
from actcomp.tools.memory import MemoryReport, format_bytes, parse_bytes
from actcomp.tools.user_batch import UserBatch, copy_model, gradient_cosine, old_objects_frozen
from actcomp.whole_model.policy import EXACT_KINDS, LOSSY_KINDS, RestPolicy
from actcomp.whole_model.session import several_policies

# Rungs from light to heavy. Linear/Conv inputs only serve the weight gradient (DropIT), so
# min-k belongs on their ladder; the op kinds' tensors feed the gradient flowing back, so theirs
# stops at quantizers. "fewbit4" is the 4-bit derivative code of GELU/SiLU inputs (the "4bit"
# preset's), int4 in groups of 64 for the kind's other tensors.
LAYER_SPECS = ("bf16", "int8", "int4", "mink0.5+int8", "mink0.9+int8", "mink0.9+int4")
KIND_SPECS = ("bf16", "int8", "fewbit4", "int4:group=64", "int2:group=32")
# Knapsack resolution: the budget in this many units, each part's bytes rounded up.
_UNITS = 16384
# Solves against the plan's measured bytes (the parts' bytes overlap a little), and how far under
# the budget a re-solve aims after a plan that went over (a fraction of the budget).
_RESOLVES, _MARGIN = 6, 0.002
# A batch of at least this many rows has the rungs' bytes counted on a quarter of its rows, or on
# the rows its errors are measured on where those are fewer (bytes grow with the rows; a row's
# values do not matter to them).
_PROBE_ROWS = 8
# The parts' errors are measured on as many rows as save this many of plain's bytes, one row at
# least, whatever the batch's size: 8 rows of vit_tiny at 32 px (5 tokens a row, 0.71 MiB), where
# 2 rows chose a plan bending the gradient more than the 4-bit preset at its bytes (0.9813 against
# 0.9821; 0.9847 on 4 rows, 0.9885 on all 8). The estimates rest on values, not rows: a row of
# ViT-S or resnet50 at 224 px saves 56-81 MiB, and their errors on one row choose as on 2 or 8
# (benchmarks/results/budget_stop62/; budget_stop60/ and budget_stop61/ for 2 rows against 8).
# Until stop 61 a quarter of a larger batch was taken, so the search's steps grew with the batch;
# until stop 62 two rows at least, a quarter of a batch of 8.
_ERROR_BYTES = 5_700_000
_ERROR_MIN_ROWS = 1
# A language model's rows (``input_ids``) are sequences: 2 at least, so that a batch of 2 is
# measured on each sequence's first tokens (below), not on one whole sequence of the two.
_ERROR_MIN_SEQUENCES = 2
# A language model's batch of too few rows to cut has its errors measured on its first tokens
# instead: as many as save _ERROR_BYTES, a quarter if fewer, this many at least. A Llama of 8 layers
# (hidden 512, a sink token and outlier channels) at 1 x 2048 tokens chose as well on its first 64
# as on 512 (a quarter, until stop 62): at 0.5, 0.2 and 0.1 the same bytes within 0.001 at the same
# cosines, and at the presets' bytes 0.9983 / 0.9867 / 0.9880 / 0.9767 against 0.9983 / 0.9867 /
# 0.9833 / 0.9768 (benchmarks/results/budget_stop62/long_llama_errors_on_*; 256 tokens chose worse
# there, 0.9810 / 0.9818 / 0.9745 on three: choices among near-equal rungs are noisy at any length).
_ERROR_TOKENS = 64
# A language model's bytes are counted on its first tokens only where plain's bytes of every kind
# there are the tokens' share of the whole's, within this (relative).
_LINEAR = 0.02
# An unmeasured rung's error above its lighter rungs' (relative, and absolute over an exact rung's
# zero): a tie then goes to the measured rung, and the loop in _solve measures only what can win.
_UNMEASURED, _UNMEASURED_FLOOR = 1e-6, 1e-12
# A plan whose measured cosine falls below this warns: the errors no longer add, the plan is a guess.
_FAR = 0.9


@dataclass(frozen=True)
class PlannedPart:
    """One part of the plan: a layer (``kind`` "layer") or an op kind, the spec chosen (None:
    as it is; "exact": the kind's exact codecs alone), its bytes plain and planned, and the
    squared gradient error it adds alone, relative to the gradient's. ``members``: the layers
    sharing one input, which take one spec (or the kind)."""

    name: str
    kind: str
    spec: str | None
    plain_bytes: int
    kept_bytes: int
    error: float
    members: tuple[str, ...]


@dataclass(frozen=True)
class BudgetPlan:
    """What :func:`plan_budget` chose: ``pipeline`` and ``rest`` to pass to
    :func:`actcomp.to_compressed` (or :meth:`apply`), the bytes plain and kept by the plan as
    measured, the whole gradient's cosine against plain's, the parts, the layers whose error could
    not be measured (no gradient on the batch), and the search's cost. ``print(plan)`` shows the
    call that pins it and the parts by op kind."""

    budget_bytes: int
    plain_bytes: int
    kept_bytes: int
    smallest_bytes: int
    cosine: float
    pipeline: dict[str, str | None]
    rest: dict[str, Any]
    parts: tuple[PlannedPart, ...]
    unmeasured: tuple[str, ...]
    steps: int
    forwards: int
    # Where the parts' errors were measured: "every row", "8 of 32 rows", "64 of 256 tokens".
    errors_on: str = "every row"
    # Backwards over a step's retained forward, beyond that step's own (the op kinds' rungs).
    backwards: int = 0

    @property
    def budget(self) -> float:
        return self.budget_bytes / self.plain_bytes

    @property
    def kept_fraction(self) -> float:
        return self.kept_bytes / self.plain_bytes

    def call(self) -> str:
        """The :func:`actcomp.to_compressed` call that pins the plan."""
        return f"actcomp.to_compressed(model, {self.pipeline!r}, rest={self.rest!r})"

    def apply(self, model: nn.Module) -> nn.Module:
        """``to_compressed(model, plan.pipeline, rest=plan.rest)``: converts ``model`` in place."""
        return to_compressed(model, self.pipeline, rest=self.rest)

    def __str__(self) -> str:
        lines = [f"budget {self.budget:.3f} of plain's {format_bytes(self.plain_bytes)} kept for backward: the plan "
                 f"keeps {format_bytes(self.kept_bytes)} ({self.kept_fraction:.3f}, {1 / self.kept_fraction:.1f}x "
                 f"fewer), gradient cosine {self.cosine:.4f} against plain's",
                 f"search: {self.steps} steps, {self.backwards} more backwards and {self.forwards} forwards, the "
                 "parts' errors measured on "
                 f"{self.errors_on}; the smallest reachable is {self.smallest_bytes / self.plain_bytes:.3f}",
                 "", "pin it:", "  " + self.call(), "",
                 f"{'part':<28} {'codec':<16} {'plain':>10} {'planned':>10} {'error':>9}"]
        layers = [part for part in self.parts if part.kind == "layer"]
        for spec, _ in Counter(part.spec for part in layers).most_common():
            chosen = [part for part in layers if part.spec == spec]
            count = sum(len(part.members) for part in chosen)
            lines.append(self._row(f"{count} Linear/Conv layer{'s' * (count > 1)}", spec, chosen))
        for part in self.parts:
            if part.kind != "layer":
                lines.append(self._row(part.name, part.spec, [part]))
        if self.unmeasured:
            lines += ["", f"{len(self.unmeasured)} layers had no gradient on this batch (a zero-initialised norm "
                          "after them?): each planned at the median measured layer's relative error and share; plan on a trained "
                          f"checkpoint to measure them ({', '.join(self.unmeasured[:3])}{' ...' * (len(self.unmeasured) > 3)})"]
        return "\n".join(lines)

    @staticmethod
    def _row(name: str, spec: str | None, parts: list[PlannedPart]) -> str:
        plain, kept = sum(part.plain_bytes for part in parts), sum(part.kept_bytes for part in parts)
        error = sum(part.error for part in parts)
        return f"{name:<28} {str(spec):<16} {format_bytes(plain):>10} {format_bytes(kept):>10} {error:>9.2e}"


def plan_budget(model: nn.Module, batch: Any, budget: float | int | str, *,
                loss_fn: Callable[[Any], torch.Tensor] | None = None, seed: int = 0,
                layer_specs: Sequence[str] = LAYER_SPECS, kind_specs: Sequence[str] = KIND_SPECS,
                attention_floors: bool = True) -> BudgetPlan:
    """The codecs that keep at most ``budget`` of what plain PyTorch keeps for backward on
    ``batch``, with the least gradient error (module docstring: how, and what it costs).

    ``budget`` is a fraction of plain's kept bytes (a float in (0, 1]) or bytes for this batch
    (an int, or a size such as ``"1.5GiB"``). ``batch``, ``loss_fn`` and ``seed`` as for
    :func:`actcomp.check`. ``layer_specs`` and ``kind_specs`` are the ladders searched (fewer
    rungs, fewer steps; one spec alone is a ladder of one). ``attention_floors=False`` lets
    fused attention's query, key, value and output take the attention rungs too
    (``rest={..., "attention_floors": False}``): one step's cosine on a random model hardly
    drops, but a trained language model's sink token bends the gradient, and training from
    scratch suffers too (a byte-level Llama's validation loss 1.18x plain's at 8.5x fewer bytes
    without the floors, 0.92x with them; ``bench_lm_text.py``): keep them. The same model, batch
    and seed give the same plan. Where the budget cannot be met the error names the smallest reachable fraction;
    a plan whose measured cosine falls below 0.9 warns. Called under ``torch.autocast`` it plans
    for mixed precision (the bytes and the fraction are autocast's). ``model`` is not modified.
    """
    if compressed_layers(model) or getattr(model, "actcomp_rest", None) is not None:
        raise ActcompError("plan_budget takes the plain model (it converts copies itself); this one is converted "
                           "already: pass the model before to_compressed, or actcomp.from_compressed(model)")
    bytes_of_budget(budget, 1)  # a malformed budget is refused before anything is measured
    with old_objects_frozen():
        return _planned(model, UserBatch(batch, loss_fn, seed), budget, _ladder(layer_specs), _ladder(kind_specs),
                        attention_floors)


def _planned(model: nn.Module, run: UserBatch, budget: float | int | str, layer_specs: tuple[str, ...],
             kind_specs: tuple[str, ...], attention_floors: bool) -> BudgetPlan:
    """:func:`plan_budget`'s search and choice, its arguments checked."""
    search = _Search(model, run, layer_specs, kind_specs, attention_floors)
    plain_bytes = search.plain_bytes
    budget_bytes = bytes_of_budget(budget, plain_bytes)
    parts, fixed = search.parts()
    smallest = fixed + sum(min(option.bytes for option in part.options) for part in parts)
    if smallest > budget_bytes:
        raise ActcompError(
            f"budget {budget!r} ({format_bytes(budget_bytes)}, {budget_bytes / plain_bytes:.3f} of plain's "
            f"{format_bytes(plain_bytes)}) cannot be met on this model and batch: the smallest reachable is "
            f"{smallest / plain_bytes:.3f} ({format_bytes(smallest)}), every part at its smallest rung"
            + ("; attention_floors=False reaches lower" if attention_floors and any(
                part.name == "attention" for part in parts) else ""))
    chosen, pipeline, rest, kept, cosine = _fit(search, parts, budget_bytes - fixed, budget_bytes, attention_floors)
    if not cosine >= _FAR:
        warnings.warn(f"plan_budget: the plan for budget {budget!r} bends the gradient far (cosine {cosine:.3f} against "
                      "plain's): the parts' errors are too large to add up, and training on it is a gamble; ask for "
                      "more memory" + ("" if attention_floors else ", or keep SDPA's floors"), UserWarning, stacklevel=3)
    planned = tuple(PlannedPart(part.name, part.kind, part.options[index].spec, part.options[0].bytes,
                                part.options[index].bytes, part.options[index].error, part.members)
                    for part, index in zip(parts, chosen))
    return BudgetPlan(budget_bytes, plain_bytes, kept, smallest, cosine, pipeline, rest, planned,
                      tuple(sorted(search.unmeasured)), search.steps, search.forwards, search.errors_on,
                      search.backwards)


def _ladder(specs: str | Sequence[str]) -> tuple[str, ...]:
    """A ladder of specs; one spec given alone is a ladder of one rung (not of its letters).

    >>> _ladder("int8"), _ladder(["bf16", "int8"])
    (('int8',), ('bf16', 'int8'))
    """
    return (specs,) if isinstance(specs, str) else tuple(specs)


def _fit(search: _Search, parts: list[_Part], capacity: int, budget_bytes: int, attention_floors: bool):
    """The knapsack's choice, its mappings, the bytes it keeps as measured and its cosine. The
    parts overlap a little (a tensor two ops save is counted once), so a plan that misses is
    solved again against what it kept; the fullest plan within the budget wins. The first plan
    is measured with one step, its bytes and gradient from the same forward: it is mostly the
    one kept (the knapsack's choice fits the parts' bytes, which the plan's own measure matches
    on our models to 0.1%). A later plan is measured with a forward, and the winner's gradient
    with a step if it was not the first. A choice made again is not measured again: within the
    budget it ends the search (more room did not change the least-error choice: its errors tie,
    as a LoRA model's adapters' inputs at initialisation, whose gradient is zero, and the fewest
    bytes win the tie), over it the room shrinks further."""
    best, kept, measured = None, 0, {}
    for attempt in range(_RESOLVES):
        chosen = _solve(search, parts, capacity)
        if chosen is None:
            if attempt == 0:
                raise _unusable_rungs_error(search, parts, budget_bytes - capacity, budget_bytes, search.plain_bytes)
            break  # solved again below the smallest plan: the closest measured one stands
        if tuple(chosen) in measured:
            kept = measured[tuple(chosen)]
            if kept <= budget_bytes:
                break
        else:
            pipeline = _pipeline_mapping(parts, chosen, search.left_out)
            rest = _rest_mapping(parts, chosen, attention_floors)
            kept, cosine = search.kept_bytes(pipeline, rest, with_cosine=attempt == 0)
            measured[tuple(chosen)] = kept
            if kept <= budget_bytes and (best is None or kept > best[3]):
                best = (chosen, pipeline, rest, kept, cosine)
        if kept <= budget_bytes and (kept >= 0.95 * budget_bytes or not any(chosen)):
            break
        capacity += budget_bytes - kept - (_MARGIN * budget_bytes if kept > budget_bytes else 0)
    if best is None:
        plain = search.plain_bytes
        raise ActcompError(f"the closest plan keeps {format_bytes(kept)} ({kept / plain:.3f} of plain's), over the "
                           f"budget's {format_bytes(budget_bytes)}; ask for at least {kept / plain:.3f}")
    if best[4] is None:
        best = (*best[:4], search.cosine(best[1], best[2]))
    return best


def _solve(search: _Search, parts: list[_Part], capacity: int) -> list[int]:
    """The knapsack's choice, measuring an op kind's rung only when a choice wants it.

    An unmeasured rung counts as bending the gradient a hair more than the heaviest-erring
    lighter rung measured (a coarser code of the same tensors bends it no less), so the loop
    ends with a choice whose every rung is measured and which no other choice beats as long as
    a kind's errors grow along its ladder: the full search's choice, for a fraction of its steps.
    ``parts`` is updated in place with what was measured. None where nothing fits (a rung
    measured unusable, or a capacity below the smallest plan)."""
    while True:
        chosen = _knapsack([_bounded(part) for part in parts], capacity)
        if chosen is None:
            return None
        if not _measured(search, parts, list(enumerate(chosen))):
            return chosen


def _measured(search: _Search, parts: list[_Part], options: list[tuple[int, int]]) -> bool:
    """Measure the errors of the ``(part, option)`` pairs not measured yet, into ``parts``;
    whether there were any."""
    wanted = [(at, index) for at, index in options if parts[at].options[index].error is None]
    if not wanted:
        return False
    errors = search.kind_errors([(parts[at].name, parts[at].options[index].spec) for at, index in wanted])
    for (at, index), error in zip(wanted, errors):
        part = parts[at]
        updated = list(part.options)
        updated[index] = replace(updated[index], error=error)
        parts[at] = replace(part, options=tuple(updated))
    return True


def _unusable_rungs_error(search: _Search, parts: list[_Part], fixed: int, budget_bytes: int,
                          plain: int) -> ActcompError:
    """The error for a budget that only rungs measured unusable (a non-finite gradient) reach,
    naming them and the smallest plan of usable ones: each part's lightest rung not refused is
    measured first (a coarse rung's NaN often comes with the next one's), so the figure given is
    one a plan meets, not a guess the next call refutes."""

    def lightest_usable(part: _Part) -> int:
        usable = [index for index, option in enumerate(part.options)
                  if option.error is None or not math.isinf(option.error)]
        return min(usable, key=lambda index: part.options[index].bytes)

    while _measured(search, parts, [(at, lightest_usable(part)) for at, part in enumerate(parts)]):
        pass
    refused = [f"{part.name} at {option.spec}" for part in parts for option in part.options
               if option.error is not None and math.isinf(option.error)]
    smallest = fixed + sum(part.options[lightest_usable(part)].bytes for part in parts)
    return ActcompError(
        f"the budget ({format_bytes(budget_bytes)}, {budget_bytes / plain:.3f} of plain's) cannot be met by codecs "
        f"that keep the gradient finite on this batch: {', '.join(refused[:4])} gave a NaN or inf gradient, and "
        f"without them the smallest reachable is {smallest / plain:.3f}; ask for at least that (BatchNorm over a "
        "few values a channel can turn coarse codes into NaN: docs/guide/limitations.md, 'Tiny batch statistics')")


def _usable_error(error: float) -> float:
    """A measured error, or infinity where it is NaN: a rung whose gradient is not finite on
    the batch is never chosen (NaN would poison the knapsack's sums and comparisons)."""
    return error if not math.isnan(error) else math.inf


def _bounded(part: _Part) -> _Part:
    """``part`` with each unmeasured option's error bounded below by its lighter rungs' (their
    finite ones: a rung refused for a NaN gradient says nothing of the next)."""
    if all(option.error is not None for option in part.options):
        return part
    options, floor = [], 0.0
    for option in part.options:
        if option.error is None:
            options.append(replace(option, error=floor * (1 + _UNMEASURED) + _UNMEASURED_FLOOR))
        else:
            floor = max(floor, option.error) if math.isfinite(option.error) else floor
            options.append(option)
    return replace(part, options=tuple(options))


def bytes_of_budget(budget: float | int | str, plain_bytes: int) -> int:
    """``budget`` in bytes: a fraction of ``plain_bytes``, bytes, or a size string; a malformed
    one raises (the command line asks before it builds a model).

    >>> bytes_of_budget(0.25, 1000), bytes_of_budget(300, 1000), bytes_of_budget("1KiB", 4096)
    (250, 300, 1024)
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise ActcompError(f"budget must be a fraction of plain's kept bytes (a float in (0, 1]), bytes (an int) or "
                           f"a size such as '1.5GiB', got {type(budget).__name__}: {budget!r}")
    if isinstance(budget, str):
        return parse_bytes(budget)
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ActcompError(f"budget={budget!r}: a fraction of plain's kept bytes must be in (0, 1]; write bytes "
                               "as an int or a size string ('1.5GiB')")
        return round(budget * plain_bytes)
    if budget <= 0:
        raise ActcompError(f"budget={budget!r}: bytes must be positive")
    return budget


@dataclass(frozen=True)
class _Option:
    spec: str | None
    bytes: int
    error: float | None  # None: not measured yet (an op kind's rung no choice has wanted)


@dataclass(frozen=True)
class _Part:
    name: str
    kind: str
    options: tuple[_Option, ...]
    # The layers that share one input (a block's conv1 and downsample), or the kind.
    members: tuple[str, ...]


class _Search:
    """The measurements: copies of the model converted rung by rung, on the user's batch."""

    def __init__(self, model: nn.Module, run: UserBatch, layer_specs: tuple[str, ...], kind_specs: tuple[str, ...],
                 attention_floors: bool = True):
        self.model, self.run, self.layer_specs, self.kind_specs = model, run, layer_specs, kind_specs
        self.attention_floors = attention_floors
        self.reference, plain = run.gradients_and_memory(copy_model(model))
        self.plain_bytes = plain.total_bytes
        self._plain_kinds = {row.kind: row.plain_bytes for row in plain.kinds}
        norm = _squared_norm(self.reference)
        if not norm:
            raise ActcompError("plain's gradient is zero on this batch: no error can be measured; does the loss "
                               "depend on the parameters?")
        self.steps, self.forwards, self.backwards = 1, 0, 0
        self._buffers: dict[torch.device, torch.Tensor] = {}  # _squared_distance's, by device
        self.unmeasured: set[str] = set()
        # Every copy measured routes the loss as the plan will: a lossy plan takes the chunked
        # loss (loss="auto"), whose saves a custom Function makes, kind "other". Measured with
        # the model's own loss, "other" held the logits' log-softmax instead, and a plan giving
        # it int2 coded the chunked loss's hidden states unmeasured (a Llama's cosine 0.9937
        # where the parts' errors summed to 0.9996).
        self.loss = "chunked" if has_routable_loss(model) else "plain"
        self.left_out: tuple[str, ...] = ()
        self.probe, self.scale = self._probe_rows()
        # The parts' errors are measured on fewer rows (or tokens) where the batch has enough
        # (_error_rows), against plain's gradient there; the plan's cosine on the whole batch.
        self.measured, self.measured_reference, self.norm = self._error_rows(norm)
        tokens = f"{self.measured.tokens} of {run.tokens} tokens" if self.measured.tokens < run.tokens else ""
        rows = f"{self.measured.rows} of {run.rows} rows" if self.measured.rows < run.rows else ""
        self.errors_on = ("every row" if self.measured is self.run else " of ".join(filter(None, (tokens, rows)))
                          or "every row")

    def _probe_rows(self) -> tuple[UserBatch, float]:
        """The batch the rungs' bytes are counted on, and what scales its bytes to the batch's.

        The rungs' forwards only count bytes, and every part's bytes grow with the batch's rows,
        so a batch of :data:`_PROBE_ROWS` or more rows is counted on a quarter of them, or on the
        rows the errors are measured on where fewer (resnet50 at batch 8 or 32: 9 forwards on one
        row), scaled by plain's bytes on the whole over plain's there. What does not grow with the
        rows (a position table) is scaled with the rest: the parts then look a little larger, and
        the plan is measured on the whole batch and solved again (:func:`_fit`). A model that will
        not run on fewer rows is counted on the whole (one row that will not is tried as two).

        A language model's sequences (however many: those rows, or every row of a batch of fewer)
        are counted on a quarter of their tokens (:data:`_ERROR_TOKENS` at least; a Llama's 1 x
        2048: 8 forwards of 512 tokens; 2 of a small one's 16 x 256: 64 each) where every op
        kind's plain bytes there are that share of the whole's: a model whose saves grow otherwise
        (an eager attention's probabilities, as the sequence's square; rotary tables, by the tokens
        alone, once rows are cut too) is counted on those rows, or on the whole, since one scale
        for all would misjudge the parts."""
        count = self.run.rows
        rows = self.run.first_rows(min(count // 4, self._error_row_count())) if count >= _PROBE_ROWS else None
        cut = (rows or self.run).first_tokens(max(_ERROR_TOKENS, self.run.tokens // 4)) if self.run.tokens else None
        for probe, by_tokens in ((cut, True), (rows, False)):
            counted = self._scaled_probe(probe, by_tokens) if probe is not None else None
            if counted is not None:
                return counted
        return self.run, 1.0

    def _scaled_probe(self, probe: UserBatch, by_tokens: bool) -> tuple[UserBatch, float] | None:
        """``probe`` (or the two rows one row widened to) and the scale of its bytes to the
        whole batch's; None where it does not run, saves nothing, or (``by_tokens``) where a kind's
        plain bytes there are not the probe's share of the whole's (:data:`_LINEAR`)."""
        probe, report = self._first_that_runs(probe, self._counted_memory, wider=not by_tokens)
        if report is None or not report.total_bytes:  # a model that cannot run on fewer rows
            return None
        scale = self.plain_bytes / report.total_bytes
        if by_tokens:
            share = self.run.rows * self.run.tokens / (probe.rows * probe.tokens)
            ratios = [scale] + [self._plain_kinds.get(row.kind, 0) / row.plain_bytes
                                for row in report.kinds if row.plain_bytes]
            if any(abs(ratio / share - 1) > _LINEAR for ratio in ratios):
                return None
        return probe, scale

    def _error_rows(self, whole_norm: float) -> tuple[UserBatch, dict[str, torch.Tensor], float]:
        """The batch the parts' errors are measured on, plain's gradient on it and that
        gradient's squared norm (``whole_norm`` is the whole batch's).

        As many rows as save :data:`_ERROR_BYTES` of plain's bytes, :data:`_ERROR_MIN_ROWS` at
        least, where the batch has more (not a share of the batch: the estimates rest on values,
        and a larger batch does not need more of them); a language model's sequences
        (``input_ids``: those rows, or every row of a batch of fewer) on their first tokens
        (:meth:`_error_token_count`: a causal model computes a sequence's first tokens as it does
        in the whole sequence; until stop 64 a batch of more rows took its rows whole, 4x the
        tokens of 2 x 256 on the small Llama of ``bench_budget.py``, at no better a choice); both
        only where the loss is the model's own (a ``loss_fn``
        may hold the whole batch's labels), else the whole batch. Each part's error is a share of
        plain's squared gradient there, every part measured on the same rows, so the knapsack
        compares like with like at a fraction of the steps' compute (ViT-S's batch of 8 or 32 at
        224 px measures each kind's rung on one row, vit_tiny's at 32 px on 8). One row that will
        not run (BatchNorm1d in training mode) is tried as two. The plan itself is
        measured on the whole batch."""
        count = self._error_row_count()
        # The bytes' rows serve where they are these rows, or the two that one row widened to.
        widened = count == 1 and self.probe.rows == 2
        rows = (self.probe if self.probe is not self.run and (self.probe.rows == count or widened)
                else self.run.first_rows(count))
        if self.run.tokens:  # a language model's sequences, however many: their first tokens
            sequences = rows or self.run
            rows = sequences.first_tokens(self._error_token_count(sequences.rows)) or rows
        if rows is None or self.run.loss_fn is not None:
            return self.run, self.reference, whole_norm
        rows, reference = self._first_that_runs(rows, self._counted_gradients)
        if reference is None:  # a model that cannot step on fewer rows is measured whole
            return self.run, self.reference, whole_norm
        norm = _squared_norm(reference)
        if list(reference) != list(self.reference) or not 0 < norm < math.inf:
            # A parameter the rows do not reach, or no gradient to measure against there (a
            # fine-tuning batch whose first tokens are all prompt, labelled -100: a NaN loss).
            return self.run, self.reference, whole_norm
        return rows, reference, norm

    def _error_row_count(self) -> int:
        """How many rows the parts' errors are measured on where the batch has more: as many as
        save :data:`_ERROR_BYTES` of plain's bytes, :data:`_ERROR_MIN_ROWS` at least
        (:data:`_ERROR_MIN_SEQUENCES` for a language model's sequences)."""
        rows = self.run.rows
        per_row = self.plain_bytes / rows if rows else 0
        least = _ERROR_MIN_SEQUENCES if self.run.tokens else _ERROR_MIN_ROWS
        return max(least, math.ceil(_ERROR_BYTES / per_row) if per_row else rows)

    def _error_token_count(self, sequences: int) -> int:
        """How many of each sequence's first tokens a language model has its errors measured on,
        over ``sequences`` of its rows: as many as save :data:`_ERROR_BYTES` of plain's bytes
        there, or a quarter of them where that is fewer, :data:`_ERROR_TOKENS` at least (a Llama's
        1 x 2048 tokens at hidden 512: 64; the small one's 2 x 256, or 2 of its 16 x 256: 64, a
        quarter)."""
        tokens = self.run.tokens
        per_token = self.plain_bytes * sequences / self.run.rows / tokens if tokens else 0
        by_bytes = math.ceil(_ERROR_BYTES / per_token) if per_token else tokens
        return max(_ERROR_TOKENS, min(tokens // 4, by_bytes))

    def _first_that_runs(self, rows: UserBatch, measure: Callable[[UserBatch], Any],
                         wider: bool = True) -> tuple[UserBatch | None, Any]:
        """``rows`` and ``measure(rows)``; where that raises and ``rows`` is one row (and
        ``wider``), two rows and their measure, since a layer may need two to run in training mode
        (BatchNorm1d's statistics over the batch); (None, None) where nothing ran."""
        two = self.run.first_rows(2) if wider and rows.rows == 1 else None
        for candidate in filter(None, (rows, two)):
            try:
                return candidate, measure(candidate)
            except Exception:  # noqa: BLE001 - any failure on fewer rows sends the caller to the whole batch
                continue
        return None, None

    def _counted_memory(self, rows: UserBatch) -> MemoryReport:
        self.forwards += 1
        return rows.memory(copy_model(self.model))

    def _counted_gradients(self, rows: UserBatch) -> dict[str, torch.Tensor]:
        self.steps += 1
        return rows.gradients(copy_model(self.model))

    def parts(self) -> tuple[list[_Part], int]:
        """Every part with its options (rung 0: plain layers, exact kind), and the bytes no part
        holds (the model's other saves)."""
        rungs = max(len(self.layer_specs), len(self.kind_specs))
        measured = [self._report(None if rung == 0 else _rung(self.layer_specs, rung),
                                 None if rung == 0 else _rung(self.kind_specs, rung)) for rung in range(rungs + 1)]
        reports = [report for report, _ in measured]
        # Every layer a spec converts, named from the first rung's copy (rung 0 converts none).
        converted = measured[1][1] if self.layer_specs else []
        scale = self.scale
        first, rows = reports[0], [_row_bytes(report, scale) for report in reports]
        # Plain layers beside lossy kinds: where a kind's codec keeps nothing of a tensor a layer
        # saves too (fused attention's output, run again in backward, is the output projection's
        # input), the layer's own row holds it, and compressing the layer frees it.
        beside = self._report(None, _rung(self.kind_specs, 1))[0] if self.kind_specs and converted else first
        plain_rows = _row_bytes(beside, scale)
        groups = _layer_groups(converted, beside, reports[1] if self.layer_specs else first)
        # Layers no part holds (keeping nothing of their own: a LoRA model's frozen base layers)
        # stay plain in the plan: its "*" rule would otherwise give them the commonest spec, its
        # error never measured.
        grouped = {name for group in groups for name in group}
        self.left_out = tuple(name for name in converted if name not in grouped and name not in beside.plain_on_input)
        kinds = [row.kind for row in first.kinds if row.kind in LOSSY_KINDS and row.kept_bytes > 0]
        fixed = round(first.total_bytes * scale) - sum(_group_bytes(rows[0], group) for group in groups) - sum(
            _kind_bytes(first, kind, scale) for kind in kinds)
        # A rung keeping no fewer bytes than a lighter one is never chosen: its round trips are
        # not worth a watcher's time (mink0.5+int8 keeps more than int4 on every layer).
        wanted = {}
        for group in groups:
            options = [_Option(str(rung), _group_bytes(plain_rows if rung == 0 else rows[rung], group), 0.0)
                       for rung in range(len(self.layer_specs) + 1)]
            useful = {int(option.spec) - 1 for option in _lighter_only(options)[1:]}
            wanted.update({name: useful for name in group})
        errors = self._layer_errors([name for group in groups for name in group], wanted)
        parts = []
        for group in groups:
            options = [_Option(None, _group_bytes(plain_rows, group), 0.0)]
            for rung, spec in enumerate(self.layer_specs, 1):
                options.append(_Option(spec, _group_bytes(rows[rung], group),
                                       sum(errors[rung - 1][name] for name in group)))
            parts.append(_Part("+".join(group), "layer", _lighter_only(options), group))
        for kind in kinds:
            options = [_Option("exact", _kind_bytes(first, kind, scale), 0.0)]
            for rung, spec in enumerate(self.kind_specs, 1):
                if spec == "fewbit4" and kind != "activation":
                    continue  # the derivative codes are GELU/SiLU's; the kind's other tensors take int4 next
                kept = _kind_bytes(reports[rung], kind, scale)
                # A rung that keeps no fewer bytes than a lighter one is never worth a step.
                if kept < min(option.bytes for option in options):
                    options.append(_Option(spec, kept, None))  # measured when a choice wants it
            parts.append(_Part(kind, "kind", tuple(options), (kind,)))
        return parts, fixed

    def kept_bytes(self, pipeline: dict, rest: dict, *, with_cosine: bool = False) -> tuple[int, float | None]:
        """What the plan keeps on the whole batch, and with ``with_cosine`` its gradient's cosine
        against plain's from the same forward (a step instead of a forward; else None)."""
        converted = to_compressed(copy_model(self.model), pipeline, rest=rest)
        if not with_cosine:
            self.forwards += 1
            return self.run.memory(converted).total_bytes, None
        self.steps += 1
        gradients, report = self.run.gradients_and_memory(converted)
        return report.total_bytes, gradient_cosine(self._checked(gradients, self.reference), self.reference)

    def cosine(self, pipeline: dict, rest: dict) -> float:
        self.steps += 1
        gradients = self.run.gradients(to_compressed(copy_model(self.model), pipeline, rest=rest))
        return gradient_cosine(self._checked(gradients, self.reference), self.reference)

    def _report(self, layer_spec: str | None, kind_spec: str | None) -> tuple[MemoryReport, list[str]]:
        """The memory report of a copy with every layer at ``layer_spec`` and every lossy kind at
        ``kind_spec``, and the names of the layers converted."""
        self.forwards += 1
        rest = "exact" if kind_spec is None else _kinds_alone({kind: kind_spec for kind in LOSSY_KINDS},
                                                              self.attention_floors)
        converted = to_compressed(copy_model(self.model), {"*": layer_spec}, rest=rest, loss=self.loss)
        return self.probe.memory(converted), list(compressed_layers(converted))

    def _layer_errors(self, layers: list[str],
                      wanted: Mapping[str, set[int]] | None = None) -> list[dict[str, float]]:
        """Each layer's share of the squared gradient error at each rung of the layer ladder.

        One step measures every rung: a copy whose layers keep their inputs exactly
        (``"mink0"``), the gradient flowing back as plain's, and at each layer's backward the
        weight gradient from every rung's round trip of its input against the exact one
        (:mod:`actcomp.layers.weight_gradients`). A layer that step cannot measure so (called
        more than once a step, whose errors add as tensors, or with its own forward, whose weight
        is not the parameter) is measured as stop 49 measured every layer: one step per rung
        with every such layer converted. ``wanted``: the rungs (0-based) worth measuring for each
        layer (every rung where not given); the others are left at 0, and are never chosen.

        A layer whose plain weight gradient is zero on this batch (a zero-initialised norm after
        it, as timm's ResNets start) shows no error, so it is given what can be measured: the
        median relative error of the layers that have a gradient, at their median gradient share."""
        pipelines = [as_pipeline(spec, "layer_specs") for spec in self.layer_specs]
        squared = [dict.fromkeys(layers, 0.0) for _ in pipelines]
        calls: Counter[str] = Counter()

        def watch(call: WeightGradientCall) -> None:
            if call.name not in squared[0]:
                return
            calls[call.name] += 1
            exact = call.grad_weight.float()
            for rung, pipeline in enumerate(pipelines):
                if wanted is not None and rung not in wanted.get(call.name, ()):
                    continue
                chosen = adapter_pipeline(call.name, pipeline)  # LoRA adapters' layers as to_compressed does
                if chosen is not None:
                    through = call.weight_gradient_through(chosen.fresh())
                    squared[rung][call.name] += float(self._squared_distance(through, exact))

        own_forward = set()
        if layers and pipelines:
            probe = to_compressed(copy_model(self.model), "mink0", loss=self.loss)
            own_forward = {name for name, module in probe.named_modules() if getattr(module, "actcomp_own_forward", 0)}
            with watching_weight_gradients(watch):
                self._gradients(probe)
        # Unseen layers ran plain (on the model's input, first_layer="auto"): no error, as converted.
        stepped = [layer for layer in layers if calls[layer] > 1 or layer in own_forward]
        for rung, spec in enumerate(self.layer_specs if stepped else ()):
            got = self._gradients(to_compressed(copy_model(self.model), {layer: spec for layer in stepped},
                                                loss=self.loss))
            for layer in stepped:
                squared[rung][layer] = sum(float((got[name] - self.measured_reference[name]).square().sum())
                                           for name in self._own(layer))
        return [self._fill_unmeasured({layer: _usable_error(error / self.norm) for layer, error in errors.items()},
                                      {layer for layer in layers if wanted is None or rung in wanted.get(layer, ())})
                for rung, errors in enumerate(squared)]

    def _own(self, layer: str) -> list[str]:
        return [name for name in self.measured_reference if name.rpartition(".")[0] == layer]

    @functools.cached_property
    def _shares(self) -> dict[str, float]:
        """Each layer's share of plain's squared gradient norm, by layer name (made once)."""
        squared: dict[str, float] = {}
        for name, grad in self.measured_reference.items():
            layer = name.rpartition(".")[0]
            squared[layer] = squared.get(layer, 0.0) + float(grad.square().sum())
        return {layer: total / self.norm for layer, total in squared.items()}

    def _fill_unmeasured(self, errors: dict[str, float], measured: set[str] | None = None) -> dict[str, float]:
        """``errors`` with each layer that has no gradient given the median measured one's; the
        median over the layers ``measured`` at this rung (every layer where not given)."""
        relative, shares, unmeasured = [], [], []
        for layer, error in errors.items():
            share = self._shares.get(layer, 0.0)
            if share > 0 and (measured is None or layer in measured):
                relative.append(error / share)
                shares.append(share)
            elif share == 0:
                unmeasured.append(layer)
        self.unmeasured.update(unmeasured)
        assumed = statistics.median(relative) * statistics.median(shares) if relative else 0.0
        return {layer: assumed if layer in unmeasured else error for layer, error in errors.items()}

    def kind_errors(self, rungs: Sequence[tuple[str, str]]) -> list[float]:
        """Each (kind, spec)'s share of the squared gradient error, the kind alone at the spec:
        one forward packing every save under each rung's policy, then a backward per rung over
        the retained graph (:func:`~actcomp.whole_model.session.several_policies`), each giving
        the gradient that rung's own step gives. The forward was most of a rung's step on a
        language model (its Python per op)."""
        rests = [_kinds_alone({kind: spec}, self.attention_floors) for kind, spec in rungs]
        converted = to_compressed(copy_model(self.model), "mink0", rest=rests[0], loss=self.loss)
        self.steps += 1
        self.backwards += len(rests) - 1
        with several_policies([RestPolicy.parse(rest) for rest in rests]) as select:
            return self.measured.over_backwards(converted, len(rests), select, self._squared_error)

    def _squared_error(self, model: nn.Module) -> float:
        """``model``'s gradients' squared distance from plain's on the errors' rows, over the
        latter's squared norm. Each difference is taken in float32 into one reused buffer: float64
        copies of ViT-S's 22M gradients, their differences and squares (fresh pages each, under
        the 1 MiB mmap threshold) were a third of a kind rung's time. A float32 difference of two
        float32 gradients is exact where they are within a factor 2 of each other, and within
        float32's rounding of the difference elsewhere."""
        grads = self._checked({name: p.grad for name, p in model.named_parameters() if p.grad is not None},
                              self.measured_reference)
        total = sum(self._squared_distance(grads[name].reshape(-1), reference)
                    for name, reference in self._reference32.items())
        return _usable_error(float(total) / self.norm)

    @functools.cached_property
    def _reference32(self) -> dict[str, torch.Tensor]:
        """Plain's gradients on the errors' rows in float32 (exact: they were float32 or
        narrower before their float64 copies)."""
        return {name: grad.float() for name, grad in self.measured_reference.items()}

    def _squared_distance(self, got: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """``|got - reference|^2`` (a float32 ``reference`` of ``got``'s shape), the difference
        taken in float32 in a buffer kept per device and grown as needed, not a fresh one."""
        buffer = self._buffers.get(reference.device)
        if buffer is None or buffer.numel() < reference.numel():
            buffer = self._buffers[reference.device] = torch.empty(reference.numel(), dtype=torch.float32,
                                                             device=reference.device)
        difference = torch.sub(got, reference, out=buffer[:reference.numel()].view(reference.shape))
        # Squared in place and summed in float32, a tensor's sum carried on in float64. torch's
        # float32 sum is a cascade of partial sums: 5e-8 relative on 1.8M squares, at a fifth of
        # a float64 sum's time (which converts every element; 0.4 of ViT-S's 1.8 s for 6 kind
        # rungs). A float32 dot product (one running sum) drifted by 1e-5.
        return difference.square_().sum().to(torch.float64)

    def _gradients(self, converted: nn.Module) -> dict[str, torch.Tensor]:
        """``converted``'s gradients on the rows the parts' errors are measured on."""
        self.steps += 1
        return self._checked(self.measured.gradients(converted), self.measured_reference)

    @staticmethod
    def _checked(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [name for name in reference if name not in got]
        if missing:
            raise ActcompError(f"the converted model's parameters {missing[:3]} got no gradient where plain's did")
        return got


def _squared_norm(gradients: dict[str, torch.Tensor]) -> float:
    return float(sum(grad.square().sum() for grad in gradients.values()))


def _rung(specs: tuple[str, ...], rung: int) -> str | None:
    """Rung ``rung`` (1-based) of a ladder, its last past its end, None for an empty one."""
    return specs[min(rung, len(specs)) - 1] if specs else None


def _kinds_alone(specs: Mapping[str, str], attention_floors: bool = True) -> dict[str, Any]:
    """A ``rest`` mapping: the kinds in ``specs`` at their spec ("fewbit4" as 4-bit derivative
    codes), every other kind exact; ``attention_floors=False`` lifts SDPA's floors where attention
    is lossy.

    >>> _kinds_alone({"activation": "fewbit4"})["fewbit"], _kinds_alone({"attention": "int8"})["activation"]
    (4, 'exact')
    """
    rest: dict[str, Any] = {kind: "exact" for kind in LOSSY_KINDS + EXACT_KINDS}
    for kind, spec in specs.items():
        if spec == "fewbit4":
            rest.update({kind: "int4:group=64", "fewbit": 4} if kind == "activation" else {kind: "int4:group=64"})
        else:
            rest[kind] = spec
    if not attention_floors and rest["attention"] != "exact":
        rest["attention_floors"] = False
    return rest


def _layer_groups(converted: list[str], plain: MemoryReport, compressed: MemoryReport) -> list[tuple[str, ...]]:
    """The ``converted`` layers, less those reading the model's input (they run plain), grouped
    by the input they share (a ResNet block's conv1 and downsample, an LLM's q/k/v projections):
    a storage ``plain``'s layers all keep (compressing one of them alone frees nothing), or the
    input ``compressed``'s layers all read (one code for all of them: under autocast each plain
    layer keeps a bf16 copy of its own, while one spec for the group codes the input once, so
    the group's bytes at a rung are that one code's). Groups keeping nothing (a LoRA model's
    frozen base layers) are left out."""
    layers = [name for name in converted if name not in plain.plain_on_input]
    group_of = {name: (name,) for name in layers}
    shared = [storage.savers for storage in plain.storages] + compressed.shared_inputs
    for names in shared:
        sharing = [name for name in layers if name in names]
        if len(sharing) > 1:
            merged = tuple(sorted({member for name in sharing for member in group_of[name]}, key=layers.index))
            group_of.update({member: merged for member in merged})
    groups, rows = list(dict.fromkeys(group_of[name] for name in layers)), _row_bytes(plain)
    return [group for group in groups if _group_bytes(rows, group) > 0]


def _row_bytes(report: MemoryReport, scale: float = 1.0) -> dict[str, int]:
    """The bytes each module keeps, by name (times ``scale``)."""
    return {row.name: round(row.nbytes * scale) for row in report.rows}


def _group_bytes(rows: dict[str, int], group: tuple[str, ...]) -> int:
    return sum(rows.get(name, 0) for name in group)


def _kind_bytes(report: MemoryReport, kind: str, scale: float = 1.0) -> int:
    return round(next((row.kept_bytes for row in report.kinds if row.kind == kind), 0) * scale)


def _lighter_only(options: list[_Option]) -> tuple[_Option, ...]:
    """The options that keep fewer bytes than every lighter rung (the others can never win)."""
    kept = [options[0]]
    for option in options[1:]:
        if option.bytes < min(choice.bytes for choice in kept):
            kept.append(option)
    return tuple(kept)


def _knapsack(parts: list[_Part], capacity: int, round_up: bool = True) -> list[int] | None:
    """One option per part with the least summed error whose bytes fit ``capacity``: dynamic
    programming over the bytes in :data:`_UNITS` units, each part's bytes rounded up, so the
    chosen bytes never exceed ``capacity`` (rounded down, ViT-S's 50 parts chose plans 0.1% over
    the budget, each solved and measured again); where nothing fits so (a capacity within the
    rounding of the smallest plan), rounded down. Ties go to the option listed first (less
    compressed). Index 0 for every part if nothing is needed; None if nothing fits, an option
    of infinite error (:func:`_usable_error`) never being taken.

    >>> a = (_Option(None, 100, 0.0), _Option("int8", 25, 0.1), _Option("int4", 12, 0.5))
    >>> parts = [_Part("a", "layer", a, ("a",)), _Part("b", "layer", a[:2], ("b",))]
    >>> _knapsack(parts, 130), _knapsack(parts, 60), _knapsack(parts, 1000), _knapsack(parts, 30)
    ([1, 0], [1, 1], [0, 0], None)
    """
    unit = max(capacity, 1) / _UNITS
    units = (lambda size: math.ceil(size / unit)) if round_up else (lambda size: int(size / unit))
    infinity = float("inf")
    best = torch.full((_UNITS + 1,), infinity, dtype=torch.float64)
    best[0] = 0.0
    picks = []
    for part in parts:
        # Row i: the least error with option i taken, by bytes used; the minimum over the rows
        # takes the first of equal ones (torch.min's index), the option listed first.
        shifted = torch.full((len(part.options), _UNITS + 1), infinity, dtype=torch.float64)
        for index, option in enumerate(part.options):
            weight = units(option.bytes)
            if weight <= _UNITS:
                torch.add(best[:_UNITS + 1 - weight], option.error, out=shifted[index, weight:])
        best, pick = shifted.min(dim=0)
        picks.append(pick)
    if math.isinf(float(best.min())):
        return _knapsack(parts, capacity, round_up=False) if round_up else None
    used = int(torch.argmin(best))  # the first of equal errors: the fewest bytes
    chosen = []
    for part, pick in zip(reversed(parts), reversed(picks)):
        index = int(pick[used])
        chosen.append(index)
        used -= units(part.options[index].bytes)
    return chosen[::-1]


def _pipeline_mapping(parts: list[_Part], chosen: list[int], left_out: Sequence[str] = ()) -> dict[str, str | None]:
    """The layers' specs as a ``to_compressed`` mapping: ``"*"`` for the most common spec, after
    a rule for each other (:func:`_short_rules`); the ``left_out`` layers as they are."""
    specs = {name: part.options[index].spec for part, index in zip(parts, chosen) if part.kind == "layer"
             for name in part.members}
    specs.update(dict.fromkeys(left_out))
    if not specs:
        return {"*": None}
    common = Counter(specs.values()).most_common(1)[0][0]
    return {**_short_rules(specs, common), "*": common}


def _short_rules(specs: dict[str, str | None], common: str | None) -> dict[str, str | None]:
    """Patterns for the layers whose spec is not ``common``: each layer's name with the most of
    its numbered path parts made ``*`` that still matches no layer of another spec (so the rules
    never contradict each other, whatever their order), or the name itself.

    >>> specs = {f"layer1.{i}.conv{j}": "int4" for i in range(3) for j in (1, 2)}
    >>> specs.update({"layer1.1.conv2": "int8", "layer2.0.conv1": "int8", "layer2.1.conv1": "int8", "fc": None})
    >>> _short_rules(specs, "int4")
    {'layer1.1.conv2': 'int8', 'layer2.*.conv1': 'int8', 'fc': None}
    """
    rules: dict[str, str | None] = {}
    for name, spec in specs.items():
        if spec == common or any(fnmatch.fnmatchcase(name, pattern) for pattern in rules):
            continue
        parts = name.split(".")
        numbered = [index for index, part in enumerate(parts) if part.isdigit()]
        chosen = name
        # Most general first: every numbered part a wildcard, then fewer.
        for count in range(len(numbered), 0, -1):
            for subset in itertools.combinations(numbered, count):
                pattern = ".".join("*" if index in subset else part for index, part in enumerate(parts))
                if all(other == spec for layer, other in specs.items() if fnmatch.fnmatchcase(layer, pattern)):
                    chosen = pattern
                    break
            if chosen != name:
                break
        rules[chosen] = spec
    return rules


def _rest_mapping(parts: list[_Part], chosen: list[int], attention_floors: bool) -> dict[str, Any]:
    return _kinds_alone({part.name: part.options[index].spec for part, index in zip(parts, chosen)
                         if part.kind == "kind"}, attention_floors)
