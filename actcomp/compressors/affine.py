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
>>> packed.nbytes  # 500 bytes of codes + 16 groups * (4-byte fp32 offset + 2-byte bf16 scale) + the finite flag
597
>>> bool((Int4(group=64).decompress(packed) - x).abs().max() <= 2 / 15)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from actcomp import host_allocator
from actcomp.core import backends
from actcomp.core.backends import register_implementation
from actcomp.core.chain import finite_flag
from actcomp.core.codec import Compressor, Encoded, Hints, setting
from actcomp.core.registry import register_compressor
from actcomp.kernels import native_cpu
from actcomp.kernels.bitpack import packed_size
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.noise import RoundingNoise
from actcomp.kernels.quantize import dequantize_affine, dequantize_affine_pointwise, grouped_shape, quantize_affine


@dataclass(frozen=True)
class GroupQuant(Compressor):
    """Per-group affine codes of ``bits`` bits; the registered widths are :class:`Int8`,
    :class:`Int4` and :class:`Int2`, each a name bound to a width.

    Encodes and decodes a chunk at a time (:mod:`~actcomp.kernels.chunks`), in whole
    groups and bytes: the groups, codes and noise are those of one whole-tensor call.

    ``scale="channel"`` (int4's and int2's default) first divides each feature channel by a power of two
    near its mean magnitude, where the caller names the last axis as the channels (a Linear
    layer's input): an outlier channel, 20-60x the others on every token as in trained
    language models, then no longer sets the scale of every group it shares, which left int4
    codes of the other channels mostly zero. Powers of two are exact, one int8 exponent per
    channel is kept, and a tensor without such an axis (or a float16 one, whose range the
    division could leave) is grouped as it is. ``scale="group"`` (int8's default) groups as it is
    always: 8-bit codes keep the other channels well enough (a language model's gradient cosine
    0.9997 with outliers built in, ``benchmarks/bench_lm_quality.py``), and the channel pass
    costs a compression about 2.7x its time on CPU.

    >>> packed = Int2(group=4).compress(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    >>> packed.tensors[-1], Int2(group=4).decompress(packed)
    (tensor([228], dtype=torch.uint8), tensor([0., 1., 2., 3.]))
    >>> x = torch.randn(512, 64); x[:, 3] *= 50  # an outlier channel
    >>> def error(stage):
    ...     return (stage.decompress(stage.compress(x, channel_dim=-1)) - x)[:, 4:].abs().mean()
    >>> error = {s: error(Int4(scale=s)) for s in ("channel", "group")}
    >>> bool(error["channel"] < error["group"] / 5)
    True
    """

    kind = "quantizer"
    bits: ClassVar[int]
    group: int = setting(256, minimum=1)
    scale: Literal["channel", "group"] = setting("channel")

    def _channels(self, x: torch.Tensor, hints: Hints) -> int | None:
        """The channel count when this call scales channels first, else None."""
        if self.scale != "channel" or hints.channel_dim is None or x.dim() < 2 or x.numel() == 0:
            return None
        if hints.channel_dim % x.dim() != x.dim() - 1 or x.dtype not in _FP32_RANGE:
            return None
        return x.shape[-1]

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        group, bits = self.group, self.bits
        flat = x.reshape(-1)
        count = flat.numel()
        channels = self._channels(x, hints)
        exponents, inverse = _channel_exponents(flat, channels)
        noise = RoundingNoise(flat)
        codes = torch.empty(packed_size(count, bits), dtype=torch.uint8, device=flat.device)
        groups = grouped_shape(count, group)[0]
        offset = torch.empty(groups, dtype=flat.dtype, device=flat.device)
        scale = torch.empty(groups, dtype=torch.bfloat16, device=flat.device)
        # Chunks sized by the input's width: the codes come from float32 copies of a chunk.
        length = aligned_length(flat.device, count, group, 8, channels or 1, element_size=flat.element_size())
        for start, stop in spans(count, length):
            shape = grouped_shape(stop - start, group)
            part_noise = noise.slice(start, shape[0] * group).view(shape)
            part = _scaled(flat[start:stop], inverse)
            part_codes, part_offset, part_scale = quantize_affine(part, bits, group, part_noise)
            first, first_group = start * bits // 8, start // group
            codes[first:first + part_codes.numel()] = part_codes
            offset[first_group:first_group + shape[0]] = part_offset
            scale[first_group:first_group + shape[0]] = part_scale
        return Encoded(codes, (offset, scale, *exponents), (x.shape, x.dtype))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        shape, dtype = meta
        offset, scale, *exponents = saved
        group, bits, count = self.group, self.bits, shape.numel()
        out = torch.empty(count, dtype=dtype, device=payload.device)
        length = aligned_length(payload.device, count, group, 8, element_size=dtype.itemsize)
        for start, stop in spans(count, length):
            first, first_group, groups = start * bits // 8, start // group, grouped_shape(stop - start, group)[0]
            out[start:stop] = dequantize_affine(
                payload[first:first + packed_size(stop - start, bits)], offset[first_group:first_group + groups],
                scale[first_group:first_group + groups], bits, group, torch.Size([stop - start]), dtype)
        return _unscaled(out, exponents).view(shape)


