"""Element sparsifiers (DropIT §3.3): keep some elements exactly, drop the rest to zero.

Every stage here keeps ``k = n - floor(drop_rate * n)`` elements (see
:func:`~actcomp.compressors.base.drop_count`; ``random`` keeps that many on average), hands
the kept values on as a flat payload in ascending position order, and stores the positions
with the cheapest encoding of :mod:`actcomp.compressors.positions`.

>>> import torch
>>> x = torch.tensor([[0.1, -3.0], [2.0, 0.2]])
>>> MinK(0.5).decompress(MinK(0.5).compress(x))
tensor([[ 0., -3.],
        [ 2.,  0.]])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actcomp.compressors.base import Compressor, Encoded, Hints, drop_count, setting
from actcomp.compressors.positions import encode_positions, scatter_kept
from actcomp.registry import register_compressor


class _ElementSparsifier(Compressor):
    """Shared encode/decode: subclasses only choose which positions to keep."""

    kind = "sparsifier"
    takes_rate = True

    def keep_index(self, flat: torch.Tensor, kept: int) -> torch.Tensor:
        """Flat positions of the ``kept`` elements to keep, in any order."""
        raise NotImplementedError

    def kept_count(self, count: int) -> int:
        return count - drop_count(count, self.drop_rate)

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        kept = self.kept_count(flat.numel())
        if kept == flat.numel():
            return Encoded(flat, (), ("dense", flat.numel(), kept))
        index = self.keep_index(flat, kept).sort().values
        saved, meta = encode_positions(index, flat.numel())
        return Encoded(flat[index], saved, meta)

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        return scatter_kept(payload, saved, meta)


@register_compressor
@dataclass(frozen=True)
class MinK(_ElementSparsifier):
    """Exact global min-k: drops the ``drop_rate`` fraction of smallest |x|.

    Ties at the threshold are broken by ``torch.topk`` (unspecified but exact in count).
    """

    name = "mink"
    drop_rate: float = 0.9

    def keep_index(self, flat: torch.Tensor, kept: int) -> torch.Tensor:
        return torch.topk(flat.abs(), kept, sorted=False).indices


@register_compressor
@dataclass(frozen=True)
class ParallelMinK(_ElementSparsifier):
    """Exact min-k inside consecutive blocks of ``block`` elements (DropIT's parallel min-k).

    Each full block keeps ``block - floor(drop_rate * block)`` elements; a last partial block
    of ``r`` elements keeps ``r - floor(drop_rate * r)``. One batched ``topk`` over rows is
    much faster than a global one.
    """

    name = "pmink"
    drop_rate: float = 0.9
    block: int = setting(2**14, minimum=1)

    def keep_index(self, flat: torch.Tensor, kept: int) -> torch.Tensor:
        count = flat.numel()
        magnitude = flat.abs()
        full_blocks, tail = divmod(count, self.block)
        parts = []
        if full_blocks:
            rows = magnitude[: full_blocks * self.block].view(full_blocks, self.block)
            row_kept = super().kept_count(self.block)
            index = torch.topk(rows, row_kept, dim=1, sorted=False).indices
            offsets = torch.arange(0, full_blocks * self.block, self.block, device=flat.device)
            parts.append((index + offsets.unsqueeze(1)).view(-1))
        if tail:
            tail_kept = super().kept_count(tail)
            index = torch.topk(magnitude[full_blocks * self.block:], tail_kept, sorted=False).indices
            parts.append(index + full_blocks * self.block)
        return torch.cat(parts)

    def kept_count(self, count: int) -> int:
        full_blocks, tail = divmod(count, self.block)
        return full_blocks * super().kept_count(self.block) + super().kept_count(tail)


@register_compressor
@dataclass(frozen=True)
class RandomDrop(_ElementSparsifier):
    """Drops each element independently with probability ``drop_rate``.

    The mask comes from a seeded generator, so only the seed (Python metadata) is kept, not
    the positions: the kept values are the whole cost. The kept count is binomial with
    mean ``(1 - drop_rate) * n``.
    """

    name = "random"
    draws_global_random = True
    drop_rate: float = 0.9

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        if self.drop_rate == 0:
            return Encoded(flat, (), ("dense", flat.numel(), flat.numel()))
        # The seed is drawn from the global generator, so torch.manual_seed reproduces runs.
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        mask = self._mask(seed, flat.numel(), flat.device)
        return Encoded(flat[mask], (), ("seeded", flat.numel(), seed))

    def _mask(self, seed: int, count: int, device: torch.device) -> torch.Tensor:
        generator = torch.Generator(device=device).manual_seed(seed)
        return torch.rand(count, generator=generator, device=device) >= self.drop_rate

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        kind, count, seed = meta
        if kind == "dense":
            return payload
        mask = self._mask(seed, count, payload.device)
        return payload.new_zeros(count).masked_scatter_(mask, payload)


@register_compressor
@dataclass(frozen=True)
class DropITReference(Compressor):
    """DropIT's released storage format, for comparison: global top-k, the kept values in the
    input dtype and their int32 indices (in top-k order). Costs 8 bytes per kept fp32 value.
    """

    name = "dropit"
    kind = "sparsifier"
    takes_rate = True
    drop_rate: float = 0.9

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        kept = flat.numel() - drop_count(flat.numel(), self.drop_rate)
        indices = torch.topk(flat.abs(), kept, sorted=False).indices
        return Encoded(flat[indices], (indices.to(torch.int32),), flat.numel())

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta) -> torch.Tensor:
        return payload.new_zeros(meta).index_copy_(0, saved[0].long(), payload)
