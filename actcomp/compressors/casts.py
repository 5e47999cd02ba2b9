"""Storage casts: keep the tensor in fp16, bf16 or fp8 (e4m3) and cast back on decompress.

Casts saturate: a finite value beyond the target's range becomes its largest finite value
instead of overflowing to inf, while NaN and +-inf stay themselves (``fp16`` and ``bf16`` keep
every non-finite value, so the chain keeps no finite flag for them). ``fp8`` scales the tensor
by ``amax / 448`` (one fp32 scalar kept) so the e4m3 range is used fully; e4m3 has no inf, so
a tensor holding one decodes to NaN (the chain's flag).

>>> import torch
>>> x = torch.tensor([1.0, 1e6, -float("inf")])
>>> Fp16().decompress(Fp16().compress(x)).tolist()
[1.0, 65504.0, -inf]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from actcomp import host_allocator
from actcomp.core import backends
from actcomp.core.backends import register_implementation
from actcomp.core.codec import Compressor, Encoded, Hints
from actcomp.core.registry import register_compressor
from actcomp.kernels import native_cpu
from actcomp.kernels.chunks import map_chunks
from actcomp.kernels.device_constants import true_divide

_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast with finite values clamped into ``dtype``'s range (NaN and +-inf stay as they are).

    >>> saturating_cast(torch.tensor([1e6, -1.0, -float("inf")]), torch.float16).tolist()
    [65504.0, -1.0, -inf]
    """
    if x.dtype == dtype:
        return x
    limit = torch.finfo(dtype).max
    if torch.finfo(x.dtype).max <= limit:
        return x.to(dtype)
    # Clamp in fp32 (the limit may not exist in x's dtype: bf16 rounds 65504 up to 65536), a
    # chunk at a time so the fp32 copy stays a chunk's.
    flat = x.reshape(-1)
    return map_chunks(flat, dtype, lambda part: _clamped_finite(part.float(), limit)).view(x.shape)


def _clamped_finite(values: torch.Tensor, limit: float) -> torch.Tensor:
    """``values`` clamped to ``[-limit, limit]``, infinities left alone."""
    return torch.where(values.isinf(), values, values.clamp(-limit, limit))


class _Cast(Compressor):
    kind = "quantizer"
    flags_non_finite = False  # NaN and +-inf cast to themselves
    storage: ClassVar[torch.dtype]

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        return Encoded(saturating_cast(x, self.storage), (), x.dtype)

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        # Saturate on the way back too: fp16's 65504 is stored by bf16 as 65536.
        return saturating_cast(payload, meta)


@register_compressor
@dataclass(frozen=True)
class Fp16(_Cast):
    name = "fp16"
    storage = torch.float16


@register_compressor
@dataclass(frozen=True)
class Bf16(_Cast):
    name = "bf16"
    storage = torch.bfloat16


@register_compressor
@dataclass(frozen=True)
class Fp8(Compressor):
    name = "fp8"
    kind = "quantizer"

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        # max(-min, max): two reductions, no |x| temporary.
        amax = torch.maximum(-x.amin(), x.amax()).float() if x.numel() else x.new_zeros((), dtype=torch.float32)
        scale = true_divide(amax, _FP8_MAX)
        # Zero (or an amax so small the division underflows) keeps scale 1: no 0/0.
        scale = torch.where(scale > 0, scale, 1.0)
        codes = map_chunks(x.reshape(-1), torch.float8_e4m3fn, lambda part: (part.float() / scale).clamp(-_FP8_MAX, _FP8_MAX))
        return Encoded(codes.view(x.shape), (scale,), x.dtype)

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        limit = torch.finfo(meta).max
        values = map_chunks(payload.reshape(-1), meta, lambda part: (part.float() * saved[0]).clamp(-limit, limit))
        return values.view(payload.shape)


def _cpu_encode(codec: Fp8, x: torch.Tensor, hints: Hints) -> Encoded:
    """:meth:`Fp8.encode` in two passes of :mod:`~actcomp.kernels.native_cpu` (the range, then the codes)."""
    flat = x.reshape(-1).contiguous()
    scale = true_divide(native_cpu.fp8_amax(flat), _FP8_MAX)
    # The scale as encode computes it: zero (or an underflow) keeps 1.
    scale = torch.where(scale > 0, scale, 1.0)
    return Encoded(native_cpu.fp8_encode(flat, scale).view(x.shape), (scale,), x.dtype)


