"""The exact codecs and the few-bit derivative codes as Triton kernels: one launch encodes, one
decodes (dropout's float scale: one more, a reduction of the encode's per-program partials).

They give the codes of :mod:`actcomp.whole_model.exact_codecs` and
:mod:`actcomp.whole_model.derivative_codes` bit for bit, and decode the same stand-ins:

- :func:`encode_codes` reads each value once and writes its ``bits``-bit code into a
  little-endian bit stream (code ``i`` at bits ``[i*bits, (i+1)*bits)``: what
  :func:`~actcomp.kernels.bitpack.pack_codes` makes, runs of 8 codes in ``bits`` bytes). A code is
  a predicate's bit (ReLU's ``not (x <= 0)``, LeakyReLU's ``x > 0``, dropout's ``x != 0``,
  hardtanh's ``not (x <= low or x >= high)``, with NaN as a third state where asked) or the
  number of a codebook's edges below the value (a binary search in a padded table);
- :func:`dropout_encode` also keeps what dropout's decode needs of a float mask, its largest
  value (or NaN where it is not a mask), from per-program partials that a second launch reduces;
- :func:`decode_table` writes each value once: a table's entry at the code (the codecs'
  stand-ins, the representatives), NaN everywhere where the finite flag is false;
  :func:`dropout_decode` writes ``0``/``1`` (bool) or ``scale * 0``/``scale``;
- :func:`pool_encode` and :func:`pool_decode` turn max-pooling's flat argmax positions into
  their offsets inside the window and back, in int64 with floor division as torch's.

Comparisons are made in float32, where bf16 and fp16 values and float32 bounds are exact, so a
code never depends on a rounding. Sizes of nothing launch nothing.

>>> import torch
>>> from actcomp.kernels import triton_runtime
>>> triton_runtime.runs_on(torch.device("cpu")) in (True, False)
True
"""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl

from actcomp.kernels.bitpack import packed_size
from actcomp.kernels.triton_affine import rounded_to
from actcomp.kernels.triton_runtime import cdiv, device_guard, launch

# Runs of 8 codes a program of the encode packs, and values a program of the decode writes.
ENCODE_RUNS = 128
DECODE_ELEMENTS = 1024
# Programs' partials the dropout scale's reduction takes at a time.
REDUCE_BLOCK = 1024
# The predicates encode_codes knows (one bit each but "inside_or_nan", 2 bits; "interval", any).
PREDICATES = ("not_at_most_zero", "above_zero", "nonzero", "inside", "inside_or_nan", "interval")
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# The dropout partials, one row each: any NaN, largest non-NaN value, any +0.0, any non-zero
# non-NaN value, the smallest and the largest of those.
_PARTIALS = 6


def takes(count: int) -> bool:
    """Whether these kernels index ``count`` values (int32 element indices)."""
    return 0 <= count < 2**31 - 8 * ENCODE_RUNS


@triton.jit
def _code(values, table_ptr, valid, low, high, PREDICATE: tl.constexpr, BITS: tl.constexpr):
    """Each float32 value's code under ``PREDICATE`` (int64)."""
    if PREDICATE == "not_at_most_zero":
        code = (values <= 0) == 0  # NaN is not <= 0: it passes, as in ReLU's backward
    elif PREDICATE == "above_zero":
        code = values > 0
    elif PREDICATE == "nonzero":
        code = values != 0
    elif PREDICATE == "inside":
        code = ((values <= low) | (values >= high)) == 0
    elif PREDICATE == "inside_or_nan":
        inside = (((values <= low) | (values >= high)) == 0).to(tl.int64)
        code = tl.where(values != values, 2, inside)
    else:  # "interval": the edges below the value, in a table of 2**BITS - 1 sorted edges (+inf padded)
        code = tl.zeros(values.shape, tl.int64)
        for level in tl.static_range(BITS):
            # Not annotated constexpr: a compiled kernel refuses to reassign one in an unrolled
            # loop (the interpreter allows it; the H100 run found this).
            span = 1 << (BITS - 1 - level)
            edge = tl.load(table_ptr + code + (span - 1), mask=valid, other=0.0).to(tl.float32)
            code = tl.where(values > edge, code + span, code)
    return code.to(tl.int64)


