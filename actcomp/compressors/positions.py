"""Compact storage of *which* elements a sparsifier kept.

For ``k`` kept positions out of ``n`` each tensor gets the cheapest of:

===========  ==================================================  ==========================
encoding     stored                                              bytes
===========  ==================================================  ==========================
``dense``    nothing (every element kept)                        0
``bitmask``  1 bit per element                                   ceil(n / 8)
``rice``     the gaps between kept positions, Golomb-Rice coded  ceil(k r / 8) + ceil(u / 8)
             with ``r`` low bits each plus a unary high part
             (``u`` = k + sum(gap >> r) bits), ``r`` chosen per
             tensor
===========  ==================================================  ==========================

16-bit block offsets and 32-bit indices are not offered: Rice coding with ``r = 15`` or
``r = 31`` already costs about what they do (16 or 32 bits per position, plus one bit per
2**r of gap), and the chosen ``r`` is the cheapest. At DropIT's 90% drop rate Rice needs
about 0.5 bit per element, half a bitmask. Never int64. Everything is vectorized:
cumulative sums undo the gaps, no per-element Python.

>>> import torch
>>> index = torch.tensor([3, 40, 41, 97])
>>> saved, meta = encode_positions(index, 100)
>>> meta, sum(t.numel() for t in saved)  # gaps 3, 36, 0, 55 with r = 4: 16 + 9 bits
(('rice', 100, 4, 4, 9), 4)
>>> scatter_kept(torch.tensor([1.0, 2.0, 3.0, 4.0]), saved, meta).nonzero().view(-1).tolist()
[3, 40, 41, 97]
"""

from __future__ import annotations

import math

import torch

from actcomp.compressors.bitpack import pack_bits, packed_size, unpack_bits


def rice_bits(gaps: torch.Tensor, low_bits: int) -> int:
    """Total bits of Rice-coding ``gaps`` with ``low_bits`` low bits each."""
    return gaps.numel() * (low_bits + 1) + int((gaps >> low_bits).sum())


def best_rice_parameter(gaps: torch.Tensor) -> int:
    """The ``r`` minimizing :func:`rice_bits`; the optimum is near log2(mean gap * ln 2)."""
    mean = float(gaps.float().mean()) if gaps.numel() else 0.0
    guess = max(0, math.floor(math.log2(mean * math.log(2)))) if mean > 1 else 0
    candidates = [r for r in (guess - 1, guess, guess + 1, guess + 2) if 0 <= r <= 40]
    return min(candidates, key=lambda r: rice_bits(gaps, r))


def encode_positions(index: torch.Tensor, count: int) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """Encode sorted, distinct flat positions ``index`` among ``count``; returns (tensors, meta)."""
    kept = index.numel()
    if kept == count:
        return (), ("dense", count, kept)
    gaps = torch.diff(index, prepend=index.new_full((1,), -1)) - 1
    low_bits = best_rice_parameter(gaps)
    high = gaps >> low_bits
    unary_length = kept + int(high.sum())
    rice_bytes = packed_size(kept * low_bits, 1) + packed_size(unary_length, 1)
    if packed_size(count, 1) <= rice_bytes:
        mask = torch.zeros(count, dtype=torch.bool, device=index.device)
        mask[index] = True
        return (pack_bits(mask),), ("bitmask", count, kept)
    # Unary part: each gap's high part as that many 0 bits, then a 1.
    unary = torch.zeros(unary_length, dtype=torch.bool, device=index.device)
    unary[torch.cumsum(high + 1, 0) - 1] = True
    low = _bits_of(gaps, low_bits)
    return (pack_bits(unary), pack_bits(low)), ("rice", count, kept, low_bits, unary_length)


def decode_positions(saved: tuple[torch.Tensor, ...], meta: tuple) -> torch.Tensor:
    """The sorted flat positions :func:`encode_positions` was given (not for ``dense``)."""
    encoding, count, kept = meta[:3]
    if encoding == "bitmask":
        return unpack_bits(saved[0], count).nonzero().view(-1)
    _, _, _, low_bits, unary_length = meta
    ones = unpack_bits(saved[0], unary_length).nonzero().view(-1)
    high = torch.diff(ones, prepend=ones.new_full((1,), -1)) - 1
    shifts = torch.arange(low_bits, device=ones.device)
    low = (unpack_bits(saved[1], kept * low_bits).view(kept, low_bits).long() << shifts).sum(1)
    return torch.cumsum(((high << low_bits) | low) + 1, 0) - 1


def scatter_kept(values: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: tuple) -> torch.Tensor:
    """Place kept ``values`` (ascending position order) into a flat zero tensor."""
    encoding, count = meta[:2]
    if encoding == "dense":
        return values
    out = values.new_zeros(count)
    if encoding == "bitmask":
        return out.masked_scatter_(unpack_bits(saved[0], count), values)
    return out.index_put_((decode_positions(saved, meta),), values)


def _bits_of(values: torch.Tensor, width: int) -> torch.Tensor:
    """The low ``width`` bits of each value, least significant first, flattened."""
    shifts = torch.arange(width, device=values.device)
    return ((values.unsqueeze(1) >> shifts) & 1).view(-1).bool()
