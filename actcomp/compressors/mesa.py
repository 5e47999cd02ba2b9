"""Mesa-style 8-bit quantization with running (EMA) ranges per channel group.

Each pipeline (one per converted layer) keeps a :class:`RunningRange` for its mesa8 stage:
``min``/``max`` per channel group, updated on every compress:
``r = momentum * r + (1 - momentum) * batch``. A stage used alone keeps nothing between
calls, so each call uses the batch's own range. Values are quantized to the nearest of 256
levels of the running range; values outside it are clamped to the nearest end (never
wrapped). Inputs are finite: the pipeline sets NaN and +-inf aside (they count as 0 in the
batch range) and puts them back at their positions.

Groups split the channel axis (given by the caller, e.g. 1 for conv inputs) into ``groups``
equal parts. A payload without a channel axis (after an element sparsifier) has one group.

>>> import torch
>>> stage = Mesa8()
>>> x = torch.linspace(0, 1, 256)
>>> bool((stage.decompress(stage.compress(x)) - x).abs().max() <= 0.5 / 255 + 1e-6)
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actcomp.core import backends
from actcomp.core.backends import register_implementation
from actcomp.core.codec import Compressor, Encoded, Hints, setting
from actcomp.core.registry import register_compressor
from actcomp.errors import ActcompError
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.device_constants import true_divide

_LEVELS = 255


@dataclass
class RunningRange:
    """One pipeline's running per-group minimum and maximum for :class:`Mesa8` (None until
    the first batch).

    >>> running = RunningRange()
    >>> running.update(torch.tensor([0.0]), torch.tensor([4.0]), momentum=0.5)
    (tensor([0.]), tensor([4.]))
    >>> running.update(torch.tensor([-2.0]), torch.tensor([2.0]), momentum=0.5)
    (tensor([-1.]), tensor([3.]))
    """

    low: torch.Tensor | None = None
    high: torch.Tensor | None = None

    def update(self, low: torch.Tensor, high: torch.Tensor, momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Blend a batch's range in and return the running one."""
        previous = self.low
        if previous is None or previous.shape != low.shape or previous.device != low.device:
            # The first batch (or a new layout) starts the running range.
            self.low, self.high = low, high
        else:
            weight = 1 - momentum
            self.low, self.high = previous.lerp(low, weight), self.high.lerp(high, weight)
        return self.low, self.high


