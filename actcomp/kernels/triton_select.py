"""The element sparsifiers (``mink``, ``smink``, ``dropit``, ``random``) as Triton kernels: a
radix select for the threshold, then a count and a write pass that compact the kept values by
prefix sums.

They give the codes of :mod:`~actcomp.compressors.elements` bit for bit (the kept values in
position order, the positions as a bitmask, Elias-Fano or int32 indices), working on the
values' bit patterns only (no float arithmetic), so non-finite values select as the reference's
integer keys do:

- :func:`encode`: the threshold is the ``rank``-th largest magnitude key (sign bit cleared) of
  the tensor, or of its evenly spaced sample for ``smink``, found by radix select: fp32's 31-bit
  keys in digits of 11, 11 and 9 bits, fp16's and bf16's 15-bit ones in 8 and 8. A launch per
  digit but the last, each program counting the digits of the keys that share the prefix found
  so far into its own histogram and adding it to the global one with atomics; every later
  program resolves the digits from those histograms itself (at most 2048 bins a pass), so no
  launch is spent on that. A count launch takes the last digit: per block, for every value it may
  take, how many keys lie at or above it and how many above the prefix (and its histogram of the
  digit, of ``smink``'s sample where it samples, added to the global one); it also zeroes
  Elias-Fano's streams. A write launch reads the digit off the histograms and its block's
  offsets off the rows of the blocks before its own (each program sums them itself, up to
  :data:`_SCAN` blocks; beyond, one more launch sums the threshold's column), keeps the
  keys above the threshold and the first ``ties`` equal ones, puts each kept value in its slot
  (the block's offset plus its own ``tl.cumsum``) and writes the bitmask bytes, the int32
  indices, or Elias-Fano's bits with ``atomic_or`` into int32 words.
- :func:`decode`: a launch counts the set bits of each block of the bitmask (Elias-Fano's high
  stream; it also fills Elias-Fano's output, which the next scatters into), and a launch writes
  each element (scatters each slot's value to its position), its rank the counts of the blocks
  before its own (summed as the encode's are) plus its rank within; indices fill and scatter in
  two launches.

``random`` (:func:`encode_random`, :func:`decode_random`) selects on 16-bit hashes of (position,
seed) computed in registers instead of magnitudes, and its decode runs the same passes again,
the write pass gathering each element's value from its slot.

The chain's finite flag (:mod:`~actcomp.core.chain`) costs no launch: where an encode is given
``finite``, the count launch sets it true and the write launch (after it on the same stream)
clears it where its block holds a magnitude key at or above infinity's; a decode given it
writes NaN everywhere in the launches that write the output.

Triton launches per encode: 4 (fp32) or 3 (fp16, bf16) for ``mink``, ``smink`` and ``dropit``,
3 for ``random``, plus a ``torch.zeros`` (the histograms); per decode: 2, and 3 and a
``torch.zeros`` for ``random``. Past :data:`_SCAN` blocks of 2048 elements (bits of a decode's
stream), a launch more each (an encode's sums one column; a decode's is a ``torch.cumsum`` of
one count a block).

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
from actcomp.kernels.triton_runtime import cdiv, device_guard, launch

# A radix select's digits, from the top: ``wide`` bits each but the last, which takes what is left
# of the key's bits (as ``(passes, wide, last)``): four passes over fp32's 31-bit magnitudes with
# at most 256 bins, two over the 15-bit ones of fp16 and bf16 and random's 16-bit hashes. A pass
# costs with its bins, not its keys: ``tl.histogram`` works bin by bin, and every program of the
# later passes reads the earlier histograms whole. With 2048-bin digits (3, 11, 9) an H200 took
# 80 us a histogram pass over 2.4M fp32 keys, and 28 us over a sample of 24K (one program's
# time), where a 256-bin pass over as many bf16 keys took 11 us and 5 us (stop 52's profile): one
# launch more for four passes of about the bf16 cost.
_DIGITS = {4: (4, 8, 7), 2: (2, 8, 8)}  # by the keys' bytes
# Keys a program of a histogram pass counts; rows of 8 elements (a bitmask byte) a program of
# the count and write passes takes, and bitmask (or high-stream) bytes a decode program takes.
HISTOGRAM_BLOCK = 4096
ROWS = 256
DECODE_ROWS = 256
_ZERO_BLOCK = 1024
# Up to this many blocks, each program of a write or decode pass sums the counts of the blocks
# before its own in one vector load (no prefix-sum launch); beyond, its reads would grow with the
# square of the blocks (for all programs), and one launch makes the offsets instead (the
# encode's _offsets_kernel, the decode's torch.cumsum of one count a block).
_SCAN = 1024
# Blocks :func:`_offsets_kernel` sums a step.
_OFFSETS_CHUNK = 2048
_BITS = {2: torch.int16, 4: torch.int32}
# A magnitude's bits (sign cleared) at or above these are inf or NaN.
_INFINITY = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
# The NaN ``torch.where(finite, x, math.nan)`` writes (backends.nan_unless_finite), as bits.
_NAN = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def takes(dtype: torch.dtype, count: int) -> bool:
    """Whether these kernels select among ``count`` values of ``dtype``: fp32, bf16 or fp16,
    positions in int32."""
    return dtype in (torch.float32, torch.bfloat16, torch.float16) and count < 2**31 - 2**16


@triton.jit
def _resolve(hist_ptr, rank, DONE: tl.constexpr, PASSES: tl.constexpr, WIDE: tl.constexpr, LAST: tl.constexpr):
    """The key's digits found by the first ``DONE`` of ``PASSES`` histogram passes (``WIDE`` bits
    each, the last ``LAST``; rows of ``2**WIDE`` bins), as one prefix, and the rank from the top,
    among the keys sharing it, of the key sought (``rank`` before any pass)."""
    # A sum, not rank.to(): a GPU launch passes an int argument equal to 1 as a constant.
    wanted = rank + tl.zeros((), tl.int64)
    prefix = tl.zeros((), tl.int64)
    for done in tl.static_range(DONE):
        if done < PASSES - 1:
            digit, wanted = _digit(tl.load(hist_ptr + done * (1 << WIDE) + tl.arange(0, 1 << WIDE)), wanted)
            prefix = (prefix << WIDE) | digit
        else:
            digit, wanted = _digit(tl.load(hist_ptr + done * (1 << WIDE) + tl.arange(0, 1 << LAST)), wanted)
            prefix = (prefix << LAST) | digit
    return prefix, wanted


@triton.jit
def _digit(counts, wanted):
    """The digit of the key of rank ``wanted`` from the top, from the ``counts`` of the digit's values
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
                      RANDOM: tl.constexpr, PASS: tl.constexpr, PASSES: tl.constexpr, WIDE: tl.constexpr,
                      LAST: tl.constexpr, BLOCK: tl.constexpr):
    """Pass ``PASS`` (one of the first ``PASSES - 1``; the count pass takes the last digit): the
    ``WIDE``-bit digit below the prefix found so far, of the keys sharing it, among every
    ``stride``-th of ``count`` values."""
    prefix, wanted = _resolve(hist_ptr, rank, PASS, PASSES, WIDE, LAST)
    shift: tl.constexpr = LAST + WIDE * (PASSES - 2 - PASS)
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    keys = _keys(bits_ptr, seed_ptr, index.to(tl.int64) * stride, valid, KEY_MASK, RANDOM)
    if PASS > 0:
        valid = valid & ((keys >> (shift + WIDE)) == prefix)
    local = tl.histogram((keys >> shift) & ((1 << WIDE) - 1), 1 << WIDE, mask=valid)
    tl.atomic_add(hist_ptr + PASS * (1 << WIDE) + tl.arange(0, 1 << WIDE), local, mask=local > 0)