@triton.jit
def _encode_kernel(x_ptr, table_ptr, packed_ptr, partials_ptr, count, packed_bytes, programs, low, high,
                   PREDICATE: tl.constexpr, BITS: tl.constexpr, RUNS: tl.constexpr, PARTIALS: tl.constexpr):
    run = tl.program_id(0) * RUNS + tl.arange(0, RUNS)
    lane = tl.arange(0, 8)
    index = run[:, None] * 8 + lane[None, :]
    valid = index < count
    values = tl.load(x_ptr + index, mask=valid, other=0).to(tl.float32)
    code = tl.where(valid, _code(values, table_ptr, valid, low, high, PREDICATE, BITS), 0)
    # A run of 8 codes is BITS bytes of one little-endian word (at most 64 bits): the fields do
    # not overlap, so the sum is an or.
    word = tl.sum(code << (lane * BITS).to(tl.int64)[None, :], axis=1)
    out = run[:, None] * BITS + lane[None, :]
    packed = ((word[:, None] >> (lane * 8).to(tl.int64)[None, :]) & 0xFF).to(tl.uint8)
    tl.store(packed_ptr + out, packed, mask=(lane[None, :] < BITS) & (out < packed_bytes))
    if PARTIALS:  # what dropout's scale needs of this program's values (see _scale_kernel)
        nan = values != values
        number = valid & (nan == 0)
        nonzero = number & (values != 0)
        program = tl.program_id(0)
        tl.store(partials_ptr + program, tl.max(tl.max((valid & nan).to(tl.float32), axis=1), axis=0))
        tl.store(partials_ptr + programs + program,
                 tl.max(tl.max(tl.where(number, values, -float("inf")), axis=1), axis=0))
        positive_zero = number & (values == 0) & (values.to(tl.int32, bitcast=True) == 0)
        tl.store(partials_ptr + 2 * programs + program, tl.max(tl.max(positive_zero.to(tl.float32), axis=1), axis=0))
        tl.store(partials_ptr + 3 * programs + program, tl.max(tl.max(nonzero.to(tl.float32), axis=1), axis=0))
        tl.store(partials_ptr + 4 * programs + program,
                 tl.min(tl.min(tl.where(nonzero, values, float("inf")), axis=1), axis=0))
        tl.store(partials_ptr + 5 * programs + program,
                 tl.max(tl.max(tl.where(nonzero, values, -float("inf")), axis=1), axis=0))


