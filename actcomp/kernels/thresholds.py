"""Magnitude thresholds for min-k selection, without sorting the tensor.

A global ``topk`` over a large tensor allocates several times its bytes and is the slowest
step of DropIT's compression. Min-k only needs the *threshold*: the ``kept``-th largest
magnitude ``t``. Keeping every ``|x| > t`` and the first ``|x| == t`` in position order then
keeps exactly ``kept`` elements, in one compare-and-pack pass.

- :func:`exact_threshold` brackets ``t`` between two quantiles of an evenly spaced sample,
  counts the elements above the bracket and gathers the few inside it in one chunked pass,
  and picks ``t`` among those: the exact threshold from about one read of the tensor and
  temporaries of about 1% of it. Should the sample mislead (a bracket that misses ``t``,
  about once in a million for unstructured values), the bracket widens and the pass runs again.
- :func:`sampled_threshold` takes ``t`` from the sample alone, for the one-pass ``smink``
  stage: no pass over the tensor at all, and a kept fraction within sampling error.

>>> import torch
>>> x = torch.randn(10**6)
>>> t = exact_threshold(x, 100_000)
>>> int((x.abs() > t.value).sum()) + t.ties == 100_000
True
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from actcomp.kernels.chunks import aligned_length, spans

SAMPLE = 2**16
# Half-width of the bracket in standard deviations of a sample quantile.
_MARGIN_SIGMAS = 5.0


class Threshold(NamedTuple):
    """Keep every ``|x| > value`` and the first ``ties`` elements with ``|x| == value``."""

    value: float
    ties: int


def magnitude_sample(flat: torch.Tensor, size: int = SAMPLE) -> torch.Tensor:
    """``|x|`` of about ``size`` evenly spaced elements of ``flat`` (all of them when fewer),
    in float32 (float64 for float64). The stride is odd and not a multiple of 3, 5 or 7, so the sample does not
    alias with channel or token periods (384 = 2**7 3, 3136 = 2**6 7**2)."""
    count = flat.numel()
    step = max(1, count // size)
    while step > 1 and any(step % p == 0 for p in (2, 3, 5, 7)):
        step -= 1
    return _wide(flat[::step].abs())


def _wide(values: torch.Tensor) -> torch.Tensor:
    """float32 (float64 for float64 values): every magnitude of the input dtype, exactly."""
    return values.double() if values.dtype == torch.float64 else values.float()


def _rank(sample: torch.Tensor, fraction: float) -> float:
    """The sample's value at ``fraction`` of its sorted order (clamped to its ends)."""
    count = sample.numel()
    index = min(max(int(fraction * count), 0), count - 1)
    # A partial top-k from the nearer end: three times faster than kthvalue on CPU.
    if count - index <= count // 2:
        return float(torch.topk(sample, count - index, sorted=False).values.min())
    return float(torch.topk(sample, index + 1, largest=False, sorted=False).values.max())


def sampled_threshold(flat: torch.Tensor, kept: int, size: int = SAMPLE) -> tuple[float, float]:
    """``(t, tie_share)``: ``t`` is the estimate, from a sample of about ``size``, of the
    ``kept``-th largest ``|x|``; keeping every ``|x| > t`` and a ``tie_share`` of the
    ``|x| == t`` keeps about ``kept``."""
    sample = magnitude_sample(flat, size)
    size, count = sample.numel(), flat.numel()
    value = _rank(sample, 1 - kept / count)
    above = int((sample > value).sum())
    equal = int((sample == value).sum())
    wanted = kept / count * size - above
    # A value drawn once is no evidence of a mass of ties (fp32 values rarely repeat), and
    # looking for ties costs a pass: only a repeated value (bf16, zeros, clamps) is split.
    share = min(max(wanted / equal, 0.0), 1.0) if equal > 1 else 0.0
    return value, share


def exact_threshold(flat: torch.Tensor, kept: int) -> Threshold:
    """The exact threshold keeping ``kept`` (1 to numel - 1) elements of ``flat`` (1-D, finite)."""
    count = flat.numel()
    if count <= SAMPLE:
        magnitude = flat.abs()
        value = torch.kthvalue(_wide(magnitude), count - kept + 1).values
        return Threshold(float(value), kept - int((magnitude > value).sum()))
    sample = magnitude_sample(flat)
    dropped = 1 - kept / count
    margin = _MARGIN_SIGMAS * math.sqrt(max(dropped * (1 - dropped), 1 / count) / sample.numel()) + 2 / sample.numel()
    while True:
        low = _rank(sample, dropped - margin) if dropped - margin > 0 else -1.0
        high = _rank(sample, dropped + margin) if dropped + margin < 1 else math.inf
        found = _threshold_in(flat, kept, low, high)
        if found is not None:
            return found
        margin *= 4  # the sample misled: widen the bracket and look again


def _threshold_in(flat: torch.Tensor, kept: int, low: float, high: float) -> Threshold | None:
    """The threshold if it lies in ``[low, high]``, else None. One chunked pass counts the
    elements above ``high`` and at either end, and gathers the magnitudes strictly between."""
    count = flat.numel()
    above = at_high = at_low = 0
    inside = []
    for start, stop in spans(count, aligned_length(flat.device, count)):
        magnitude = flat[start:stop].abs()
        above += int((magnitude > high).sum())
        at_high += int((magnitude == high).sum())
        if low < high:
            at_low += int((magnitude == low).sum())
            inside.append(magnitude[(magnitude > low) & (magnitude < high)])
    if kept <= above:
        return None
    if kept <= above + at_high:
        return Threshold(high, kept - above)
    between = _wide(torch.cat(inside)) if inside else _wide(flat.new_zeros(0))
    rank = kept - above - at_high  # the wanted element's rank, from the top, among those between
    if rank <= between.numel():
        value = torch.kthvalue(between, between.numel() - rank + 1).values
        greater = above + at_high + int((between > value).sum())
        return Threshold(float(value), kept - greater)
    if kept <= above + at_high + between.numel() + at_low:
        return Threshold(low, kept - above - at_high - between.numel())
    return None
