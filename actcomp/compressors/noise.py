"""Uniform noise for stochastic rounding, from generators of its own.

Drawing the noise from torch's global generator would move that generator: a dropout after a
compressed layer would then draw a different mask than in plain PyTorch. So each device has
a torch.Generator of its own, seeded on every call from ``torch.initial_seed()`` (reading it
consumes no number) and the values being rounded. The noise is thus a function of the seed
and the values, which makes it reproducible wherever the values are:

- ``torch.manual_seed(s)`` makes runs reproducible, also when repeated in one process;
- a checkpointed layer (``torch.utils.checkpoint``) recomputes its input and rounds it with the
  same noise as in the forward, so its gradients equal the uncheckpointed layer's;
- different values (every step of training: the weights move) get independent noise, while
  rounding the very same values twice under one seed gives the same codes twice.

>>> import torch
>>> x = torch.randn(1000)
>>> before = torch.get_rng_state()
>>> noise = rounding_noise(x, (4, 256))
>>> torch.equal(torch.get_rng_state(), before), torch.equal(noise, rounding_noise(x, (4, 256)))
(True, True)
"""

from __future__ import annotations

import torch

_MASK64 = 2**64 - 1
# Same-size integer views of float dtypes: their bit patterns sum exactly.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_generators: dict[torch.device, torch.Generator] = {}


def rounding_noise(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values in [0, 1) of ``shape`` on ``x``'s device, to round ``x`` with; a function of
    ``torch.initial_seed()`` and ``x``'s values, drawn without touching the global generator."""
    generator = _generators.get(x.device)
    if generator is None:
        generator = _generators[x.device] = torch.Generator(device=x.device)
    generator.manual_seed(_mix(torch.initial_seed() ^ _mix(_fingerprint(x))))
    return torch.rand(shape, generator=generator, device=x.device, dtype=torch.float32)


def _fingerprint(x: torch.Tensor) -> int:
    """The sum of ``x``'s bit patterns. Integer sums are exact, so equal values give an equal
    fingerprint whatever their memory layout or the reduction order."""
    return int(x.view(_BITS[x.element_size()]).sum(dtype=torch.int64))


def _mix(value: int) -> int:
    """``value`` through splitmix64's mixer: nearby inputs give unrelated seeds, and the noise
    never repeats the global stream that ``torch.manual_seed`` with the same number starts
    (that stream may have made the very values being rounded)."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