@triton.jit
def _scale_kernel(partials_ptr, scale_ptr, programs, NAN_UNLESS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """DropoutMask's scale: ``x.amax()`` (NaN where a value is), and with ``NAN_UNLESS_MASK``
    NaN unless every value is 0 or that largest one: unless the non-zero values are all equal
    and the largest (no NaN either)."""
    nan = tl.zeros((BLOCK,), tl.float32)
    largest = tl.full((BLOCK,), -float("inf"), tl.float32)
    positive_zero = tl.zeros((BLOCK,), tl.float32)
    nonzero = tl.zeros((BLOCK,), tl.float32)
    nonzero_low = tl.full((BLOCK,), float("inf"), tl.float32)
    nonzero_high = tl.full((BLOCK,), -float("inf"), tl.float32)
    for start in range(0, programs, BLOCK):
        program = start + tl.arange(0, BLOCK)
        valid = program < programs
        nan = tl.maximum(nan, tl.load(partials_ptr + program, mask=valid, other=0.0))
        largest = tl.maximum(largest, tl.load(partials_ptr + programs + program, mask=valid, other=-float("inf")))
        positive_zero = tl.maximum(positive_zero, tl.load(partials_ptr + 2 * programs + program, mask=valid, other=0.0))
        nonzero = tl.maximum(nonzero, tl.load(partials_ptr + 3 * programs + program, mask=valid, other=0.0))
        nonzero_low = tl.minimum(nonzero_low, tl.load(partials_ptr + 4 * programs + program, mask=valid,
                                                      other=float("inf")))
        nonzero_high = tl.maximum(nonzero_high, tl.load(partials_ptr + 5 * programs + program, mask=valid,
                                                        other=-float("inf")))
    largest = tl.max(largest, axis=0)
    # A largest value of zero is +0.0 where one was seen, else -0.0 (a max's choice between them
    # is the implementation's; see the module's limits).
    zero = tl.zeros(largest.shape, tl.float32)
    largest = tl.where(largest == 0, tl.where(tl.max(positive_zero, axis=0) > 0, zero, -zero), largest)
    any_nan = tl.max(nan, axis=0) > 0
    if NAN_UNLESS_MASK:
        nonzero_high = tl.max(nonzero_high, axis=0)
        is_mask = (tl.max(nonzero, axis=0) == 0) | (
            (tl.min(nonzero_low, axis=0) == nonzero_high) & (nonzero_high == largest))
        any_nan = any_nan | (is_mask == 0)
    scale = tl.where(any_nan, float("nan"), largest)
    tl.store(scale_ptr, scale.to(scale_ptr.dtype.element_ty))


@triton.jit
def _read_codes(packed_ptr, index, valid, packed_bytes, BITS: tl.constexpr):
    """Code ``index`` of the bit stream (it may span two bytes where BITS does not divide 8)."""
    position = index.to(tl.int64) * BITS
    byte = position >> 3
    pair = tl.load(packed_ptr + byte, mask=valid, other=0).to(tl.int32)
    if 8 % BITS != 0:
        pair |= tl.load(packed_ptr + byte + 1, mask=valid & (byte + 1 < packed_bytes), other=0).to(tl.int32) << 8
    return (pair >> (position & 7).to(tl.int32)) & ((1 << BITS) - 1)


@triton.jit
def _decode_kernel(packed_ptr, table_ptr, finite_ptr, out_ptr, count, packed_bytes, BITS: tl.constexpr,
                   TABLE: tl.constexpr, BLOCK: tl.constexpr, FLAGGED: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    code = _read_codes(packed_ptr, index, valid, packed_bytes, BITS)
    if TABLE == "codes":  # bool out (as uint8): the bit itself
        values = code.to(out_ptr.dtype.element_ty)
    elif TABLE == "scale":  # dropout's float mask: scale where kept, scale * 0 elsewhere
        scale = tl.load(table_ptr).to(tl.float32)
        values = tl.where(code != 0, scale, scale * 0.0)
        if out_ptr.dtype.element_ty == tl.bfloat16:
            # torch's bf16 rounding makes every NaN 0x7FC0; rounding by the bits would keep its sign.
            values = rounded_to(tl.where(values != values, float("nan"), values), tl.bfloat16)
        else:
            values = values.to(out_ptr.dtype.element_ty)
    else:
        values = tl.load(table_ptr + code, mask=valid, other=0)
    if FLAGGED:
        finite = tl.load(finite_ptr).to(tl.int32)
        # In float32 (exact): the interpreter has no bf16 constant for the NaN.
        values = tl.where(finite != 0, values.to(tl.float32), float("nan")).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + index, values, mask=valid)


@triton.jit
def _floor_divide(value, divisor):
    """``value // divisor`` rounded down for a positive ``divisor``, whatever ``//`` rounds to."""
    quotient = value // divisor
    return tl.where(quotient * divisor > value, quotient - 1, quotient)


@triton.jit
def _window_origin(position, out_rows, out_cols, stride_row, stride_col, pad_row, pad_col):
    """Row and column, in the input plane, of the window corner of output ``position``."""
    column = position % out_cols
    row = (position // out_cols) % out_rows
    return row * stride_row - pad_row, column * stride_col - pad_col


@triton.jit
def _pool_encode_kernel(x_ptr, packed_ptr, count, width, out_rows, out_cols, stride_row, stride_col, pad_row,
                        pad_col, dilation_row, dilation_col, kernel_cols, BITS: tl.constexpr, PER_BYTE: tl.constexpr,
                        BYTES: tl.constexpr):
    byte = tl.program_id(0) * BYTES + tl.arange(0, BYTES)
    field = tl.arange(0, PER_BYTE)
    position = (byte[:, None] * PER_BYTE + field[None, :]).to(tl.int64)
    valid = position < count
    argmax = tl.load(x_ptr + position, mask=valid, other=0).to(tl.int64)
    origin_row, origin_col = _window_origin(position, out_rows, out_cols, stride_row, stride_col, pad_row, pad_col)
    input_row = _floor_divide(argmax, width)
    row = _floor_divide(input_row - origin_row, dilation_row)
    col = _floor_divide(argmax - input_row * width - origin_col, dilation_col)
    offset = (row * kernel_cols + col) & 0xFF  # the reference's cast to uint8 wraps
    offset = tl.where(valid, offset, 0)
    if BITS == 1:
        offset = (offset != 0).to(tl.int64)  # packed as bools: any non-zero offset is a 1
    # The reference shifts and sums uint8 codes: bits past a byte's end drop, the sum wraps.
    fields = (offset << (field * BITS).to(tl.int64)[None, :]) & 0xFF
    packed = (tl.sum(fields, axis=1) & 0xFF).to(tl.uint8)
    tl.store(packed_ptr + byte, packed, mask=byte * PER_BYTE < count)


@triton.jit
def _pool_decode_kernel(packed_ptr, out_ptr, count, width, out_rows, out_cols, stride_row, stride_col, pad_row,
                        pad_col, dilation_row, dilation_col, kernel_cols, BITS: tl.constexpr, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    offset = _read_codes(packed_ptr, index, valid, count, BITS).to(tl.int64)
    origin_row, origin_col = _window_origin(index.to(tl.int64), out_rows, out_cols, stride_row, stride_col,
                                            pad_row, pad_col)
    row = origin_row + (offset // kernel_cols) * dilation_row
    col = origin_col + (offset % kernel_cols) * dilation_col
    tl.store(out_ptr + index, row * width + col, mask=valid)


def encode_codes(flat: torch.Tensor, predicate: str, bits: int = 1, table: torch.Tensor | None = None,
                 low: float = 0.0, high: float = 0.0) -> torch.Tensor:
    """The ``bits``-bit codes of contiguous 1-D ``flat`` (float32/bfloat16/float16, or bool as
    uint8) under ``predicate`` (one of :data:`PREDICATES`), packed as
    :func:`~actcomp.kernels.bitpack.pack_codes` packs them. ``low``/``high``: hardtanh's bounds;
    ``table``: ``"interval"``'s ``2**bits - 1`` sorted edges in ``flat``'s dtype. One launch."""
    return _encode(flat, predicate, bits, table, low, high, None)


def dropout_encode(flat: torch.Tensor, nan_unless_mask: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DropoutMask's bits of non-empty float ``flat`` and its scale (1 element of ``flat``'s
    dtype): the largest value, NaN where one is NaN or, with ``nan_unless_mask``, where a value
    is neither 0 nor that largest one. Two launches."""
    programs = cdiv(flat.numel(), 8 * ENCODE_RUNS)
    partials = torch.empty(_PARTIALS * programs, dtype=torch.float32, device=flat.device)
    packed = _encode(flat, "nonzero", 1, None, 0.0, 0.0, partials)
    scale = torch.empty(1, dtype=flat.dtype, device=flat.device)
    with device_guard(flat):
        launch(_scale_kernel, (1,), partials, scale, programs, NAN_UNLESS_MASK=nan_unless_mask, BLOCK=REDUCE_BLOCK)
    return packed, scale


def _encode(flat: torch.Tensor, predicate: str, bits: int, table: torch.Tensor | None, low: float, high: float,
            partials: torch.Tensor | None) -> torch.Tensor:
    count = flat.numel()
    packed = torch.empty(packed_size(count, bits), dtype=torch.uint8, device=flat.device)
    if count == 0:
        return packed
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    # The bounds as float32 rounds them (to nearest, as torch compares a float32 tensor with a
    # Python number); past float32's range they are infinite.
    low, high = ctypes.c_float(low).value, ctypes.c_float(high).value
    with device_guard(flat):
        launch(_encode_kernel, (cdiv(count, 8 * ENCODE_RUNS),), flat, flat if table is None else table, packed,
               packed if partials is None else partials, count, packed.numel(), cdiv(count, 8 * ENCODE_RUNS),
               low, high, PREDICATE=predicate, BITS=bits, RUNS=ENCODE_RUNS, PARTIALS=partials is not None)
    return packed


def decode_table(packed: torch.Tensor, table: torch.Tensor, bits: int, count: int,
                 finite: torch.Tensor | None = None) -> torch.Tensor:
    """``table[code]`` for the ``count`` ``bits``-bit codes in ``packed``, a 1-D tensor of
    ``table``'s dtype; NaN everywhere where ``finite`` (a 0-d bool) is false. One launch."""
    return _decode(packed, table, bits, count, table.dtype, "table", finite)


def dropout_decode(packed: torch.Tensor, scale: torch.Tensor | None, count: int, dtype: torch.dtype) -> torch.Tensor:
    """DropoutMask's mask of ``count`` elements: bools where ``scale`` is None, else ``scale``
    where a bit is set and ``scale * 0`` elsewhere. One launch."""
    if scale is None:
        return _decode(packed, packed, 1, count, torch.bool, "codes", None)
    return _decode(packed, scale, 1, count, dtype, "scale", None)


def _decode(packed: torch.Tensor, table: torch.Tensor, bits: int, count: int, dtype: torch.dtype, kind: str,
            finite: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(count, dtype=dtype, device=packed.device)
    if count == 0:
        return out
    with device_guard(packed):
        launch(_decode_kernel, (cdiv(count, DECODE_ELEMENTS),), packed, table,
               packed if finite is None else finite, out.view(torch.uint8) if dtype == torch.bool else out, count,
               packed.numel(), BITS=bits, TABLE=kind, BLOCK=DECODE_ELEMENTS, FLAGGED=finite is not None)
    return out


def _pool_settings(kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                   dilation: tuple[int, ...], width: int, out_size: tuple[int, ...]) -> tuple[int, ...]:
    return (width, out_size[0], out_size[1], stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
            kernel[1])


def pool_encode(flat: torch.Tensor, bits: int, kernel: tuple[int, ...], stride: tuple[int, ...],
                padding: tuple[int, ...], dilation: tuple[int, ...], width: int,
                out_size: tuple[int, ...]) -> torch.Tensor:
    """PoolOffsets' codes of contiguous 1-D integer argmax positions ``flat``: each one's offset
    in its window, ``bits`` (1, 2, 4 or 8) to a code. One launch."""
    count = flat.numel()
    packed = torch.empty(packed_size(count, bits), dtype=torch.uint8, device=flat.device)
    if count == 0:
        return packed
    per_byte = 8 // bits
    with device_guard(flat):
        launch(_pool_encode_kernel, (cdiv(packed.numel(), ENCODE_RUNS),), flat, packed, count,
               *_pool_settings(kernel, stride, padding, dilation, width, out_size), BITS=bits, PER_BYTE=per_byte,
               BYTES=ENCODE_RUNS)
    return packed


def pool_decode(packed: torch.Tensor, bits: int, count: int, kernel: tuple[int, ...], stride: tuple[int, ...],
                padding: tuple[int, ...], dilation: tuple[int, ...], width: int,
                out_size: tuple[int, ...]) -> torch.Tensor:
    """The ``count`` int64 argmax positions :func:`pool_encode` coded. One launch."""
    out = torch.empty(count, dtype=torch.int64, device=packed.device)
    if count == 0:
        return out
    with device_guard(packed):
        launch(_pool_decode_kernel, (cdiv(count, DECODE_ELEMENTS),), packed, out, count,
               *_pool_settings(kernel, stride, padding, dilation, width, out_size), BITS=bits,
               BLOCK=DECODE_ELEMENTS)
    return out
