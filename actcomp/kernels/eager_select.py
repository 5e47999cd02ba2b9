"""Min-k on CPU in eager mode: the static path's codes from a few passes instead of twenty.

The static path (:mod:`~actcomp.kernels.thresholds` and :func:`~actcomp.kernels.positions.encode_kept`)
makes about twenty passes over the tensor (two radix-select histograms, then tie ranks, slot
ranks and the position writer a chunk at a time) so that it needs no data-sized op. Where those
cost nothing extra (:mod:`~actcomp.kernels.eager_cpu`), this path

- takes the *candidates*: the elements whose magnitude key is at least a key that an evenly
  spaced sample puts safely below the kept share (4 standard deviations of a sample quantile,
  as ``smink``'s margin), their positions found with ``nonzero`` a chunk at a time;
- settles the exact threshold (radix select) and the ties among those few (about ``k`` plus
  the margin);
- hands the kept positions to the position form's writer (:meth:`~actcomp.kernels.positions.EliasFano.from_positions`).

Its outputs equal the static path's bit for bit (the tests run both), and a sample that misses
(the candidates fewer than ``k``, about once in 30,000 tensors) hands the tensor to the static
path. It is the element sparsifiers' CPU implementation (registered in
:mod:`actcomp.compressors.elements`, chosen by :mod:`actcomp.core.backends`), taken on a CPU
(:mod:`~actcomp.kernels.eager_cpu`) where the candidates' temporaries stay small beside the
input (:func:`worth_it`); the reference never runs it.

>>> import torch
>>> from actcomp.kernels.thresholds import kept_count
>>> x = torch.randn(100_000)
>>> positions = exact_kept_positions(x, kept_count(x.numel(), 0.9))
>>> positions.numel(), bool((x.abs()[positions].min() >= x.abs().kthvalue(90_000).values))
(10000, True)
"""

from __future__ import annotations

import math

import torch

from actcomp.kernels import native_cpu
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.positions import index_chunk_length
from actcomp.kernels.thresholds import (
    SAMPLE,
    Threshold,
    key_bits,
    magnitude_keys,
    sample_of,
    sample_step,
    sampled_rank,
    sampled_threshold,
    select_threshold,
)

# As smink's: the sample's quantile is moved this many of its standard deviations toward
# keeping more, so that fewer than k candidates turn up only about once in 30,000 tensors.
_MARGIN_SIGMAS = 4.0


def worth_it(count: int, kept: int, element_size: int) -> bool:
    """Whether the candidates (an int32 position and a key each, about ``1.1 kept`` of them) stay
    within 0.35x the input's bytes, the rest of the temporaries budget (0.5x) left to the steps
    after: up to about 10% kept for 2-byte floats, 15% for fp32."""
    return count < 2**31 and kept * (4 + element_size) * 1.1 <= count * element_size * 0.35


def exact_kept_positions(flat: torch.Tensor, kept: int) -> torch.Tensor | None:
    """The ascending int32 positions of ``flat``'s ``kept`` largest magnitudes (ties in position
    order), as :func:`~actcomp.kernels.thresholds.exact_threshold` selects them; None when the
    sample missed."""
    count = flat.numel()
    # The floor only bounds the candidates, so the kept positions are exact whatever the sample:
    # its stride rounds up, to about SAMPLE keys (rounding down read a (4, 197, 384) tensor whole,
    # and selecting among its 302,592 keys took half the encode).
    sample = magnitude_keys(flat[::sample_step(count, SAMPLE, round_up=True)])
    share = kept / count
    margin = _MARGIN_SIGMAS * math.sqrt(share * (1 - share) * sample.numel()) + 1
    rank = math.ceil(share * sample.numel() + margin)
    floor = _largest(sample, rank) if rank < sample.numel() else 0
    # Room for the candidates the sample predicts, and a little more: a native search that finds
    # more says so and runs again, so the estimate costs time only when it is short.
    positions, keys = _candidates(flat, floor, capacity=math.ceil(count * rank / sample.numel() * 1.05) + 64)
    if keys.numel() < kept:
        return None
    if native_cpu.compacts(positions, keys):
        key, ties = native_cpu.select(keys, kept)
        return native_cpu.compact(positions, keys, key, ties)
    # Radix select over the candidates, a chunk at a time: topk and kthvalue copy all of them
    # with an int64 index each on CPU (0.4x a fp32 input at 10% kept).
    threshold = select_threshold(lambda start, stop: keys[start:stop], keys.numel(), kept,
                                 key_bits(flat.dtype), flat.device)
    return _kept_among(positions, keys, threshold.key, int(threshold.ties))


