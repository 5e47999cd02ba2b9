"""GACT-style per-group affine quantization to 8, 4 or 2 bits with stochastic rounding.

Values are split into consecutive groups of ``group`` elements (a last partial group is
allowed). Per group: ``offset`` = the group minimum, stored in the input dtype (so a
constant group is exact), and ``scale = (max - min) / (2**bits - 1)`` stored as bf16 rounded
*up* (bf16 keeps fp32's range, and rounding up guarantees the codes cover the group).
Codes ``floor((x - offset) / scale + u)``, ``u ~ U[0, 1)``, are unbiased
(E[decompress(x)] = x), clamped to ``[0, 2**bits - 1]`` and bit-packed.

Inputs are finite: the pipeline sets NaN and +-inf aside and puts them back at their
positions, so a non-finite value costs its group nothing.

:func:`quantize_affine` and :func:`dequantize_affine` are the pure pair underneath, with the
rounding noise passed in; the stages draw it from :mod:`~actcomp.compressors.noise`, never
from torch's global generator, and run it a chunk at a time.

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

from actcomp.compressors.base import Compressor, Encoded, Hints, setting
from actcomp.compressors.bitpack import pack_codes, packed_size, unpack_codes
from actcomp.compressors.chunks import aligned_length, spans
from actcomp.compressors.noise import RoundingNoise
from actcomp.errors import ActcompError
from actcomp.registry import register_compressor

_MAX_FINITE_BF16_BITS = 0x7F7F


def round_up_to_bf16(values: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 values rounded up to the next bf16 (saturating at bf16's max)."""
    bits = values.contiguous().view(torch.int32)
    upper = ((bits + 0xFFFF) >> 16).clamp_(max=_MAX_FINITE_BF16_BITS)
    return upper.to(torch.int16).view(torch.bfloat16)


def grouped_shape(count: int, group: int) -> tuple[int, int]:
    """``(groups, group)``: the rows :func:`quantize_affine` splits ``count`` values into, the
    last one padded when partial; its ``noise`` has this shape.

    >>> grouped_shape(1000, 256)
    (4, 256)
    """
    return -(-count // group), group


def quantize_affine(x: torch.Tensor, bits: int, group: int,
                    noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, offset, scale)`` of ``x``: ``bits``-bit codes (1, 2, 4 or 8) bit-packed into
    uint8, and per group of ``group`` values its offset (in ``x``'s dtype) and scale (bf16).

    ``noise`` holds one float32 value in [0, 1) per code, shaped :func:`grouped_shape`:
    ``U[0, 1)`` draws make the rounding stochastic and unbiased; None rounds to nearest, as
    noise 0.5 would. ``x`` must be finite.

    >>> x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    >>> codes, offset, scale = quantize_affine(x, bits=2, group=4)
    >>> codes, offset, scale  # codes 0, 1, 2, 3 in two bits each, low bits first
    (tensor([228], dtype=torch.uint8), tensor([0.]), tensor([1.], dtype=torch.bfloat16))
    >>> dequantize_affine(codes, offset, scale, bits=2, group=4, shape=x.shape, dtype=x.dtype)
    tensor([0., 1., 2., 3.])
    """
    flat = x.reshape(-1)
    count = flat.numel()
    shape = grouped_shape(count, group)
    groups = shape[0]
    if noise is None:
        noise = torch.full(shape, 0.5, device=x.device, dtype=torch.float32)
    elif noise.shape != shape:
        raise ActcompError(f"noise for {count} values in groups of {group} must have shape {shape}, got {tuple(noise.shape)}")
    if count % group:
        # Pad with a value of the last group so its min and max do not change.
        flat = torch.cat([flat, flat[-1:].expand(groups * group - count)])
    values = flat.view(shape).float()
    # Two reductions: aminmax over short rows is ten times slower than amin and amax.
    low, high = values.amin(dim=1), values.amax(dim=1)
    levels = 2**bits - 1
    # max/levels - min/levels cannot overflow where (max - min) could.
    scale = round_up_to_bf16(high / levels - low / levels)
    # Offsets in the input dtype are exact: every value, the minimum too, came from it.
    offset = low.to(x.dtype)
    step = scale.float().unsqueeze(1)
    inverse_step = 1 / torch.where(step > 0, step, 1.0)
    # codes = floor((x - min) / step + u): one fused multiply-add onto the noise, and the
    # uint8 cast truncates, which is floor for the clamped, non-negative values.
    codes = torch.addcmul(noise, values - low.unsqueeze(1), inverse_step).clamp_(0, levels)
    # Through int16: float -> uint8 is not vectorized on CPU, float -> int16 -> uint8 is (4x).
    return pack_codes(codes.view(-1)[:count].to(torch.int16).to(torch.uint8), bits), offset, scale


def dequantize_affine(codes: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor, bits: int, group: int,
                      shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The values :func:`quantize_affine` encoded, of ``shape`` and ``dtype``: ``offset + code * scale``."""
    count = shape.numel()
    groups = offset.numel()
    unpacked = unpack_codes(codes, bits, count).float()
    if count % group:
        unpacked = torch.cat([unpacked, unpacked.new_zeros(groups * group - count)])
    values = torch.addcmul(offset.float().unsqueeze(1), unpacked.view(groups, group), scale.float().unsqueeze(1))
    # The rounded-up scale can step past the dtype's largest value; saturate.
    limit = torch.finfo(dtype).max
    return values.view(-1)[:count].clamp(-limit, limit).to(dtype).view(shape)


class GroupQuant(Compressor):
    """Shared implementation; the registered stages are :class:`Int8`, :class:`Int4`, :class:`Int2`.

    Encodes and decodes a chunk at a time (:mod:`~actcomp.compressors.chunks`), in whole
    groups and bytes: the groups, codes and noise are those of one whole-tensor call.
    """

    kind = "quantizer"
    bits: ClassVar[int] = 8

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        group = self.group  # type: ignore[attr-defined]
        flat = x.reshape(-1)
        count = flat.numel()
        noise = RoundingNoise(flat, group)
        length = aligned_length(flat.device, count, noise.period, 8)
        codes = torch.empty(packed_size(count, self.bits), dtype=torch.uint8, device=flat.device)
        groups = grouped_shape(count, group)[0]
        offset = torch.empty(groups, dtype=flat.dtype, device=flat.device)
        scale = torch.empty(groups, dtype=torch.bfloat16, device=flat.device)
        for start, stop in spans(count, length):
            shape = grouped_shape(stop - start, group)
            part_noise = noise.slice(start, shape[0] * group).view(shape)
            part_codes, part_offset, part_scale = quantize_affine(flat[start:stop], self.bits, group, part_noise)
            first = start * self.bits // 8
            codes[first:first + part_codes.numel()] = part_codes
            offset[start // group:start // group + shape[0]] = part_offset
            scale[start // group:start // group + shape[0]] = part_scale
        return Encoded(codes, (offset, scale), (x.shape, x.dtype))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        shape, dtype = meta
        offset, scale = saved
        group, bits, count = self.group, self.bits, shape.numel()  # type: ignore[attr-defined]
        out = torch.empty(count, dtype=dtype, device=payload.device)
        for start, stop in spans(count, aligned_length(payload.device, count, group, 8)):
            first, groups = start * bits // 8, grouped_shape(stop - start, group)[0]
            out[start:stop] = dequantize_affine(
                payload[first:first + packed_size(stop - start, bits)], offset[start // group:start // group + groups],
                scale[start // group:start // group + groups], bits, group, torch.Size([stop - start]), dtype)
        return out.view(shape)


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
