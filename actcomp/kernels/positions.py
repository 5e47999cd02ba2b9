"""Compact storage of *which* elements a sparsifier kept, written and read a chunk at a time.

For ``k`` kept positions out of ``n`` each tensor gets one of:

===========  ==================================================  ==========================
encoding     stored                                              bytes
===========  ==================================================  ==========================
``dense``    nothing (every element kept)                        0
``bitmask``  1 bit per element                                   ceil(n / 8)
``rice``     the gaps between kept positions, Golomb-Rice coded  ceil(k r / 8) + ceil(u / 8)
             with ``r`` low bits each plus a unary high part
             (``u`` = k + sum(gap >> r) bits)
===========  ==================================================  ==========================

A sparsifier hands the positions over chunk by chunk, as bool masks of consecutive slices
(:class:`PositionWriter`), so the encoding is chosen before any position is seen, from ``n``
and the expected ``k`` alone: Rice with the ``r`` that is cheapest for randomly spread
positions (geometric gaps), whenever that is expected to be smaller than a bitmask. Other
placements cannot cost much more: the unary parts sum to at most ``k + n / 2**r`` bits,
however the positions cluster. At DropIT's 90% drop rate Rice needs about 0.48 bit per
element, half a bitmask. The bit streams run on across chunk
boundaries; the metadata records each chunk's kept count and unary length, so
:func:`scatter_kept` reads them back a chunk at a time too. Never int64 in what is stored.

>>> import torch
>>> index = torch.tensor([3, 40, 41, 97])
>>> saved, meta = encode_positions(index, 100)
>>> meta[:4], sum(t.numel() for t in saved)  # gaps 3, 36, 0, 55 with r = 4: 16 + 9 bits
(('rice', 100, 4, 4), 4)
>>> scatter_kept(torch.tensor([1.0, 2.0, 3.0, 4.0]), saved, meta).nonzero().view(-1).tolist()
[3, 40, 41, 97]
"""

from __future__ import annotations

import itertools
import math

import torch

from actcomp.kernels.bitpack import pack_bits, packed_size, unpack_bits
from actcomp.kernels.chunks import aligned_length, spans


def expected_rice_bits(count: int, kept: int, low_bits: int) -> float:
    """Expected bits per kept position of Rice coding with ``low_bits``, for ``kept`` positions
    spread at random among ``count``: gaps are then geometric, with ``q = 1 - kept / count``,
    and the unary part of one gap averages ``sum_j q**(j 2**r) = q**(2**r) / (1 - q**(2**r))``."""
    q_power = (1 - kept / count) ** (2**low_bits)
    return low_bits + 1 + q_power / (1 - q_power)


def rice_parameter(count: int, kept: int) -> int:
    """The ``r`` with the fewest :func:`expected_rice_bits`; near ``log2(count ln 2 / kept)``."""
    if kept <= 0 or count <= kept:
        return 0
    guess = max(0, math.floor(math.log2(count * math.log(2) / kept)))
    return min(range(max(0, guess - 1), guess + 3), key=lambda r: expected_rice_bits(count, kept, r))


def choose_encoding(count: int, kept: int) -> tuple[str, int]:
    """``(encoding, r)`` for ``kept`` (expected) positions among ``count``: Rice when its expected
    size is below a bitmask's, else the bitmask."""
    if kept >= count:
        return "dense", 0
    if kept <= 0:
        return "rice", rice_parameter(count, 1)
    low_bits = rice_parameter(count, kept)
    return ("rice", low_bits) if kept * expected_rice_bits(count, kept, low_bits) < count else ("bitmask", 0)


class _BitStream:
    """Bits appended in pieces, packed 8 to a byte as they come; fewer than 8 wait for the next."""

    def __init__(self, device: torch.device):
        self.pending = torch.zeros(0, dtype=torch.bool, device=device)
        self.parts: list[torch.Tensor] = []

    def append(self, bits: torch.Tensor) -> None:
        if self.pending.numel():
            bits = torch.cat([self.pending, bits])
        whole = bits.numel() // 8 * 8
        if whole:
            self.parts.append(pack_bits(bits[:whole]))
        self.pending = bits[whole:]

    def finish(self) -> torch.Tensor:
        if self.pending.numel():
            self.parts.append(pack_bits(self.pending))
        if not self.parts:
            return torch.zeros(0, dtype=torch.uint8, device=self.pending.device)
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


