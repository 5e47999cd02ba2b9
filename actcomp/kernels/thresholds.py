"""Thresholds for min-k selection, as tensor functions: no sort, no read back to Python.

A magnitude's *key* is its bit pattern with the sign bit cleared, read as an integer of the
same width (int16 for fp16 and bf16, int32 for fp32, int64 for fp64): finite magnitudes order
as their keys do, so selecting on keys selects on ``|x|`` without an fp32 copy. A
:class:`Threshold` is a key and a tie count (0-d tensors on the data's device): keep every key
above it and the first ``ties`` keys equal to it, in position order (:class:`ThresholdSelector`).

- :func:`exact_threshold` finds the ``kept``-th largest key by radix select, 16 bits a pass
  (one pass for 2-byte floats, two for fp32, four for fp64): each pass counts, a chunk at a
  time, the keys that share the prefix found so far into a 65,536-bin histogram. Temporaries
  are a chunk's, the time a few reads of the tensor whatever its values.
- :func:`sampled_threshold` takes the key from an evenly spaced sample, for the one-pass
  ``smink`` stage, and counts once what lies above it.

>>> import torch
>>> x = torch.randn(10**5)
>>> t = exact_threshold(x, 10_000)
>>> int((magnitude_keys(x) > t.key).sum() + t.ties)
10000
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from actcomp.kernels import eager_cpu
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.noise import lowbias32_

SAMPLE = 2**16
# How far (in standard deviations of a sample quantile) smink raises its threshold above the
# sample's estimate, so that more than its capacity lies above it only once in ~30,000 calls.
_MARGIN_SIGMAS = 4.0
_DIGIT_BITS = 16
_KEY_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# Keys of random selection (see random_keys).
RANDOM_KEY_BITS = 16


class Threshold(NamedTuple):
    """Keep every key ``> key`` and the first ``ties`` keys ``== key`` (both 0-d tensors)."""

    key: torch.Tensor
    ties: torch.Tensor


def kept_count(count: int, drop_rate: float) -> int:
    """How many of ``count`` elements a drop rate keeps: ``ceil((1 - rate) count)`` with the rate
    read as the decimal it prints as (as :func:`~actcomp.core.codec.drop_count`), at least one
    of a non-empty tensor; integer arithmetic, so a symbolic count traces under torch.compile.

    >>> kept_count(100, 0.29), kept_count(10, 0.95), kept_count(10**8, 0.29), kept_count(0, 0.5)
    (71, 1, 71000000, 0)
    """
    numerator, denominator = _decimal_ratio(drop_rate)
    return count - min(numerator * count // denominator, max(count - 1, 0))


def _decimal_ratio(rate: float) -> tuple[int, int]:
    """The shortest decimal fraction that reads back as ``rate``, as ``(numerator, 10**digits)``."""
    denominator = 1
    while round(rate * denominator) / denominator != rate:
        denominator *= 10
    return round(rate * denominator), denominator


def key_bits(dtype: torch.dtype) -> int:
    """Bits of a magnitude key of ``dtype``: all but the sign."""
    return 8 * dtype.itemsize - 1


def magnitude_keys(values: torch.Tensor) -> torch.Tensor:
    """``|values|`` as integer keys of the same width (see the module docstring)."""
    keys = values.view(_KEY_DTYPES[values.element_size()])
    return keys & (2 ** key_bits(values.dtype) - 1)


def random_keys(seed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """16-bit keys of flat positions ``start`` to ``stop``: the top half of lowbias32 of
    (position xor ``seed``, a 1-element int64 tensor below 2**31), the same in eager and
    compiled code. 16 bits make radix select one pass; the share of elements tied at the
    threshold, broken by position, is then about 2**-16.

    >>> seed = torch.tensor([7])
    >>> torch.equal(random_keys(seed, 0, 10)[4:], random_keys(seed, 4, 10))
    True
    """
    # int32 lanes where positions fit (int64 ones are twice the bytes and slower); both give
    # the same bits. Positions past 2**32 fold their high half in.
    dtype = torch.int32 if stop <= 2**31 else torch.int64
    position = torch.arange(start, stop, dtype=dtype, device=seed.device)
    if dtype == torch.int64:
        position = (position ^ (position >> 32)) & (2**32 - 1)
    hashed = lowbias32_(position ^ seed.to(dtype))
    return (hashed >> 16) & 0xFFFF


def select_threshold(keys_of: Callable[[int, int], torch.Tensor], count: int, kept: int, bits: int,
                     device: torch.device) -> Threshold:
    """The :class:`Threshold` keeping ``kept`` (1 to ``count``) of ``count`` non-negative keys of
    ``bits`` bits, which ``keys_of(start, stop)`` gives a chunk at a time: radix select."""
    prefix = torch.zeros((), dtype=torch.int64, device=device)  # the key's leading bits found so far
    # The rank from the top, among the keys sharing the prefix, of the key sought.
    wanted = torch.full((), kept, dtype=torch.int64, device=device)
    # Chunks of the values' length: a histogram pass holds one int32 or int64 temporary per
    # key, and a chunk's fixed cost (a 65,536-bin count) is paid once per 2**18 keys.
    length = aligned_length(device, count)
    shift = bits
    while shift > 0:
        width = min(_DIGIT_BITS, shift)
        shift -= width
        first = shift + width == bits  # every key shares the empty prefix
        histogram = torch.zeros(2**width + (0 if first else 2), dtype=torch.int64, device=device)
        for start, stop in spans(count, length):
            leading = keys_of(start, stop) >> shift
            # After the first digit, keys below the prefix land in bin 0, those above it in the
            # last bin, and digit d of the prefix's keys in bin d + 1.
            bins = leading if first else (leading - (prefix << width)).clamp_(-1, 2**width) + 1
            histogram += _bin_counts(bins, histogram.numel())
        counts = histogram if first else histogram[1:-1]
        at_or_above = counts.flip(0).cumsum(0).flip(0)  # non-increasing in the digit
        digit = (at_or_above >= wanted).sum() - 1
        # Above the digit found: the largest count that falls short (no read of one element,
        # which would be a host read under torch.compile).
        wanted = wanted - torch.where(at_or_above < wanted, at_or_above, 0).max()
        prefix = (prefix << width) | digit
    return Threshold(prefix, wanted)


def _bin_counts(bins: torch.Tensor, size: int) -> torch.Tensor:
    """How many of ``bins`` (integers in ``[0, size)``) fall in each of ``size`` bins."""
    if not eager_cpu.applies(bins) or torch.compiler.is_compiling():
        # bincount's length depends on the largest bin (data) unless it is at most minlength:
        # compiled, that is a data-dependent shape; on a GPU, a read of that bin back to the
        # host (the first GPU run caught it: tests/core/test_cuda_sync.py). Integer sums are exact
        # in any order, so the atomics behind index_add_ change nothing.
        counts = torch.zeros(size, dtype=torch.int64, device=bins.device)
        return counts.index_add_(0, bins.long(), torch.ones_like(bins, dtype=torch.int64))
    # Eager on the CPU, where reading the largest bin back stalls nothing: bincount is a plain
    # counting loop, several times faster than index_add_.
    return torch.bincount(bins, minlength=size)


def exact_threshold(flat: torch.Tensor, kept: int) -> Threshold:
    """The threshold keeping exactly ``kept`` (1 to numel) elements of ``flat`` (1-D, finite):
    the largest magnitudes, ties kept in position order."""
    return select_threshold(lambda start, stop: magnitude_keys(flat[start:stop]), flat.numel(), kept,
                            key_bits(flat.dtype), flat.device)


def sampled_threshold(flat: torch.Tensor, kept: int, size: int = SAMPLE) -> Threshold:
    """A threshold keeping at most ``kept`` elements of ``flat``, its key estimated from a sample
    of about ``size`` and raised by 4 standard deviations of a sample quantile; ties fill what
    the elements above it leave of ``kept``, none when the key is zero (dropping a zero loses
    nothing). One pass counts the elements above the key."""
    count = flat.numel()
    sample = magnitude_keys(sample_of(flat, size))
    rank = sampled_rank(count, kept, sample.numel())
    key = torch.topk(sample, rank, sorted=False).values.min().long()
    above = torch.zeros((), dtype=torch.int64, device=flat.device)
    # Chunks of the values' length: a chunk's temporaries are a key and a bool per element
    # (count_nonzero: a bool sum would first cast the mask to int64).
    for start, stop in spans(count, aligned_length(flat.device, count)):
        above += (magnitude_keys(flat[start:stop]) > key).count_nonzero()
    ties = torch.where(key > 0, (kept - above).clamp(min=0), 0)
    return Threshold(key, ties)


def sampled_rank(count: int, kept: int, sampled: int) -> int:
    """The rank from the top, in a sample of ``sampled`` of ``count`` keys, of
    :func:`sampled_threshold`'s key: the kept share less 4 standard deviations of a sample
    quantile, so that more than ``kept`` lie above it only about once in 30,000 tensors.

    >>> sampled_rank(10**6, 10**5, 65536)
    6246
    """
    share = kept / count
    margin = _MARGIN_SIGMAS * math.sqrt(share * (1 - share) * sampled)
    return min(max(math.floor(share * sampled - margin), 1), sampled)


def sample_of(flat: torch.Tensor, size: int = SAMPLE) -> torch.Tensor:
    """About ``size`` evenly spaced elements of ``flat`` (all of them when fewer). The stride is
    odd and not a multiple of 3, 5 or 7, so the sample does not alias with channel or token
    periods (384 = 2**7 3, 3136 = 2**6 7**2)."""
    return flat[::sample_step(flat.numel(), size)]


def sample_step(count: int, size: int = SAMPLE, round_up: bool = False) -> int:
    """The stride of :func:`sample_of` among ``count`` elements: ``count // size`` moved to the
    nearest stride with no factor 2, 3, 5 or 7, down (the sample's size, smink's codes depend
    on it), or ``round_up`` (at most about ``size`` elements: rounding down falls to 1, the
    whole tensor, anywhere below 11 ``size``).

    >>> sample_step(10**6), sample_step(100), sample_step(302_592), sample_step(302_592, round_up=True)
    (13, 1, 1, 11)
    """
    step = max(1, count // size)
    while step > 1 and any(step % p == 0 for p in (2, 3, 5, 7)):
        step += 1 if round_up else -1
    return step


class ThresholdSelector:
    """What to keep of consecutive chunks of keys under ``threshold``: a bool mask per chunk,
    the ties counted on across chunks.

    >>> select = ThresholdSelector(Threshold(torch.tensor(2), torch.tensor(1)))
    >>> select(torch.tensor([2, 3, 1])).tolist(), select(torch.tensor([2, 5])).tolist()
    ([True, True, False], [False, True])
    """

    def __init__(self, threshold: Threshold):
        self.threshold = threshold
        self.tied = torch.zeros((), dtype=torch.int64, device=threshold.key.device)

    def __call__(self, keys: torch.Tensor) -> torch.Tensor:
        key, ties = self.threshold
        equal = keys == key
        tie_rank = torch.cumsum(equal, 0) + self.tied
        self.tied = tie_rank[-1]
        return (keys > key) | (equal & (tie_rank <= ties))