def _cpu_decode(codec: Fp8, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
    codes = payload.reshape(-1).contiguous().view(torch.uint8)
    return native_cpu.fp8_decode(codes, saved[0].contiguous(), meta).view(payload.shape)


# CPU float32 and bfloat16, 1 to 2**31 - 1 values, the kernels built (and a float32 scale to decode by).
register_implementation(
    Fp8, "native",
    encode=_cpu_encode, encodes=lambda codec, x, hints: native_cpu.casts(x.device, x.dtype, x.numel()),
    decode=_cpu_decode,
    decodes=lambda codec, payload, saved, meta: native_cpu.casts(payload.device, meta, payload.numel())
    and saved[0].dtype == torch.float32)


def _native_takes(x: torch.Tensor, storage: torch.dtype) -> bool:
    # The one cast the reference makes in four passes: float32 to bfloat16 (the others are
    # a plain .to(), which ATen does in one).
    return storage == torch.bfloat16 and x.dtype == torch.float32 and native_cpu.casts(x.device, x.dtype, x.numel())


def _cpu_widen(payload: torch.Tensor) -> torch.Tensor:
    """bfloat16 ``payload`` as float32: ATen's own cast (a C loop did not beat it: 1.04-1.22x its
    time, ``benchmarks/results/native_levels_stop45/``), written into a decode buffer of
    :func:`~actcomp.host_allocator.empty_for_writing` (reused in backward) instead of a fresh one."""
    out = host_allocator.empty_for_writing(payload.numel(), torch.float32)
    return out.copy_(payload.reshape(-1)).view(payload.shape)


register_implementation(
    Bf16, "native",
    encode=lambda codec, x, hints: Encoded(native_cpu.saturate_bf16(x.reshape(-1).contiguous()).view(x.shape), (),
                                           x.dtype),
    encodes=lambda codec, x, hints: _native_takes(x, codec.storage),
    decode=lambda codec, payload, saved, meta: _cpu_widen(payload),
    decodes=lambda codec, payload, saved, meta: meta == torch.float32 and payload.dtype == torch.bfloat16
    and native_cpu.casts(payload.device, payload.dtype, payload.numel()))


def _triton_cast(codec: _Cast, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`saturating_cast` in one launch of :mod:`~actcomp.kernels.triton_casts` where it
    clamps; a plain cast (one launch, or none) is left to torch."""
    if x.dtype == dtype or torch.finfo(x.dtype).max <= torch.finfo(dtype).max:
        return saturating_cast(x, dtype)
    from actcomp.kernels import triton_casts

    return triton_casts.saturating_cast(x.reshape(-1).contiguous(), dtype).view(x.shape)


def _triton_cast_takes(device: torch.device, *dtypes: torch.dtype) -> bool:
    if not backends.triton_runs_on(device):
        return False
    from actcomp.kernels import triton_casts

    return all(triton_casts.takes(dtype) for dtype in dtypes)


# CUDA float32, bfloat16 and float16 (CPU under Triton's interpreter).
register_implementation(
    _Cast, "triton",
    encode=lambda codec, x, hints: Encoded(_triton_cast(codec, x, codec.storage), (), x.dtype),
    encodes=lambda codec, x, hints: _triton_cast_takes(x.device, x.dtype),
    decode=lambda codec, payload, saved, meta: _triton_cast(codec, payload, meta),
    decodes=lambda codec, payload, saved, meta: _triton_cast_takes(payload.device, payload.dtype, meta))


def _triton_encode(codec: Fp8, x: torch.Tensor, hints: Hints, finite: torch.Tensor | None = None) -> Encoded:
    """:meth:`Fp8.encode` in two launches of :mod:`~actcomp.kernels.triton_casts` (the range, then
    the codes), writing the chain's finite flag ``finite`` on the way where given."""
    from actcomp.kernels import triton_casts

    codes, scale = triton_casts.fp8_encode(x.reshape(-1).contiguous(), finite)
    return Encoded(codes.view(x.shape), (scale,), x.dtype)


def _triton_decode(codec: Fp8, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta,
                   finite: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`Fp8.decode` in one launch, NaN everywhere where ``finite`` is false."""
    from actcomp.kernels import triton_casts

    return triton_casts.fp8_decode(payload.reshape(-1).contiguous(), saved[0], meta, finite).view(payload.shape)


# CUDA float32, bfloat16 and float16 (CPU under Triton's interpreter), a float32 scale to decode by.
register_implementation(
    Fp8, "triton", encode=_triton_encode,
    encodes=lambda codec, x, hints: _triton_cast_takes(x.device, x.dtype) and x.numel() < 2**31 - 2**16,
    decode=_triton_decode, applies_finite_flag=True, writes_finite_flag=True,
    decodes=lambda codec, payload, saved, meta: _triton_cast_takes(payload.device, meta)
    and payload.numel() < 2**31 - 2**16 and saved[0].dtype == torch.float32)