class PositionWriter:
    """Encodes kept positions given as bool masks of consecutive slices of ``length`` elements
    (a multiple of 8), ``expected`` of ``count`` kept overall.

    >>> writer = PositionWriter(64, expected=2, length=32, device=torch.device("cpu"))
    >>> for position in (2, 63):  # one kept in each slice of 32: gaps 2 and 60
    ...     mask = torch.zeros(32, dtype=torch.bool)
    ...     mask[position % 32] = True
    ...     writer.add(mask)
    >>> saved, meta = writer.finish()
    >>> meta  # r = 4: unary parts 0b1 (gap 2 >> 4 = 0) and 0b0001 (60 >> 4 = 3)
    ('rice', 64, 2, 4, 32, (1, 1), (1, 4))
    """

    def __init__(self, count: int, expected: int, length: int, device: torch.device):
        self.count, self.length, self.device = count, length, device
        self.encoding, self.low_bits = choose_encoding(count, expected)
        self.kept: list[int] = []
        self.unary: list[int] = []
        self.bitmask: list[torch.Tensor] = []
        self.high_stream, self.low_stream = _BitStream(device), _BitStream(device)
        self.start = 0
        self.last = -1  # the last kept position so far: gaps run on across chunks

    def add(self, mask: torch.Tensor | None = None, index: torch.Tensor | None = None, length: int | None = None) -> None:
        """The next slice's kept positions: its bool ``mask``, or the ascending positions
        ``index`` in it and its ``length``, or both; every slice but the last is ``length`` long."""
        if mask is not None:
            length = mask.numel()
        if self.encoding == "bitmask":
            if mask is None:
                mask = torch.zeros(length, dtype=torch.bool, device=self.device).index_fill_(0, index, True)
            self.bitmask.append(pack_bits(mask))
            self.kept.append(int(mask.sum()) if index is None else index.numel())
        elif self.encoding == "rice":
            index = mask.nonzero().view(-1) if index is None else index
            kept = index.numel()
            self.kept.append(kept)
            if kept:
                index = index + self.start
                gaps = torch.diff(index, prepend=index.new_full((1,), self.last)) - 1
                self.last = int(index[-1])
                high = gaps >> self.low_bits
                ones = torch.cumsum(high + 1, 0) - 1
                unary = torch.zeros(int(ones[-1]) + 1, dtype=torch.bool, device=self.device)
                unary[ones] = True
                self.unary.append(unary.numel())
                self.high_stream.append(unary)
                if self.low_bits:
                    shifts = torch.arange(self.low_bits, device=self.device)
                    self.low_stream.append(((gaps.unsqueeze(1) >> shifts) & 1).view(-1).bool())
            else:
                self.unary.append(0)
        else:
            self.kept.append(length)
        self.start += length

    def finish(self) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """``(tensors, meta)`` to store; ``meta`` starts ``(encoding, count, kept)``."""
        kept = sum(self.kept)
        if kept == self.count:
            return (), ("dense", self.count, kept)
        if self.encoding == "rice":
            return ((self.high_stream.finish(), self.low_stream.finish()),
                    ("rice", self.count, kept, self.low_bits, self.length, tuple(self.kept), tuple(self.unary)))
        packed = self.bitmask[0] if len(self.bitmask) == 1 else torch.cat(self.bitmask)
        return (packed,), ("bitmask", self.count, kept, self.length, tuple(self.kept))


def encode_positions(index: torch.Tensor, count: int) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """Encode sorted, distinct flat positions ``index`` among ``count``; returns (tensors, meta)."""
    length = aligned_length(index.device, count, 8)
    writer = PositionWriter(count, index.numel(), length, index.device)
    bounds = torch.searchsorted(index, torch.arange(0, count + length, length, device=index.device)).tolist()
    for (start, stop), first, last in zip(spans(count, length), bounds, bounds[1:]):
        writer.add(index=index[first:last] - start, length=stop - start)
    return writer.finish()


def _bit_range(packed: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Bits ``start`` to ``start + count`` of a packed stream, as bools."""
    first = start // 8
    bits = unpack_bits(packed[first:packed_size(start + count, 1)], packed_size(start + count, 1) * 8 - first * 8)
    return bits[start - first * 8:start - first * 8 + count]


def scatter_kept(values: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: tuple) -> torch.Tensor:
    """Place kept ``values`` (ascending position order) into a flat zero tensor, a chunk at a time."""
    encoding, count = meta[:2]
    if encoding == "dense":
        return values
    out = torch.empty(count, dtype=values.dtype, device=values.device)
    if encoding == "bitmask":
        _, _, _, length, chunk_kept = meta
        value_starts = itertools.accumulate(chunk_kept, initial=0)
        for (start, stop), first, kept in zip(spans(count, length), value_starts, chunk_kept):
            part = out[start:stop].zero_()
            if kept:
                part.masked_scatter_(unpack_bits(packed_slice(saved[0], start, stop), stop - start),
                                     values[first:first + kept])
        return out
    _, _, _, low_bits, length, chunk_kept, chunk_unary = meta
    high_stream, low_stream = saved
    first = unary_start = 0
    last = -1
    for (start, stop), kept, unary in zip(spans(count, length), chunk_kept, chunk_unary):
        part = out[start:stop].zero_()
        if not kept:
            continue
        ones = _bit_range(high_stream, unary_start, unary).nonzero().view(-1)
        gaps = (torch.diff(ones, prepend=ones.new_full((1,), -1)) - 1) << low_bits
        if low_bits:
            shifts = torch.arange(low_bits, device=values.device)
            gaps |= (_bit_range(low_stream, first * low_bits, kept * low_bits).view(kept, low_bits).long() << shifts).sum(1)
        index = torch.cumsum(gaps + 1, 0) + (last - start)
        last = start + int(index[-1])
        part.index_put_((index,), values[first:first + kept])
        first += kept
        unary_start += unary
    return out


def packed_slice(packed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The bytes of a bitmask holding elements ``start`` (a multiple of 8) to ``stop``."""
    return packed[start // 8:packed_size(stop, 1)]