def sampled_kept_positions(flat: torch.Tensor, kept: int, size: int) -> torch.Tensor:
    """:func:`kept_positions_over` the :func:`~actcomp.kernels.thresholds.sampled_threshold` of
    ``flat``, the same positions: where the native kernels run, the threshold's count of keys
    above its key is read off the candidates instead of a pass over ``flat``."""
    if not native_cpu.selects(flat):
        return kept_positions_over(flat, sampled_threshold(flat, kept, size), kept)
    sample = magnitude_keys(sample_of(flat, size))
    key = _largest(sample, sampled_rank(flat.numel(), kept, sample.numel()))
    positions, keys = _candidates(flat, key, capacity=kept + kept // 16 + 64)
    above = int((keys > key).count_nonzero())
    ties = max(kept - above, 0) if key > 0 else 0
    chosen = native_cpu.compact(positions, keys, key, ties)[:kept]
    return torch.cat([chosen, chosen.new_full((kept - chosen.numel(),), flat.numel())])


def kept_positions_over(flat: torch.Tensor, threshold: Threshold, kept: int) -> torch.Tensor:
    """The ascending int32 positions :class:`~actcomp.kernels.thresholds.ThresholdSelector` keeps
    under ``threshold``, at most ``kept`` (the first ones in position order), then ``flat.numel()``
    for each slot left empty."""
    # Past the threshold: the kept and the ties among them, about kept.
    positions, keys = _candidates(flat, threshold.key, capacity=kept + kept // 16 + 64)
    chosen = _kept_among(positions, keys, threshold.key, int(threshold.ties))[:kept]
    return torch.cat([chosen, chosen.new_full((kept - chosen.numel(),), flat.numel())])


def _largest(keys: torch.Tensor, rank: int) -> int | torch.Tensor:
    """The ``rank``-th largest of ``keys`` (as ``topk(keys, rank).values.min()``)."""
    if native_cpu.takes_keys(keys):
        return native_cpu.select(keys, rank)[0]
    return torch.topk(keys, rank, sorted=False).values.min()


def _candidates(flat: torch.Tensor, floor: int | torch.Tensor,
                capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (int32) and magnitude keys of the elements whose key is at least ``floor``.
    Counted first, so that both are written once into tensors of their size: pieces joined by
    ``cat`` would be held twice at the join. One pass of a native kernel where it runs
    (``capacity``: the room it allocates first)."""
    if native_cpu.selects(flat):
        return native_cpu.positions_and_keys(flat.contiguous(), floor, capacity)
    chunks = list(spans(flat.numel(), aligned_length(flat.device, flat.numel())))
    counts = torch.stack([(magnitude_keys(flat[start:stop]) >= floor).count_nonzero() for start, stop in chunks])
    counts = counts.tolist()
    positions = torch.empty(sum(counts), dtype=torch.int32, device=flat.device)
    keys = torch.empty(sum(counts), dtype=magnitude_keys(flat[:1]).dtype, device=flat.device)
    filled = 0
    for (start, stop), found in zip(chunks, counts):
        part = magnitude_keys(flat[start:stop])
        index = (part >= floor).nonzero().view(-1)
        torch.index_select(part, 0, index, out=keys[filled:filled + found])
        positions[filled:filled + found] = index
        positions[filled:filled + found] += start
        filled += found
    return positions, keys


def _kept_among(positions: torch.Tensor, keys: torch.Tensor, key: torch.Tensor, ties: int) -> torch.Tensor:
    """The candidates' positions whose key is above ``key``, and the first ``ties`` equal to it,
    moved to the front of ``positions``: a view of it."""
    if native_cpu.compacts(positions, keys):
        return native_cpu.compact(positions, keys, int(key), ties)
    return _with_ties(positions, keys > key, keys, key, ties)


def _with_ties(positions: torch.Tensor, chosen: torch.Tensor, keys: torch.Tensor, key: torch.Tensor,
               ties: int) -> torch.Tensor:
    """The positions ``chosen`` marks, and those of the first ``ties`` candidates equal to
    ``key``, written over the front of ``positions`` (which they never overtake) and returned
    as a view of it."""
    length = index_chunk_length(keys.device, keys.numel())
    for start, stop in spans(keys.numel(), length):
        if ties <= 0:
            break
        equal = (keys[start:stop] == key).nonzero().view(-1)[:ties]
        chosen[equal + start] = True
        ties -= equal.numel()
    filled = 0
    for start, stop in spans(positions.numel(), length):
        part = positions[start:stop][chosen[start:stop]]  # a copy: the write may overlap it
        positions[filled:filled + part.numel()] = part
        filled += part.numel()
    return positions[:filled]
