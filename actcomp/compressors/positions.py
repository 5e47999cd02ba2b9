"""Compact storage of *which* elements a sparsifier kept.

For ``k`` kept positions out of ``n`` each tensor gets the cheapest of:

============  ==========================================  ======================
encoding      stored                                      bytes
============  ==========================================  ======================
``dense``     nothing (every element kept)                0
``bitmask``   1 bit per element                           ceil(n / 8)
``offsets``   uint16 offset inside 2**16-element blocks,  2 k + 4 ceil(n / 2**16)
              plus an int32 count per block
``index32``   int32 flat index                            4 k
============  ==========================================  ======================

Never int64. Kept values are always stored in ascending position order, so every encoding
decodes to the same boolean mask.

>>> import torch
>>> mask = torch.tensor([True, False, False, True])
>>> saved, meta = encode_positions(mask)
>>> meta, scatter_kept(torch.tensor([5.0, 7.0]), saved, meta).tolist()
(('bitmask', 4, 2), [5.0, 0.0, 0.0, 7.0])
"""

from __future__ import annotations

import torch

from actcomp.compressors.bitpack import pack_bits, packed_size, unpack_bits

_BLOCK_BITS = 16
_BLOCK = 1 << _BLOCK_BITS


def encoding_costs(count: int, kept: int) -> dict[str, int]:
    """Bytes each encoding would store for ``kept`` of ``count`` positions."""
    if kept == count:
        return {"dense": 0}
    costs = {
        "bitmask": packed_size(count, 1),
        "offsets": 2 * kept + 4 * -(-count // _BLOCK),
    }
    if count < 2**31:
        costs["index32"] = 4 * kept
    return costs


def cheapest_encoding(count: int, kept: int) -> str:
    costs = encoding_costs(count, kept)
    return min(costs, key=costs.__getitem__)


def encode_positions(mask: torch.Tensor, kept: int | None = None) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """Encode a flat bool mask; returns (saved tensors, metadata). ``kept`` avoids a sync."""
    count = mask.numel()
    if kept is None:
        kept = int(mask.sum())
    encoding = cheapest_encoding(count, kept)
    meta = (encoding, count, kept)
    if encoding == "dense":
        return (), meta
    if encoding == "bitmask":
        return (pack_bits(mask),), meta
    index = mask.nonzero().view(-1)
    if encoding == "index32":
        return (index.to(torch.int32),), meta
    # uint16 offsets are stored as int16 bits: the cast wraps, decode masks it back.
    offsets = (index & (_BLOCK - 1)).to(torch.int16)
    counts = torch.bincount(index >> _BLOCK_BITS, minlength=-(-count // _BLOCK)).to(torch.int32)
    return (offsets, counts), meta


def scatter_kept(values: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: tuple) -> torch.Tensor:
    """Place kept ``values`` (ascending position order) into a flat zero tensor."""
    encoding, count, kept = meta
    if encoding == "dense":
        return values
    out = values.new_zeros(count)
    if encoding == "bitmask":
        return out.masked_scatter_(unpack_bits(saved[0], count), values)
    if encoding == "index32":
        index = saved[0].long()
    else:
        offsets, counts = saved
        blocks = torch.arange(counts.numel(), device=values.device)
        blocks = torch.repeat_interleave(blocks, counts.long(), output_size=kept)
        index = (blocks << _BLOCK_BITS) | (offsets.long() & (_BLOCK - 1))
    out[index] = values
    return out
