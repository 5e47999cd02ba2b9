"""Exact codecs: what a backward reads of some saved tensors fits in a few bits per element.

A codec turns a saved tensor into :class:`Kept` (the tensors really stored and how to rebuild a
stand-in). The stand-in is not the tensor, but the op's own backward kernel, given the stand-in,
computes bit-for-bit the gradient it computes from the tensor:

- ReLU keeps its output and reads only ``not (y <= 0)``; Hardtanh (ReLU6) reads
  ``not (x <= low or x >= high)``; LeakyReLU reads ``x > 0``: one bit each
  (:func:`relu_mask`, :func:`hardtanh_mask`, :func:`leaky_relu_mask`). NaN keeps its branch.
- Dropout keeps its mask: ``bool`` (CUDA) or ``0``/``1/(1-p)`` floats (CPU): one bit plus the
  scale (:func:`dropout_mask`).
- MaxPool keeps its input only for its shape and the argmax as int64 flat positions; each
  argmax lies in its window, so its offset there needs ``log2(window)`` bits (2 for 2x2,
  4 for 3x3) and the input needs no bytes at all (:func:`pool_offsets`, :func:`shape_only`).

>>> import torch
>>> y = torch.relu(torch.randn(4, 256))
>>> kept = relu_mask(y)
>>> kept.nbytes, torch.equal(kept.unpack() > 0, y > 0)
(128, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from actcomp.kernels.bitpack import pack_bits, pack_codes, packed_size, unpack_bits, unpack_codes
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.layouts import dense_strides, restride


class Kept:
    """A saved tensor in compressed form: ``tensors`` are exactly what is stored."""

    __slots__ = ("codec", "tensors", "_rebuild")

    def __init__(self, codec: str, tensors: tuple[torch.Tensor, ...], rebuild: Callable[[tuple], torch.Tensor]):
        self.codec = codec
        self.tensors = tensors
        self._rebuild = rebuild

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def unpack(self) -> torch.Tensor:
        """The stand-in (or, for lossy codecs, the approximation) the backward reads."""
        return self._rebuild(self.tensors)

    def __repr__(self) -> str:
        return f"Kept({self.codec!r}, {self.nbytes:,} bytes)"


def _mask_codec(codec: str, tensor: torch.Tensor, predicate: Callable[[torch.Tensor], torch.Tensor],
                inside, outside) -> Kept:
    """``predicate`` (elementwise, giving bools) in bits, computed a chunk at a time so the bool
    temporaries stay a chunk's; unpacks to ``inside`` where it held and ``outside`` elsewhere,
    laid out like ``tensor``."""
    shape, stride, dtype, count = tensor.shape, dense_strides(tensor), tensor.dtype, tensor.numel()
    values = torch.tensor([outside, inside], dtype=dtype, device=tensor.device)
    flat = tensor.reshape(-1)
    length = aligned_length(tensor.device, count, 8)
    bits = torch.empty(packed_size(count, 1), dtype=torch.uint8, device=tensor.device)
    for start, stop in spans(count, length):
        bits[start // 8:packed_size(stop, 1)] = pack_bits(predicate(flat[start:stop]))

    ones_and_zeros = (inside, outside) == (1, 0)

    def rebuild(tensors: tuple) -> torch.Tensor:
        mask = unpack_bits(tensors[0], count).view(shape)
        if dtype == torch.bool:
            return restride(mask, stride)
        # 1 and 0 (ReLU's stand-in) are the mask itself, cast: cheaper than a select.
        standin = mask.to(dtype) if ones_and_zeros else torch.where(mask, values[1], values[0])
        return restride(standin, stride)

    return Kept(codec, (bits,), rebuild)


def relu_mask(result: torch.Tensor) -> Kept:
    """ReLU's saved output: its backward passes the gradient where ``not (y <= 0)``."""
    return _mask_codec("relu-mask", result, lambda part: ~(part <= 0), 1, 0)


def leaky_relu_mask(saved: torch.Tensor) -> Kept:
    """LeakyReLU's saved input (or output, in place): its backward branches on ``x > 0``."""
    return _mask_codec("relu-mask", saved, lambda part: part > 0, 1, 0)


