"""Exact codecs: what a backward reads of some saved tensors fits in a few bits per element.

Each is a registered codec (kind ``exact``): it encodes a saved tensor (whole-model mode hands it
flat) into packed codes, and decodes a *stand-in*. The stand-in is not the tensor, but the op's
own backward kernel, given the stand-in, computes bit-for-bit the gradient it computes from the
tensor:

- ReLU keeps its output and reads only ``not (y <= 0)``; Hardtanh (ReLU6) reads
  ``not (x <= low or x >= high)``; LeakyReLU reads ``x > 0``: one bit each (:class:`ReluMask`,
  :class:`ClampMask`, :class:`LeakyReluMask`). NaN keeps its branch.
- Dropout keeps its mask: ``bool`` (CUDA) or ``0``/``1/(1-p)`` floats (CPU): one bit, plus the
  scale for floats (:class:`DropoutMask`).
- MaxPool keeps its input only for its shape and the argmax as int64 flat positions; each
  argmax lies in its window, so its offset there needs ``log2(window)`` bits (2 for 2x2,
  4 for 3x3) and the input needs no bytes at all (:class:`PoolOffsets`, :class:`ShapeOnly`).
- A tensor the backward only compares with one constant (what compiled training finds in the
  backward graph: ReLU's output tested ``<= 0``) needs the comparison's result, one bit
  (:class:`ComparisonMask`).

Encode and decode are functions of tensors and settings: no value is read back to Python, and
the sizes follow from the input's. On CUDA (and under Triton's interpreter, asked for) each
encode and decode is one launch of :mod:`~actcomp.kernels.triton_masks`, the same codes and
stand-ins bit for bit; a float dropout mask's scale takes one more. :class:`BitMask` is the base of the one-bit masks; a user's
exact codec for an op of their own is a subclass with a ``predicate`` (docs/codecs.md).

>>> import torch
>>> y = torch.relu(torch.randn(4, 256))
>>> packed = ReluMask().compress(y)
>>> packed.nbytes, torch.equal(ReluMask().decompress(packed) > 0, y > 0)
(128, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from actcomp.core import backends
from actcomp.core.backends import register_implementation
from actcomp.core.codec import Compressor, Encoded, Hints, setting
from actcomp.core.registry import register_codec
from actcomp.kernels import native_cpu
from actcomp.kernels.bitpack import pack_bits, pack_codes, packed_size, unpack_bits, unpack_codes
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.device_constants import device_table


def select(codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values[codes]`` for uint8 codes (or a bool mask). Never a bool cast or ``where`` on the
    mask: Inductor's CPU code for those does not build (torch 2.14.1), and an index compiles."""
    return torch.index_select(values, 0, codes.view(torch.uint8).int())


