"""The element sparsifiers (``mink``, ``smink``, ``dropit``, ``random``) as Triton kernels: a
radix select for the threshold, then a count and a write pass that compact the kept values by
prefix sums.

They give the codes of :mod:`~actcomp.compressors.elements` bit for bit (the kept values in
position order, the positions as a bitmask, Elias-Fano or int32 indices), working on the
values' bit patterns only (no float arithmetic), so non-finite values select as the reference's
integer keys do:

- :func:`encode`: the threshold is the ``rank``-th largest magnitude key (sign bit cleared) of
  the tensor, or of its evenly spaced sample for ``smink``, found by radix select over 8-bit
  digits: a launch per byte of the dtype, each program counting the digits of the keys that
  share the prefix found so far into its own histogram and adding it to the global one with
  atomics; every later program resolves the digits from those histograms itself (256 bins a
  pass), so no launch is spent on that. A count launch then writes, per block, how many keys lie
  above the threshold and how many equal it (and zeroes Elias-Fano's streams), ``torch.cumsum``
  turns those into offsets, and a write launch keeps the keys above the threshold and the first
  ``ties`` equal ones, puts each kept value in its slot (block offset plus the block's own
  ``tl.cumsum``) and writes the bitmask bytes, the int32 indices, or Elias-Fano's bits with
  ``atomic_or`` into int32 words. Where the select runs over all the keys (not ``smink``'s
  sample), the count launch is the last digit's pass: each block writes its own histogram of
  that digit, and the write pass reads the digit and its block's counts off their prefix sums.
- :func:`decode`: a launch counts the set bits of each block of the bitmask (Elias-Fano's high
  stream), ``torch.cumsum`` turns those into ranks, and a launch writes each element (scatters
  each slot's value to its position); indices scatter in one launch.

``random`` (:func:`encode_random`, :func:`decode_random`) selects on 16-bit hashes of (position,
seed) computed in registers instead of magnitudes, and its decode runs the same passes again,
the write pass gathering each element's value from its slot.

Triton launches per encode: 5 (fp32) or 3 (fp16, bf16) for ``mink`` and ``dropit``, 6 or 4 for
``smink`` where it samples, 3 for ``random``, plus a ``torch.zeros`` (the histograms) and a
``torch.cumsum``; per decode: 2 and a ``torch.cumsum`` (and a ``torch.zeros`` of the output for
Elias-Fano), 1 and a ``torch.zeros`` for indices, 3 for ``random``.

>>> import torch
>>> from actcomp.kernels import triton_runtime
>>> triton_runtime.runs_on(torch.device("cpu")) in (True, False)
True
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actcomp.kernels.bitpack import packed_size
from actcomp.kernels.triton_affine import _lowbias32
from actcomp.kernels.triton_runtime import device_guard, launch

_BINS = 256  # a radix pass's histogram: 8-bit digits
# Keys a program of a histogram pass counts; rows of 8 elements (a bitmask byte) a program of
# the count and write passes takes, and bitmask (or high-stream) bytes a decode program takes.
HISTOGRAM_BLOCK = 4096
ROWS = 256
DECODE_ROWS = 256
_ZERO_BLOCK = 1024
_BITS = {2: torch.int16, 4: torch.int32}


def takes(dtype: torch.dtype, count: int) -> bool:
    """Whether these kernels select among ``count`` values of ``dtype``: fp32, bf16 or fp16,
    positions in int32."""
    return dtype in (torch.float32, torch.bfloat16, torch.float16) and count < 2**31 - 2**16


@triton.jit
def _resolve(hist_ptr, rank, DONE: tl.constexpr):
    """The key's digits found by the first ``DONE`` histogram passes, as one prefix, and the rank
    from the top, among the keys sharing it, of the key sought (``rank`` before any pass)."""
    bins = tl.arange(0, 256)
    # A sum, not rank.to(): a GPU launch passes an int argument equal to 1 as a constant.
    wanted = rank + tl.zeros((), tl.int64)
    prefix = tl.zeros((), tl.int64)
    for done in tl.static_range(DONE):
        digit, wanted = _digit(tl.load(hist_ptr + done * 256 + bins), wanted)
        prefix = (prefix << 8) | digit
    return prefix, wanted


@triton.jit
def _digit(counts, wanted):
    """The digit of the key of rank ``wanted`` from the top, from the 256 ``counts`` of the digit
    among the keys sharing the prefix, and its rank among the keys sharing that digit too."""
    counts = counts.to(tl.int64)
    at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # non-increasing
    digit = tl.sum((at_or_above >= wanted).to(tl.int64), axis=0) - 1
    return digit, wanted - tl.max(tl.where(at_or_above < wanted, at_or_above, 0), axis=0)


@triton.jit
def _keys(bits_ptr, seed_ptr, index, valid, KEY_MASK: tl.constexpr, RANDOM: tl.constexpr):
    """The keys at ``index``: the magnitudes' bits, or ``random``'s 16-bit hashes of (position, seed)."""
    if RANDOM:
        seed = tl.load(seed_ptr).to(tl.uint32)
        return ((_lowbias32(index.to(tl.uint32) ^ seed) >> 16) & 0xFFFF).to(tl.int32)
    else:
        return tl.load(bits_ptr + index, mask=valid, other=0).to(tl.int32) & KEY_MASK


@triton.jit
def _histogram_kernel(bits_ptr, seed_ptr, hist_ptr, count, stride, rank, KEY_MASK: tl.constexpr,
                      RANDOM: tl.constexpr, PASS: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr):
    """Pass ``PASS``: the digit below the prefix found so far, of the keys sharing it, among
    every ``stride``-th of ``count`` values."""
    prefix, wanted = _resolve(hist_ptr, rank, PASS)
    shift: tl.constexpr = 8 * (PASSES - 1 - PASS)
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    keys = _keys(bits_ptr, seed_ptr, index.to(tl.int64) * stride, valid, KEY_MASK, RANDOM)
    if PASS > 0:
        valid = valid & ((keys >> (shift + 8)) == prefix)
    local = tl.histogram((keys >> shift) & 255, 256, mask=valid)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + PASS * 256 + bins, local, mask=local > 0)


@triton.jit
def _rank_within(flags):
    """Each element's count of set ``flags`` before it in a (rows, 8) block, in row-major order."""
    flags = flags.to(tl.int32)
    row_sums = tl.sum(flags, axis=1)
    row_before = tl.cumsum(row_sums, axis=0) - row_sums
    return tl.cumsum(flags, axis=1) - flags + row_before[:, None]


