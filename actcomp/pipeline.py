"""Pipelines: stages chained left to right, and the packed state they produce.

Non-finite values stay where they were, whatever the stages: ``compress`` sets every NaN,
+inf and -inf aside (their flat positions as int32, int64 beyond 2**31 elements, and their
values in the input dtype, both among the packed tensors), hands the stages the input with
those elements zeroed, and ``decompress`` puts them back exactly. So overflow reaches the
gradients just where it would without compression (loss scalers rely on it), and stages
only ever see finite values.

>>> import torch, actcomp
>>> pipeline = actcomp.parse("mink0.9+int8")
>>> x = torch.randn(4096)
>>> packed = pipeline.compress(x)
>>> packed.nbytes < 0.06 * x.numel() * x.element_size()
True
>>> pipeline.decompress(packed).shape
torch.Size([4096])
>>> x[[3, 70]] = torch.tensor([float("nan"), -float("inf")])
>>> y = pipeline.decompress(pipeline.compress(x))
>>> y[[3, 70]], int(y.isfinite().sum())
(tensor([nan, -inf]), 4094)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from actcomp.compressors.base import Compressor, Hints
from actcomp.errors import ActcompError
from actcomp.registry import build_stage, list_compressors
from actcomp.spec import format_spec, parse_spec, spec_error


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

    >>> import actcomp
    >>> actcomp.parse("int8").compress(torch.zeros(4, 256))
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


class Pipeline:
    """Stages applied left to right: at most one sparsifier, then at most one quantizer.

    >>> from actcomp.compressors import MinK, Int8
    >>> Pipeline(MinK(0.9), Int8()) == parse("mink0.9+int8")
    True
    """

    def __init__(self, *stages: Compressor):
        for stage in stages:
            if not isinstance(stage, Compressor):
                raise ActcompError(f"pipeline stages must be Compressor instances, got {stage!r}")
        problem = _order_problem([stage.kind for stage in stages])
        if problem is not None:
            index, why = problem
            raise ActcompError(f"{why} in pipeline {format_spec(s.stage_spec for s in stages)!r}")
        self.stages = tuple(stages)

    @property
    def spec(self) -> str:
        """The canonical spec string; ``parse(p.spec) == p``."""
        return format_spec(stage.stage_spec for stage in self.stages)

    def __str__(self) -> str:
        return self.spec

    def __repr__(self) -> str:
        return f"Pipeline({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def fresh(self) -> Pipeline:
        """Same spec, fresh per-stage state (each converted layer gets its own)."""
        return Pipeline(*(stage.fresh() for stage in self.stages))

    def compress(self, x: torch.Tensor, *, channel_dim: int | None = None) -> Packed:
        """Compress ``x``; ``channel_dim`` names its channel axis for channel-wise stages."""
        if not isinstance(x, torch.Tensor):
            raise ActcompError(f"compress expects a tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ActcompError(f"compress expects a floating-point tensor, got dtype {x.dtype}")
        if channel_dim is not None and x.dim() and not -x.dim() <= channel_dim < x.dim():
            raise ActcompError(f"channel_dim={channel_dim} is out of range for a tensor of shape {tuple(x.shape)}")
        hints = Hints(channel_dim=channel_dim if x.dim() else None)
        payload, non_finite = _set_aside_non_finite(x.detach())
        tensors = list(non_finite)
        stage_layouts = []
        for stage in self.stages:
            payload, saved, meta = stage.encode(payload, hints)
            tensors.extend(saved)
            stage_layouts.append((len(saved), meta))
            # Past an element sparsifier the payload is a flat list of values.
            if payload.dim() != x.dim():
                hints = Hints(channel_dim=None)
        tensors.append(payload)
        layout = PackedLayout(self.spec, x.shape, x.dtype, x.device, tuple(stage_layouts), len(non_finite))
        return Packed(tuple(tensors), layout)

    def decompress(self, packed: Packed) -> torch.Tensor:
        """The tensor :meth:`compress` was given, up to the stages' loss."""
        layout = packed.layout
        if layout.spec != self.spec:
            raise ActcompError(f"packed data was made by pipeline {layout.spec!r}, not {self.spec!r}")
        non_finite = packed.tensors[:layout.non_finite]
        *tensors, payload = packed.tensors[layout.non_finite:]
        end = len(tensors)
        for stage, (count, meta) in reversed(list(zip(self.stages, layout.stages))):
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


def parse(spec: str | Pipeline) -> Pipeline:
    """A new pipeline from a spec string (or a fresh copy of a pipeline).

    >>> parse("pmink0.9:block=4096+int4:group=64")
    Pipeline('pmink0.9:block=4096+int4:group=64')
    """
    if isinstance(spec, Pipeline):
        return spec.fresh()
    stage_specs = parse_spec(spec, list_compressors())
    stages = [build_stage(stage, spec) for stage in stage_specs]
    problem = _order_problem([stage.kind for stage in stages])
    if problem is not None:
        index, why = problem
        start, length = stage_specs[index].span
        raise spec_error(why, spec, start, length, "a pipeline is [sparsifier][+quantizer], e.g. 'mink0.9+int8'")
    return Pipeline(*stages)


def _order_problem(kinds: list[str]) -> tuple[int, str] | None:
    """Index and reason of the first stage that breaks [sparsifier][+quantizer]."""
    if not kinds:
        return 0, "a pipeline needs at least one stage"
    seen: set[str] = set()
    for index, kind in enumerate(kinds):
        if kind in seen:
            return index, f"a second {kind} is meaningless"
        if kind == "sparsifier" and "quantizer" in seen:
            return index, "a sparsifier after a quantizer would sparsify codes"
        seen.add(kind)
    return None
