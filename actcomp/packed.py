"""Packed data: what a chain of stages keeps of a tensor, and the loop that runs the stages.

:func:`pack` runs the stages left to right, each one's payload feeding the next, and keeps
what each stage saves; :func:`unpack` runs them backwards. A :class:`~actcomp.pipeline.Pipeline`
and a stage used alone both pack through here. :class:`Hints` and :class:`Encoded` are what
passes between this loop and a stage.

Non-finite values stay where they were, whatever the stages: ``pack`` sets every NaN,
+inf and -inf aside (their flat positions as int32, int64 beyond 2**31 elements, and their
values in the input dtype, both among the packed tensors), hands the stages the input with
those elements zeroed, and ``unpack`` puts them back exactly. So overflow reaches the
gradients just where it would without compression (loss scalers rely on it), and stages
only ever see finite values.

>>> import torch
>>> from actcomp.compressors import Int8, MinK
>>> stages = (MinK(0.9), Int8())
>>> x = torch.randn(4096)
>>> x[[3, 70]] = torch.tensor([float("nan"), -float("inf")])
>>> packed = pack(stages, "mink0.9+int8", x)
>>> packed.nbytes < 0.06 * x.numel() * x.element_size()
True
>>> y = unpack(stages, "mink0.9+int8", packed)
>>> y[[3, 70]], int(y.isfinite().sum())
(tensor([nan, -inf]), 4094)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from actcomp.errors import ActcompError

if TYPE_CHECKING:
    from actcomp.compressors.base import Compressor


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
    # How many of the packed tensors, the first ones, hold the input's non-finite values:
    # 0, or 2 (their flat positions and their values).
    non_finite: int = 0


@dataclass(frozen=True, eq=False)
class Packed:
    """A compressed tensor: the tensors kept plus their layout.

    ``tensors`` are exactly what is stored, so ``nbytes`` is exact. To route them through
    autograd, pass them to ``ctx.save_for_backward``, keep ``layout`` on the side, and rebuild
    with ``Packed(ctx.saved_tensors, layout)``. Its repr shows what is kept, not the values:

    >>> from actcomp.compressors import Int8
    >>> pack([Int8()], "int8", torch.zeros(4, 256))
    Packed('int8', float32[4, 256] on cpu, 1,048 of 4,096 bytes (25.6%): float32[4], bfloat16[4], uint8[1024])
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


def pack(stages: Sequence[Compressor], spec: str, x: torch.Tensor, *, channel_dim: int | None = None,
         states: Sequence[Any] | None = None) -> Packed:
    """Run ``stages`` (whose spec string is ``spec``) on ``x``; ``channel_dim`` names its channel
    axis for channel-wise stages. ``states`` are the stages' runtime states, which the caller
    keeps between calls (see :meth:`~actcomp.compressors.base.Compressor.initial_state`);
    without them every stage starts from its initial state.

    >>> from actcomp.compressors import MinK
    >>> packed = pack([MinK(0.5)], "mink0.5", torch.tensor([1.0, -4.0, 2.0, 0.5]))
    >>> packed.tensors  # the kept positions as a bitmask (0b0110), then the kept values
    (tensor([6], dtype=torch.uint8), tensor([-4.,  2.]))
    """
    if not isinstance(x, torch.Tensor):
        raise ActcompError(f"compress expects a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ActcompError(f"compress expects a floating-point tensor, got dtype {x.dtype}")
    if channel_dim is not None and x.dim() and not -x.dim() <= channel_dim < x.dim():
        raise ActcompError(f"channel_dim={channel_dim} is out of range for a tensor of shape {tuple(x.shape)}")
    if states is None:
        states = [stage.initial_state() for stage in stages]
    hints = Hints(channel_dim=channel_dim if x.dim() else None)
    payload, non_finite = _set_aside_non_finite(x.detach())
    tensors = list(non_finite)
    stage_layouts = []
    for stage, state in zip(stages, states, strict=True):
        # Only stateful stages take a third argument: every other stage keeps encode(x, hints).
        payload, saved, meta = stage.encode(payload, hints) if state is None else stage.encode(payload, hints, state)
        tensors.extend(saved)
        stage_layouts.append((len(saved), meta))
        # Past an element sparsifier the payload is a flat list of values.
        if payload.dim() != x.dim():
            hints = Hints(channel_dim=None)
    tensors.append(payload)
    layout = PackedLayout(spec, x.shape, x.dtype, x.device, tuple(stage_layouts), len(non_finite))
    return Packed(tuple(tensors), layout)


def unpack(stages: Sequence[Compressor], spec: str, packed: Packed) -> torch.Tensor:
    """The tensor :func:`pack` was given, up to the stages' loss; ``packed`` must come from
    stages with the same ``spec``."""
    layout = packed.layout
    if layout.spec != spec:
        raise ActcompError(f"packed data was made by pipeline {layout.spec!r}, not {spec!r}")
    non_finite = packed.tensors[:layout.non_finite]
    *tensors, payload = packed.tensors[layout.non_finite:]
    end = len(tensors)
    for stage, (count, meta) in reversed(list(zip(stages, layout.stages))):
        saved = tuple(tensors[end - count:end])
        end -= count
        payload = stage.decode(payload, saved, meta)
    if non_finite:
        positions, values = non_finite
        # Out of place: a stage may hand back one of the packed tensors itself.
        payload = payload.reshape(-1).index_put((positions.long(),), values)
    return payload.reshape(layout.shape)


def _set_aside_non_finite(x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``x`` with its NaN and +-inf zeroed, and their flat positions and exact values; ``x``
    itself and no tensors when every element is finite."""
    # A NaN or inf anywhere makes the sum non-finite, so one reduction clears the usual case.
    # fp16 sums into fp32: large finite fp16 tensors would overflow their own dtype.
    total = x.sum(dtype=torch.float32) if x.dtype == torch.float16 else x.sum()
    if bool(total.isfinite()):
        return x, ()
    non_finite = ~x.isfinite()
    positions = non_finite.reshape(-1).nonzero().view(-1)
    if positions.numel() == 0:  # the finite values summed past the dtype's range
        return x, ()
    values = x.reshape(-1)[positions]
    index_dtype = torch.int32 if x.numel() < 2**31 else torch.int64
    return x.masked_fill(non_finite, 0), (positions.to(index_dtype), values)