# Dtypes whose range holds a value divided by a channel's power of two (see _channel_exponents).
_FP32_RANGE = (torch.float32, torch.bfloat16, torch.float64)
# Exponents are kept as int8; this bound keeps 2**e and 2**-e normal in float32 and bfloat16.
_MAX_EXPONENT = 126
# The rows a channel's mean magnitude is estimated from, at most about twice this.
_SAMPLED_ROWS = 512


def _channel_exponents(flat: torch.Tensor, channels: int | None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """``((exponents,), 2**-exponents)`` for rows of ``channels`` values: per channel, the
    floor of log2 of its mean magnitude over up to about a thousand evenly spaced rows (int8,
    in [-126, 126]) and the float multiplier in ``flat``'s dtype; ``((), None)`` for no channels.

    The mean, not the maximum: a sink token's 300x on a channel would set that channel's
    maximum, and every other token's value there would then be coded in steps of the sink's
    size. A scaled value is at most rows times its channel's mean over 2**e, so within float32's
    range.
    """
    if channels is None:
        return (), None
    # Evenly spaced rows suffice for a power of two: it only has to be near the mean.
    rows = flat.view(-1, channels)
    rows = rows[::max(1, rows.shape[0] // _SAMPLED_ROWS)]
    # A chunk of rows at a time (linalg.vector_norm over dim 0 took 10x this on CPU), each value
    # divided by the row count first: a float32 sum of values near float32's maximum would
    # overflow (a float64 sum took 3x as long).
    mean = torch.zeros(channels, dtype=torch.float32, device=flat.device)
    for start, stop in spans(rows.shape[0], max(1, aligned_length(flat.device, flat.numel()) // channels)):
        mean += rows[start:stop].abs().mul_(1 / rows.shape[0]).sum(0, dtype=torch.float32)
    exponents = torch.floor(torch.log2(mean)).clamp_(-_MAX_EXPONENT, _MAX_EXPONENT).to(torch.int8)
    return (exponents,), torch.exp2(-exponents.float()).to(flat.dtype)


def _scaled(part: torch.Tensor, inverse: torch.Tensor | None) -> torch.Tensor:
    """A chunk of whole rows times the channels' multipliers (exact: powers of two)."""
    return part if inverse is None else (part.view(-1, inverse.numel()) * inverse).view(-1)


def _unscaled(out: torch.Tensor, exponents: list[torch.Tensor]) -> torch.Tensor:
    """Decoded rows times 2**exponent per channel, in place."""
    if exponents:
        out.view(-1, exponents[0].numel()).mul_(torch.exp2(exponents[0].float()).to(out.dtype))
    return out


def _cpu_encode(codec: GroupQuant, x: torch.Tensor, hints: Hints, finite: torch.Tensor | None = None) -> Encoded:
    """:meth:`GroupQuant.encode` in one pass of :mod:`~actcomp.kernels.native_cpu` (a pass per
    chunk when channels are scaled: the scaled copy is a chunk's), writing the chain's finite
    flag ``finite`` where given: from the kernel's own group ranges, or with channels scaled one
    ``aminmax`` of the input (a scaled chunk is not the input)."""
    flat = x.reshape(-1).contiguous()
    count, channels = flat.numel(), codec._channels(x, hints)
    exponents, inverse = _channel_exponents(flat, channels)
    groups = grouped_shape(count, codec.group)[0]
    codes = torch.empty(packed_size(count, codec.bits), dtype=torch.uint8)
    offset = torch.empty(groups, dtype=flat.dtype)
    scale = torch.empty(groups, dtype=torch.bfloat16)
    if channels is None:
        native_cpu.quantize_seeded(flat, codec.bits, codec.group, codes, offset, scale, finite=finite)
    else:
        seed = native_cpu.noise_seed(flat)
        if finite is not None:
            finite.copy_(finite_flag(flat))
        length = aligned_length(flat.device, count, codec.group, 8, channels)
        for start, stop in spans(count, length):
            first, first_group = start * codec.bits // 8, start // codec.group
            native_cpu.quantize(_scaled(flat[start:stop], inverse), codec.bits, codec.group, seed, codes[first:],
                                offset[first_group:], scale[first_group:], base=start)
    return Encoded(codes, (offset, scale, *exponents), (x.shape, x.dtype))


def _cpu_decode(codec: GroupQuant, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
    """:meth:`GroupQuant.decode` in one pass of :mod:`~actcomp.kernels.native_cpu`."""
    shape, dtype = meta
    offset, scale, *exponents = saved
    out = host_allocator.empty_for_writing(shape.numel(), dtype)
    native_cpu.dequantize(payload.contiguous(), offset.contiguous(), scale.contiguous(), codec.bits, codec.group, out)
    return _unscaled(out, exponents).view(shape)


# CPU float32 and bfloat16, 1 to 2**31 - 1 values, the kernels built.
register_implementation(
    GroupQuant, "native", writes_finite_flag=True,
    encode=_cpu_encode, encodes=lambda codec, x, hints: native_cpu.quantizes(x.device, x.dtype, x.numel(), codec.bits),
    decode=_cpu_decode,
    decodes=lambda codec, payload, saved, meta: native_cpu.quantizes(payload.device, meta[1], meta[0].numel(), codec.bits))


def _triton_encode(codec: GroupQuant, x: torch.Tensor, hints: Hints, finite: torch.Tensor | None = None) -> Encoded:
    """:meth:`GroupQuant.encode` in two launches of :mod:`~actcomp.kernels.triton_affine`
    (the channels' powers of two, where scaled, are a few small reductions before), writing the
    chain's finite flag ``finite`` on the way where given."""
    from actcomp.kernels import triton_affine

    flat = x.reshape(-1).contiguous()
    exponents, inverse = _channel_exponents(flat, codec._channels(x, hints))
    codes, offset, scale = triton_affine.quantize(flat, codec.bits, codec.group, inverse, finite)
    return Encoded(codes, (offset, scale, *exponents), (x.shape, x.dtype))


def _triton_decode(codec: GroupQuant, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta,
                   finite: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`GroupQuant.decode` in one launch, NaN everywhere where ``finite`` is false."""
    from actcomp.kernels import triton_affine

    shape, dtype = meta
    offset, scale, *exponents = saved
    return triton_affine.dequantize(payload, offset, scale, codec.bits, codec.group, shape.numel(), dtype,
                                    exponents[0] if exponents else None, finite).view(shape)


def _triton_takes(codec: GroupQuant, device: torch.device, dtype: torch.dtype, count: int) -> bool:
    if not backends.triton_runs_on(device):
        return False
    from actcomp.kernels import triton_affine

    return triton_affine.takes(dtype, count, codec.bits, codec.group)


# CUDA float32, bfloat16 and float16 (CPU under Triton's interpreter), whole bytes per group.
register_implementation(
    GroupQuant, "triton", encode=_triton_encode,
    encodes=lambda codec, x, hints: _triton_takes(codec, x.device, x.dtype, x.numel()),
    decode=_triton_decode, applies_finite_flag=True, writes_finite_flag=True,
    decodes=lambda codec, payload, saved, meta: _triton_takes(codec, payload.device, meta[1], meta[0].numel()))


# In a traced graph, the encode is one custom op whose implementation is the eager path's choice
# (the native kernel on a CPU, the Triton kernel on CUDA, else the reference): a compiled graph
# gives the eager codes, and Inductor compiles an extern call where the traced reference is a few
# dozen loops of generated code (its C++ code generation dominated compress_in_graph's first call:
# benchmarks/profile_first_compiled_call.py). The decode is traced (_graph_decode).
@torch.library.custom_op("actcomp::group_quant_encode", mutates_args=())
def _encode_op(x: torch.Tensor, bits: int, group: int, scale: str, channel_dim: int | None,
               flagged: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    codec = _WIDTHS[bits](group=group, scale=scale)
    hints = Hints(channel_dim=channel_dim)
    if flagged:  # the chain's finite flag too, written by the kernel where it can
        (codes, (offset, step, *exponents), _), finite = backends.encode_flagged(codec, x, hints, finite_flag)
    else:
        (codes, (offset, step, *exponents), _), finite = backends.encode(codec, x, hints), _no_flag(x.device)
    return codes, offset, step, exponents[0] if exponents else _no_exponents(x.device), finite


def _no_flag(device: torch.device) -> torch.Tensor:
    """The op's flag output where none was asked for (an op's outputs are fixed in number)."""
    return torch.ones((0,), dtype=torch.bool, device=device)


def _no_exponents(device: torch.device) -> torch.Tensor:
    """The exponents where channels are not scaled."""
    return torch.empty(0, dtype=torch.int8, device=device)


@_encode_op.register_fake
def _(x, bits, group, scale, channel_dim, flagged):
    codec = _WIDTHS[bits](group=group, scale=scale)
    count = x.numel()
    groups = (count + group - 1) // group
    channels = codec._channels(x, Hints(channel_dim=channel_dim))
    return (x.new_empty(((count * bits + 7) // 8,), dtype=torch.uint8), x.new_empty((groups,)),
            x.new_empty((groups,), dtype=torch.bfloat16), x.new_empty((channels or 0,), dtype=torch.int8),
            x.new_empty(() if flagged else (0,), dtype=torch.bool))


def _graph_encode(codec: GroupQuant, x: torch.Tensor, hints: Hints, *, flagged: bool = False):
    """:meth:`GroupQuant.encode` as one call of ``actcomp::group_quant_encode``; with
    ``flagged``, ``(encoded, finite flag)`` from the same call."""
    codes, offset, step, exponents, finite = _encode_op(x, codec.bits, codec.group, codec.scale, hints.channel_dim,
                                                        flagged)
    channels = codec._channels(x, hints)
    encoded = Encoded(codes, (offset, step, exponents) if channels else (offset, step), (x.shape, x.dtype))
    return (encoded, finite) if flagged else encoded


def _graph_decode(codec: GroupQuant, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta,
                  finite: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`GroupQuant.decode` traced as pointwise operations (the reference's values bit for
    bit), NaN everywhere where ``finite`` is given and false. Not an extern call, unlike the
    encode: Inductor computes the decoded values inside the kernel that reads them (a GELU's
    backward, a norm's), as its own fp8 pass does, so no decoded copy lives beside the backward's
    own buffers (with an extern decode, a compiled ViT-S's MLP backward held three MLP-sized
    buffers where the fp8 pass's holds two)."""
    shape, dtype = meta
    offset, step, *exponents = saved
    values = dequantize_affine_pointwise(payload, offset, step, codec.bits, codec.group, shape, dtype)
    if exponents:  # as _unscaled: times 2**exponent per channel, in the output dtype
        channels = exponents[0].numel()
        values = (values.reshape(-1, channels) * torch.exp2(exponents[0].float()).to(dtype)).view(shape)
    return values if finite is None else torch.where(finite, values, float("nan"))


backends.register_graph_op(GroupQuant, encode=_graph_encode, decode=_graph_decode)


# The registered widths: a name and a width each, all behaviour in GroupQuant. They are classes,
# so `Int4(group=64)`, `isinstance(stage, Int8)` and pickles that name `affine.Int8` keep working.
@register_compressor
@dataclass(frozen=True)
class Int8(GroupQuant):
    """``int8``: 1 byte per value.

    >>> Int8(group=64)
    Int8(group=64, scale='group')
    """

    name, bits = "int8", 8
    scale: Literal["channel", "group"] = setting("group")


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

    >>> Int2().compress(torch.zeros(8)).nbytes  # 2 bytes of codes, a 4-byte offset, a 2-byte scale, the flag
    9
    """

    name, bits = "int2", 2


_WIDTHS = {8: Int8, 4: Int4, 2: Int2}
