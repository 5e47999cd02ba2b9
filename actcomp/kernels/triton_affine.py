"""The per-group affine codes (int8, int4, int2) as Triton kernels: one launch makes the noise
seed, one encodes, one decodes.

They give :func:`~actcomp.kernels.quantize.quantize_affine`'s codes, offsets and scales bit for
bit on finite inputs, with the noise :mod:`~actcomp.kernels.noise` defines hashed in registers
from (seed, element index) instead of read from a table:

- :func:`noise_seed` is :func:`actcomp.kernels.noise.noise_seed` in one program (the eager one
  is about twenty launches on a 0-d tensor);
- :func:`quantize` reads each value once: a program takes ``rows`` groups, reduces each to its
  minimum and maximum, rounds the step up to bf16, and writes the packed codes, the offset and
  the scale; a channel's power of two (int4's ``scale="channel"``) multiplies as it loads;
- :func:`dequantize` writes each value once, the channel's power of two and the finite flag's
  NaN applied on the way (the chain's NaN pass is then not another pass over the output).

Divisions are ``div_rn`` (Triton's ``/`` is approximate on a GPU) and launches turn off
multiply-add fusion (:func:`~actcomp.kernels.triton_runtime.launch`): the reference rounds
``(x - min) * (1 / step)`` and then ``+ noise``.

Kernels owe the reference their codes on finite inputs only: a group holding NaN or inf is
covered by the finite flag, which decodes the whole tensor to NaN.

>>> import torch
>>> from actcomp.kernels import triton_runtime
>>> triton_runtime.runs_on(torch.device("cpu")) in (True, False)
True
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actcomp.kernels.bitpack import packed_size
from actcomp.kernels.noise import FINGERPRINT_SAMPLE, ROTATION_KEY, _mix_seed_and_size
from actcomp.kernels.triton_runtime import cdiv, device_guard, interpreting, launch, next_power_of_2

# Elements a program of the encode works on (whole groups, at least one) and of the decode.
ENCODE_ELEMENTS = 2048
DECODE_ELEMENTS = 1024
# The largest group (rounded up to a power of two) one program holds in registers.
MAX_GROUP = 8192
# A compiled kernel may read a module's global only as a constexpr (the interpreter reads any:
# the H100 run found this one).
_ROTATION_KEY = tl.constexpr(ROTATION_KEY)
# Same-size integer views of the float dtypes, as the eager fingerprint sums them.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def takes(dtype: torch.dtype, count: int, bits: int, group: int) -> bool:
    """Whether these kernels encode and decode ``count`` values of ``dtype`` in ``bits``-bit
    codes, groups of ``group``: float32/bfloat16/float16, int32 indices, whole bytes per group."""
    return (dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 < count < 2**31 - 2 * group
            and bits in (2, 4, 8) and group % (8 // bits) == 0 and next_power_of_2(group) <= MAX_GROUP)


@triton.jit
def _lowbias32(value):
    """Chris Wellons' lowbias32 on uint32 lanes (products wrap modulo 2**32)."""
    value ^= value >> 16
    value *= 0x7FEB352D
    value ^= value >> 15
    value *= 0x846CA68B
    value ^= value >> 16
    return value


# The bf16 bits torch's cast gives a NaN: a GPU's canonical NaN, and on a CPU (where the
# interpreter runs) all ones.
_BF16_NAN = tl.constexpr(-1 if interpreting() else 0x7FFF)