def hardtanh_mask(saved: torch.Tensor, low: float, high: float) -> Kept | None:
    """Hardtanh's (ReLU6's) saved tensor: its backward passes the gradient where
    ``not (x <= low or x >= high)``. None when no value of the dtype lies strictly inside."""
    # The CPU kernel compares bf16/fp16 values as float32 against float32 bounds: comparing in
    # bf16 would round the bound (0.7 to 0.69921875) and block the value equal to it.
    compute = torch.float32 if saved.dtype in (torch.bfloat16, torch.float16) else saved.dtype
    middle = torch.tensor((low + high) / 2, dtype=saved.dtype)
    if not bool((middle.to(compute) > low) & (middle.to(compute) < high)):
        return None

    def inside(part: torch.Tensor) -> torch.Tensor:
        values = part.to(compute)
        return ~((values <= low) | (values >= high))

    kept = _mask_codec("clamp-mask", saved, inside, middle.item(), -math.inf)
    nan = saved.isnan()
    if not bool(nan.any()):
        return kept
    # For NaN the CPU kernel's answer depends on the code path: its vectorised loop tests
    # ``low < x < high`` (blocks NaN), its scalar tail ``not (x <= low or x >= high)`` (passes
    # it). Only NaN itself, at the same place in a tensor of the same layout, gets the same
    # answer: keep the NaN positions (8 bytes each) and put NaN back there.
    shape, rebuild_mask = saved.shape, kept._rebuild

    def rebuild(tensors: tuple) -> torch.Tensor:
        standin = rebuild_mask(tensors[:1])
        standin[torch.unravel_index(tensors[1], shape)] = math.nan
        return standin

    return Kept("clamp-mask", (*kept.tensors, nan.reshape(-1).nonzero().squeeze(1)), rebuild)


def dropout_mask(mask: torch.Tensor) -> Kept | None:
    """Dropout's saved mask: ``bool`` or floats that are all ``0`` or one scale ``1/(1-p)``.
    None when the floats are not of that form (then it is not a dropout mask)."""
    if mask.dtype == torch.bool:
        return _mask_codec("dropout-mask", mask, lambda part: part, True, False)
    scale = mask.amax() if mask.numel() else mask.new_zeros(())
    if not bool(((mask == 0) | (mask == scale)).all()):
        return None
    return _mask_codec("dropout-mask", mask, lambda part: part != 0, scale.item(), 0)


def shape_only(tensor: torch.Tensor) -> Kept:
    """A tensor whose backward reads only its shape and layout (MaxPool's input): no bytes."""
    shape, stride, dtype, device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
    contiguous = tensor.is_contiguous()

    def rebuild(tensors: tuple) -> torch.Tensor:
        if contiguous:
            return torch.zeros((), dtype=dtype, device=device).expand(shape)
        # The layout (channels_last) decides the gradient's layout: allocate, never fill.
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    return Kept("shape-only", (), rebuild)


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[-1]))


def pool_offsets(indices: torch.Tensor, input_shape: Sequence[int], kernel_size, stride, padding,
                 dilation) -> Kept | None:
    """max_pool2d's argmax (flat positions in each input plane) as the offset inside its window.

    None when a window has more than 256 positions (then a byte per offset is no saving).
    """
    kernel, step = _pair(kernel_size), _pair(stride if stride else kernel_size)
    pad, dil = _pair(padding), _pair(dilation)
    window = kernel[0] * kernel[1]
    if window > 256:
        return None
    bits = next(b for b in (1, 2, 4, 8) if window <= 2**b)
    width = int(input_shape[-1])
    shape, stride_out, device = indices.shape, dense_strides(indices), indices.device
    rows = torch.arange(shape[-2], device=device).view(-1, 1) * step[0] - pad[0]
    cols = torch.arange(shape[-1], device=device) * step[1] - pad[1]
    row_in_window = torch.div(torch.div(indices, width, rounding_mode="floor") - rows, dil[0], rounding_mode="floor")
    col_in_window = torch.div(indices % width - cols, dil[1], rounding_mode="floor")
    offsets = (row_in_window * kernel[1] + col_in_window).to(torch.uint8)

    def rebuild(tensors: tuple) -> torch.Tensor:
        offset = unpack_codes(tensors[0], bits, shape.numel()).view(shape).long()
        row = rows + torch.div(offset, kernel[1], rounding_mode="floor") * dil[0]
        col = cols + (offset % kernel[1]) * dil[1]
        return restride(row * width + col, stride_out)

    return Kept(f"pool-offsets{bits}", (pack_codes(offsets.reshape(-1), bits),), rebuild)
