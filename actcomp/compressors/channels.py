"""Channel sparsifiers (DropIT §3.3): keep whole channels, store only their ids.

The channel axis comes from the spec option ``dim`` or, when that is unset, from the caller
(the compressed layers pass 1 for convolutions and -1 for linear layers). With neither, the
stage refuses rather than guess. Kept: ``C - floor(drop_rate * C)`` channels.

>>> import torch
>>> x = torch.tensor([[1.0, 0.1, 5.0], [1.0, 0.1, 5.0]])
>>> ChannelMinK(0.5).decompress(ChannelMinK(0.5).compress(x, channel_dim=-1))
tensor([[1., 0., 5.],
        [1., 0., 5.]])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from actcomp.core import backends
from actcomp.core.backends import register_implementation
from actcomp.core.codec import Compressor, Encoded, Hints
from actcomp.core.registry import register_compressor
from actcomp.errors import ActcompError
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.thresholds import kept_count


@dataclass(frozen=True)
class _ChannelSparsifier(Compressor):
    kind = "sparsifier"
    takes_rate = True
    drop_rate: float = 0.9
    dim: int | None = None

    def choose(self, x: torch.Tensor, dim: int, kept: int) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        dim = self.dim if self.dim is not None else hints.channel_dim
        if dim is None:
            raise ActcompError(
                f"{self.name!r} needs to know the channel axis of a tensor of shape {tuple(x.shape)}: "
                f"set it in the spec ('{self.name}{self.drop_rate}:dim=1') or pass channel_dim="
            )
        if not -x.dim() <= dim < x.dim():
            raise ActcompError(f"channel dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
        dim %= x.dim()
        channels = x.shape[dim]
        kept = kept_count(channels, self.drop_rate)
        ids = self.choose(x, dim, kept).sort().values
        id_dtype = torch.int16 if channels <= 2**15 else torch.int32
        return Encoded(x.index_select(dim, ids), (ids.to(id_dtype),), KeptChannels(dim, channels))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: KeptChannels) -> torch.Tensor:
        shape = list(payload.shape)
        shape[meta.dim] = meta.channels
        return payload.new_zeros(shape).index_copy_(meta.dim, saved[0].long(), payload)


@dataclass(frozen=True)
class KeptChannels:
    """A channel sparsifier's metadata: the channel axis and its length before dropping."""

    dim: int
    channels: int


@register_compressor
@dataclass(frozen=True)
class ChannelMinK(_ChannelSparsifier):
    """Drops the channels with the smallest L2 norm (norms accumulated in fp32)."""

    name = "channel"

    def choose(self, x: torch.Tensor, dim: int, kept: int) -> torch.Tensor:
        return torch.topk(channel_norms(x, dim), kept, sorted=False).indices


def channel_norms(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The fp32 L2 norm of each channel along ``dim``, summed over slices of the other leading
    axis so that the fp32 copy of a low-precision ``x`` stays a slice's.

    >>> channel_norms(torch.tensor([[3.0, 1.0], [4.0, 0.0]]), dim=1)
    tensor([5., 1.])
    """
    other = [d for d in range(x.dim()) if d != dim]
    if not other:
        return x.float().abs()
    outer = other[0]  # slice along the first non-channel axis
    step = max(1, aligned_length(x.device, x.numel()) * x.shape[outer] // max(x.numel(), 1))
    squares = torch.zeros(x.shape[dim], dtype=torch.float32, device=x.device)
    for start, stop in spans(x.shape[outer], step):
        part = x.narrow(outer, start, stop - start)
        squares += torch.linalg.vector_norm(part, dim=other, dtype=torch.float32) ** 2
    return squares.sqrt()


@register_compressor
@dataclass(frozen=True)
class RandomChannels(_ChannelSparsifier):
    """Drops uniformly random channels (exactly ``floor(drop_rate * C)`` of them)."""

    name = "rchannel"
    draws_global_random = True

    def choose(self, x: torch.Tensor, dim: int, kept: int) -> torch.Tensor:
        return torch.randperm(x.shape[dim], device=x.device)[:kept]


def _triton_decode(codec: _ChannelSparsifier, payload: torch.Tensor, saved: tuple[torch.Tensor, ...],
                   meta: KeptChannels, finite: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`_ChannelSparsifier.decode` in one launch of :mod:`~actcomp.kernels.triton_channels`,
    NaN everywhere where ``finite`` is false."""
    from actcomp.kernels import triton_channels

    return triton_channels.scatter(payload.contiguous(), saved[0].contiguous(), meta.dim, meta.channels, finite)


def _triton_decodes(codec: _ChannelSparsifier, payload: torch.Tensor, saved: tuple[torch.Tensor, ...],
                    meta: KeptChannels) -> bool:
    if not backends.triton_runs_on(payload.device):
        return False
    from actcomp.kernels import triton_channels

    shape = list(payload.shape)
    shape[meta.dim] = meta.channels
    return triton_channels.takes(payload.dtype, math.prod(shape))


# The decode only (the encode's choice is a top-k of norms, or a permutation, torch's own).
# CUDA float32, bfloat16 and float16 (CPU under Triton's interpreter); both sparsifiers.
register_implementation(_ChannelSparsifier, "triton", decode=_triton_decode, decodes=_triton_decodes,
                        applies_finite_flag=True)
