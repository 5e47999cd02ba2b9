"""The largest batch whose training step stays under a memory budget, found in fresh processes.

Each candidate batch trains in a process of its own (:func:`actcomp.tools.peak_rss.peak_rss`: a step at
batch 2, then one at the candidate batch, which thus starts with gradients allocated),
so the answer is the operating system's peak, allocator slack and backward temporaries included,
never an estimate from bytes kept. Peak memory grows about linearly with the batch, so two small
probes give a first guess; bisection between the largest batch that fits and the smallest that
does not then settles it. A probe stops as soon as it passes the budget.

>>> search = largest_batch("resnet18", None, budget=parse_budget("1GiB"), img_size=32)  # doctest: +SKIP
>>> 0 < search.batch < search.smallest_over and search.peak <= search.budget  # doctest: +SKIP
True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from actcomp.errors import ActcompError
from actcomp.tools.memory import format_bytes, parse_bytes
from actcomp.tools.peak_rss import peak_rss

# A probe is a fresh Python process that has imported torch and timm: hundreds of MiB before
# its first step. A budget below this is a typo (a missing or wrong unit), never a real limit.
SMALLEST_BUDGET = 64 * 2**20


def parse_budget(text: str, where: str = "budget") -> int:
    """A memory budget as people write it, in bytes; unlike :func:`actcomp.tools.memory.parse_bytes`
    it needs a unit, and refuses budgets under 64 MiB, which no training process fits.

    >>> parse_budget("4GiB"), parse_budget("512M")
    (4294967296, 536870912)
    """
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if 0 < number < math.inf:
        # "4" meant 4 GiB, never 4 bytes: read as bytes, it would start a search that cannot succeed.
        raise ActcompError(f"{where} {text!r} has no unit; write the size with one, e.g. '{text.strip()}GiB', "
                           "'3.5GB', '512MiB', '512M' (KiB/MiB/GiB and K/M/G are powers of 1024, KB/MB/GB of 1000)")
    try:
        budget = parse_bytes(text)
    except ActcompError as error:
        raise ActcompError(f"{where}: {error}") from None
    if budget < SMALLEST_BUDGET:
        raise ActcompError(f"{where} {text!r} is {format_bytes(budget)}, below {format_bytes(SMALLEST_BUDGET)}: a "
                           "process that has imported torch is larger than that before its first step, so no batch "
                           "fits; give it in MiB or GiB, e.g. '4GiB'")
    return budget


@dataclass
class BatchSearch:
    """What :func:`largest_batch` found: ``batch`` fits (peak ``peak``), ``batch + 1`` or the next
    probe above it did not; ``probes`` lists every (batch, peak) measured, in order."""

    budget: int
    batch: int = 0
    peak: int = 0
    probes: list[tuple[int, int]] = field(default_factory=list)

    @property
    def smallest_over(self) -> int | None:
        over = [batch for batch, peak in self.probes if peak > self.budget]
        return min(over) if over else None


def largest_batch(model: str, spec: str | None, *, budget: int, rest: str | None = None, checkpoint: bool = False,
                  img_size: int = 224, steps: int = 1, warmup_batch: int | None = 2, threads: int | None = None,
                  first_layer: str | None = "auto", start: int = 16, tolerance: float = 0.03, limit: int = 1 << 16,
                  progress: Callable[[int, int, bool], None] | None = None) -> BatchSearch:
    """The largest batch of timm ``model`` whose training step peaks at most ``budget`` bytes.

    ``spec``, ``rest``, ``checkpoint``, ``threads`` and ``first_layer`` configure the step as in
    :func:`actcomp.tools.peak_rss.peak_rss` (``spec=None``: plain PyTorch); by default each probe runs
    one step at batch 2 (BatchNorm refuses batch 1 where its input is 1x1) and then ``steps=1``
    step at the candidate batch, which peaks as a steady-state training step does (gradients
    already allocated). The search stops when the
    largest batch that fits and the smallest that does not are within ``tolerance`` of each
    other (relative; 1 batch at least): ``batch`` may then be up to that much below the true
    largest. ``progress(batch, peak, fits)`` is called after every probe.
    """
    if budget <= 0:
        raise ActcompError(f"largest_batch: the budget must be a positive number of bytes, got {budget}")
    if not 0 <= tolerance < 1:
        raise ActcompError(f"largest_batch: tolerance must be in [0, 1), got {tolerance}")
    search = BatchSearch(budget)
    probes = _Probes(search, progress, lambda batch: peak_rss(
        model, spec, batch=batch, img_size=img_size, steps=steps, warmup_batch=warmup_batch, rest=rest,
        first_layer=first_layer, checkpoint=checkpoint, threads=threads, abort_above=budget))
    low, high = _bracket(probes, start, tolerance, limit)
    while high is not None and high - low > max(1, tolerance * low):
        middle = (low + high) // 2
        if probes.fits(middle):
            low = middle
        else:
            high = middle
    search.batch = low
    search.peak = probes.peaks.get(low, 0)
    return search


@dataclass
class _Probes:
    """Each batch's peak, measured once, added to ``search.probes`` and shown to ``progress``."""

    search: BatchSearch
    progress: Callable[[int, int, bool], None] | None
    measure: Callable[[int], int]
    peaks: dict[int, int] = field(default_factory=dict)

    def fits(self, batch: int) -> bool:
        if batch not in self.peaks:
            peak = self.peaks[batch] = self.measure(batch)
            self.search.probes.append((batch, peak))
            if self.progress is not None:
                self.progress(batch, peak, peak <= self.search.budget)
        return self.peaks[batch] <= self.search.budget


def _bracket(probes: _Probes, start: int, tolerance: float, limit: int) -> tuple[int, int | None]:
    """A batch that fits (0 trivially) and a larger one that does not (None: none up to ``limit``)."""
    small, larger = start, 2 * start
    if not probes.fits(small):
        return 0, small
    if not probes.fits(larger):
        return small, larger
    # Peak is about affine in the batch: aim at the budget, then walk from there with
    # doubling steps until one batch fits and a larger one does not.
    per_sample = max(1.0, (probes.peaks[larger] - probes.peaks[small]) / (larger - small))
    guess = max(larger + 1, min(limit, larger + int((probes.search.budget - probes.peaks[larger]) / per_sample)))
    step = max(1, math.ceil(tolerance * guess))
    if probes.fits(guess):
        low, high = guess, None
        while high is None and low < limit:
            candidate = min(limit, low + step)
            if probes.fits(candidate):
                low = candidate
            else:
                high = candidate
            step *= 2
        return low, high
    low, high = larger, guess
    while high - step > low:
        if probes.fits(high - step):
            return high - step, high
        high -= step
        step *= 2
    return low, high
