"""GACT-style per-group affine quantization to 8, 4 or 2 bits with stochastic rounding.

Values are split into consecutive groups of ``group`` elements (a last partial group is
allowed). Per group: ``offset`` = the group minimum, stored in the input dtype (so a
constant group is exact), and ``scale = (max - min) / (2**bits - 1)`` stored as bf16 rounded
*up* (bf16 keeps fp32's range, and rounding up guarantees the codes cover the group).
Codes ``floor((x - offset) / scale + u)``, ``u ~ U[0, 1)``, are unbiased
(E[decompress(x)] = x), clamped to ``[0, 2**bits - 1]`` and bit-packed.

Inputs are finite: the pipeline sets NaN and +-inf aside and puts them back at their
positions, so a non-finite value costs its group nothing.

>>> import torch
>>> x = torch.linspace(-1, 1, 1000)
>>> packed = Int4(group=64).compress(x)
>>> packed.nbytes  # 500 bytes of codes + 16 groups * (4-byte fp32 offset + 2-byte bf16 scale)
596
>>> bool((Int4(group=64).decompress(packed) - x).abs().max() <= 2 / 15)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from actcomp.compressors.base import Compressor, Encoded, Hints, owned, setting
from actcomp.compressors.bitpack import pack_codes, unpack_codes
from actcomp.registry import register_compressor

_MAX_FINITE_BF16_BITS = 0x7F7F


def round_up_to_bf16(values: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 values rounded up to the next bf16 (saturating at bf16's max)."""
    bits = values.contiguous().view(torch.int32)
    upper = ((bits + 0xFFFF) >> 16).clamp_(max=_MAX_FINITE_BF16_BITS)
    return upper.to(torch.int16).view(torch.bfloat16)


class GroupQuant(Compressor):
    """Shared implementation; the registered stages are :class:`Int8`, :class:`Int4`, :class:`Int2`."""

    kind = "quantizer"
    bits: ClassVar[int] = 8

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        count, group = flat.numel(), self.group  # type: ignore[attr-defined]
        groups = -(-count // group)
        if count % group:
            # Pad with a value of the last group so its min and max do not change.
            flat = torch.cat([flat, flat[-1:].expand(groups * group - count)])
        values = flat.view(groups, group).float()
        low, high = values.aminmax(dim=1)
        levels = 2**self.bits - 1
        # max/levels - min/levels cannot overflow where (max - min) could.
        scale = round_up_to_bf16(high / levels - low / levels)
        # Offsets in the input dtype are exact: every value, the minimum too, came from it.
        offset = low.to(x.dtype)
        step = scale.float().unsqueeze(1)
        inverse_step = 1 / torch.where(step > 0, step, 1.0)
        # codes = floor((x - min) / step + u): one fused multiply-add onto the noise, and the
        # uint8 cast truncates, which is floor for the clamped, non-negative values.
        codes = torch.rand_like(values).addcmul_(values - low.unsqueeze(1), inverse_step).clamp_(0, levels)
        packed = pack_codes(codes.view(-1)[:count].to(torch.uint8), self.bits)
        return Encoded(owned(packed), (owned(offset), scale), (x.shape, x.dtype))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        shape, dtype = meta
        count = shape.numel()
        offset, scale = saved
        group = self.group  # type: ignore[attr-defined]
        groups = offset.numel()
        codes = unpack_codes(payload, self.bits, count).float()
        if count % group:
            codes = torch.cat([codes, codes.new_zeros(groups * group - count)])
        values = torch.addcmul(offset.float().unsqueeze(1), codes.view(groups, group), scale.float().unsqueeze(1))
        # The rounded-up scale can step past the dtype's largest value; saturate.
        limit = torch.finfo(dtype).max
        return values.view(-1)[:count].clamp(-limit, limit).to(dtype).view(shape)


@register_compressor
@dataclass(frozen=True)
class Int8(GroupQuant):
    """8-bit per-group quantization (1 byte per value)."""

    name = "int8"
    bits = 8
    group: int = setting(256, minimum=1)


@register_compressor
@dataclass(frozen=True)
class Int4(GroupQuant):
    """4-bit per-group quantization (2 values per byte)."""

    name = "int4"
    bits = 4
    group: int = setting(256, minimum=1)


@register_compressor
@dataclass(frozen=True)
class Int2(GroupQuant):
    """2-bit per-group quantization (4 values per byte)."""

    name = "int2"
    bits = 2
    group: int = setting(256, minimum=1)
