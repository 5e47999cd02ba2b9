"""Packing of small unsigned codes (1 to 8 bits) into uint8 bytes.

Codes are packed little-end first: code ``j`` of a byte sits at bits ``[j*bits, (j+1)*bits)``.
Widths that do not divide 8 (3, 5, 6, 7) pack each run of 8 codes into ``bits`` bytes, read
as one little-endian integer with code ``j`` at bits ``[j*bits, (j+1)*bits)``.

>>> import torch
>>> codes = torch.tensor([1, 2, 3, 0, 1], dtype=torch.uint8)
>>> packed = pack_codes(codes, bits=2)
>>> packed.numel(), unpack_codes(packed, bits=2, count=5).tolist()
(2, [1, 2, 3, 0, 1])
"""

from __future__ import annotations

import torch

# Multiplying eight 0/1 bytes (read as one little-endian int64) by this constant gathers
# their bits into the top byte without carries: byte i lands on bit 56 + i.
_GATHER_BITS = 0x0102040810204080


def packed_size(count: int, bits: int) -> int:
    """Bytes needed for ``count`` codes of ``bits`` bits."""
    return (count * bits + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor into ceil(n / 8) bytes (1 bit per element)."""
    count = mask.numel()
    padded = pad_to_multiple(mask.view(torch.uint8), 8)
    words = padded.view(torch.int64)
    return ((words * _GATHER_BITS) >> 56).to(torch.uint8)[: packed_size(count, 1)]


# Unpacking spreads a byte into the eight bytes of an int64, keeps bit i in byte i, and turns
# each non-zero byte into 1 (adding 0x7F sets its top bit without a carry into the next byte):
# four operations on one word per 8 elements, instead of eight shifts per byte.
_SPREAD = 0x0101010101010101
_PICK = 0x8040201008040201 - 2**64  # as a signed int64
_NON_ZERO = 0x7F7F7F7F7F7F7F7F


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a flat bool tensor of ``count`` elements."""
    words = packed.to(torch.int64) * _SPREAD
    words &= _PICK
    words += _NON_ZERO
    words >>= 7
    words &= _SPREAD
    # A compare, not a bitcast view as bool: inductor cannot vectorize the cast of such a view.
    return words.view(torch.uint8)[:count] != 0


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack flat uint8 codes in [0, 2**bits) into ``packed_size(n, bits)`` bytes."""
    if bits == 8:
        return codes
    if bits == 1:
        return pack_bits(codes.bool())
    if 8 % bits:
        return _pack_runs(codes, bits)
    per_byte = 8 // bits
    grouped = pad_to_multiple(codes, per_byte).view(-1, per_byte)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    # Fields do not overlap, so a sum is a bitwise or.
    return (grouped << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`."""
    if bits == 8:
        return packed[:count]
    if bits == 1:
        return unpack_bits(packed, count).to(torch.uint8)
    if 8 % bits:
        return _unpack_runs(packed, bits, count)
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).view(-1)[:count]


def pad_to_multiple(flat: torch.Tensor, multiple: int) -> torch.Tensor:
    """``flat`` (1-D) with zeros after it up to a multiple of ``multiple`` elements.

    >>> pad_to_multiple(torch.tensor([1, 2, 3]), 4).tolist()
    [1, 2, 3, 0]
    """
    count = flat.numel()
    extra = -count % multiple
    if torch.compiler.is_compiling():
        # Compiled code pads always (maybe with nothing), by a gather: a branch on the
        # remainder, or a cat that skips an empty piece, would guard on it and compile one
        # graph for sizes that divide and another for those that do not. Not F.pad: in an int8
        # decode whose length is static and whose group count is symbolic, Inductor (torch
        # 2.14.1) read the padded tail out of bounds (tests/core/test_backends.py caught it).
        position = torch.arange(count + extra, device=flat.device)
        return torch.where(position < count, flat[position.clamp(max=count - 1)], 0).to(flat.dtype)
    if extra == 0:
        return flat.contiguous()
    return torch.cat([flat, flat.new_zeros(extra)])


def _pack_runs(codes: torch.Tensor, bits: int) -> torch.Tensor:
    runs = pad_to_multiple(codes, 8).view(-1, 8).long()
    shifts = torch.arange(0, 8 * bits, bits, device=codes.device)
    words = (runs << shifts).sum(dim=1, keepdim=True)  # fields do not overlap: a sum is an or
    byte_shifts = torch.arange(0, 8 * bits, 8, device=codes.device)
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8).view(-1)[: packed_size(codes.numel(), bits)]


def _unpack_runs(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    runs = pad_to_multiple(packed, bits).view(-1, bits).long()
    byte_shifts = torch.arange(0, 8 * bits, 8, device=packed.device)
    words = (runs << byte_shifts).sum(dim=1, keepdim=True)
    shifts = torch.arange(0, 8 * bits, bits, device=packed.device)
    return ((words >> shifts) & ((1 << bits) - 1)).to(torch.uint8).view(-1)[:count]
