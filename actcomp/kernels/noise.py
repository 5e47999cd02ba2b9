"""Uniform noise for stochastic rounding: cheap, chunkable, and without torch's global generator.

Drawing the noise from torch's global generator would move that generator: a dropout after a
compressed layer would then draw a different mask than in plain PyTorch. Drawing a fresh value
per element would cost more than the rounding itself (``torch.rand`` of a tensor takes half
the time of cloning it on CPU). So the noise for a tensor is built from a *table* of about
65k uniform draws (:data:`PERIOD`, rounded up to a multiple of the group size): the flat tensor
is cut into periods of the table's length, and period ``k`` reads the table rotated by a
pseudo-random offset ``r_k``. Every element gets a U[0, 1) draw, so rounding stays unbiased;
two elements share a draw only by chance (about one pair in 65k), never in a pattern that
follows the tensor's shape (a channel, a token, a repeated image).

The table and the offsets are a function of ``torch.initial_seed()`` (reading it consumes no
number) and a fingerprint of an evenly spaced *sample* of the values, drawn from a generator of
this module's own. That makes the noise reproducible wherever the values are:

- ``torch.manual_seed(s)`` makes runs reproducible, also when repeated in one process;
- a checkpointed layer (``torch.utils.checkpoint``) recomputes its input and rounds it with the
  same noise as in the forward, so its gradients equal the uncheckpointed layer's;
- different values (every step of training: the weights move) get independent noise, while
  rounding the very same values twice under one seed gives the same codes twice.

A chunk of the tensor asks for its own slice (:meth:`RoundingNoise.slice`), so a chunked
quantizer rounds exactly as a whole-tensor one would.

>>> import torch
>>> x = torch.randn(1000)
>>> before = torch.get_rng_state()
>>> noise = RoundingNoise(x, group=256)
>>> torch.equal(torch.get_rng_state(), before), torch.equal(noise.slice(0, 70_000), RoundingNoise(x, 256).slice(0, 70_000))
(True, True)
>>> whole = noise.slice(0, 200_000)
>>> torch.equal(whole[65_000:135_000], noise.slice(65_000, 70_000))
True
"""

from __future__ import annotations

import torch

PERIOD = 2**16
# Elements of the values read to seed the noise: enough that any change of the values
# a training step makes shows up, few enough to cost nothing.
FINGERPRINT_SAMPLE = 1024

_MASK64 = 2**64 - 1
# Same-size integer views of float dtypes: their bit patterns sum exactly.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_generators: dict[torch.device, torch.Generator] = {}


def period_for(group: int) -> int:
    """The table length for groups of ``group``: the multiple of it nearest above :data:`PERIOD`,
    so a group never straddles a period's end."""
    return -(-PERIOD // group) * group


class RoundingNoise:
    """The noise for rounding ``x`` in groups of ``group``: float32 values in [0, 1) on ``x``'s
    device, a function of ``torch.initial_seed()`` and a sample of ``x``'s values, drawn without
    touching the global generator."""

    def __init__(self, x: torch.Tensor, group: int = 1):
        generator = _generators.get(x.device)
        if generator is None:
            generator = _generators[x.device] = torch.Generator(device=x.device)
        self.seed = _mix(torch.initial_seed() ^ _mix(_fingerprint(x)))
        generator.manual_seed(self.seed)
        self.period = period_for(group)
        table = torch.rand(self.period, generator=generator, device=x.device, dtype=torch.float32)
        # Twice over, so any rotation of the table is one slice of it.
        self._doubled = torch.cat([table, table])

    def offset(self, period: int) -> int:
        """Where period number ``period`` starts reading the table (plain Python: no device sync)."""
        return _mix(self.seed ^ _mix(period)) % self.period

    def slice(self, start: int, count: int) -> torch.Tensor:
        """The noise of flat elements ``start`` to ``start + count``."""
        pieces = []
        position, stop = start, start + count
        while position < stop:
            period, within = divmod(position, self.period)
            length = min(self.period - within, stop - position)
            begin = self.offset(period) + within
            pieces.append(self._doubled[begin:begin + length])
            position += length
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _fingerprint(x: torch.Tensor) -> int:
    """The sum of the bit patterns of up to :data:`FINGERPRINT_SAMPLE` evenly spaced elements of ``x``, and
    its size. Integer sums are exact, so equal values give an equal fingerprint whatever their
    memory layout."""
    count = x.numel()
    step = max(1, count // FINGERPRINT_SAMPLE)
    if x.is_contiguous():
        sample = x.reshape(-1)[::step]
    else:  # the same elements, read in logical order without copying the tensor
        positions = torch.arange(0, count, step, device=x.device)
        sample = x[torch.unravel_index(positions, x.shape)].contiguous()
    return int(sample.view(_BITS[x.element_size()]).sum(dtype=torch.int64)) ^ (count << 40)


def _mix(value: int) -> int:
    """``value`` through splitmix64's mixer: nearby inputs give unrelated seeds, and the noise
    never repeats the global stream that ``torch.manual_seed`` with the same number starts
    (that stream may have made the very values being rounded)."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
