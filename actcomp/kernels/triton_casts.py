"""The storage casts (fp16, bf16 with saturation; fp8 e4m3 with a scale) as Triton kernels.

They give :mod:`~actcomp.compressors.casts`' codes and values bit for bit, non-finite values
included, on the tensors' device:

- :func:`saturating_cast`: one launch, where the eager cast is four a chunk (``isinf``,
  ``clamp``, ``where``, the cast);
- :func:`fp8_encode`: two launches. The first reduces ``max |x|`` to one partial per program
  (at most :data:`MAX_PARTIALS`), the second reduces the partials again in every program, so
  each knows the scale without a third launch, and writes the codes (its first program the
  scale);
- :func:`fp8_decode`: one launch, the finite flag's NaN applied on the way.

The e4m3 codes are made with integer operations, as c10's ``fp8e4m3fn_from_fp32_value``
makes them (round to nearest even, subnormals by a float sum), not by Triton's fp8 cast:
the interpreter's and the GPUs' differ from torch's on ties and NaN.

>>> import torch
>>> takes(torch.float32), takes(torch.float64)
(True, False)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actcomp.kernels.triton_affine import rounded_to
from actcomp.kernels.triton_runtime import cdiv, device_guard, launch, next_power_of_2

# Elements a program works on.
BLOCK = 2048
# The most programs of fp8's range pass: each program of its encode reads them all.
MAX_PARTIALS = 1024
FP8_MAX = 448.0
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def takes(dtype: torch.dtype) -> bool:
    """Whether these kernels read and write ``dtype``: float32, bfloat16 or float16."""
    return dtype in _DTYPES


@triton.jit
def _clamped(values, limit, KEEP_INFINITIES: tl.constexpr):
    """float32 ``values`` clamped to ``[-limit, limit]``, NaN kept (a GPU's minimum would drop
    it), infinities kept where asked."""
    beyond = tl.abs(values) > limit
    if KEEP_INFINITIES:
        beyond = beyond & (tl.abs(values) != float("inf"))
    return tl.where(beyond, tl.where(values > 0, limit, -limit), values)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, count, limit, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    values = _clamped(tl.load(x_ptr + index, mask=valid, other=0.0).to(tl.float32), limit, True)
    tl.store(out_ptr + index, rounded_to(values, out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _fp8_range_kernel(x_ptr, partial_ptr, count, BLOCK: tl.constexpr):
    """``max |x|`` over a grid-strided share of ``x``, NaN where the share holds one."""
    programs = tl.num_programs(0)
    high = tl.full((), 0.0, tl.float32)
    nan = tl.full((), 0, tl.int32)
    for start in range(tl.program_id(0) * BLOCK, count, programs * BLOCK):
        index = start + tl.arange(0, BLOCK).to(tl.int64)
        values = tl.load(x_ptr + index, mask=index < count, other=0.0).to(tl.float32)
        nan = tl.maximum(nan, tl.max((values != values).to(tl.int32), axis=0))
        high = tl.maximum(high, tl.max(tl.where(values == values, tl.abs(values), 0.0), axis=0))
    tl.store(partial_ptr + tl.program_id(0), tl.where(nan > 0, float("nan"), high))


@triton.jit
def _fp8_encode_kernel(x_ptr, partial_ptr, scale_ptr, codes_ptr, finite_ptr, count, partials,
                       BLOCK: tl.constexpr, PARTIALS: tl.constexpr, FLAGGED: tl.constexpr):
    partial = tl.load(partial_ptr + tl.arange(0, PARTIALS), mask=tl.arange(0, PARTIALS) < partials, other=0.0)
    nan = tl.max((partial != partial).to(tl.int32), axis=0)
    amax = tl.where(nan > 0, float("nan"), tl.max(tl.where(partial == partial, partial, 0.0), axis=0))
    if FLAGGED and tl.program_id(0) == 0:
        # max |x| is NaN or inf exactly where a value is: the chain's finite flag, at no pass of its own.
        tl.store(finite_ptr, (amax < float("inf")).to(tl.uint8))
    # Divided once, rounded once, as the reference's true_divide does on every device (a
    # multiplication by 1/448 is one float32 step off: the H100 run of stop 50).
    scale = tl.div_rn(amax, 448.0)
    # Zero, an underflow or NaN keeps 1 (NaN > 0 is false), as the reference's where does.
    scale = tl.where(scale > 0, scale, 1.0)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    values = _widened(tl.load(x_ptr + index, mask=valid, other=0.0))
    values = _clamped(tl.div_rn(values, tl.zeros_like(values) + scale), 448.0, False)
    tl.store(codes_ptr + index, _e4m3_bits(values).to(tl.uint8), mask=valid)


@triton.jit
def _widened(values):
    """``values`` in float32 as torch widens them: a float16 NaN becomes the canonical NaN
    (0x7FFFFFFF, positive), where the interpreter's numpy would keep its sign."""
    wide = values.to(tl.float32)
    if values.dtype == tl.float16:
        wide = tl.where(wide != wide, 0x7FFFFFFF, wide.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    return wide


@triton.jit
def _e4m3_bits(values):
    """The e4m3fn bits of float32 ``values`` (NaN, or within +-448), as c10 rounds them."""
    bits = values.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # Below 2**-6 (fp8's subnormals) a float sum with 2**14 rounds to fp8's step, nearest even.
    subnormal = (tl.abs(values) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    odd = (magnitude >> 20) & 1
    normal = (magnitude - (120 << 23) + 0x7FFFF + odd) >> 20
    code = tl.where(magnitude >= (1087 << 20), 0x7F, tl.where(magnitude < (121 << 23), subnormal, normal))
    return (code & 0x7F) | ((bits >> 24) & 0x80)


@triton.jit
def _fp8_decode_kernel(codes_ptr, scale_ptr, finite_ptr, out_ptr, count, limit, BLOCK: tl.constexpr,
                       FLAGGED: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    byte = tl.load(codes_ptr + index, mask=valid, other=0).to(tl.int32)
    code = byte & 0x7F
    # e4m3fn to float32 exactly, as c10 converts: NaN (0x7F) has the bits 0x7FF00000.
    normal = ((code << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    magnitude = tl.where(code < 8, (code & 7).to(tl.float32) * (1.0 / 512.0), normal).to(tl.int32, bitcast=True)
    magnitude = tl.where(code == 0x7F, 0x7FF00000, magnitude)
    values = (magnitude | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True)
    values = rounded_to(_clamped(values * tl.load(scale_ptr), limit, False), out_ptr.dtype.element_ty)
    if FLAGGED:
        values = nan_unless(values, tl.load(finite_ptr).to(tl.int32) != 0)
    tl.store(out_ptr + index, values, mask=valid)


@triton.jit
def nan_unless(values, finite):
    """``values`` where ``finite``, else the NaN ``torch.where(finite, values, nan)`` writes in
    their dtype (0x7FC0 in bf16, 0x7E00 in fp16): selected by bits, as no cast can be trusted
    to give the same NaN on every device."""
    if values.dtype == tl.float32:
        return tl.where(finite, values, float("nan"))
    else:
        nan = 0x7FC0 if values.dtype == tl.bfloat16 else 0x7E00
        return tl.where(finite, values.to(tl.int16, bitcast=True), nan).to(tl.int16).to(values.dtype, bitcast=True)


def saturating_cast(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`actcomp.compressors.casts.saturating_cast` of contiguous 1-D ``flat`` to ``dtype``
    (both :func:`takes`): finite values clamped into ``dtype``'s range. One launch."""
    out = torch.empty(flat.numel(), dtype=dtype, device=flat.device)
    if flat.numel():
        with device_guard(flat):
            launch(_cast_kernel, (cdiv(flat.numel(), BLOCK),), flat, out, flat.numel(),
                   torch.finfo(dtype).max, BLOCK=BLOCK)
    return out


def fp8_encode(flat: torch.Tensor, finite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of contiguous 1-D ``flat``, as :meth:`~actcomp.compressors.casts.Fp8.encode`
    makes them: float8_e4m3fn codes of ``x / scale``, ``scale = max |x| / 448`` (1 where that is
    zero or NaN). Where ``finite`` (a 0-d bool) is given, it is written: whether every value is
    finite. Two launches (for an empty ``flat``, fills)."""
    count = flat.numel()
    codes = torch.empty(count, dtype=torch.float8_e4m3fn, device=flat.device)
    if not count:
        if finite is not None:
            finite.fill_(True)
        return codes, torch.ones((), dtype=torch.float32, device=flat.device)
    scale = torch.empty((), dtype=torch.float32, device=flat.device)
    programs = min(cdiv(count, BLOCK), MAX_PARTIALS)
    partials = torch.empty(programs, dtype=torch.float32, device=flat.device)
    with device_guard(flat):
        launch(_fp8_range_kernel, (programs,), flat, partials, count, BLOCK=BLOCK)
        launch(_fp8_encode_kernel, (cdiv(count, BLOCK),), flat, partials, scale, codes.view(torch.uint8),
               scale if finite is None else finite.view(torch.uint8), count, programs, BLOCK=BLOCK,
               PARTIALS=next_power_of_2(programs), FLAGGED=finite is not None)
    return codes, scale


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               finite: torch.Tensor | None = None) -> torch.Tensor:
    """The values :func:`fp8_encode` encoded in contiguous 1-D ``codes``, as a tensor of
    ``dtype`` (clamped into its range), all NaN where ``finite`` (a 0-d bool) is false. One launch."""
    out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    if codes.numel():
        with device_guard(codes):
            launch(_fp8_decode_kernel, (cdiv(codes.numel(), BLOCK),), codes.view(torch.uint8), scale,
                   scale if finite is None else finite, out, codes.numel(), torch.finfo(dtype).max, BLOCK=BLOCK,
                   FLAGGED=finite is not None)
    return out