@triton.jit
def rounded_to(values, dtype: tl.constexpr):
    """float32 ``values`` rounded to nearest-even in ``dtype``, as torch's casts round. bf16 by
    its bits: Triton's interpreter truncates a bf16 cast (a GPU rounds), and a test must see the
    GPU's codes. NaN becomes torch's NaN of the device (the rounding would carry into the sign)."""
    if dtype == tl.bfloat16:
        bits = values.to(tl.int32, bitcast=True)
        bits = tl.where(values != values, _BF16_NAN << 16, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return values.to(dtype)


@triton.jit
def _noise(index, seed):
    """:func:`actcomp.kernels.noise.noise_at` of int32 ``index`` under uint32 ``seed``."""
    period = (index >> 16).to(tl.uint32)
    rotation = _lowbias32(period ^ _ROTATION_KEY) & 0xFFFF
    rotated = ((index.to(tl.uint32) & 0xFFFF) + rotation) & 0xFFFF
    hashed = _lowbias32(rotated ^ seed)
    return ((hashed >> 8) & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _seed_kernel(bits_ptr, seed_ptr, finite_ptr, count, step, mix, SAMPLES: tl.constexpr, FLAGGED: tl.constexpr):
    """noise_seed: the bit patterns of every ``step``-th element summed (int64), folded to 32
    bits, mixed with ``mix`` (torch's seed and the size) and hashed. Also sets the finite flag
    true, for the encode (launched after it on the same stream) to clear."""
    if FLAGGED:
        tl.store(finite_ptr, 1)
    position = tl.arange(0, SAMPLES).to(tl.int64) * step
    sample = tl.load(bits_ptr + position, mask=position < count, other=0).to(tl.int64)
    total = tl.sum(sample, axis=0)
    folded = (total ^ (total >> 32)) & 0xFFFFFFFF
    seed = _lowbias32((folded ^ mix).to(tl.uint32))
    tl.store(seed_ptr, seed.to(tl.int64))


@triton.jit
def _quantize_kernel(x_ptr, inverse_ptr, seed_ptr, codes_ptr, offset_ptr, scale_ptr, finite_ptr, count, group,
                     channels, BITS: tl.constexpr, PER_BYTE: tl.constexpr, BYTES: tl.constexpr, ROWS: tl.constexpr,
                     SCALED: tl.constexpr, FLAGGED: tl.constexpr):
    levels: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    byte = tl.arange(0, BYTES)
    field = tl.arange(0, PER_BYTE)
    within = byte[:, None] * PER_BYTE + field[None, :]  # a value's place in its group
    index = rows[:, None, None] * group + within[None, :, :]
    valid = (within[None, :, :] < group) & (index < count)
    values = tl.load(x_ptr + index, mask=valid, other=0.0)
    if FLAGGED:  # any program that meets NaN or inf clears the flag (all write the same byte)
        magnitude = tl.abs(values.to(tl.float32))
        infinite = tl.max(tl.max(tl.max(((magnitude < float("inf")) == 0).to(tl.int32), axis=2), axis=1), axis=0)
        if infinite > 0:
            tl.store(finite_ptr, 0)
    if SCALED:  # times the channel's power of two, rounded to the input's dtype as the reference's product is
        inverse = tl.load(inverse_ptr + index % channels, mask=valid, other=1.0)
        values = rounded_to(values.to(tl.float32) * inverse.to(tl.float32), values.dtype)
    values = values.to(tl.float32)
    low = tl.min(tl.min(tl.where(valid, values, float("inf")), axis=2), axis=1)
    high = tl.max(tl.max(tl.where(valid, values, -float("inf")), axis=2), axis=1)
    # (max / levels - min / levels) rounded up to the next bf16, saturating at bf16's largest.
    step = tl.div_rn(high, levels * 1.0) - tl.div_rn(low, levels * 1.0)
    upper = tl.minimum((step.to(tl.int32, bitcast=True) + 0xFFFF) >> 16, 0x7F7F)
    step = (upper << 16).to(tl.float32, bitcast=True)
    inverse_step = tl.div_rn(tl.full(step.shape, 1.0, tl.float32), tl.where(step > 0, step, 1.0))
    seed = tl.load(seed_ptr).to(tl.uint32)
    noisy = (values - low[:, None, None]) * inverse_step[:, None, None] + _noise(index, seed)
    codes = tl.minimum(tl.maximum(noisy, 0.0), levels * 1.0).to(tl.int32)
    codes = tl.where(valid, codes, 0) << (field * BITS)[None, None, :]
    packed = tl.sum(codes, axis=2).to(tl.uint8)  # the fields do not overlap: a sum is an or
    first = rows[:, None] * group + byte[None, :] * PER_BYTE
    tl.store(codes_ptr + first // PER_BYTE, packed, mask=(byte[None, :] * PER_BYTE < group) & (first < count))
    row_valid = rows * group < count
    tl.store(offset_ptr + rows, low.to(offset_ptr.dtype.element_ty), mask=row_valid)
    tl.store(scale_ptr + rows, step.to(tl.bfloat16), mask=row_valid)


@triton.jit
def _dequantize_kernel(codes_ptr, offset_ptr, scale_ptr, exponents_ptr, finite_ptr, out_ptr, count, group, channels,
                       limit, BITS: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr,
                       SCALED: tl.constexpr, FLAGGED: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    byte = tl.load(codes_ptr + index // PER_BYTE, mask=valid, other=0).to(tl.int32)
    code = (byte >> ((index % PER_BYTE) * BITS)) & ((1 << BITS) - 1)
    row = index // group
    offset = tl.load(offset_ptr + row, mask=valid, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + row, mask=valid, other=0.0).to(tl.float32)
    # code * scale is exact in float32 (8 bits times a bf16): the sum is rounded once, fused or not.
    values = tl.minimum(tl.maximum(offset + code.to(tl.float32) * scale, -limit), limit)
    values = rounded_to(values, out_ptr.dtype.element_ty)
    if SCALED:  # times 2**exponent of the channel, built from its bits: exact, as torch.exp2 is
        exponent = tl.load(exponents_ptr + index % channels, mask=valid, other=0).to(tl.int32)
        power = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
        values = rounded_to(values.to(tl.float32) * power, out_ptr.dtype.element_ty)
    if FLAGGED:
        finite = tl.load(finite_ptr).to(tl.int32)
        # In float32 (exact): the interpreter has no bf16 constant for the NaN.
        values = tl.where(finite != 0, values.to(tl.float32), float("nan")).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + index, values, mask=valid)


def noise_seed(flat: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`actcomp.kernels.noise.noise_seed` of contiguous 1-D ``flat``, in one launch; sets
    ``finite`` (a 0-d bool) true on the way where given."""
    count = flat.numel()
    step = max(1, count // FINGERPRINT_SAMPLE)
    seed = torch.empty((), dtype=torch.int64, device=flat.device)
    with device_guard(flat):
        launch(_seed_kernel, (1,), flat.view(_BITS[flat.element_size()]), seed, seed if finite is None else finite,
               count, step, _mix_seed_and_size(count), SAMPLES=2 * FINGERPRINT_SAMPLE, FLAGGED=finite is not None)
    return seed


def quantize(flat: torch.Tensor, bits: int, group: int, inverse: torch.Tensor | None = None,
             finite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, offset, scale)`` of contiguous 1-D ``flat`` (see :func:`takes`), as
    :meth:`~actcomp.compressors.affine.GroupQuant.encode` makes them: ``inverse`` holds each
    channel's power of two (the last axis of ``flat``'s rows), or None. Where ``finite`` (a 0-d
    bool) is given, it is written: whether every value of ``flat`` is finite. Two launches."""
    count = flat.numel()
    groups = -(-count // group)
    codes = torch.empty(packed_size(count, bits), dtype=torch.uint8, device=flat.device)
    offset = torch.empty(groups, dtype=flat.dtype, device=flat.device)
    scale = torch.empty(groups, dtype=torch.bfloat16, device=flat.device)
    per_byte = 8 // bits
    padded = next_power_of_2(group)
    rows = max(1, ENCODE_ELEMENTS // padded)
    seed = noise_seed(flat, finite)
    with device_guard(flat):
        launch(_quantize_kernel, (cdiv(groups, rows),), flat, flat if inverse is None else inverse, seed, codes,
               offset, scale, seed if finite is None else finite, count, group,
               1 if inverse is None else inverse.numel(), BITS=bits, PER_BYTE=per_byte, BYTES=max(1, padded // per_byte),
               ROWS=rows, SCALED=inverse is not None, FLAGGED=finite is not None)
    return codes, offset, scale


def dequantize(codes: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor, bits: int, group: int, count: int,
               dtype: torch.dtype, exponents: torch.Tensor | None = None,
               finite: torch.Tensor | None = None) -> torch.Tensor:
    """The ``count`` values :func:`quantize` encoded, as a 1-D tensor of ``dtype``: each channel
    times ``2**exponents`` where given, all NaN where ``finite`` (a 0-d bool) is false. One launch."""
    out = torch.empty(count, dtype=dtype, device=codes.device)
    with device_guard(codes):
        launch(_dequantize_kernel, (cdiv(count, DECODE_ELEMENTS),), codes, offset, scale,
               codes if exponents is None else exponents, codes if finite is None else finite, out, count, group,
               1 if exponents is None else exponents.numel(), torch.finfo(dtype).max, BITS=bits, PER_BYTE=8 // bits,
               BLOCK=DECODE_ELEMENTS, SCALED=exponents is not None, FLAGGED=finite is not None)
    return out
