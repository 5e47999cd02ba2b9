"""GACT-style per-group affine quantization to 8, 4 or 2 bits with stochastic rounding.

Values are split into consecutive groups of ``group`` elements (a last partial group is
allowed). Per group: ``offset`` = the group minimum, stored in the input dtype (so a
constant group is exact), and ``scale = (max - min) / (2**bits - 1)`` stored as bf16 rounded
*up* (bf16 keeps fp32's range, and rounding up guarantees the codes cover the group).
Codes ``floor((x - offset) / scale + u)``, ``u ~ U[0, 1)``, are unbiased
(E[decompress(x)] = x), clamped to ``[0, 2**bits - 1]`` and bit-packed.

Inputs are finite: the pipeline sets NaN and +-inf aside and puts them back at their
positions, so a non-finite value costs its group nothing.

:func:`~actcomp.kernels.quantize.quantize_affine` and
:func:`~actcomp.kernels.quantize.dequantize_affine` are the pure pair underneath, with the
rounding noise passed in; the stages draw it from :mod:`~actcomp.kernels.noise`, never
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

from actcomp.core.codec import Compressor, Encoded, Hints, setting
from actcomp.core.registry import register_compressor
from actcomp.kernels.bitpack import packed_size
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.noise import RoundingNoise
from actcomp.kernels.quantize import dequantize_affine, grouped_shape, quantize_affine


class GroupQuant(Compressor):
    """Shared implementation; the registered stages are :class:`Int8`, :class:`Int4`, :class:`Int2`.

    Encodes and decodes a chunk at a time (:mod:`~actcomp.kernels.chunks`), in whole
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
