"""Packed data: what a chain of codecs keeps of a tensor (:class:`Packed`), and what passes
between the chain and one codec (:class:`Hints` in, :class:`Encoded` out).

Data only: the loop that makes a :class:`Packed` is :mod:`actcomp.core.chain`.

>>> Packed((torch.zeros(4, dtype=torch.uint8),), PackedLayout("int8", torch.Size([4]), torch.float32, torch.device("cpu"), ()))
Packed('int8', float32[4] on cpu, 4 of 16 bytes (25.0%): uint8[4])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class Hints:
    """What a caller knows about the tensor that the tensor itself does not say.

    ``channel_dim`` is the channel axis: 1 for (N, C, ...) conv inputs, -1 for (..., C)
    linear inputs, None when the tensor has no channel structure.

    >>> Hints(channel_dim=1)
    Hints(channel_dim=1)
    """

    channel_dim: int | None = None


class Encoded(NamedTuple):
    """One stage's output: the payload for the next stage, what it keeps, and metadata."""

    payload: torch.Tensor
    saved: tuple[torch.Tensor, ...]
    meta: Any


@dataclass(frozen=True)
class PackedLayout:
    """The Python-side metadata of a :class:`Packed`: everything but the tensors."""

    spec: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    # Per stage: how many of the packed tensors are its own, and its metadata.
    stages: tuple[tuple[int, Any], ...]
    # Whether the first packed tensor is the input's finite flag (0-d bool, see
    # actcomp.core.chain): a tensor holding NaN or inf decodes to NaN everywhere.
    flagged: bool = False
    # Whole-model mode packs a saved tensor flat, in the axis order ``permutation`` (None: its
    # own), and rebuilds it with ``strides`` (None: contiguous), since backward kernels choose
    # by strides.
    permutation: tuple[int, ...] | None = None
    strides: tuple[int, ...] | None = None


@dataclass(frozen=True, eq=False)
class Packed:
    """A compressed tensor: the tensors kept plus their layout.

    ``tensors`` are exactly what is stored, so ``nbytes`` is exact. To route them through
    autograd, pass them to ``ctx.save_for_backward``, keep ``layout`` on the side, and rebuild
    with ``Packed(ctx.saved_tensors, layout)``. Its repr shows what is kept, not the values:

    >>> from actcomp.compressors import Int8
    >>> Int8().compress(torch.zeros(4, 256))
    Packed('int8', float32[4, 256] on cpu, 1,049 of 4,096 bytes (25.6%): bool[], float32[4], bfloat16[4], uint8[1024])
    """

    tensors: tuple[torch.Tensor, ...]
    layout: PackedLayout

    @property
    def nbytes(self) -> int:
        """Bytes of the kept tensors (sum of numel * element size)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __repr__(self) -> str:
        layout = self.layout
        dense = layout.shape.numel() * layout.dtype.itemsize
        share = f" ({self.nbytes / dense:.1%})" if dense else ""
        kept = ", ".join(_typed_shape(t.dtype, t.shape) for t in self.tensors)
        return (
            f"Packed({layout.spec!r}, {_typed_shape(layout.dtype, layout.shape)} on {layout.device}, "
            f"{self.nbytes:,} of {dense:,} bytes{share}: {kept})"
        )


def _typed_shape(dtype: torch.dtype, shape: torch.Size) -> str:
    """``float32[4, 256]``: a tensor's dtype and shape, without its values."""
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"