def pack_chunked(flat: torch.Tensor, bits: int, codes_of: Callable[[torch.Tensor], torch.Tensor],
                 length: int) -> torch.Tensor:
    """``codes_of`` (bools for 1 bit, uint8 codes otherwise) of ``flat`` packed ``bits`` to an
    element, a chunk of ``length`` (a multiple of 8) at a time, so temporaries stay a chunk's."""
    count = flat.numel()
    out = torch.empty(packed_size(count, bits), dtype=torch.uint8, device=flat.device)
    for start, stop in spans(count, length):
        codes = codes_of(flat[start:stop])
        # Each chunk starts on a byte: ``length`` is a multiple of 8.
        out[start * bits // 8:packed_size(stop, bits)] = pack_bits(codes) if bits == 1 else pack_codes(codes, bits)
    return out


@dataclass(frozen=True)
class BitMask(Compressor):
    """Base of the one-bit exact codecs: ``predicate`` of each element, packed 8 to a byte
    (``ceil(n / 8)`` bytes); decodes to ``inside`` where it held and ``outside`` elsewhere.

    >>> class Positive(BitMask):
    ...     def predicate(self, part):
    ...         return part > 0
    >>> codec = Positive()
    >>> codec.decompress(codec.compress(torch.tensor([-2.0, 3.0, 0.0])))
    tensor([0., 1., 0.])
    """

    kind = "exact"
    flags_non_finite = False
    inside: ClassVar[float] = 1.0
    outside: ClassVar[float] = 0.0
    # The kernels' name for the predicate (native_cpu.MASK_MODES, triton_masks.PREDICATES), None
    # if they have none.
    native_predicate: ClassVar[str | None] = None

    def predicate(self, part: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def standins(self, dtype: torch.dtype) -> tuple[float, float]:
        """The values decode gives where the predicate failed and where it held."""
        return self.outside, self.inside

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        bits = pack_chunked(flat, 1, self.predicate, aligned_length(x.device, flat.numel(), 8))
        return Encoded(bits, (), (flat.numel(), x.dtype))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        count, dtype = meta
        mask = unpack_bits(payload, count)
        outside, inside = self.standins(dtype)
        if (outside, inside) == (0, 1):
            # 1 and 0 (ReLU's stand-in) are the mask itself, cast: cheaper than a select.
            return mask.view(torch.uint8).to(dtype)
        return select(mask, device_table((outside, inside), dtype, payload.device))


def _cpu_mask_encode(codec: BitMask, x: torch.Tensor, hints: Hints) -> Encoded:
    """:meth:`BitMask.encode` in one pass of :mod:`~actcomp.kernels.native_cpu`."""
    flat = x.reshape(-1).contiguous()
    return Encoded(native_cpu.mask_pack(flat, codec.native_predicate), (), (flat.numel(), x.dtype))


def _cpu_mask_decode(codec: BitMask, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
    count, dtype = meta
    return native_cpu.mask_unpack(payload.contiguous(), count, torch.tensor(codec.standins(dtype), dtype=dtype))


# For the predicates the kernels know, and only where encode (decode) is BitMask's own: a
# subclass may decode otherwise (dropout's scale).
register_implementation(
    BitMask, "native", encode=_cpu_mask_encode,
    encodes=lambda codec, x, hints: codec.native_predicate is not None and type(codec).encode is BitMask.encode
    and native_cpu.casts(x.device, x.dtype, x.numel()),
    decode=_cpu_mask_decode,
    decodes=lambda codec, payload, saved, meta: codec.native_predicate is not None
    and type(codec).decode is BitMask.decode and meta[0] > 0 and native_cpu.unpacks_mask(payload.device, meta[1]))


# The dtypes the Triton kernels (kernels/triton_masks.py) read and write.
TRITON_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def triton_takes(device: torch.device, dtype: torch.dtype, count: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether :mod:`~actcomp.kernels.triton_masks` codes ``count`` values of ``dtype`` (one of
    ``dtypes``) on ``device``: CUDA, or a CPU under Triton's interpreter when asked for."""
    if dtype not in dtypes or not backends.triton_runs_on(device):
        return False
    from actcomp.kernels import triton_masks

    return triton_masks.takes(count)


def _triton_mask_encode(codec: BitMask, x: torch.Tensor, hints: Hints) -> Encoded:
    """:meth:`BitMask.encode` in one launch of :mod:`~actcomp.kernels.triton_masks`."""
    from actcomp.kernels import triton_masks

    flat = x.reshape(-1).contiguous()
    return Encoded(triton_masks.encode_codes(flat, codec.native_predicate), (), (flat.numel(), x.dtype))


def _triton_mask_decode(codec: BitMask, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
    """:meth:`BitMask.decode` in one launch: each bit's stand-in from a two-entry table."""
    from actcomp.kernels import triton_masks

    count, dtype = meta
    return triton_masks.decode_table(payload.contiguous(), device_table(codec.standins(dtype), dtype, payload.device),
                                     1, count)


# The encode for the predicates the kernels know; the decode wherever it is BitMask's own (it
# reads no predicate, only the stand-ins).
register_implementation(
    BitMask, "triton", encode=_triton_mask_encode,
    encodes=lambda codec, x, hints: codec.native_predicate is not None and type(codec).encode is BitMask.encode
    and triton_takes(x.device, x.dtype, x.numel(), TRITON_FLOATS),
    decode=_triton_mask_decode,
    decodes=lambda codec, payload, saved, meta: type(codec).decode is BitMask.decode
    and triton_takes(payload.device, meta[1], meta[0], TRITON_FLOATS))


@register_codec
@dataclass(frozen=True)
class ReluMask(BitMask):
    """ReLU's saved output: its backward passes the gradient where ``not (y <= 0)`` (NaN too)."""

    name = "relu-mask"
    native_predicate = "not_at_most_zero"

    def predicate(self, part: torch.Tensor) -> torch.Tensor:
        return ~(part <= 0)


@register_codec
@dataclass(frozen=True)
class LeakyReluMask(BitMask):
    """LeakyReLU's saved input (or output, in place): its backward branches on ``x > 0``."""

    name = "leaky-relu-mask"
    native_predicate = "above_zero"

    @property
    def label(self) -> str:
        return "relu-mask"  # the memory report's name for both ReLU masks since 0.1.0

    def predicate(self, part: torch.Tensor) -> torch.Tensor:
        return part > 0


@register_codec
@dataclass(frozen=True)
class ComparisonMask(BitMask):
    """A saved tensor its backward reads only through one comparison with a constant,
    ``x <comparison> threshold``: one bit an element, the comparison's result. Decodes to
    ``-inf`` or ``+inf``, whichever side the comparison held on, so the backward's own
    comparison gives its result again for any finite threshold and in any dtype (a stand-in of
    ``threshold - 1`` would round onto the threshold in bf16 at 256 and up). The compiled engine
    (:mod:`~actcomp.whole_model.in_graph`) finds such tensors in the backward graph: ReLU's output,
    which the backward tests ``<= 0``.

    >>> codec = ComparisonMask("le", 0.0)
    >>> codec.decompress(codec.compress(torch.tensor([-2.0, 0.0, 3.0, float("nan")])))
    tensor([-inf, -inf, inf, inf])
    """

    name = "comparison-mask"
    comparison: Literal["le", "lt", "ge", "gt"] = "le"
    threshold: float = 0.0

    @property
    def label(self) -> str:
        return self.name

    def predicate(self, part: torch.Tensor) -> torch.Tensor:
        return getattr(torch, self.comparison)(part, self.threshold)

    def standins(self, dtype: torch.dtype) -> tuple[float, float]:
        below_holds = self.comparison in ("le", "lt")
        return (math.inf, -math.inf) if below_holds else (-math.inf, math.inf)

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        count, dtype = meta
        outside, inside = self.standins(dtype)
        # Python numbers, not a table tensor: this decode runs inlined in compiled backward
        # graphs, where a tensor constant made while the hook is traced does not survive.
        return torch.where(unpack_bits(payload, count), inside, outside).to(dtype)


def _compare_dtype(dtype: torch.dtype) -> torch.dtype:
    # The CPU kernel compares bf16/fp16 values as float32 against float32 bounds: comparing in
    # bf16 would round the bound (0.7 to 0.69921875) and block the value equal to it.
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def clamp_middle(low: float, high: float, dtype: torch.dtype) -> float | None:
    """A value of ``dtype`` strictly between ``low`` and ``high`` as hardtanh's kernel compares,
    None when there is none (then every gradient is blocked and no stand-in exists). Reads only
    the settings, never a tensor's values."""
    middle = torch.tensor((low + high) / 2, dtype=dtype)
    compared = middle.to(_compare_dtype(dtype))
    return middle.item() if bool((compared > low) & (compared < high)) else None


@register_codec
@dataclass(frozen=True)
class ClampMask(Compressor):
    """Hardtanh's (ReLU6's) saved tensor: its backward passes the gradient where
    ``not (x <= low or x >= high)``. ``states=2``: one bit an element (``ceil(n / 8)`` bytes).

    For NaN the CPU kernel's answer depends on the code path: its vectorised loop tests
    ``low < x < high`` (blocks NaN), its scalar tail ``not (x <= low or x >= high)`` (passes
    it). Only NaN itself, at the same place in a tensor of the same layout, gets the same
    answer: ``states=3`` keeps NaN as a third state, two bits an element (``ceil(n / 4)``
    bytes). Whole-model mode picks 3 only for a tensor holding NaN (an eager-only check).

    >>> codec = ClampMask(-1.0, 1.0)
    >>> codec.decompress(codec.compress(torch.tensor([-3.0, 0.2, 5.0])))
    tensor([-inf, 0., -inf])
    """

    name = "clamp-mask"
    kind = "exact"
    flags_non_finite = False
    low: float = -1.0
    high: float = 1.0
    states: int = setting(2, minimum=2, below=4)

    @property
    def label(self) -> str:
        return self.name

    def _codes(self, part: torch.Tensor) -> torch.Tensor:
        values = part.to(_compare_dtype(part.dtype))
        inside = ~((values <= self.low) | (values >= self.high))
        if self.states == 2:
            return inside
        return torch.where(part.isnan(), 2, inside.to(torch.uint8)).to(torch.uint8)

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        codes = pack_chunked(flat, self.states - 1, self._codes, aligned_length(x.device, flat.numel(), 8))
        return Encoded(codes, (), (flat.numel(), x.dtype))

    def standin_table(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """What codes 0, 1 and 2 decode to: ``-inf`` (blocked), the middle (passed), NaN."""
        middle = (self.low + self.high) / 2  # rounded to dtype, as clamp_middle rounds it
        return device_table((-math.inf, middle, math.nan), dtype, device)

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        count, dtype = meta
        values = self.standin_table(dtype, payload.device)
        if self.states == 2:
            return select(unpack_bits(payload, count), values)
        return select(unpack_codes(payload, 2, count), values)


def _triton_clamp_encode(codec: ClampMask, x: torch.Tensor, hints: Hints) -> Encoded:
    """:meth:`ClampMask.encode` in one launch of :mod:`~actcomp.kernels.triton_masks`."""
    from actcomp.kernels import triton_masks

    flat = x.reshape(-1).contiguous()
    predicate = "inside" if codec.states == 2 else "inside_or_nan"
    codes = triton_masks.encode_codes(flat, predicate, codec.states - 1, low=codec.low, high=codec.high)
    return Encoded(codes, (), (flat.numel(), x.dtype))


def _triton_clamp_decode(codec: ClampMask, payload: torch.Tensor, saved: tuple[torch.Tensor, ...],
                         meta: Any) -> torch.Tensor:
    """:meth:`ClampMask.decode` in one launch: each code's stand-in from the same table."""
    from actcomp.kernels import triton_masks

    count, dtype = meta
    return triton_masks.decode_table(payload.contiguous(), codec.standin_table(dtype, payload.device), codec.states - 1,
                                     count)


register_implementation(
    ClampMask, "triton", encode=_triton_clamp_encode,
    encodes=lambda codec, x, hints: triton_takes(x.device, x.dtype, x.numel(), TRITON_FLOATS),
    decode=_triton_clamp_decode,
    decodes=lambda codec, payload, saved, meta: triton_takes(payload.device, meta[1], meta[0], TRITON_FLOATS))


@register_codec
@dataclass(frozen=True)
class DropoutMask(BitMask):
    """Dropout's saved mask, one bit an element (``ceil(n / 8)`` bytes): ``bool`` as it is;
    floats, all ``0`` or one scale ``1/(1-p)`` (the CPU kernel's), with the scale kept too
    (one element more). ``other_values="nan"`` checks that on the device as it codes (a tensor
    that may not be a mask: one SDPA saves): one that is not decodes to NaN, never to a wrong
    mask, and nothing is read back to decide.

    >>> codec = DropoutMask(other_values="nan")
    >>> codec.decompress(codec.compress(torch.tensor([0.0, 2.0, 2.0])))
    tensor([0., 2., 2.])
    >>> codec.decompress(codec.compress(torch.tensor([0.0, 2.0, 0.5])))
    tensor([nan, nan, nan])
    """

    name = "dropout-mask"
    takes = frozenset({"bool", "float"})
    other_values: Literal["trust", "nan"] = "trust"

    @property
    def label(self) -> str:
        return self.name

    def predicate(self, part: torch.Tensor) -> torch.Tensor:
        return part if part.dtype == torch.bool else part != 0

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        bits, _, meta = super().encode(x, hints)
        if x.dtype == torch.bool:
            return Encoded(bits, (), meta)
        # The scale is the largest value (a reduction on the device: nothing read back).
        scale = x.reshape(-1).amax().reshape(1)
        if self.other_values == "nan":
            is_mask = ((x == 0) | (x == scale)).all()
            scale = torch.where(is_mask, scale, math.nan)
        return Encoded(bits, (scale,), meta)

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        count, dtype = meta
        mask = unpack_bits(payload, count)
        if dtype == torch.bool:
            return mask
        (scale,) = saved
        # A NaN scale (not a mask) makes the zeros NaN too.
        return select(mask, torch.cat([scale * 0, scale]))


def _triton_dropout_encode(codec: DropoutMask, x: torch.Tensor, hints: Hints) -> Encoded:
    """:meth:`DropoutMask.encode`: one launch for a bool mask; for floats, one more reduces the
    programs' partials to the scale (its check with ``other_values="nan"`` included)."""
    from actcomp.kernels import triton_masks

    flat = x.reshape(-1).contiguous()
    meta = (flat.numel(), x.dtype)
    if x.dtype == torch.bool:
        return Encoded(triton_masks.encode_codes(flat, "nonzero"), (), meta)
    bits, scale = triton_masks.dropout_encode(flat, codec.other_values == "nan")
    return Encoded(bits, (scale,), meta)


def _triton_dropout_decode(codec: DropoutMask, payload: torch.Tensor, saved: tuple[torch.Tensor, ...],
                           meta: Any) -> torch.Tensor:
    """:meth:`DropoutMask.decode` in one launch."""
    from actcomp.kernels import triton_masks

    count, dtype = meta
    return triton_masks.dropout_decode(payload.contiguous(), None if dtype == torch.bool else saved[0], count, dtype)


# A float mask of no elements has no largest value: the reference raises, and so it runs there.
register_implementation(
    DropoutMask, "triton", encode=_triton_dropout_encode,
    encodes=lambda codec, x, hints: triton_takes(x.device, x.dtype, x.numel(), (torch.bool,))
    or (x.numel() > 0 and triton_takes(x.device, x.dtype, x.numel(), TRITON_FLOATS)),
    decode=_triton_dropout_decode,
    decodes=lambda codec, payload, saved, meta: triton_takes(payload.device, meta[1], meta[0],
                                                             (torch.bool, *TRITON_FLOATS)))


@register_codec
@dataclass(frozen=True)
class ShapeOnly(Compressor):
    """A tensor whose backward reads only its shape and layout (max and average pooling's
    input): no bytes.
    Decodes to a broadcast zero, which the packed layout turns into its tensor's layout."""

    name = "shape-only"
    kind = "exact"
    flags_non_finite = False

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        return Encoded(torch.empty(0, dtype=torch.uint8, device=x.device), (), (x.numel(), x.dtype))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        count, dtype = meta
        return torch.zeros((), dtype=dtype, device=payload.device).expand(count)


@register_codec
@dataclass(frozen=True)
class PoolOffsets(Compressor):
    """max_pool2d's argmax (flat positions in each input plane of ``width`` columns, output
    planes of ``out_size``) as the offset inside its window: ``bits`` = 1, 2, 4 or 8 bits for
    windows of up to 2, 4, 16 or 256 positions; ``ceil(n * bits / 8)`` bytes.

    >>> x = torch.randn(1, 1, 4, 4)
    >>> _, indices = torch.ops.aten.max_pool2d_with_indices(x, 2, 2)
    >>> codec = PoolOffsets(width=4, out_size=(2, 2))
    >>> codec.label, torch.equal(codec.decompress(codec.compress(indices)), indices)
    ('pool-offsets2', True)
    """

    name = "pool-offsets"
    kind = "exact"
    takes = frozenset({"int"})
    flags_non_finite = False
    reads_positions = True
    kernel: tuple[int, ...] = setting((2, 2), minimum=1)
    stride: tuple[int, ...] = setting((2, 2), minimum=1)
    padding: tuple[int, ...] = setting((0, 0), minimum=0)
    dilation: tuple[int, ...] = setting((1, 1), minimum=1)
    width: int = setting(1, minimum=1)
    out_size: tuple[int, ...] = setting((1, 1), minimum=0)

    @property
    def bits(self) -> int:
        return next(b for b in (1, 2, 4, 8) if self.kernel[0] * self.kernel[1] <= 2**b)

    @property
    def label(self) -> str:
        return f"pool-offsets{self.bits}"

    def _window_origins(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column of each output position's window corner, in the input plane."""
        rows = torch.arange(self.out_size[0], device=device).view(-1, 1) * self.stride[0] - self.padding[0]
        cols = torch.arange(self.out_size[1], device=device) * self.stride[1] - self.padding[1]
        return rows, cols

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        indices = x.reshape(-1, *self.out_size)
        rows, cols = self._window_origins(x.device)
        row_in_window = torch.div(torch.div(indices, self.width, rounding_mode="floor") - rows, self.dilation[0],
                                  rounding_mode="floor")
        col_in_window = torch.div(indices % self.width - cols, self.dilation[1], rounding_mode="floor")
        offsets = (row_in_window * self.kernel[1] + col_in_window).to(torch.uint8)
        return Encoded(pack_codes(offsets.reshape(-1), self.bits), (), x.numel())

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        offset = unpack_codes(payload, self.bits, meta).view(-1, *self.out_size).long()
        rows, cols = self._window_origins(payload.device)
        row = rows + torch.div(offset, self.kernel[1], rounding_mode="floor") * self.dilation[0]
        col = cols + (offset % self.kernel[1]) * self.dilation[1]
        return (row * self.width + col).reshape(-1)

    def geometry(self) -> tuple[int, ...]:
        """What the native kernels need to place a window: the kernel's columns, stride,
        padding and dilation (two each), the input plane's width, the output plane's size."""
        return (self.kernel[1], *self.stride, *self.padding, *self.dilation, self.width, *self.out_size)


def _whole_planes(codec: PoolOffsets, count: int) -> bool:
    """Whether ``count`` positions are whole output planes of a 2-d pool: what the kernels take
    (the reference's reshape raises on anything else)."""
    plane = math.prod(codec.out_size)
    two_d = all(len(pair) == 2 for pair in (codec.kernel, codec.stride, codec.padding, codec.dilation, codec.out_size))
    return two_d and plane > 0 and count % plane == 0


def _native_pool_takes(codec: PoolOffsets, device: torch.device, dtype: torch.dtype, count: int) -> bool:
    return _whole_planes(codec, count) and native_cpu.takes_pool_indices(device, dtype, count)


register_implementation(
    PoolOffsets, "native",
    encode=lambda codec, x, hints: Encoded(native_cpu.pool_encode(x.reshape(-1).contiguous(), codec.bits,
                                                                  codec.geometry()), (), x.numel()),
    encodes=lambda codec, x, hints: _native_pool_takes(codec, x.device, x.dtype, x.numel()),
    decode=lambda codec, payload, saved, meta: native_cpu.pool_decode(payload.contiguous(), meta, codec.bits,
                                                                      codec.geometry()),
    decodes=lambda codec, payload, saved, meta: _native_pool_takes(codec, payload.device, torch.int64, meta))


def _triton_pool_takes(codec: PoolOffsets, device: torch.device, dtype: torch.dtype, count: int) -> bool:
    return _whole_planes(codec, count) and triton_takes(device, dtype, count, (torch.int64, torch.int32))


def _triton_pool_encode(codec: PoolOffsets, x: torch.Tensor, hints: Hints) -> Encoded:
    """:meth:`PoolOffsets.encode` in one launch of :mod:`~actcomp.kernels.triton_masks`."""
    from actcomp.kernels import triton_masks

    flat = x.reshape(-1).contiguous()
    return Encoded(triton_masks.pool_encode(flat, codec.bits, codec.kernel, codec.stride, codec.padding,
                                            codec.dilation, codec.width, codec.out_size), (), x.numel())


def _triton_pool_decode(codec: PoolOffsets, payload: torch.Tensor, saved: tuple[torch.Tensor, ...],
                        meta: Any) -> torch.Tensor:
    """:meth:`PoolOffsets.decode` in one launch."""
    from actcomp.kernels import triton_masks

    return triton_masks.pool_decode(payload.contiguous(), codec.bits, meta, codec.kernel, codec.stride, codec.padding,
                                    codec.dilation, codec.width, codec.out_size)


register_implementation(
    PoolOffsets, "triton", encode=_triton_pool_encode,
    encodes=lambda codec, x, hints: _triton_pool_takes(codec, x.device, x.dtype, x.numel()),
    decode=_triton_pool_decode,
    decodes=lambda codec, payload, saved, meta: _triton_pool_takes(codec, payload.device, torch.int64, meta))