@register_compressor
@dataclass(frozen=True)
class Mesa8(Compressor):
    name = "mesa8"
    kind = "quantizer"
    groups: int = setting(1, minimum=1)
    momentum: float = setting(0.9, minimum=0, below=1)

    def initial_state(self) -> RunningRange:
        return RunningRange()

    def _grouped(self, x: torch.Tensor, channel_dim: int | None) -> tuple[torch.Tensor, int | None]:
        """``x`` viewed as (outer, groups, channels per group, inner), and its channel axis."""
        if channel_dim is None or x.dim() == 0:
            if self.groups > 1:
                raise ActcompError(
                    f"mesa8:groups={self.groups} needs a channel axis, but this tensor of shape "
                    f"{tuple(x.shape)} has none (e.g. it follows an element sparsifier)"
                )
            return x.reshape(1, 1, 1, -1), None
        channel_dim %= x.dim()
        channels = x.shape[channel_dim]
        if channels % self.groups:
            raise ActcompError(f"mesa8:groups={self.groups} does not divide the {channels} channels of shape {tuple(x.shape)}")
        outer = x.shape[:channel_dim].numel()
        inner = x.shape[channel_dim + 1:].numel()
        return x.reshape(outer, self.groups, channels // self.groups, inner), channel_dim

    def encode(self, x: torch.Tensor, hints: Hints, state: RunningRange | None = None) -> Encoded:
        # Called directly without a state, this is one call of a fresh pipeline.
        running = self.initial_state() if state is None else state
        grouped, channel_dim = self._grouped(x, hints.channel_dim)
        if x.numel() == 0:
            empty = torch.zeros(self.groups, device=x.device)
            return Encoded(x.to(torch.uint8), (empty, empty), (channel_dim, x.dtype))
        # Reductions over the other axes allocate nothing of x's size.
        # A group's NaN or inf would poison the running range for every later batch: such a
        # group's extreme counts as 0 (the tensor itself decodes to NaN, by the chain's flag).
        batch_low = grouped.amin(dim=(0, 2, 3)).float().nan_to_num_(0.0, 0.0, 0.0)
        batch_high = grouped.amax(dim=(0, 2, 3)).float().nan_to_num_(0.0, 0.0, 0.0)
        low, high = running.update(batch_low, batch_high, self.momentum)
        scale = true_divide((high - low).clamp_(min=0), _LEVELS)
        safe_scale = torch.where(scale > 0, scale, 1.0)
        low_b, inverse_b = low.view(1, -1, 1, 1), (1 / safe_scale).view(1, -1, 1, 1)

        def quantize(part: torch.Tensor) -> torch.Tensor:
            # Through int16: float -> uint8 is not vectorized on CPU.
            return ((part.float() - low_b) * inverse_b).round_().clamp_(0, _LEVELS).to(torch.int16)

        codes = _map_rows(grouped, torch.uint8, quantize)
        return Encoded(codes.view(x.shape), (low.clone(), scale), (channel_dim, x.dtype))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        channel_dim, dtype = meta
        low, scale = saved
        grouped, _ = self._grouped(payload, channel_dim)
        low_b, scale_b = low.view(1, -1, 1, 1), scale.view(1, -1, 1, 1)
        # A multiply then an add, never a fused multiply-add (eager addcmul's): the compiled
        # decode, which does not fuse, then gives the same values.
        values = _map_rows(grouped, dtype, lambda part: part.float().mul_(scale_b).add_(low_b))
        return values.view(payload.shape)


def _map_rows(grouped: torch.Tensor, dtype: torch.dtype, function) -> torch.Tensor:
    """``function`` over slices of ``grouped`` (outer, groups, channels per group, inner), written
    into one new tensor of ``dtype``: slices of the outer axis, or of the inner one when there
    is a single outer row (a batch of one, or the channels first)."""
    out = torch.empty(grouped.shape, dtype=dtype, device=grouped.device)
    if grouped.numel() == 0:
        return out
    axis = 0 if grouped.shape[0] > 1 else 3
    step = max(1, aligned_length(grouped.device, grouped.numel()) * grouped.shape[axis] // grouped.numel())
    for start, stop in spans(grouped.shape[axis], step):
        out.narrow(axis, start, stop - start).copy_(function(grouped.narrow(axis, start, stop - start)))
    return out


def _triton_decode(codec: Mesa8, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta,
                   finite: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`Mesa8.decode` in one launch of :mod:`~actcomp.kernels.triton_mesa`, NaN everywhere
    where ``finite`` is false."""
    from actcomp.kernels import triton_mesa

    channel_dim, dtype = meta
    grouped, _ = codec._grouped(payload, channel_dim)
    span = grouped.shape[2] * grouped.shape[3]  # the values of one group in one outer row
    low, scale = (tensor.contiguous() for tensor in saved)
    return triton_mesa.dequantize(payload.reshape(-1).contiguous(), low, scale, max(span, 1), dtype,
                                  finite).view(payload.shape)


def _triton_decodes(codec: Mesa8, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> bool:
    if not backends.triton_runs_on(payload.device):
        return False
    from actcomp.kernels import triton_mesa

    return triton_mesa.takes(meta[1], payload.numel()) and all(tensor.dtype == torch.float32 for tensor in saved)


# The decode only: the chain encodes a stateful stage itself (its running range), undispatched.
# CUDA float32, bfloat16 and float16 (CPU under Triton's interpreter).
register_implementation(Mesa8, "triton", decode=_triton_decode, decodes=_triton_decodes, applies_finite_flag=True)
