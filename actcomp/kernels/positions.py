"""Storage of *which* elements a sparsifier kept, and the chunked pass that gathers them.

A sparsifier keeps at most ``capacity`` elements of ``count`` (min-k: exactly
``ceil((1 - rate) count)``), chosen a chunk at a time by a bool mask. :func:`encode_kept`
gathers the kept values into ``capacity`` slots in position order (slots left over hold
zeros) and hands each chunk's kept positions to the writer of a *form*, a small frozen
dataclass that is also the metadata decoding needs (:meth:`scatter` puts the values back):

- :class:`Dense`: every element kept, nothing stored (0 bytes);
- :class:`Bitmask`: a bit per element, ``ceil(n / 8)`` bytes;
- :class:`EliasFano`: per kept position its low ``b`` bits, and its high part in unary (a bit
  per slot plus one per bucket of ``2**b`` positions), ``ceil(k b / 8) + ceil((k + (n >> b) + 1) / 8)``
  bytes;
- :class:`Indices`: int32 positions (DropIT's released format), ``4 k`` bytes;
- :class:`Rice`: the gaps, Golomb-Rice coded with ``r`` low bits, ``ceil(k r / 8) + ceil(u / 8)``
  bytes where ``u = k + sum(gap >> r)`` depends on the data (eager only).

The static forms' sizes follow from ``n`` and ``k`` alone, so :func:`static_form` picks the
smaller of a bitmask and the best Elias-Fano width before any value is seen, and every shape
is known before the data are: no read back to Python, and the same code compiles. Elias-Fano
needs about 0.525 bit per element at k = n / 10 (b = 3), a bitmask 1, Rice 0.48 but a size
that depends on the gaps, so :class:`Rice` reads counts back to Python (free on a CPU in eager
mode, a stall of the launch queue on a GPU, impossible in a compiled graph); it is asked for
explicitly (``mink0.9:rice=1``) and refuses to run under ``torch.compile``. Slots a sparsifier
leaves empty (``smink``, whose count is not fixed) take the position ``n`` in Elias-Fano,
past the end, and no bit in a bitmask.

>>> import torch
>>> mask = torch.tensor([False, True, True, False, False, False, False, True] * 4)
>>> form = static_form(32, 12)
>>> values, saved, form = encode_kept(torch.arange(1.0, 33.0), lambda part, start: mask[start:start + part.numel()], 12, form)
>>> form, values[:4].tolist()
(Bitmask(count=32, capacity=12), [2.0, 3.0, 8.0, 10.0])
>>> torch.equal(form.scatter(values, saved), torch.arange(1.0, 33.0) * mask)
True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from actcomp.errors import ActcompError
from actcomp.kernels import native_cpu
from actcomp.kernels.bitpack import pack_bits, pack_codes, packed_size, unpack_bits
from actcomp.kernels.chunks import aligned_length, spans

# Which elements of a chunk to keep: (chunk, its start) -> bool mask.
Selector = Callable[[torch.Tensor, int], torch.Tensor]
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_LOW_BITS = 8  # Elias-Fano's low bits are packed as codes of at most a byte


@dataclass(frozen=True)
class Dense:
    """Every element kept: the values are the tensor, nothing else is stored."""

    count: int

    def scatter(self, values: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return values


@dataclass(frozen=True)
class Bitmask:
    """A bit per element, set where a value was kept."""

    count: int
    capacity: int

    def writer(self, device: torch.device) -> _BitmaskWriter:
        return _BitmaskWriter(self, device)

    def from_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the writer stores, from the ascending kept positions (``count`` in empty slots)."""
        packed = torch.zeros(packed_size(self.count, 1), dtype=torch.uint8, device=positions.device)
        return (set_bits(positions[positions < self.count], packed),)

    def scatter(self, values: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        length = index_chunk_length(values.device, self.count)
        masks = ((start, stop, unpack_bits(saved[0][start // 8:packed_size(stop, 1)], stop - start))
                 for start, stop in spans(self.count, length))
        return expand_kept(values, self.count, masks)

    def scatter_on_cpu(self, values: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """:meth:`scatter` on a CPU (:mod:`~actcomp.kernels.eager_cpu`): one pass of the native
        kernel where it is built."""
        if native_cpu.scatters(values) and values.numel() >= self.capacity:
            return native_cpu.bitmask_expand(saved[0].contiguous(), values.contiguous(), self.count)
        return self.scatter(values, saved)


@dataclass(frozen=True)
class EliasFano:
    """Elias-Fano coding of the ascending kept positions: the ``j``-th one's low ``low_bits``
    bits as a code, and a bit set at ``(position >> low_bits) + j`` of a bit vector of
    ``capacity + (count >> low_bits) + 1`` bits. Empty slots hold the position ``count``."""

    count: int
    capacity: int
    low_bits: int

    @property
    def high_length(self) -> int:
        return self.capacity + (self.count >> self.low_bits) + 1

    def nbytes(self) -> int:
        return packed_size(self.capacity, self.low_bits) + packed_size(self.high_length, 1)

    def writer(self, device: torch.device) -> _EliasFanoWriter:
        return _EliasFanoWriter(self, device)

    def from_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the writer stores, from the ascending kept positions (``count`` in empty slots):
        bit ``(position >> b) + slot`` of the high stream, and each position's low bits."""
        bits = self.low_bits
        high = torch.zeros(packed_size(self.high_length, 1), dtype=torch.uint8, device=positions.device)
        if native_cpu.codes_positions(positions):
            low = torch.zeros(packed_size(self.capacity, bits), dtype=torch.uint8)
            native_cpu.elias_fano_encode(positions.contiguous(), bits, high, low)
            return high, low
        codes = torch.empty(self.capacity, dtype=torch.uint8, device=positions.device)
        # A chunk of slots at a time: the int32 temporaries are a chunk's, not k's.
        for start, stop in spans(self.capacity, index_chunk_length(positions.device, self.capacity)):
            part = positions[start:stop]
            slots = torch.arange(start, stop, dtype=part.dtype, device=part.device)
            set_bits((part >> bits) + slots, high)
            codes[start:stop] = part & (2**bits - 1)
        return high, _packed_codes(codes, bits)

    def scatter(self, values: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        high, low = saved
        device = values.device
        # Set bit i of the high stream is slot j's, j its rank among the set bits, and i - j its
        # bucket (the position's high part); its low code is read at slot j. A chunk of the high
        # stream at a time: temporaries are a chunk's, never a slot's worth of the tensor.
        out = values.new_zeros(self.count + 1)  # one past the end takes the bits not set
        last_slot = self.capacity - 1
        kept = torch.zeros((), dtype=torch.int64, device=device)
        for start, stop in spans(self.high_length, index_chunk_length(device, self.high_length)):
            bits = unpack_bits(high[start // 8:packed_size(stop, 1)], stop - start)
            rank = torch.cumsum(bits, 0) + (kept - 1)
            slot = rank.clamp(0, last_slot)
            bucket = torch.arange(start, stop, device=device) - rank
            position = (bucket << self.low_bits) | _read_codes(low, slot * self.low_bits, self.low_bits)
            _bits_of(out).scatter_(0, torch.where(bits, position, self.count), _bits_of(values).index_select(0, slot))
            kept = rank[-1] + 1
        return out[:self.count]

    def scatter_on_cpu(self, values: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """:meth:`scatter` on a CPU (:mod:`~actcomp.kernels.eager_cpu`): one pass of the native
        kernel where it is built, else the set bits of a chunk of the high stream found with
        ``nonzero``, and only their slots visited, instead of a rank and a scatter for every bit."""
        high, low = saved
        if native_cpu.scatters(values):
            return native_cpu.elias_fano_scatter(values.contiguous(), high.contiguous(), low.contiguous(),
                                                 self.low_bits, self.count)
        out = values.new_zeros(self.count + 1)  # one past the end takes the empty slots
        slot = 0
        # Chunks of a quarter of the values' length: the few int64 temporaries per set bit (~40%
        # of them) stay ~0.1x a bf16 input, and a chunk's fixed cost is paid once per 2**16 bits.
        for start, stop in spans(self.high_length, aligned_length(values.device, self.high_length, 8) // 4):
            ones = unpack_bits(high[start // 8:packed_size(stop, 1)], stop - start).nonzero().view(-1)
            found = ones.numel()
            slots = torch.arange(slot, slot + found)
            codes = _read_codes(low, slots * self.low_bits, self.low_bits)
            # Set bit i of the high stream is slot j's, and i - j its position's high part.
            position = ones.sub_(slots).add_(start)
            del slots
            position.bitwise_left_shift_(self.low_bits).bitwise_or_(codes)
            _bits_of(out).scatter_(0, position, _bits_of(values[slot:slot + found]))
            slot += found
        return out[:self.count]


@dataclass(frozen=True)
class Indices:
    """The kept positions as int32 (int64 beyond 2**31 elements), ascending."""

    count: int
    capacity: int

    def writer(self, device: torch.device) -> _IndicesWriter:
        return _IndicesWriter(self, device)

    def from_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the writer stores, from the ascending kept positions (0 in an empty slot)."""
        dtype = torch.int32 if self.count <= 2**31 else torch.int64
        return (torch.where(positions < self.count, positions, 0).to(dtype),)

    def scatter(self, values: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        out = values.new_zeros(self.count)
        _bits_of(out).index_copy_(0, saved[0].long(), _bits_of(values))
        return out


@dataclass(frozen=True)
class Rice:
    """Golomb-Rice coded gaps between kept positions, with ``low_bits`` low bits each and a unary
    high part; the streams run on across chunks of ``length``, whose kept counts and unary
    lengths the metadata record. Eager only: its size depends on the gaps."""

    count: int
    capacity: int
    low_bits: int
    length: int
    chunk_kept: tuple[int, ...] = ()
    chunk_unary: tuple[int, ...] = ()

    def writer(self, device: torch.device) -> _RiceWriter:
        return _RiceWriter(self, device)

    def scatter(self, values: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        high_stream, low_stream = saved
        out = values.new_empty(self.count)
        first = unary_start = 0
        last = -1
        for (start, stop), kept, unary in zip(spans(self.count, self.length), self.chunk_kept, self.chunk_unary):
            part = out[start:stop].zero_()
            if not kept:
                continue
            ones = _bit_range(high_stream, unary_start, unary).nonzero().view(-1)
            gaps = (torch.diff(ones, prepend=ones.new_full((1,), -1)) - 1) << self.low_bits
            if self.low_bits:
                shifts = torch.arange(self.low_bits, device=values.device)
                low = _bit_range(low_stream, first * self.low_bits, kept * self.low_bits)
                gaps |= (low.view(kept, self.low_bits).long() << shifts).sum(1)
            index = torch.cumsum(gaps + 1, 0) + (last - start)
            last = start + int(index[-1])
            part.index_put_((index,), values[first:first + kept])
            first += kept
            unary_start += unary
        return out


PositionForm = Dense | Bitmask | EliasFano | Indices | Rice


def index_chunk_length(device: torch.device, count: int) -> int:
    """Elements per chunk of a pass that holds several int64 temporaries per element (ranks,
    slots, positions): an eighth of :func:`~actcomp.kernels.chunks.aligned_length`'s, a
    multiple of 8, so that they weigh what a chunk of the values would; all of ``count`` while
    ``torch.compile`` traces.

    >>> index_chunk_length(torch.device("cpu"), 10**7)
    32768
    """
    if torch.compiler.is_compiling():
        # One slice, like aligned_length: a shorter symbolic length would unroll a loop whose
        # trip count guards on the size, one graph per shape.
        return count
    return max(8, aligned_length(device, count, 8) // 64 * 8)


def static_form(count: int, capacity: int) -> Dense | Bitmask | EliasFano:
    """The smaller static form for ``capacity`` kept of ``count``: a bitmask, or Elias-Fano with
    the low-bit width of fewest bytes (a bitmask on a tie).

    >>> static_form(1000, 1000), static_form(1000, 500), static_form(1000, 100)
    (Dense(count=1000), Bitmask(count=1000, capacity=500), EliasFano(count=1000, capacity=100, low_bits=3))
    """
    if torch.compiler.is_compiling():
        return _static_form(count, capacity)  # sizes may be symbolic there: traced, not cached
    return _cached_static_form(count, capacity)


def _static_form(count: int, capacity: int) -> Dense | Bitmask | EliasFano:
    if capacity >= count:
        return Dense(count)
    best: Dense | Bitmask | EliasFano = Bitmask(count, capacity)
    size = packed_size(count, 1)
    for bits in range(1, _MAX_LOW_BITS + 1):
        candidate = EliasFano(count, capacity, bits)
        if candidate.nbytes() < size:
            best, size = candidate, candidate.nbytes()
    return best


# A layer's sizes repeat every step: the search over low-bit widths (ten forms built and
# measured) is paid once per size. The forms are frozen, so sharing them is safe.
_cached_static_form = functools.lru_cache(maxsize=4096)(_static_form)


def rice_form(count: int, capacity: int, length: int) -> Dense | Rice:
    """Rice coding for ``capacity`` kept of ``count``, in chunks of ``length`` (a multiple of 8),
    with the ``r`` of fewest expected bits for randomly spread positions. Eager only."""
    if torch.compiler.is_compiling():
        raise ActcompError("Rice-coded positions (rice=1) have a size that depends on the data and "
                           "cannot be compiled; leave rice unset for the static form")
    return Dense(count) if capacity >= count else Rice(count, capacity, rice_parameter(count, capacity), length)


def encode_kept(flat: torch.Tensor, select: Selector, capacity: int, form: PositionForm | None = None,
                length: int | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], PositionForm | None]:
    """The kept values of ``flat`` (1-D) in ``capacity`` slots, in position order, what ``form``
    stores of their positions, and the form to decode them with (None, with nothing stored,
    when ``form`` is: the caller knows the positions another way). ``select`` chooses a chunk's
    elements (chunks of ``length``, a multiple of 8); past ``capacity`` kept, later ones are
    dropped."""
    count = flat.numel()
    if isinstance(form, Dense):
        return flat, (), form
    length = length or index_chunk_length(flat.device, count)
    writer = None if form is None else form.writer(flat.device)
    values = flat.new_zeros(capacity + 1)  # the last slot takes every element not kept
    kept = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start, stop in spans(count, length):
        part = flat[start:stop]
        mask = select(part, start)
        rank = torch.cumsum(mask, 0) + (kept - 1)
        # Past capacity, and every element not kept, into the spare slot.
        slot = torch.where(mask, rank, capacity).clamp_(max=capacity)
        _bits_of(values).scatter_(0, slot, _bits_of(part))
        if writer is not None:
            writer.add(slot, rank, start)
        kept = rank[-1] + 1
    saved, form = ((), None) if writer is None else writer.finish()
    return values[:capacity].clone(), saved, form


def encode_positions(flat: torch.Tensor, positions: torch.Tensor, form: Bitmask | EliasFano | Indices,
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], PositionForm]:
    """:func:`encode_kept`'s outputs when the kept positions are known: ``positions`` ascending,
    one a slot, ``flat.numel()`` in a slot left empty (its value 0).

    >>> form = static_form(32, 4)
    >>> values, saved, _ = encode_positions(torch.arange(1.0, 33.0), torch.tensor([1, 2, 7, 32]), form)
    >>> values.tolist(), torch.equal(form.scatter(values, saved)[[1, 2, 7]], torch.tensor([2.0, 3.0, 8.0]))
    ([2.0, 3.0, 8.0, 0.0], True)
    """
    count = flat.numel()
    if native_cpu.codes_positions(positions) and native_cpu.scatters(flat):
        return native_cpu.gather(flat.contiguous(), positions.contiguous()), form.from_positions(positions), form
    values = _bits_of(flat).index_select(0, positions.clamp(max=count - 1))
    values.masked_fill_(positions == count, 0)  # an empty slot holds +0.0
    return values.view(flat.dtype), form.from_positions(positions), form


def set_bits(bits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Sets the ``bits`` (distinct, int32 or int64, none set yet) of the little-endian bit stream
    ``packed`` (uint8), in place.

    >>> set_bits(torch.tensor([0, 3, 9]), torch.zeros(2, dtype=torch.uint8)).tolist()
    [9, 2]
    """
    # The bits are distinct and clear: adding each one's byte value is or-ing it in.
    return packed.scatter_add_(0, bits >> 3, torch.bitwise_left_shift(1, bits & 7).to(torch.uint8))


def _packed_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8) packed ``bits`` each, a chunk of whole bytes at a time: packing widens
    them to int64 on the way."""
    packed = torch.empty(packed_size(codes.numel(), bits), dtype=torch.uint8, device=codes.device)
    for start, stop in spans(codes.numel(), index_chunk_length(codes.device, codes.numel())):
        packed[start * bits // 8:packed_size(stop, bits)] = pack_codes(codes[start:stop], bits)
    return packed


def _bits_of(values: torch.Tensor) -> torch.Tensor:
    """``values`` viewed as integers of their width: moved bit for bit, and on CPU a scatter of
    fp16 or bf16 would otherwise work on an fp32 copy of the whole tensor."""
    return values.view(_INT_OF_WIDTH[values.element_size()])


def expand_kept(values: torch.Tensor, count: int, masks: Iterable[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """A flat tensor of ``count`` zeros with ``values`` put, in order, where the bool masks of
    consecutive chunks ``(start, stop, mask)`` are set.

    >>> expand_kept(torch.tensor([5.0, 6.0]), 4, [(0, 4, torch.tensor([False, True, False, True]))])
    tensor([0., 5., 0., 6.])
    """
    out = values.new_empty(count)
    # Ranks as int32 where they fit: half the bytes, and index_select's int32 path is faster.
    dtype = _position_dtype(values.numel())
    kept = torch.zeros((), dtype=dtype, device=values.device)
    last = max(values.numel() - 1, 0)
    for start, stop, mask in masks:
        rank = torch.cumsum(mask, 0, dtype=dtype) + (kept - 1)
        # Bit patterns times the mask: +0.0 where not kept, and several times faster than a
        # torch.where on CPU.
        picked = _bits_of(values.index_select(0, rank.clamp(0, last)))
        torch.mul(picked, mask, out=_bits_of(out[start:stop]))
        kept = rank[-1] + 1
    return out


class _BitmaskWriter:
    def __init__(self, form: Bitmask, device: torch.device):
        self.form = form
        self.packed = torch.empty(packed_size(form.count, 1), dtype=torch.uint8, device=device)

    def add(self, slot: torch.Tensor, rank: torch.Tensor, start: int) -> None:
        self.packed[start // 8:start // 8 + packed_size(slot.numel(), 1)] = pack_bits(slot < self.form.capacity)

    def finish(self) -> tuple[tuple[torch.Tensor, ...], Bitmask]:
        return (self.packed,), self.form


class _EliasFanoWriter:
    """Writes both streams as the chunks come, in passes over a chunk's bucket ends and kept
    slots, not over a buffer of positions (4 bytes a kept element).

    The high stream is bucket after bucket, each a one per member and a zero to end it, so it
    starts all ones and only the ends are cleared: the end of bucket ``j`` sits at bit ``j +
    C_j``, ``C_j`` the count kept through that bucket, read off the running rank at the bucket's
    last element. Empty slots (``smink``) join the last bucket, whose end is the stream's last
    bit. The low codes (a byte each, until packed at the end) are scattered by slot."""

    def __init__(self, form: EliasFano, device: torch.device):
        self.form = form
        self.high = torch.full((packed_size(form.high_length, 1),), 0xFF, dtype=torch.uint8, device=device)
        self.low = torch.zeros(form.capacity + 1, dtype=torch.uint8, device=device)  # spare last slot
        # Filled in by add: how many slots are taken, and the low bits of ``count`` (tensors: a
        # symbolic count read as a Python value would make a graph per shape).
        self.taken = self.count_code = None

    def add(self, slot: torch.Tensor, rank: torch.Tensor, start: int) -> None:
        form, bits = self.form, self.form.low_bits
        stop = start + slot.numel()
        codes = torch.arange(start, stop, dtype=_position_dtype(form.count), device=slot.device) & (2**bits - 1)
        self.low.scatter_(0, slot, codes.to(torch.uint8))
        self.taken = (rank[-1] + 1).clamp(max=form.capacity)
        self.count_code = (codes[-1] + 1) & (2**bits - 1)  # the last chunk's: count's low bits
        # The bucket ends in this chunk: every full bucket's last element (the last, partial
        # bucket ends with the stream). Clearing a set bit is subtracting it: each end is
        # cleared once.
        full = (form.count >> bits) << bits
        if torch.compiler.is_compiling():
            # Pointwise over the chunk (a strided slice with symbolic bounds sends Inductor's
            # index simplification into minutes); elements that end no bucket add 0 to byte 0.
            position = torch.arange(start, stop, device=slot.device)
            is_end = ((position & (2**bits - 1)) == 2**bits - 1) & (position < full)
            ends = (position >> bits) + (rank + 1).clamp(max=form.capacity)
            clear = torch.where(is_end, 256 - torch.bitwise_left_shift(1, ends & 7), 0)
            self.high.scatter_add_(0, torch.where(is_end, ends >> 3, 0), clear.to(torch.uint8))
            return
        first_end = ((start >> bits) + 1 << bits) - 1
        last_end = min(stop, full)
        if first_end >= last_end:
            return
        through = (rank[first_end - start:last_end - start:2**bits] + 1).clamp_(max=form.capacity)
        ends = through + torch.arange(first_end >> bits, last_end >> bits, device=slot.device)
        self.high.scatter_add_(0, ends >> 3, (256 - torch.bitwise_left_shift(1, ends & 7)).to(torch.uint8))

    def finish(self) -> tuple[tuple[torch.Tensor, ...], EliasFano]:
        length = self.form.high_length
        # The last bucket's end, and the pad bits of the last byte, are zeros.
        self.high[-1] &= (1 << ((length - 1) % 8)) - 1
        capacity, bits = self.form.capacity, self.form.low_bits
        # Handed over and dropped here: the caller's copy of the values comes next, in the peak.
        codes, self.low = self.low[:capacity], torch.empty(0, dtype=torch.uint8)
        if self.taken is not None:
            # Empty slots join the last bucket with the low bits of ``count``, so that they
            # decode to ``count`` itself, past the end; a code of 0 would decode to the last
            # bucket's first position, a real element whose value the empty slot's zero would
            # overwrite.
            count_code = self.count_code.to(torch.uint8)
            for start, stop in spans(capacity, index_chunk_length(codes.device, capacity)):
                empty = torch.arange(start, stop, dtype=torch.int32, device=codes.device) >= self.taken
                codes[start:stop] = torch.where(empty, count_code, codes[start:stop])
        return (self.high, _packed_codes(codes, bits)), self.form


def _position_dtype(count: int) -> torch.dtype:
    """The integer type of positions in ``range(count + 1)``: int32 where they fit."""
    return torch.int32 if count < 2**31 else torch.int64


class _IndicesWriter:
    def __init__(self, form: Indices, device: torch.device):
        self.form = form
        self.dtype = torch.int32 if form.count <= 2**31 else torch.int64
        self.index = torch.zeros(form.capacity + 1, dtype=self.dtype, device=device)

    def add(self, slot: torch.Tensor, rank: torch.Tensor, start: int) -> None:
        self.index.scatter_(0, slot, torch.arange(start, start + slot.numel(), dtype=self.dtype, device=slot.device))

    def finish(self) -> tuple[tuple[torch.Tensor, ...], Indices]:
        return (self.index[:-1].clone(),), self.form


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


class _RiceWriter:
    """Rice-codes each chunk's kept positions as it comes; reads counts back to Python."""

    def __init__(self, form: Rice, device: torch.device):
        self.form, self.device = form, device
        self.kept: list[int] = []
        self.unary: list[int] = []
        self.high_stream, self.low_stream = _BitStream(device), _BitStream(device)
        self.last = -1  # the last kept position so far: gaps run on across chunks

    def add(self, slot: torch.Tensor, rank: torch.Tensor, start: int) -> None:
        index = (slot < self.form.capacity).nonzero().view(-1) + start
        self.kept.append(index.numel())
        if not index.numel():
            self.unary.append(0)
            return
        low_bits = self.form.low_bits
        gaps = torch.diff(index, prepend=index.new_full((1,), self.last)) - 1
        self.last = int(index[-1])
        ones = torch.cumsum((gaps >> low_bits) + 1, 0) - 1
        unary = torch.zeros(int(ones[-1]) + 1, dtype=torch.bool, device=self.device)
        unary[ones] = True
        self.unary.append(unary.numel())
        self.high_stream.append(unary)
        if low_bits:
            shifts = torch.arange(low_bits, device=self.device)
            self.low_stream.append(((gaps.unsqueeze(1) >> shifts) & 1).view(-1).bool())

    def finish(self) -> tuple[tuple[torch.Tensor, ...], Rice]:
        form = Rice(self.form.count, self.form.capacity, self.form.low_bits, self.form.length,
                    tuple(self.kept), tuple(self.unary))
        return (self.high_stream.finish(), self.low_stream.finish()), form


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


def _read_codes(stream: torch.Tensor, first_bit: torch.Tensor, bits: int) -> torch.Tensor:
    """The ``bits``-bit codes at bits ``first_bit`` of a little-endian bit stream (int64): two
    bytes read per code (index_select: several times faster than indexing on CPU), so nothing
    the size of the whole stream is unpacked."""
    byte = first_bit >> 3
    pair = stream.index_select(0, byte).long()
    # In place where a result is not read again: the int64 temporaries are a few per code.
    following = stream.index_select(0, byte.add_(1).clamp_(max=stream.numel() - 1)).long()
    pair.bitwise_or_(following.bitwise_left_shift_(8))
    del byte, following
    return pair.bitwise_right_shift_(first_bit & 7).bitwise_and_(2**bits - 1)


def _bit_range(packed: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Bits ``start`` to ``start + count`` of a packed stream, as bools."""
    first = start // 8
    bits = unpack_bits(packed[first:packed_size(start + count, 1)], packed_size(start + count, 1) * 8 - first * 8)
    return bits[start - first * 8:start - first * 8 + count]