@triton.jit
def _count_kernel(bits_ptr, seed_ptr, hist_ptr, counts_ptr, high_ptr, low_ptr, high_words, low_words, zero_span,
                  count, rank, KEY_MASK: tl.constexpr, RANDOM: tl.constexpr, PASSES: tl.constexpr,
                  FUSED: tl.constexpr, BLOCK: tl.constexpr, ZEROES: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """Per block, the keys above the threshold and those equal to it (two counts); or, ``FUSED``
    (the threshold's last digit is this pass's, over all the keys), the block's own histogram of
    the last digit among the keys sharing the prefix found so far, and how many keys lie above
    that prefix (257 counts), from which the write pass reads both. The program's share of
    Elias-Fano's word streams zeroed for the write's ``atomic_or``."""
    program = tl.program_id(0)
    index = program * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    keys = _keys(bits_ptr, seed_ptr, index, valid, KEY_MASK, RANDOM)
    if FUSED:
        prefix, wanted = _resolve(hist_ptr, rank, PASSES - 1)
        local = tl.histogram(keys & 255, 256, mask=valid & ((keys >> 8) == prefix))
        tl.store(counts_ptr + program * 257 + tl.arange(0, 256), local)
        tl.store(counts_ptr + program * 257 + 256, tl.sum((valid & ((keys >> 8) > prefix)).to(tl.int32), axis=0))
    else:
        key, wanted = _resolve(hist_ptr, rank, PASSES)
        tl.store(counts_ptr + program * 2, tl.sum((valid & (keys > key)).to(tl.int32), axis=0))
        tl.store(counts_ptr + program * 2 + 1, tl.sum((valid & (keys == key)).to(tl.int32), axis=0))
    if ZEROES:
        for offset in range(0, zero_span, ZERO_BLOCK):
            word = program * zero_span + offset + tl.arange(0, ZERO_BLOCK)
            mine = word < program * zero_span + zero_span
            tl.store(high_ptr + word, tl.zeros((ZERO_BLOCK,), tl.int32), mask=mine & (word < high_words))
            tl.store(low_ptr + word, tl.zeros((ZERO_BLOCK,), tl.int32), mask=mine & (word < low_words))


@triton.jit
def _set_code(words_ptr, code, first_bit, BITS: tl.constexpr, mask):
    """Or ``BITS``-bit ``code`` in at ``first_bit`` of a little-endian stream of int32 words."""
    offset = first_bit & 31
    word = first_bit >> 5
    tl.atomic_or(words_ptr + word, code << offset, mask=mask)
    spill = mask & (offset + BITS > 32)
    tl.atomic_or(words_ptr + word + 1, code >> tl.where(spill, 32 - offset, 0), mask=spill)


@triton.jit
def _write_kernel(bits_ptr, seed_ptr, hist_ptr, counts_ptr, cumulative_ptr, values_ptr, mask_ptr, high_ptr, low_ptr,
                  count, rank, kept, blocks, KEY_MASK: tl.constexpr, RANDOM: tl.constexpr, PASSES: tl.constexpr,
                  SAMPLED: tl.constexpr, FUSED: tl.constexpr, FORM: tl.constexpr, LOW_BITS: tl.constexpr,
                  ROWS: tl.constexpr):
    """The kept values to their slots, and their positions in the form ``FORM`` (0: a bitmask
    at ``mask_ptr``, 1: Elias-Fano's int32 word streams, 2: int32 indices at ``mask_ptr``, 3:
    none); or, with ``FORM`` 4 (``random``'s decode), each element its slot's value at ``mask_ptr``."""
    program = tl.program_id(0)
    if FUSED:  # the last digit from the blocks' histograms summed, the counts from the prefix sums
        prefix, wanted = _resolve(hist_ptr, rank, PASSES - 1)
        bins = tl.arange(0, 256)
        totals = tl.load(cumulative_ptr + (blocks - 1) * 257 + bins)
        digit, wanted = _digit(totals, wanted)
        key = (prefix << 8) | digit
        above_total = tl.load(cumulative_ptr + (blocks - 1) * 257 + 256) + tl.sum(tl.where(bins > digit, totals, 0))
        equal_total = tl.sum(tl.where(bins == digit, totals, 0))
        first = program * 257
        before = tl.load(cumulative_ptr + first + bins) - tl.load(counts_ptr + first + bins)
        above_before = tl.load(cumulative_ptr + first + 256) - tl.load(counts_ptr + first + 256) \
            + tl.sum(tl.where(bins > digit, before, 0))
        equal_before = tl.sum(tl.where(bins == digit, before, 0))
    else:
        key, wanted = _resolve(hist_ptr, rank, PASSES)
        above_total = tl.load(cumulative_ptr + (blocks - 1) * 2)
        equal_total = tl.load(cumulative_ptr + (blocks - 1) * 2 + 1)
        above_before = tl.load(cumulative_ptr + program * 2) - tl.load(counts_ptr + program * 2)
        equal_before = tl.load(cumulative_ptr + program * 2 + 1) - tl.load(counts_ptr + program * 2 + 1)
    row = tl.arange(0, ROWS)
    column = tl.arange(0, 8)
    index = program * ROWS * 8 + row[:, None] * 8 + column[None, :]
    valid = index < count
    keys = _keys(bits_ptr, seed_ptr, index, valid, KEY_MASK, RANDOM)
    above = valid & (keys > key)
    equal = valid & (keys == key)
    if SAMPLED:  # ties fill what the keys above leave of ``kept``; none when the key is zero
        ties = tl.where(key > 0, tl.maximum(kept - above_total, 0), 0).to(tl.int32)
    else:
        ties = wanted.to(tl.int32)
    keep = above | (equal & (equal_before + _rank_within(equal) < ties))
    slot = above_before + tl.minimum(equal_before, ties) + _rank_within(keep)
    stored = keep & (slot < kept)  # past ``kept`` (smink's rare overflow) the last are dropped
    if FORM == 4:
        tl.store(mask_ptr + index, tl.load(values_ptr + slot, mask=stored, other=0), mask=valid)
    else:
        tl.store(values_ptr + slot, tl.load(bits_ptr + index, mask=stored), mask=stored)
        # Slots no element took (smink): a zero value, and in Elias-Fano the position ``count``.
        taken = tl.minimum(above_total + tl.minimum(equal_total, ties), kept)
        is_empty = (index >= taken) & (index < kept)  # as slots
        tl.store(values_ptr + index, tl.zeros((ROWS, 8), values_ptr.dtype.element_ty), mask=is_empty)
        if FORM == 1:
            low_mask: tl.constexpr = (1 << LOW_BITS) - 1
            high_bit = (index >> LOW_BITS) + slot
            tl.atomic_or(high_ptr + (high_bit >> 5), 1 << (high_bit & 31), mask=stored)
            _set_code(low_ptr, index & low_mask, slot * LOW_BITS, LOW_BITS, stored)
            empty_bit = (count >> LOW_BITS) + index
            tl.atomic_or(high_ptr + (empty_bit >> 5), 1 << (empty_bit & 31), mask=is_empty)
            _set_code(low_ptr, (index * 0 + count) & low_mask, index * LOW_BITS, LOW_BITS, is_empty)
        elif FORM == 2:
            tl.store(mask_ptr + slot, index, mask=stored)
            tl.store(mask_ptr + index, tl.zeros((ROWS, 8), tl.int32), mask=is_empty)
        elif FORM == 0:
            byte = tl.sum(tl.where(stored, 1 << column[None, :], 0), axis=1)
            tl.store(mask_ptr + program * ROWS + row, byte.to(tl.uint8), mask=(program * ROWS + row) * 8 < count)


def encode(flat: torch.Tensor, kept: int, low_bits: int | None,
           sampled: tuple[int, int] | None = None, indices: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The kept values of contiguous 1-D ``flat`` (``kept`` of its ``count`` values, ``0 < kept
    < count``, see :func:`takes`) in position order, and their positions: int32 indices where
    ``indices``, a bitmask where ``low_bits`` is None, else Elias-Fano's high and low streams with
    ``low_bits`` low bits. The threshold is the ``kept``-th largest key (``mink``), or with
    ``sampled = (step, rank)`` the ``rank``-th largest of every ``step``-th key (``smink``)."""
    count = flat.numel()
    device = flat.device
    values = torch.empty(kept, dtype=flat.dtype, device=device)
    if indices:
        mask = high = low = torch.empty(kept, dtype=torch.int32, device=device)
        form, saved = 2, (mask,)
    elif low_bits is None:
        mask = high = low = torch.empty(packed_size(count, 1), dtype=torch.uint8, device=device)
        form, saved = 0, (mask,)
    else:
        high_bytes = packed_size(kept + (count >> low_bits) + 1, 1)
        low_bytes = packed_size(kept, low_bits)
        mask = high = torch.empty(-(-high_bytes // 4), dtype=torch.int32, device=device)
        low = torch.empty(-(-low_bytes // 4), dtype=torch.int32, device=device)
        form, saved = 1, (high.view(torch.uint8)[:high_bytes], low.view(torch.uint8)[:low_bytes])
    _select(flat, None, kept, sampled, form, values, mask, high, low, low_bits or 1)
    return values, saved


def encode_random(flat: torch.Tensor, kept: int, seed: torch.Tensor) -> torch.Tensor:
    """``random``'s kept values of contiguous 1-D ``flat`` (``0 < kept < count``): those with the
    ``kept`` largest 16-bit keys of (position, ``seed``), ties by position, in position order."""
    values = torch.empty(kept, dtype=flat.dtype, device=flat.device)
    _select(flat, seed, kept, None, 3, values, values, values, values, 1)
    return values


def decode_random(values: torch.Tensor, seed: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` values :func:`encode_random` kept, +0 elsewhere: the keys and their
    threshold recomputed from ``seed``."""
    out = torch.empty(count, dtype=values.dtype, device=values.device)
    _select(out, seed, values.numel(), None, 4, values, out, out, out, 1)
    return out


def _select(flat: torch.Tensor, seed: torch.Tensor | None, kept: int, sampled: tuple[int, int] | None, form: int,
            values: torch.Tensor, mask: torch.Tensor, high: torch.Tensor, low: torch.Tensor, low_bits: int) -> None:
    """The launches of a selection (see :func:`_write_kernel` for ``form``): a histogram pass per
    byte of the keys, a count pass (which zeroes Elias-Fano's ``high`` and ``low``), offsets by
    ``torch.cumsum``, and the write pass."""
    count = flat.numel()
    device = flat.device
    bits = flat.view(_BITS[flat.element_size()])
    integers = values.view(bits.dtype)
    random = seed is not None
    passes = 2 if random else flat.element_size()
    key_mask = 2 ** (8 * flat.element_size() - 1) - 1
    step, rank = sampled or (1, kept)
    selected = -(-count // step)
    histograms = torch.zeros(passes, _BINS, dtype=torch.int32, device=device)
    blocks = triton.cdiv(count, ROWS * 8)
    # Exact selections take the last digit in the count pass (see _count_kernel), sampled ones
    # (the histograms are the sample's) count above and at the threshold there.
    fused = sampled is None
    counts = torch.empty(blocks, 257 if fused else 2, dtype=torch.int32, device=device)
    words = high.numel() + low.numel() if form == 1 else 0
    seed = bits if seed is None else seed
    mask = mask.view(integers.dtype) if form == 4 else mask
    with device_guard(flat):
        for index in range(passes - fused):
            launch(_histogram_kernel, (triton.cdiv(selected, HISTOGRAM_BLOCK),), bits, seed, histograms, selected,
                   step, rank, KEY_MASK=key_mask, RANDOM=random, PASS=index, PASSES=passes, BLOCK=HISTOGRAM_BLOCK)
        launch(_count_kernel, (blocks,), bits, seed, histograms, counts, high, low, high.numel(), low.numel(),
               -(-words // blocks), count, rank, KEY_MASK=key_mask, RANDOM=random, PASSES=passes, FUSED=fused, BLOCK=ROWS * 8,
               ZEROES=words > 0, ZERO_BLOCK=_ZERO_BLOCK)
        cumulative = torch.cumsum(counts, 0, dtype=torch.int32)
        launch(_write_kernel, (blocks,), bits, seed, histograms, counts, cumulative, integers, mask, high, low, count,
               rank, kept, blocks, KEY_MASK=key_mask, RANDOM=random, PASSES=passes, SAMPLED=not fused, FUSED=fused,
               FORM=form, LOW_BITS=low_bits, ROWS=ROWS)


@triton.jit
def _popcount_kernel(packed_ptr, counts_ptr, length, ROWS: tl.constexpr):
    """The set bits of each block of ``ROWS`` bytes of a bit stream of ``length`` bits."""
    program = tl.program_id(0)
    row = tl.arange(0, ROWS)
    column = tl.arange(0, 8)
    bit = program * ROWS * 8 + row[:, None] * 8 + column[None, :]
    byte = tl.load(packed_ptr + program * ROWS + row, mask=(program * ROWS + row) * 8 < length, other=0)
    set_bits = (byte.to(tl.int32)[:, None] >> column[None, :]) & 1
    tl.store(counts_ptr + program, tl.sum(tl.sum(tl.where(bit < length, set_bits, 0), axis=1), axis=0))


@triton.jit
def _expand_kernel(packed_ptr, counts_ptr, cumulative_ptr, values_ptr, out_ptr, count, kept, ROWS: tl.constexpr):
    """Bitmask: each element its slot's value where its bit is set, else +0."""
    program = tl.program_id(0)
    row = tl.arange(0, ROWS)
    column = tl.arange(0, 8)
    index = program * ROWS * 8 + row[:, None] * 8 + column[None, :]
    valid = index < count
    byte = tl.load(packed_ptr + program * ROWS + row, mask=(program * ROWS + row) * 8 < count, other=0)
    is_kept = valid & (((byte.to(tl.int32)[:, None] >> column[None, :]) & 1) != 0)
    slot = tl.load(cumulative_ptr + program) - tl.load(counts_ptr + program) + _rank_within(is_kept)
    picked = tl.load(values_ptr + slot, mask=is_kept & (slot < kept), other=0)
    tl.store(out_ptr + index, picked, mask=valid)


@triton.jit
def _elias_fano_kernel(high_ptr, low_ptr, counts_ptr, cumulative_ptr, values_ptr, out_ptr, count, kept, length,
                       low_length, LOW_BITS: tl.constexpr, ROWS: tl.constexpr):
    """Elias-Fano: set bit ``i`` of the high stream is slot ``j``'s (its rank among the set
    bits); its value goes to ``((i - j) << LOW_BITS) | low code j`` (``count``: an empty slot)."""
    program = tl.program_id(0)
    row = tl.arange(0, ROWS)
    column = tl.arange(0, 8)
    bit = program * ROWS * 8 + row[:, None] * 8 + column[None, :]
    byte = tl.load(high_ptr + program * ROWS + row, mask=(program * ROWS + row) * 8 < length, other=0)
    is_set = (bit < length) & (((byte.to(tl.int32)[:, None] >> column[None, :]) & 1) != 0)
    slot = tl.load(cumulative_ptr + program) - tl.load(counts_ptr + program) + _rank_within(is_set)
    is_set = is_set & (slot < kept)
    first = slot * LOW_BITS
    pair = tl.load(low_ptr + (first >> 3), mask=is_set, other=0).to(tl.int32)
    pair = pair | (tl.load(low_ptr + (first >> 3) + 1, mask=is_set & ((first >> 3) + 1 < low_length),
                           other=0).to(tl.int32) << 8)
    position = ((bit - slot) << LOW_BITS) | ((pair >> (first & 7)) & ((1 << LOW_BITS) - 1))
    is_set = is_set & (position < count)
    tl.store(out_ptr + position, tl.load(values_ptr + slot, mask=is_set, other=0), mask=is_set)


@triton.jit
def _indices_kernel(index_ptr, values_ptr, out_ptr, kept, BLOCK: tl.constexpr):
    """Indices: each slot's value to its position."""
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = slot < kept
    position = tl.load(index_ptr + slot, mask=valid, other=0)
    tl.store(out_ptr + position, tl.load(values_ptr + slot, mask=valid, other=0), mask=valid)


def decode_indices(values: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` values :func:`encode` kept with ``indices``, +0 elsewhere: one launch (and a
    ``torch.zeros``)."""
    out = torch.zeros(count, dtype=values.dtype, device=values.device)
    integers = values.view(_BITS[values.element_size()])
    with device_guard(values):
        launch(_indices_kernel, (triton.cdiv(values.numel(), DECODE_ROWS * 8),), index, integers,
               out.view(integers.dtype), values.numel(), BLOCK=DECODE_ROWS * 8)
    return out


def decode(values: torch.Tensor, saved: tuple[torch.Tensor, ...], count: int, low_bits: int | None) -> torch.Tensor:
    """The ``count`` values :func:`encode` kept, +0 elsewhere, as a 1-D tensor of the values' dtype."""
    device = values.device
    kept = values.numel()
    integers = values.view(_BITS[values.element_size()])
    if low_bits is None:
        (packed,) = saved
        length = count
        out = torch.empty(count, dtype=values.dtype, device=device)
    else:
        packed, low = saved
        length = kept + (count >> low_bits) + 1
        out = torch.zeros(count, dtype=values.dtype, device=device)
    blocks = triton.cdiv(length, DECODE_ROWS * 8)
    counts = torch.empty(blocks, dtype=torch.int32, device=device)
    with device_guard(values):
        launch(_popcount_kernel, (blocks,), packed, counts, length, ROWS=DECODE_ROWS)
        cumulative = torch.cumsum(counts, 0, dtype=torch.int32)
        if low_bits is None:
            launch(_expand_kernel, (blocks,), packed, counts, cumulative, integers, out.view(integers.dtype), count,
                   kept, ROWS=DECODE_ROWS)
        else:
            launch(_elias_fano_kernel, (blocks,), packed, low, counts, cumulative, integers, out.view(integers.dtype),
                   count, kept, length, low.numel(), LOW_BITS=low_bits, ROWS=DECODE_ROWS)
    return out
