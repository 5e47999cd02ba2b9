"""The loop that runs a chain of stages: :func:`pack` makes a :class:`~actcomp.core.packed.Packed`, :func:`unpack` undoes it.

:func:`pack` runs the stages left to right, each one's payload feeding the next, and keeps
what each stage saves; :func:`unpack` runs them backwards. A :class:`~actcomp.core.pipeline.Pipeline`
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
from typing import Any, Protocol

import torch

from actcomp.core import backends, watchers
from actcomp.core.packed import Encoded, Hints, Packed, PackedLayout
from actcomp.errors import ActcompError
from actcomp.kernels.layouts import restride


class Stage(Protocol):
    """What the loop needs of a stage (:class:`~actcomp.core.codec.Compressor` is one)."""

    takes: frozenset[str]
    sets_aside_non_finite: bool

    def encode(self, x: torch.Tensor, hints: Hints, *state: Any) -> Encoded: ...

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor: ...

    def initial_state(self) -> Any: ...

    def compiles(self) -> bool: ...


def pack(stages: Sequence[Stage], spec: str, x: torch.Tensor, *, channel_dim: int | None = None,
         states: Sequence[Any] | None = None, set_aside_non_finite: bool = True) -> Packed:
    """Run ``stages`` (whose spec string is ``spec``) on ``x``; ``channel_dim`` names its channel
    axis for channel-wise stages. ``states`` are the stages' runtime states, which the caller
    keeps between calls (see :meth:`~actcomp.core.codec.Compressor.initial_state`);
    without them every stage starts from its initial state. ``set_aside_non_finite=False``
    skips the eager-only check for NaN and inf (one sum read back to Python): the stages then
    see them, and a quantizer's group holding one decodes to NaN.

    >>> from actcomp.compressors import MinK
    >>> packed = pack([MinK(0.5)], "mink0.5", torch.tensor([1.0, -4.0, 2.0, 0.5]))
    >>> packed.tensors  # the kept positions as a bitmask (0b0110), then the kept values
    (tensor([6], dtype=torch.uint8), tensor([-4.,  2.]))
    """
    if watchers.active():
        return watchers.watched("pack", x, lambda: _pack(stages, spec, x, channel_dim, states, set_aside_non_finite))
    return _pack(stages, spec, x, channel_dim, states, set_aside_non_finite)


def _pack(stages: Sequence[Stage], spec: str, x: torch.Tensor, channel_dim: int | None,
          states: Sequence[Any] | None, set_aside_non_finite: bool) -> Packed:
    if not isinstance(x, torch.Tensor):
        raise ActcompError(f"compress expects a tensor, got {type(x).__name__}")
    category = "float" if x.is_floating_point() else "bool" if x.dtype == torch.bool else "int"
    if category not in stages[0].takes:
        expected = "a floating-point" if stages[0].takes == {"float"} else f"a {' or '.join(sorted(stages[0].takes))}"
        raise ActcompError(f"compress expects {expected} tensor, got dtype {x.dtype}")
    if channel_dim is not None and x.dim() and not -x.dim() <= channel_dim < x.dim():
        raise ActcompError(f"channel_dim={channel_dim} is out of range for a tensor of shape {tuple(x.shape)}")
    if states is None:
        states = [stage.initial_state() for stage in stages]
    hints = Hints(channel_dim=channel_dim if x.dim() else None)
    payload, non_finite = x.detach(), ()
    if category == "float" and stages[0].sets_aside_non_finite and set_aside_non_finite:
        payload, non_finite = _set_aside_non_finite(payload)
    tensors = list(non_finite)
    stage_layouts = []
    for stage, state in zip(stages, states, strict=True):
        # Only stateful stages take a third argument: every other stage keeps encode(x, hints).
        payload, saved, meta = backends.encode(stage, payload, hints) if state is None else stage.encode(payload, hints, state)
        tensors.extend(saved)
        stage_layouts.append((len(saved), meta))
        # Past an element sparsifier the payload is a flat list of values.
        if payload.dim() != x.dim():
            hints = Hints(channel_dim=None)
    tensors.append(payload)
    layout = PackedLayout(spec, x.shape, x.dtype, x.device, tuple(stage_layouts), len(non_finite))
    return Packed(tuple(tensors), layout)


def unpack(stages: Sequence[Stage], spec: str, packed: Packed) -> torch.Tensor:
    """The tensor :func:`pack` was given, up to the stages' loss; ``packed`` must come from
    stages with the same ``spec``."""
    if watchers.active():
        return watchers.watched("unpack", packed, lambda: _unpack(stages, spec, packed))
    return _unpack(stages, spec, packed)


def _unpack(stages: Sequence[Stage], spec: str, packed: Packed) -> torch.Tensor:
    layout = packed.layout
    if layout.spec != spec:
        raise ActcompError(f"packed data was made by pipeline {layout.spec!r}, not {spec!r}")
    non_finite = packed.tensors[:layout.non_finite]
    *tensors, payload = packed.tensors[layout.non_finite:]
    end = len(tensors)
    for stage, (count, meta) in reversed(list(zip(stages, layout.stages))):
        saved = tuple(tensors[end - count:end])
        end -= count
        payload = backends.decode(stage, payload, saved, meta)
    if non_finite:
        positions, values = non_finite
        # Out of place: a stage may hand back one of the packed tensors itself.
        payload = payload.reshape(-1).index_put((positions.long(),), values)
    return _laid_out(payload, layout)


def _laid_out(payload: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """The decoded ``payload`` in the packed tensor's shape, axis order and strides."""
    if layout.permutation is None:
        out = payload.reshape(layout.shape)
    else:
        out = payload.reshape([layout.shape[axis] for axis in layout.permutation])
        out = out.permute(sorted(range(out.dim()), key=layout.permutation.__getitem__))
    if layout.strides is None or out.stride() == layout.strides:
        return out
    if payload.dim() == 1 and payload.stride() == (0,):
        # A stand-in nobody reads the values of (a max pool's input): a broadcast zero serves a
        # contiguous tensor, an uninitialized one any other layout, which decides the gradient's.
        if layout.strides == torch.empty(layout.shape, device="meta").stride():
            return out
        return torch.empty_strided(layout.shape, layout.strides, dtype=out.dtype, device=out.device)
    return restride(out, layout.strides)


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
