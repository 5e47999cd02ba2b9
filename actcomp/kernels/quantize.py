"""Per-group affine codes: the pure pair :func:`quantize_affine` / :func:`dequantize_affine`,
with the rounding noise passed in. The registered int8/int4/int2 stages
(:mod:`actcomp.compressors.affine`) run them a chunk at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from actcomp.errors import ActcompError
from actcomp.kernels.bitpack import pack_codes, packed_size, pad_to_multiple, unpack_codes
from actcomp.kernels.device_constants import true_divide

_MAX_FINITE_BF16_BITS = 0x7F7F


def round_up_to_bf16(values: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 values rounded up to the next bf16 (saturating at bf16's max), as fp32:
    exact in bf16, and read back without a bf16 bit cast, which a compiled kernel cannot vectorize.

    >>> round_up_to_bf16(torch.tensor([1.0, 1.001, 3e38])).tolist()
    [1.0, 1.0078125, 3.00405527047391e+38]
    """
    bits = values.contiguous().view(torch.int32)
    upper = ((bits + 0xFFFF) >> 16).clamp_(max=_MAX_FINITE_BF16_BITS)
    return (upper << 16).view(torch.float32)


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
    if torch.compiler.is_compiling():
        # Compiled code pads always (maybe with nothing): a branch on the remainder, or a cat
        # that skips an empty piece, would guard on it and compile a graph for sizes that divide
        # and another for those that do not. Padding with +inf for the minimum and -inf for the
        # maximum changes neither, and is a masked load Inductor vectorizes (a gather of the
        # last value was a scalar loop); the padding's codes are cut off below.
        extra = groups * group - count
        low = F.pad(flat, (0, extra), value=math.inf).view(shape).float().amin(dim=1)
        high = F.pad(flat, (0, extra), value=-math.inf).view(shape).float().amax(dim=1)
        # A third pad, read only by the codes, so that no padded copy is shared by a reduction
        # and the codes (meant to keep Inductor from materializing one; bench_compiled's peak
        # did not move either way: 121 MiB before, 120 after).
        values = F.pad(flat, (0, extra)).view(shape).float()
    else:
        if count % group:
            # Pad with a value of the last group so its min and max do not change.
            flat = torch.cat([flat, flat[-1:].expand(groups * group - count)])
        values = flat.view(shape).float()
        # Two reductions: aminmax over short rows is ten times slower than amin and amax.
        low, high = values.amin(dim=1), values.amax(dim=1)
    levels = 2**bits - 1
    # max/levels - min/levels cannot overflow where (max - min) could.
    step = round_up_to_bf16(true_divide(high, levels) - true_divide(low, levels)).unsqueeze(1)
    # Offsets in the input dtype are exact: every value, the minimum too, came from it.
    offset = low.to(x.dtype)
    inverse_step = 1 / torch.where(step > 0, step, 1.0)
    # codes = floor((x - min) / step + u); the uint8 cast truncates, which is floor for the
    # clamped, non-negative values. A multiply then an add, each rounded, never a fused
    # multiply-add: eager addcmul fuses, compiled code does not, and a code could differ.
    codes = (values - low.unsqueeze(1)).mul_(inverse_step).add_(noise).clamp_(0, levels)
    # float -> uint8 is not vectorized on CPU; eager, float -> int16 -> uint8 is (4x faster), and
    # compiled, float -> int32 -> uint8 is (int16 makes Inductor's loop scalar: 3x slower).
    through = torch.int32 if torch.compiler.is_compiling() else torch.int16
    scale = step.view(-1).to(torch.bfloat16)
    per_byte = 8 // bits
    if torch.compiler.is_compiling() and bits in (2, 4) and group % per_byte == 0:
        # Packed within each group's row, the codes past the end zeroed (as the eager path's
        # padding is): the bytes eager packs, from pointwise loads Inductor vectorizes, where
        # packing the flat codes indexed them through the padding with a modulo per element.
        position = torch.arange(groups * group, device=codes.device).view(shape)
        small = torch.where(position < count, codes.to(through), 0).to(torch.uint8)
        fields = small.view(groups, group // per_byte, per_byte)
        packed = fields[..., 0]
        for field in range(1, per_byte):
            packed = packed | (fields[..., field] << field * bits)
        return packed.view(-1)[:packed_size(count, bits)], offset, scale
    codes = codes.view(-1)[:count].to(through).to(torch.uint8)
    return pack_codes(codes, bits), offset, scale


def dequantize_affine(codes: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor, bits: int, group: int,
                      shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The values :func:`quantize_affine` encoded, of ``shape`` and ``dtype``: ``offset + code * scale``."""
    count = shape.numel()
    groups = offset.numel()
    unpacked = unpack_codes(codes, bits, count).float()
    unpacked = pad_to_multiple(unpacked, group)
    # The product of an 8-bit code and a bf16 scale is exact in float32, so fused or not,
    # eager or compiled, the sum is rounded once.
    values = torch.addcmul(offset.float().unsqueeze(1), unpacked.view(groups, group), scale.float().unsqueeze(1))
    # The rounded-up scale can step past the dtype's largest value; saturate.
    limit = torch.finfo(dtype).max
    return values.view(-1)[:count].clamp(-limit, limit).to(dtype).view(shape)


def dequantize_affine_pointwise(codes: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor, bits: int, group: int,
                                shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize_affine`'s values bit for bit, written as one expression of each value's
    index (its group's offset and scale broadcast, no padding), for a traced graph: Inductor then
    computes the values inside the kernel that reads them, and the decoded tensor is never
    materialized (a compiled ViT-S backward held a third MLP-sized buffer through each block's
    MLP where the decode was an extern call, stop 59).

    >>> codes, offset, scale = quantize_affine(torch.randn(10), bits=4, group=4)
    >>> values = dequantize_affine_pointwise(codes, offset, scale, 4, 4, torch.Size([10]), torch.float32)
    >>> torch.equal(values, dequantize_affine(codes, offset, scale, 4, 4, torch.Size([10]), torch.float32))
    True
    """
    # A product, not torch.Size.numel(), which would turn a compile's symbolic sizes into a
    # guard on their values (and recompile for every batch size).
    count = math.prod(shape)
    groups = offset.numel()

    def per_value(per_group: torch.Tensor) -> torch.Tensor:
        return per_group.float().unsqueeze(1).expand(groups, group).reshape(-1)[:count]

    # As in dequantize_affine: code * scale is exact in float32, so the sum is rounded once.
    values = torch.addcmul(per_value(offset), unpack_codes(codes, bits, count).float(), per_value(scale))
    limit = torch.finfo(dtype).max
    return values.clamp(-limit, limit).to(dtype).view(shape)
