"""Element sparsifiers (DropIT §3.3): keep some elements exactly, drop the rest to zero.

Every stage here keeps ``k = n - floor(drop_rate * n)`` elements (see
:func:`~actcomp.core.codec.drop_count`; ``random`` keeps that many on average and
``smink`` within sampling error of it), hands the kept values on as a flat payload in
ascending position order, and stores the positions with
:mod:`actcomp.kernels.positions`.

All of them select a chunk at a time (:mod:`~actcomp.kernels.chunks`): a bool mask per
slice of the tensor, the kept values and positions packed from it while the slice is in
cache. The exact stages first find their threshold without sorting
(:mod:`~actcomp.kernels.thresholds`).

>>> import torch
>>> x = torch.tensor([[0.1, -3.0], [2.0, 0.2]])
>>> MinK(0.5).decompress(MinK(0.5).compress(x))
tensor([[ 0., -3.],
        [ 2.,  0.]])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from actcomp.core.codec import Compressor, Encoded, Hints, drop_count, setting
from actcomp.core.registry import register_compressor
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.positions import PositionWriter, scatter_kept
from actcomp.kernels.thresholds import SAMPLE, Threshold, exact_threshold, sampled_threshold

# Chooses the elements to keep in one slice: (slice, its start) -> a bool mask, or the kept
# positions in the slice in ascending order (int64).
Selector = Callable[[torch.Tensor, int], torch.Tensor]


class _ElementSparsifier(Compressor):
    """Shared chunked encode/decode: subclasses only choose which elements of a slice to keep."""

    kind = "sparsifier"
    takes_rate = True
    # Whether exactly kept_count elements are kept (then the payload is allocated up front).
    exact_count = True

    def kept_count(self, count: int) -> int:
        return count - drop_count(count, self.drop_rate)  # type: ignore[attr-defined]

    def selector(self, flat: torch.Tensor, kept: int) -> Selector:
        """What to keep in each slice of ``flat``, ``kept`` overall."""
        raise NotImplementedError

    def slice_multiple(self) -> int:
        """Slices are a multiple of this many elements (and of 8, for the bitmask)."""
        return 1

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        count = flat.numel()
        kept = self.kept_count(count)
        if kept == count:
            return Encoded(flat, (), ("dense", count, kept))
        length = aligned_length(flat.device, count, self.slice_multiple(), 8)
        select = self.selector(flat, kept)
        writer = PositionWriter(count, kept, length, flat.device)
        values = _Values(flat, kept if self.exact_count else None)
        for start, stop in spans(count, length):
            part = flat[start:stop]
            chosen = select(part, start)
            if chosen.dtype == torch.bool:
                # One compaction serves both: the positions and the values they pick.
                index = chosen.nonzero().view(-1)
                writer.add(chosen, index)
            else:
                index = chosen
                writer.add(index=index, length=part.numel())
            values.add(part[index])
        saved, meta = writer.finish()
        return Encoded(values.finish(), saved, meta)

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        return scatter_kept(payload, saved, meta)


class _Values:
    """The kept values, slice after slice: written into one tensor when their count is known,
    else gathered and joined at the end."""

    def __init__(self, flat: torch.Tensor, count: int | None):
        self.out = None if count is None else flat.new_empty(count)
        self.empty = flat.new_empty(0)
        self.parts: list[torch.Tensor] = []
        self.filled = 0

    def add(self, values: torch.Tensor) -> None:
        if self.out is None:
            self.parts.append(values)
        else:
            self.out[self.filled:self.filled + values.numel()] = values
        self.filled += values.numel()

    def finish(self) -> torch.Tensor:
        if self.out is not None:
            return self.out
        if len(self.parts) == 1:
            return self.parts[0]
        return torch.cat(self.parts) if self.parts else self.empty


def threshold_selector(threshold: Threshold) -> Selector:
    """Keeps ``|x| > threshold.value`` and the first ``threshold.ties`` elements equal to it."""
    remaining = threshold.ties

    def select(part: torch.Tensor, start: int) -> torch.Tensor:
        nonlocal remaining
        magnitude = part.abs()
        mask = magnitude > threshold.value
        if remaining:
            equal = magnitude == threshold.value
            ties = int(equal.sum())
            if ties > remaining:
                equal &= equal.cumsum(0) <= remaining
                ties = remaining
            mask |= equal
            remaining -= ties
        return mask

    return select


@register_compressor
@dataclass(frozen=True)
class MinK(_ElementSparsifier):
    """Exact global min-k: drops the ``drop_rate`` fraction of smallest |x|.

    Of the elements tied at the threshold, the first ones in memory order are kept, so the
    count is exact and the choice deterministic.
    """

    name = "mink"
    drop_rate: float = 0.9

    def selector(self, flat: torch.Tensor, kept: int) -> Selector:
        return threshold_selector(exact_threshold(flat, kept))


@register_compressor
@dataclass(frozen=True)
class SampledMinK(_ElementSparsifier):
    """One-pass min-k: the threshold is a quantile of an evenly spaced sample of ``sample`` |x|
    (65,536 by default), and one compare-and-pack pass keeps what lies above it.

    The kept fraction is ``1 - drop_rate`` within sampling error: the sample quantile's
    standard deviation is ``sqrt(p (1 - p) / sample)``, 0.0012 at ``p = 0.1`` and the default
    sample, so the kept fraction stays within 0.01 of its target (8 standard deviations). When
    more than ``drop_rate`` of the values are zero, only the non-zero ones are kept: dropping a
    zero loses nothing. Tensors of at most ``sample`` elements are read whole, and select
    exactly as ``mink`` does.
    """

    name = "smink"
    exact_count = False
    drop_rate: float = 0.9
    sample: int = setting(SAMPLE, minimum=64)

    def selector(self, flat: torch.Tensor, kept: int) -> Selector:
        if flat.numel() <= self.sample:
            return threshold_selector(exact_threshold(flat, kept))
        value, share = sampled_threshold(flat, kept, self.sample)

        def select(part: torch.Tensor, start: int) -> torch.Tensor:
            magnitude = part.abs()
            mask = magnitude > value
            if share and value > 0:
                equal = magnitude == value
                ties = int(equal.sum())
                wanted = round(share * ties)
                if wanted < ties:
                    equal &= equal.cumsum(0) <= wanted
                mask |= equal
            return mask

        return select


@register_compressor
@dataclass(frozen=True)
class ParallelMinK(_ElementSparsifier):
    """Exact min-k inside consecutive blocks of ``block`` elements (DropIT's parallel min-k).

    Each full block keeps ``block - floor(drop_rate * block)`` elements; a last partial block
    of ``r`` elements keeps ``r - floor(drop_rate * r)``. One batched ``topk`` over the rows
    of a slice is much faster than a global one.
    """

    name = "pmink"
    drop_rate: float = 0.9
    block: int = setting(2**14, minimum=1)

    def slice_multiple(self) -> int:
        return self.block

    def selector(self, flat: torch.Tensor, kept: int) -> Selector:
        block, one_block = self.block, super().kept_count
        row_kept = one_block(block)

        def select(part: torch.Tensor, start: int) -> torch.Tensor:
            # Positions straight from top-k, sorted within each block: no mask to compact.
            count = part.numel()
            full = count // block * block
            chosen = []
            if full:
                rows = part[:full].view(-1, block).abs()
                index = torch.topk(rows, row_kept, dim=1, sorted=False).indices.sort(dim=1).values
                offsets = torch.arange(0, full, block, device=part.device).unsqueeze(1)
                chosen.append((index + offsets).view(-1))
            if full < count:  # the tensor's last, partial block
                tail = torch.topk(part[full:].abs(), one_block(count - full), sorted=False).indices
                chosen.append(tail.sort().values + full)
            return chosen[0] if len(chosen) == 1 else torch.cat(chosen)

        return select

    def kept_count(self, count: int) -> int:
        full_blocks, tail = divmod(count, self.block)
        return full_blocks * super().kept_count(self.block) + super().kept_count(tail)


@register_compressor
@dataclass(frozen=True)
class RandomDrop(_ElementSparsifier):
    """Drops each element independently with probability ``drop_rate``.

    The mask comes from a seeded generator, drawn slice by slice, so only the seed (Python
    metadata) is kept, not the positions: the kept values are the whole cost. The kept count
    is binomial with mean ``(1 - drop_rate) * n``.
    """

    name = "random"
    draws_global_random = True
    exact_count = False
    drop_rate: float = 0.9

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        count = flat.numel()
        if self.drop_rate == 0:
            return Encoded(flat, (), ("dense", count, count))
        # The seed is drawn from the global generator, so torch.manual_seed reproduces runs.
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        length = aligned_length(flat.device, count)
        values = _Values(flat, None)
        for (start, stop), mask in zip(spans(count, length), self._masks(seed, count, length, flat.device)):
            values.add(flat[start:stop][mask])
        return Encoded(values.finish(), (), ("seeded", count, seed, length))

    def _masks(self, seed: int, count: int, length: int, device: torch.device):
        generator = torch.Generator(device=device).manual_seed(seed)
        for start, stop in spans(count, length):
            yield torch.rand(stop - start, generator=generator, device=device) >= self.drop_rate

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        if meta[0] == "dense":
            return payload
        _, count, seed, length = meta
        out = payload.new_empty(count)
        first = 0
        for (start, stop), mask in zip(spans(count, length), self._masks(seed, count, length, payload.device)):
            kept = int(mask.sum())
            out[start:stop].zero_().masked_scatter_(mask, payload[first:first + kept])
            first += kept
        return out


@register_compressor
@dataclass(frozen=True)
class DropITReference(Compressor):
    """DropIT's released storage format, for comparison: global min-k, the kept values in the
    input dtype and their int32 indices (ascending). Costs 8 bytes per kept fp32 value.
    """

    name = "dropit"
    kind = "sparsifier"
    takes_rate = True
    drop_rate: float = 0.9

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        count = flat.numel()
        kept = count - drop_count(count, self.drop_rate)
        values, indices = flat.new_empty(kept), torch.empty(kept, dtype=torch.int32, device=flat.device)
        if kept:
            select, first = threshold_selector(exact_threshold(flat, kept)), 0
            for start, stop in spans(count, aligned_length(flat.device, count)):
                index = select(flat[start:stop], start).nonzero().view(-1)
                values[first:first + index.numel()] = flat[start:stop][index]
                indices[first:first + index.numel()] = index + start
                first += index.numel()
        return Encoded(values, (indices,), count)

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        out = payload.new_zeros(meta)
        for start, stop in spans(payload.numel(), aligned_length(payload.device, payload.numel())):
            out.index_copy_(0, saved[0][start:stop].long(), payload[start:stop])
        return out
