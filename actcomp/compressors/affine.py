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
from actcomp.kernels import native_cpu
from actcomp.kernels.bitpack import packed_size
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.noise import RoundingNoise, noise_seed
from actcomp.kernels.quantize import dequantize_affine, grouped_shape, quantize_affine


@dataclass(frozen=True)
class GroupQuant(Compressor):
    """Per-group affine codes of ``bits`` bits; the registered widths are :class:`Int8`,
    :class:`Int4` and :class:`Int2`, each a name bound to a width.

    Encodes and decodes a chunk at a time (:mod:`~actcomp.kernels.chunks`), in whole
    groups and bytes: the groups, codes and noise are those of one whole-tensor call.

    >>> packed = Int2(group=4).compress(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    >>> packed.tensors[-1], Int2(group=4).decompress(packed)
    (tensor([228], dtype=torch.uint8), tensor([0., 1., 2., 3.]))
    """

    kind = "quantizer"
    bits: ClassVar[int]
    group: int = setting(256, minimum=1)

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        group, bits = self.group, self.bits
        flat = x.reshape(-1)
        count = flat.numel()
        noise = RoundingNoise(flat)
        codes = torch.empty(packed_size(count, bits), dtype=torch.uint8, device=flat.device)
        groups = grouped_shape(count, group)[0]
        offset = torch.empty(groups, dtype=flat.dtype, device=flat.device)
        scale = torch.empty(groups, dtype=torch.bfloat16, device=flat.device)
        # Chunks sized by the input's width: the codes come from float32 copies of a chunk.
        length = aligned_length(flat.device, count, group, 8, element_size=flat.element_size())
        for start, stop in spans(count, length):
            shape = grouped_shape(stop - start, group)
            part_noise = noise.slice(start, shape[0] * group).view(shape)
            part_codes, part_offset, part_scale = quantize_affine(flat[start:stop], bits, group, part_noise)
            first, first_group = start * bits // 8, start // group
            codes[first:first + part_codes.numel()] = part_codes
            offset[first_group:first_group + shape[0]] = part_offset
            scale[first_group:first_group + shape[0]] = part_scale
        return Encoded(codes, (offset, scale), (x.shape, x.dtype))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        shape, dtype = meta
        offset, scale = saved
        group, bits, count = self.group, self.bits, shape.numel()
        out = torch.empty(count, dtype=dtype, device=payload.device)
        length = aligned_length(payload.device, count, group, 8, element_size=dtype.itemsize)
        for start, stop in spans(count, length):
            first, first_group, groups = start * bits // 8, start // group, grouped_shape(stop - start, group)[0]
            out[start:stop] = dequantize_affine(
                payload[first:first + packed_size(stop - start, bits)], offset[first_group:first_group + groups],
                scale[first_group:first_group + groups], bits, group, torch.Size([stop - start]), dtype)
        return out.view(shape)

    def native_encode(self, x: torch.Tensor, hints: Hints) -> Encoded | None:
        """:meth:`encode` in one pass of :mod:`~actcomp.kernels.native_cpu`, on CPU float32 and bfloat16."""
        if not native_cpu.quantizes(x.device, x.dtype, x.numel(), self.bits):
            return None
        flat = x.reshape(-1).contiguous()
        groups = grouped_shape(flat.numel(), self.group)[0]
        codes = torch.empty(packed_size(flat.numel(), self.bits), dtype=torch.uint8)
        offset = torch.empty(groups, dtype=flat.dtype)
        scale = torch.empty(groups, dtype=torch.bfloat16)
        native_cpu.quantize(flat, self.bits, self.group, noise_seed(flat), codes, offset, scale)
        return Encoded(codes, (offset, scale), (x.shape, x.dtype))

    def native_decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor | None:
        """:meth:`decode` in one pass of :mod:`~actcomp.kernels.native_cpu`."""
        shape, dtype = meta
        if not native_cpu.quantizes(payload.device, dtype, shape.numel(), self.bits):
            return None
        offset, scale = saved
        out = torch.empty(shape.numel(), dtype=dtype)
        native_cpu.dequantize(payload.contiguous(), offset.contiguous(), scale.contiguous(), self.bits, self.group, out)
        return out.view(shape)


# The registered widths: a name and a width each, all behaviour in GroupQuant. They are classes,
# so `Int4(group=64)`, `isinstance(stage, Int8)` and pickles that name `affine.Int8` keep working.
@register_compressor
class Int8(GroupQuant):
    """``int8``: 1 byte per value.

    >>> Int8(group=64)
    Int8(group=64)
    """

    name, bits = "int8", 8


@register_compressor
class Int4(GroupQuant):
    """``int4``: 2 values per byte.

    >>> str(Int4(group=64))
    'int4:group=64'
    """

    name, bits = "int4", 4


@register_compressor
class Int2(GroupQuant):
    """``int2``: 4 values per byte.

    >>> Int2().compress(torch.zeros(8)).nbytes  # 2 bytes of codes, a 4-byte offset, a 2-byte scale
    8
    """

    name, bits = "int2", 2
