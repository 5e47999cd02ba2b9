"""The loop that runs a chain of stages: :func:`pack` makes a :class:`~actcomp.core.packed.Packed`, :func:`unpack` undoes it.

:func:`pack` runs the stages left to right, each one's payload feeding the next, and keeps
what each stage saves; :func:`unpack` runs them backwards. A :class:`~actcomp.core.pipeline.Pipeline`
and a stage used alone both pack through here. :class:`Hints` and :class:`Encoded` are what
passes between this loop and a stage.

A tensor holding NaN, +inf or -inf decodes to NaN everywhere: ``pack`` keeps a 0-d bool
*finite flag* (one reduction on the tensor's device, never read back) as the first packed
tensor, and ``unpack`` turns the whole output to NaN where it is false. So overflow reaches
the gradients (loss scalers see it and skip the step) on every device, eager or compiled,
with no host read and a number of packed tensors fixed by the stages. The stages themselves
see the values as they are; what they make of a non-finite value does not matter.

>>> import torch
>>> from actcomp.compressors import Int8, MinK
>>> stages = (MinK(0.9), Int8())
>>> x = torch.randn(4096)
>>> x[[3, 70]] = torch.tensor([float("nan"), -float("inf")])
>>> packed = pack(stages, "mink0.9+int8", x)
>>> packed.nbytes < 0.06 * x.numel() * x.element_size()
True
>>> bool(unpack(stages, "mink0.9+int8", packed).isnan().all())
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from actcomp import host_allocator
from actcomp.core import backends, watchers
from actcomp.core.packed import Encoded, Hints, Packed, PackedLayout
from actcomp.errors import ActcompError
from actcomp.kernels.layouts import restride


class Stage(Protocol):
    """What the loop needs of a stage (:class:`~actcomp.core.codec.Compressor` is one)."""

    takes: frozenset[str]
    flags_non_finite: bool

    def encode(self, x: torch.Tensor, hints: Hints, *state: Any) -> Encoded: ...

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor: ...

    def initial_state(self) -> Any: ...

    def compiles(self) -> bool: ...


def pack(stages: Sequence[Stage], spec: str, x: torch.Tensor, *, channel_dim: int | None = None,
         states: Sequence[Any] | None = None, flag_non_finite: bool = True) -> Packed:
    """Run ``stages`` (whose spec string is ``spec``) on ``x``; ``channel_dim`` names its channel
    axis for channel-wise stages. ``states`` are the stages' runtime states, which the caller
    keeps between calls (see :meth:`~actcomp.core.codec.Compressor.initial_state`);
    without them every stage starts from its initial state. ``flag_non_finite=False`` skips
    the finite flag (one reduction): a non-finite value then decodes as the stages make it (a
    quantizer's group holding NaN decodes to NaN, one holding inf saturates).

    >>> from actcomp.compressors import MinK
    >>> packed = pack([MinK(0.5)], "mink0.5", torch.tensor([1.0, -4.0, 2.0, 0.5]))
    >>> packed.tensors  # the finite flag, the kept positions as a bitmask (0b0110), the kept values
    (tensor(True), tensor([6], dtype=torch.uint8), tensor([-4.,  2.]))
    """
    if watchers.active():
        return watchers.watched("pack", x, lambda: _pack(stages, spec, x, channel_dim, states, flag_non_finite))
    return _pack(stages, spec, x, channel_dim, states, flag_non_finite)


def _pack(stages: Sequence[Stage], spec: str, x: torch.Tensor, channel_dim: int | None,
          states: Sequence[Any] | None, flag_non_finite: bool) -> Packed:
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
    if not backends.tracing(x):
        host_allocator.apply_request()  # what a conversion asked of glibc, once, outside compiled graphs
    hints = Hints(channel_dim=channel_dim if x.dim() else None)
    payload = x.detach()
    # Flagged unless every stage keeps NaN and inf itself (an exact mask, a cast, a sparsifier
    # that drops nothing).
    flagged = category == "float" and flag_non_finite and any(
        stage.flags_non_finite and not stage.lossless() for stage in stages)
    tensors = []
    stage_layouts = []
    for position, (stage, state) in enumerate(zip(stages, states, strict=True)):
        # Only stateful stages take a third argument: every other stage keeps encode(x, hints).
        if state is not None:
            if flagged and position == 0:
                tensors.append(finite_flag(payload))
            payload, saved, meta = stage.encode(payload, hints, state)
        elif flagged and position == 0:
            # The first stage reads the input: its kernel writes the flag as it does, where it can.
            (payload, saved, meta), flag = backends.encode_flagged(stage, payload, hints, finite_flag)
            tensors.append(flag)
        else:
            payload, saved, meta = backends.encode(stage, payload, hints)
        tensors.extend(saved)
        stage_layouts.append((len(saved), meta))
        # Past an element sparsifier the payload is a flat list of values.
        if payload.dim() != x.dim():
            hints = Hints(channel_dim=None)
    tensors.append(payload)
    layout = PackedLayout(spec, x.shape, x.dtype, x.device, tuple(stage_layouts), flagged)
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
    *tensors, payload = packed.tensors[1:] if layout.flagged else packed.tensors
    end = len(tensors)
    for position, (stage, (count, meta)) in reversed(list(enumerate(zip(stages, layout.stages)))):
        saved = tuple(tensors[end - count:end])
        end -= count
        # The first stage decodes last: it applies the finite flag, in its own pass where its kernel can.
        finite = packed.tensors[0] if layout.flagged and position == 0 else None
        payload = backends.decode(stage, payload, saved, meta, finite=finite)
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


def finite_flag(x: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``x``'s device: whether every element of ``x`` is finite. One
    reduction, never read back: a Triton kernel where they run
    (:func:`~actcomp.core.backends.triton_runs_on`), else ``torch.aminmax``.

    >>> finite_flag(torch.tensor([1.0, 2.0])), finite_flag(torch.tensor([1.0, float("inf")]))
    (tensor(True), tensor(False))
    """
    # While Dynamo traces, the eager ops: a kernel is an opaque call it would break the graph at.
    if backends.triton_runs_on(x.device) and not backends.tracing(x):
        from actcomp.kernels import triton_flags

        if triton_flags.takes(x):
            return triton_flags.finite_flag(x)  # two launches where the eager flag is four on CUDA
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    # The extremes, not a sum: a sum of finite values near the dtype's maximum overflows, and
    # that finite tensor would decode to NaN. NaN propagates through both.
    low, high = torch.aminmax(x)
    return low.isfinite() & high.isfinite()