@triton.jit
def _rank_within(flags):
    """Each element's count of set ``flags`` before it in a (rows, 8) block, in row-major order."""
    flags = flags.to(tl.int32)
    row_sums = tl.sum(flags, axis=1)
    row_before = tl.cumsum(row_sums, axis=0) - row_sums
    return tl.cumsum(flags, axis=1) - flags + row_before[:, None]


@triton.jit
def _count_kernel(bits_ptr, seed_ptr, hist_ptr, counts_ptr, high_ptr, low_ptr, finite_ptr, high_words, low_words,
                  zero_span, count, step, rank, KEY_MASK: tl.constexpr, RANDOM: tl.constexpr, PASSES: tl.constexpr,
                  WIDE: tl.constexpr, LAST: tl.constexpr, SAMPLED: tl.constexpr, FLAGGED: tl.constexpr,
                  BLOCK: tl.constexpr, ZEROES: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """The threshold's last digit's pass: per block, for each value the last digit may take, how
    many keys sharing the prefix found so far lie at or above it (``2**LAST`` counts), then how
    many keys lie above the prefix (1), from which the write pass reads its offsets; and the
    block's histogram of the last digit (``SAMPLED``: of the sample's keys, every ``step``-th)
    added to the global one, from which it reads the digit. The program's share of Elias-Fano's
    word streams zeroed for the write's ``atomic_or``; ``FLAGGED``, the finite flag set true, for
    the write pass (launched after it on the same stream) to clear."""
    program = tl.program_id(0)
    if FLAGGED:
        if program == 0:
            tl.store(finite_ptr, 1)
    index = program * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    keys = _keys(bits_ptr, seed_ptr, index, valid, KEY_MASK, RANDOM)
    prefix, wanted = _resolve(hist_ptr, rank, PASSES - 1, PASSES, WIDE, LAST)
    sharing = valid & ((keys >> LAST) == prefix)
    local = tl.histogram(keys & ((1 << LAST) - 1), 1 << LAST, mask=sharing)
    above = tl.sum((valid & ((keys >> LAST) > prefix)).to(tl.int32), axis=0)
    bins = tl.arange(0, 1 << LAST)
    row = counts_ptr + program * ((1 << LAST) + 1)
    tl.store(row + bins, above + tl.sum(local, axis=0) - tl.cumsum(local, axis=0) + local)
    tl.store(row + (1 << LAST), above)
    if SAMPLED:
        sampled = tl.histogram(keys & ((1 << LAST) - 1), 1 << LAST, mask=sharing & (index % step == 0))
        tl.atomic_add(hist_ptr + (PASSES - 1) * (1 << WIDE) + bins, sampled, mask=sampled > 0)
    else:
        tl.atomic_add(hist_ptr + (PASSES - 1) * (1 << WIDE) + bins, local, mask=local > 0)
    if ZEROES:
        for offset in range(0, zero_span, ZERO_BLOCK):
            word = program * zero_span + offset + tl.arange(0, ZERO_BLOCK)
            mine = word < program * zero_span + zero_span
            tl.store(high_ptr + word, tl.zeros((ZERO_BLOCK,), tl.int32), mask=mine & (word < high_words))
            tl.store(low_ptr + word, tl.zeros((ZERO_BLOCK,), tl.int32), mask=mine & (word < low_words))


@triton.jit
def _offsets_kernel(hist_ptr, counts_ptr, offsets_ptr, blocks, rank, PASSES: tl.constexpr, WIDE: tl.constexpr,
                    LAST: tl.constexpr, CHUNK: tl.constexpr):
    """Past ``SCAN`` blocks, one program: each block's keys above the threshold and equal to it in
    the blocks before its own (prefix sums of the threshold's column of the count pass's rows,
    ``CHUNK`` blocks a step), as rows ``(above, equal)``, and after the last block's row the
    totals. Only the column the threshold picks is summed: a ``torch.cumsum`` over every column
    (2**LAST + 1 of them, along the outer dimension) took 212 us of a 441 us ``smink0.9`` round
    trip of 2.4M values on an H100 (stop 50), and grows with the tensor."""
    key, wanted = _resolve(hist_ptr, rank, PASSES, PASSES, WIDE, LAST)
    at = key & ((1 << LAST) - 1)
    above_sum = tl.zeros((), tl.int32)
    equal_sum = tl.zeros((), tl.int32)
    for start in range(0, blocks, CHUNK):
        block = start + tl.arange(0, CHUNK)
        present = block < blocks
        row = counts_ptr + block.to(tl.int64) * ((1 << LAST) + 1) + at
        block_above = tl.load(row + 1, mask=present, other=0)
        block_equal = tl.load(row, mask=present, other=0) - block_above
        tl.store(offsets_ptr + block * 2, above_sum + tl.cumsum(block_above, axis=0) - block_above, mask=present)
        tl.store(offsets_ptr + block * 2 + 1, equal_sum + tl.cumsum(block_equal, axis=0) - block_equal, mask=present)
        above_sum += tl.sum(block_above, axis=0)
        equal_sum += tl.sum(block_equal, axis=0)
    tl.store(offsets_ptr + blocks * 2, above_sum)
    tl.store(offsets_ptr + blocks * 2 + 1, equal_sum)


@triton.jit
def _or_codes(words_ptr, first_bit, code, mask, WORDS: tl.constexpr, ROWS: tl.constexpr):
    """Or each ``code`` under ``mask`` in at its ``first_bit`` (int64) of a little-endian stream of
    int32 words, one ``atomic_or`` per word that a run of 32 elements reaches: the caller bounds
    those words to ``WORDS`` from the run's first. An atomic per code sent every code of a word
    to the same address one after another (Elias-Fano's high stream holds about 16 positions a
    word at 10% kept). A word's codes have disjoint bits, so their sum is their or."""
    bit = tl.reshape(first_bit, (ROWS // 4, 32))
    keep = tl.reshape(mask, (ROWS // 4, 32))
    value = tl.reshape(code, (ROWS // 4, 32)).to(tl.int64) << (bit & 31)
    word = bit >> 5
    low = value & 0xFFFFFFFF
    spill = value >> 32  # the part past its word, into the next
    first = tl.min(tl.where(keep, word, 2**62), axis=1)
    for step in tl.static_range(WORDS):
        target = first + step
        merged = tl.sum(tl.where(keep & (word == target[:, None]), low, 0)
                        + tl.where(keep & (word + 1 == target[:, None]), spill, 0), axis=1)
        tl.atomic_or(words_ptr + target, merged.to(tl.int32), mask=merged != 0)


@triton.jit
def _write_kernel(bits_ptr, seed_ptr, hist_ptr, counts_ptr, offsets_ptr, values_ptr, mask_ptr, high_ptr, low_ptr, finite_ptr,
                  count, rank, kept, blocks, KEY_MASK: tl.constexpr, RANDOM: tl.constexpr, PASSES: tl.constexpr,
                  WIDE: tl.constexpr, LAST: tl.constexpr, SAMPLED: tl.constexpr, FORM: tl.constexpr,
                  LOW_BITS: tl.constexpr, FLAGGED: tl.constexpr, INFINITY: tl.constexpr, NAN: tl.constexpr,
                  ROWS: tl.constexpr, SCAN: tl.constexpr, PREFIXED: tl.constexpr):
    """The kept values to their slots, and their positions in the form ``FORM`` (0: a bitmask
    at ``mask_ptr``, 1: Elias-Fano's int32 word streams, 2: int32 indices at ``mask_ptr``, 3:
    none); or, with ``FORM`` 4 (``random``'s decode), each element its slot's value at ``mask_ptr``.
    ``FLAGGED``: an encode clears the finite flag where its block holds a magnitude at or above
    ``INFINITY`` (inf or NaN); ``random``'s decode writes ``NAN`` everywhere where it is false."""
    program = tl.program_id(0)
    # The threshold from the histograms (the last digit's added by the count pass), then the
    # block's offsets from each block's two counts at the threshold's last digit: those of the
    # blocks before it summed here, or (``PREFIXED``, more than ``SCAN`` blocks) read off
    # :func:`_offsets_kernel`'s rows.
    key, wanted = _resolve(hist_ptr, rank, PASSES, PASSES, WIDE, LAST)
    at = key & ((1 << LAST) - 1)  # its column in the rows of 2**LAST + 1
    if PREFIXED:
        above_total = tl.load(offsets_ptr + blocks * 2)
        equal_total = tl.load(offsets_ptr + blocks * 2 + 1)
        above_before = tl.load(offsets_ptr + program * 2)
        equal_before = tl.load(offsets_ptr + program * 2 + 1)
    else:
        block = tl.arange(0, SCAN)
        present = block < blocks
        block_above = tl.load(counts_ptr + block * ((1 << LAST) + 1) + at + 1, mask=present, other=0)
        block_equal = tl.load(counts_ptr + block * ((1 << LAST) + 1) + at, mask=present, other=0) - block_above
        above_before = tl.sum(tl.where(block < program, block_above, 0), axis=0)
        equal_before = tl.sum(tl.where(block < program, block_equal, 0), axis=0)
        above_total = tl.sum(block_above, axis=0)
        equal_total = tl.sum(block_equal, axis=0)
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
        picked = tl.load(values_ptr + slot, mask=stored, other=0)
        if FLAGGED:
            picked = tl.where(tl.load(finite_ptr).to(tl.int32) != 0, picked, NAN)
        tl.store(mask_ptr + index, picked, mask=valid)
    else:
        if FLAGGED:
            if RANDOM:  # the keys are hashes: the magnitudes read for the flag alone
                magnitudes = tl.load(bits_ptr + index, mask=valid, other=0).to(tl.int32) & KEY_MASK
            else:
                magnitudes = keys
            if tl.max(tl.max((valid & (magnitudes >= INFINITY)).to(tl.int32), axis=1), axis=0) > 0:
                tl.store(finite_ptr, 0)  # every program that stores, stores the same byte
        tl.store(values_ptr + slot, tl.load(bits_ptr + index, mask=stored), mask=stored)
        # Slots no element took (smink): a zero value, and in Elias-Fano the position ``count``.
        taken = tl.minimum(above_total + tl.minimum(equal_total, ties), kept)
        is_empty = (index >= taken) & (index < kept)  # as slots
        tl.store(values_ptr + index, tl.zeros((ROWS, 8), values_ptr.dtype.element_ty), mask=is_empty)
        if FORM == 1:
            low_mask: tl.constexpr = (1 << LOW_BITS) - 1
            # A run of 32 elements reaches 3 words of the high stream (its positions' high parts
            # grow by at most 16, their slots by 32) and LOW_BITS + 2 of the low one.
            wide_index, wide_slot = index.to(tl.int64), slot.to(tl.int64)
            _or_codes(high_ptr, (wide_index >> LOW_BITS) + wide_slot, index * 0 + 1, stored, 3, ROWS)
            _or_codes(low_ptr, wide_slot * LOW_BITS, index & low_mask, stored, LOW_BITS + 2, ROWS)
            if SAMPLED:  # only smink leaves slots empty: mink and dropit fill all ``kept``
                _or_codes(high_ptr, (count >> LOW_BITS) + wide_index, index * 0 + 1, is_empty, 3, ROWS)
                _or_codes(low_ptr, wide_index * LOW_BITS, (index * 0 + count) & low_mask, is_empty, LOW_BITS + 2,
                          ROWS)
        elif FORM == 2:
            tl.store(mask_ptr + slot, index, mask=stored)
            tl.store(mask_ptr + index, tl.zeros((ROWS, 8), tl.int32), mask=is_empty)
        elif FORM == 0:
            byte = tl.sum(tl.where(stored, 1 << column[None, :], 0), axis=1)
            tl.store(mask_ptr + program * ROWS + row, byte.to(tl.uint8), mask=(program * ROWS + row) * 8 < count)


def encode(flat: torch.Tensor, kept: int, low_bits: int | None, sampled: tuple[int, int] | None = None,
           indices: bool = False, finite: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The kept values of contiguous 1-D ``flat`` (``kept`` of its ``count`` values, ``0 < kept
    < count``, see :func:`takes`) in position order, and their positions: int32 indices where
    ``indices``, a bitmask where ``low_bits`` is None, else Elias-Fano's high and low streams with
    ``low_bits`` low bits. The threshold is the ``kept``-th largest key (``mink``), or with
    ``sampled = (step, rank)`` the ``rank``-th largest of every ``step``-th key (``smink``).
    Where ``finite`` (a 0-d bool) is given, it is written: whether every value of ``flat`` is finite."""
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
    _select(flat, None, kept, sampled, form, values, mask, high, low, low_bits or 1, finite)
    return values, saved


def encode_random(flat: torch.Tensor, kept: int, seed: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
    """``random``'s kept values of contiguous 1-D ``flat`` (``0 < kept < count``): those with the
    ``kept`` largest 16-bit keys of (position, ``seed``), ties by position, in position order;
    ``finite`` written as :func:`encode` writes it."""
    values = torch.empty(kept, dtype=flat.dtype, device=flat.device)
    _select(flat, seed, kept, None, 3, values, values, values, values, 1, finite)
    return values


def decode_random(values: torch.Tensor, seed: torch.Tensor, count: int, finite: torch.Tensor | None = None) -> torch.Tensor:
    """The ``count`` values :func:`encode_random` kept, +0 elsewhere (NaN everywhere where
    ``finite`` is given and false): the keys and their threshold recomputed from ``seed``."""
    out = torch.empty(count, dtype=values.dtype, device=values.device)
    _select(out, seed, values.numel(), None, 4, values, out, out, out, 1, finite)
    return out


def _select(flat: torch.Tensor, seed: torch.Tensor | None, kept: int, sampled: tuple[int, int] | None, form: int,
            values: torch.Tensor, mask: torch.Tensor, high: torch.Tensor, low: torch.Tensor, low_bits: int,
            finite: torch.Tensor | None) -> None:
    """The launches of a selection (see :func:`_write_kernel` for ``form``): a histogram pass per
    digit of the keys but the last (:data:`_DIGITS`), a count pass, which takes the last digit
    (zeroes Elias-Fano's ``high`` and ``low`` and sets ``finite`` true), and the write pass
    (which clears ``finite`` on inf or NaN, or in ``random``'s decode applies it)."""
    count = flat.numel()
    device = flat.device
    bits = flat.view(_BITS[flat.element_size()])
    integers = values.view(bits.dtype)
    random = seed is not None
    key_mask = 2 ** (8 * flat.element_size() - 1) - 1
    passes, wide, last = _DIGITS[2 if random else flat.element_size()]
    step, rank = sampled or (1, kept)
    selected = -(-count // step)
    histograms = torch.zeros(passes, 2**wide, dtype=torch.int32, device=device)
    blocks = cdiv(count, ROWS * 8)
    counts = torch.empty(blocks, 2**last + 1, dtype=torch.int32, device=device)
    words = high.numel() + low.numel() if form == 1 else 0
    seed = bits if seed is None else seed
    mask = mask.view(integers.dtype) if form == 4 else mask
    flag = bits if finite is None else finite
    with device_guard(flat):
        for index in range(passes - 1):
            launch(_histogram_kernel, (cdiv(selected, HISTOGRAM_BLOCK),), bits, seed, histograms, selected,
                   step, rank, KEY_MASK=key_mask, RANDOM=random, PASS=index, PASSES=passes, WIDE=wide, LAST=last,
                   BLOCK=HISTOGRAM_BLOCK)
        launch(_count_kernel, (blocks,), bits, seed, histograms, counts, high, low, flag, high.numel(), low.numel(),
               -(-words // blocks), count, step, rank, KEY_MASK=key_mask, RANDOM=random, PASSES=passes, WIDE=wide,
               LAST=last, SAMPLED=sampled is not None, FLAGGED=finite is not None and form != 4, BLOCK=ROWS * 8,
               ZEROES=words > 0, ZERO_BLOCK=_ZERO_BLOCK)
        offsets = counts
        if blocks > _SCAN:
            offsets = torch.empty(blocks + 1, 2, dtype=torch.int32, device=device)
            launch(_offsets_kernel, (1,), histograms, counts, offsets, blocks, rank, PASSES=passes, WIDE=wide,
                   LAST=last, CHUNK=_OFFSETS_CHUNK)
        launch(_write_kernel, (blocks,), bits, seed, histograms, counts, offsets, integers, mask, high, low, flag,
               count, rank, kept, blocks, KEY_MASK=key_mask, RANDOM=random, PASSES=passes, WIDE=wide, LAST=last,
               SAMPLED=sampled is not None, FORM=form, LOW_BITS=low_bits, FLAGGED=finite is not None,
               INFINITY=_INFINITY[flat.dtype], NAN=_NAN[flat.dtype], ROWS=ROWS, SCAN=_SCAN, PREFIXED=blocks > _SCAN)


@triton.jit
def _blocks_before(counts_ptr, cumulative_ptr, program, SCAN: tl.constexpr, PREFIXED: tl.constexpr):
    """The sum of the first ``program`` int32 counts, a block's offset: summed here from at most
    ``SCAN`` counts, or (``PREFIXED``) read off their prefix sums."""
    if PREFIXED:
        before = tl.load(cumulative_ptr + program) - tl.load(counts_ptr + program)
    else:
        block = tl.arange(0, SCAN)
        before = tl.sum(tl.load(counts_ptr + block, mask=block < program, other=0), axis=0)
    return before


@triton.jit
def _fill(out_ptr, index, mask, finite_ptr, FLAGGED: tl.constexpr, NAN: tl.constexpr):
    """+0 at ``index`` of the int view ``out_ptr`` (``mask``), or ``NAN`` where the finite flag is false."""
    fill = tl.zeros(index.shape, out_ptr.dtype.element_ty)
    if FLAGGED:
        fill = tl.where(tl.load(finite_ptr).to(tl.int32) != 0, fill, NAN).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + index, fill, mask=mask)


@triton.jit
def _fill_kernel(out_ptr, finite_ptr, count, FLAGGED: tl.constexpr, NAN: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_fill` of ``count`` elements, a block a program."""
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _fill(out_ptr, index, index < count, finite_ptr, FLAGGED, NAN)


@triton.jit
def _popcount_kernel(packed_ptr, counts_ptr, out_ptr, finite_ptr, length, count, fill_span, FILLS: tl.constexpr,
                     FLAGGED: tl.constexpr, NAN: tl.constexpr, ROWS: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """The set bits of each block of ``ROWS`` bytes of a bit stream of ``length`` bits; ``FILLS``
    (Elias-Fano, which scatters), the program's ``fill_span`` of the ``count`` outputs filled
    (:func:`_fill`) for the scatter launched after it."""
    program = tl.program_id(0)
    row = tl.arange(0, ROWS)
    column = tl.arange(0, 8)
    bit = program * ROWS * 8 + row[:, None] * 8 + column[None, :]
    byte = tl.load(packed_ptr + program * ROWS + row, mask=(program * ROWS + row) * 8 < length, other=0)
    set_bits = (byte.to(tl.int32)[:, None] >> column[None, :]) & 1
    tl.store(counts_ptr + program, tl.sum(tl.sum(tl.where(bit < length, set_bits, 0), axis=1), axis=0))
    if FILLS:
        for offset in range(0, fill_span, FILL_BLOCK):
            index = program * fill_span + offset + tl.arange(0, FILL_BLOCK)
            _fill(out_ptr, index, (index < program * fill_span + fill_span) & (index < count), finite_ptr, FLAGGED, NAN)


@triton.jit
def _expand_kernel(packed_ptr, counts_ptr, cumulative_ptr, values_ptr, out_ptr, finite_ptr, count, kept,
                   FLAGGED: tl.constexpr, NAN: tl.constexpr, ROWS: tl.constexpr, SCAN: tl.constexpr,
                   PREFIXED: tl.constexpr):
    """Bitmask: each element its slot's value where its bit is set, else +0 (``FLAGGED``: NaN
    everywhere where the finite flag is false)."""
    program = tl.program_id(0)
    row = tl.arange(0, ROWS)
    column = tl.arange(0, 8)
    index = program * ROWS * 8 + row[:, None] * 8 + column[None, :]
    valid = index < count
    byte = tl.load(packed_ptr + program * ROWS + row, mask=(program * ROWS + row) * 8 < count, other=0)
    is_kept = valid & (((byte.to(tl.int32)[:, None] >> column[None, :]) & 1) != 0)
    slot = _blocks_before(counts_ptr, cumulative_ptr, program, SCAN, PREFIXED) + _rank_within(is_kept)
    picked = tl.load(values_ptr + slot, mask=is_kept & (slot < kept), other=0)
    if FLAGGED:
        picked = tl.where(tl.load(finite_ptr).to(tl.int32) != 0, picked, NAN)
    tl.store(out_ptr + index, picked, mask=valid)


@triton.jit
def _elias_fano_kernel(high_ptr, low_ptr, counts_ptr, cumulative_ptr, values_ptr, out_ptr, finite_ptr, count, kept,
                       length, low_length, LOW_BITS: tl.constexpr, FLAGGED: tl.constexpr, ROWS: tl.constexpr,
                       SCAN: tl.constexpr, PREFIXED: tl.constexpr):
    """Elias-Fano: set bit ``i`` of the high stream is slot ``j``'s (its rank among the set
    bits); its value goes to ``((i - j) << LOW_BITS) | low code j`` (``count``: an empty slot),
    over the output the popcount pass filled (none where the finite flag is false: NaN there)."""
    program = tl.program_id(0)
    row = tl.arange(0, ROWS)
    column = tl.arange(0, 8)
    bit = program * ROWS * 8 + row[:, None] * 8 + column[None, :]
    byte = tl.load(high_ptr + program * ROWS + row, mask=(program * ROWS + row) * 8 < length, other=0)
    is_set = (bit < length) & (((byte.to(tl.int32)[:, None] >> column[None, :]) & 1) != 0)
    slot = _blocks_before(counts_ptr, cumulative_ptr, program, SCAN, PREFIXED) + _rank_within(is_set)
    is_set = is_set & (slot < kept)
    if FLAGGED:
        is_set = is_set & (tl.load(finite_ptr).to(tl.int32) != 0)
    first = slot * LOW_BITS
    pair = tl.load(low_ptr + (first >> 3), mask=is_set, other=0).to(tl.int32)
    pair = pair | (tl.load(low_ptr + (first >> 3) + 1, mask=is_set & ((first >> 3) + 1 < low_length),
                           other=0).to(tl.int32) << 8)
    position = ((bit - slot) << LOW_BITS) | ((pair >> (first & 7)) & ((1 << LOW_BITS) - 1))
    is_set = is_set & (position < count)
    tl.store(out_ptr + position, tl.load(values_ptr + slot, mask=is_set, other=0), mask=is_set)


@triton.jit
def _indices_kernel(index_ptr, values_ptr, out_ptr, finite_ptr, kept, FLAGGED: tl.constexpr, BLOCK: tl.constexpr):
    """Indices: each slot's value to its position (none where the finite flag is false)."""
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = slot < kept
    if FLAGGED:
        valid = valid & (tl.load(finite_ptr).to(tl.int32) != 0)
    position = tl.load(index_ptr + slot, mask=valid, other=0)
    tl.store(out_ptr + position, tl.load(values_ptr + slot, mask=valid, other=0), mask=valid)


def decode_indices(values: torch.Tensor, index: torch.Tensor, count: int,
                   finite: torch.Tensor | None = None) -> torch.Tensor:
    """The ``count`` values :func:`encode` kept with ``indices``, +0 elsewhere (NaN everywhere
    where ``finite`` is given and false): two launches, a fill and a scatter."""
    out = torch.empty(count, dtype=values.dtype, device=values.device)
    integers = values.view(_BITS[values.element_size()])
    flagged = finite is not None
    with device_guard(values):
        launch(_fill_kernel, (cdiv(count, DECODE_ROWS * 8),), out.view(integers.dtype),
               finite if flagged else out, count, FLAGGED=flagged, NAN=_NAN[values.dtype], BLOCK=DECODE_ROWS * 8)
        launch(_indices_kernel, (cdiv(values.numel(), DECODE_ROWS * 8),), index, integers,
               out.view(integers.dtype), finite if flagged else out, values.numel(), FLAGGED=flagged,
               BLOCK=DECODE_ROWS * 8)
    return out


def decode(values: torch.Tensor, saved: tuple[torch.Tensor, ...], count: int, low_bits: int | None,
           finite: torch.Tensor | None = None) -> torch.Tensor:
    """The ``count`` values :func:`encode` kept, +0 elsewhere, as a 1-D tensor of the values'
    dtype; NaN everywhere where ``finite`` (a 0-d bool) is given and false. Two launches."""
    kept = values.numel()
    integers = values.view(_BITS[values.element_size()])
    out = torch.empty(count, dtype=values.dtype, device=values.device)
    if low_bits is None:
        (packed,) = saved
        length = count
    else:
        packed, low = saved
        length = kept + (count >> low_bits) + 1
    blocks = cdiv(length, DECODE_ROWS * 8)
    counts = torch.empty(blocks, dtype=torch.int32, device=values.device)
    flagged = finite is not None
    flag = finite if flagged else counts
    with device_guard(values):
        launch(_popcount_kernel, (blocks,), packed, counts, out.view(integers.dtype), flag, length, count,
               -(-count // blocks), FILLS=low_bits is not None, FLAGGED=flagged, NAN=_NAN[values.dtype],
               ROWS=DECODE_ROWS, FILL_BLOCK=_ZERO_BLOCK)
        cumulative = torch.cumsum(counts, 0, dtype=torch.int32) if blocks > _SCAN else counts
        if low_bits is None:
            launch(_expand_kernel, (blocks,), packed, counts, cumulative, integers, out.view(integers.dtype), flag, count,
                   kept, FLAGGED=flagged, NAN=_NAN[values.dtype], ROWS=DECODE_ROWS, SCAN=_SCAN, PREFIXED=blocks > _SCAN)
        else:
            launch(_elias_fano_kernel, (blocks,), packed, low, counts, cumulative, integers, out.view(integers.dtype),
                   flag, count, kept, length, low.numel(), LOW_BITS=low_bits, FLAGGED=flagged, ROWS=DECODE_ROWS,
                   SCAN=_SCAN, PREFIXED=blocks > _SCAN)
    return out
