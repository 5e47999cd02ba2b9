"""Uniform noise for stochastic rounding: a counter-based integer hash of (seed, element index).

The noise of flat element ``i`` is a function of ``i`` and a *seed*, an int64 scalar tensor on
the tensor's device (:func:`noise_seed`), and of nothing else: no generator, no state. So

- torch's global generator never moves: a dropout after a compressed layer draws the mask it
  draws in plain PyTorch;
- a chunk of the tensor computes its own slice (:meth:`RoundingNoise.slice`), equal to that
  slice of the whole tensor's noise, so a chunked quantizer rounds as a whole-tensor one would;
- eager and compiled code compute the same numbers, and a compiled quantizer makes the noise
  inside its kernel instead of reading a noise tensor from memory.

The seed mixes ``torch.initial_seed()`` (a Python int, not tensor data) with a fingerprint of the
values (the bit patterns of an evenly spaced sample, summed on the device), which makes the
noise reproducible wherever the values are:

- ``torch.manual_seed(s)`` makes runs reproducible, also when repeated in one process;
- a checkpointed layer (``torch.utils.checkpoint``) recomputes its input and rounds it with the
  same noise as in the forward, so its gradients equal the uncheckpointed layer's;
- different values (every step of training: the weights move) get independent noise, while
  rounding the very same values twice under one seed gives the same codes twice.

The hash is two rounds of the 32-bit finaliser lowbias32. The index's high part (its *period*
of :data:`PERIOD` elements) picks a rotation; the seeded round hashes the rotated low part::

    rotation = lowbias32(period ^ ROTATION_KEY) mod PERIOD
    noise(i) = top 24 bits of lowbias32(((i + rotation) mod PERIOD) ^ seed), as float32 / 2**24

The seeded round sees only 16 varying bits, so eager code evaluates it once per tensor as a
table of :data:`PERIOD` values and reads each period as one slice of the table rotated by an
offset computed in Python: hashing every element costs as much as the whole rounding (9x a
``clone``), a table slice costs nothing. Compiled code hashes each element in the kernel.
Every element gets a U[0, 1) draw, so rounding stays unbiased. A tensor's noise takes
:data:`PERIOD` distinct values, each period a rotation of them, as the table of random draws
before it did; two elements share a draw only when their periods' rotations happen to line
them up, never in a pattern that follows the tensor's shape (a channel, a token, an image).

>>> import torch
>>> x = torch.randn(1000)
>>> before = torch.get_rng_state()
>>> noise = RoundingNoise(x)
>>> torch.equal(torch.get_rng_state(), before), torch.equal(noise.slice(0, 70_000), RoundingNoise(x).slice(0, 70_000))
(True, True)
>>> whole = noise.slice(0, 200_000)
>>> torch.equal(whole[65_000:135_000], noise.slice(65_000, 70_000))
True
>>> torch.equal(whole, noise_at(noise.seed, torch.arange(200_000)))
True
"""

from __future__ import annotations

import torch

PERIOD = 2**16
# Elements of the values read to seed the noise: enough that any change of the values
# a training step makes shows up, few enough to cost nothing.
FINGERPRINT_SAMPLE = 1024
# Below 2**31, so it fits an int32 index too.
ROTATION_KEY = 0x1E3779B9

_LOW32 = 2**32 - 1
# Same-size integer views of float dtypes: their bit patterns sum exactly.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def lowbias32_(value):
    """Chris Wellons' lowbias32 finaliser of 32 bits, held in a Python int, an int64 tensor
    (values in [0, 2**32)) or an int32 tensor (the same bits, half the bytes); tensors are
    hashed in place.

    Never overflows int64: shifts are masked to be logical, and the second multiplier is used
    as its negative 32-bit twin, whose product agrees modulo 2**32. int32 products wrap.

    >>> lowbias32_(1), int(lowbias32_(torch.tensor(1))), int(lowbias32_(torch.tensor(1, dtype=torch.int32)))
    (1753845952, 1753845952, 1753845952)
    """
    wide = not (isinstance(value, torch.Tensor) and value.dtype == torch.int32)
    value ^= (value >> 16) & 0xFFFF
    value *= 0x7FEB352D
    if wide:
        value &= _LOW32
    value ^= (value >> 15) & 0x1FFFF
    value *= 0x846CA68B - 2**32
    if wide:
        value &= _LOW32
    value ^= (value >> 16) & 0xFFFF
    return value


def _fold32(value):
    """A 64-bit value (an int, or an int64 tensor in two's complement) xor-folded to 32 bits."""
    return (value ^ (value >> 32)) & _LOW32


def noise_seed(x: torch.Tensor) -> torch.Tensor:
    """The seed of ``x``'s noise: an int64 scalar tensor on ``x``'s device holding 32 bits, from
    ``torch.initial_seed()``, ``x``'s size and a sample of its values, with no read back to Python.

    >>> x = torch.randn(100)
    >>> bool(noise_seed(x) == noise_seed(x.clone())), bool(noise_seed(x) == noise_seed(x + 1))
    (True, False)
    """
    return lowbias32_(_fold32(_fingerprint(x)) ^ _seed_and_size_bits(x.device, x.numel()))


def noise_at(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The noise of the flat elements at ``index`` (int32, or int64 below 2**48): float32 in
    [0, 1), one element at a time, as a compiled kernel computes it. int32 gives the same values
    with half the bytes per lane.

    >>> wide = noise_at(torch.tensor(7), torch.arange(3))
    >>> wide, torch.equal(noise_at(torch.tensor(7), torch.arange(3, dtype=torch.int32)), wide)
    (tensor([0.4046, 0.2081, 0.5993]), True)
    """
    return _seeded_round(seed, ((index & (PERIOD - 1)) + _rotation(index >> 16)) & (PERIOD - 1))


class RoundingNoise:
    """The noise for rounding ``x``: float32 values in [0, 1) on ``x``'s device, made from
    :func:`noise_seed` without touching any generator.

    >>> noise = RoundingNoise(torch.zeros(4))
    >>> noise.slice(0, 4).shape, bool(noise.slice(0, 4).max() < 1)
    (torch.Size([4]), True)
    """

    def __init__(self, x: torch.Tensor):
        self.seed = noise_seed(x)
        self._doubled_table: torch.Tensor | None = None

    def slice(self, start: int, count: int) -> torch.Tensor:
        """The noise of flat elements ``start`` to ``start + count``."""
        if torch.compiler.is_compiling():
            # In the kernel, per element: no table, no loop over a symbolic number of periods.
            dtype = torch.int32 if start + count <= 2**31 else torch.int64
            return noise_at(self.seed, torch.arange(start, start + count, dtype=dtype, device=self.seed.device))
        table = self._table()
        pieces = []
        position, stop = start, start + count
        while position < stop:
            period, within = divmod(position, PERIOD)
            begin = _rotation(period) + within
            length = min(PERIOD - within, stop - position)
            pieces.append(table[begin:begin + length])
            position += length
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _table(self) -> torch.Tensor:
        """The seeded round over one period, twice over so that any rotation of it is one slice."""
        if self._doubled_table is None:
            # In int32: half the bytes of int64, and this is the eager path's one hash.
            indices = torch.arange(PERIOD, dtype=torch.int32, device=self.seed.device)
            table = _seeded_round(self.seed, indices)
            self._doubled_table = torch.cat([table, table])
        return self._doubled_table


def _seeded_round(seed: torch.Tensor, rotated: torch.Tensor) -> torch.Tensor:
    """The noise at places ``rotated`` (int32 or int64, below :data:`PERIOD`) of the table."""
    # An int64 seed of 2**31 or more wraps to the int32 with the same 32 bits.
    return _to_unit(lowbias32_(rotated ^ seed.to(rotated.dtype)))


def _rotation(period):
    """Where period number ``period`` (an int or an int tensor, below 2**32) starts reading the table."""
    return lowbias32_(period ^ ROTATION_KEY) & (PERIOD - 1)


def _to_unit(hashed: torch.Tensor) -> torch.Tensor:
    """The top 24 of 32 hashed bits as float32 in [0, 1): every value exact, steps of 2**-24."""
    hashed >>= 8
    hashed &= 0xFFFFFF  # an int32's shift drags its sign along
    return hashed.to(torch.float32).mul_(2**-24)


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """The sum (int64, on ``x``'s device) of the bit patterns of up to :data:`FINGERPRINT_SAMPLE`
    evenly spaced elements of ``x``. Integer sums are exact, so equal values give an equal
    fingerprint whatever their memory layout."""
    count = x.numel()
    step = max(1, count // FINGERPRINT_SAMPLE)
    if x.is_contiguous():
        sample = x.reshape(-1)[::step]
    else:  # the same elements, read in logical order without copying the tensor
        positions = torch.arange(0, count, step, device=x.device)
        sample = x[torch.unravel_index(positions, x.shape)].contiguous()
    return sample.view(_BITS[x.element_size()]).sum(dtype=torch.int64)


def _seed_and_size_bits(device: torch.device, count: int) -> int | torch.Tensor:
    """``torch.initial_seed()`` and a tensor's size mixed to 32 bits: a Python int in eager code;
    in compiled code the output of a custom op, which reads the seed each time the graph runs
    (the compiler cannot trace the read, and would freeze a constant at its value when compiling)."""
    if torch.compiler.is_compiling():
        return _seed_and_size_tensor(device, count)
    return _mix_seed_and_size(count)


def _mix_seed_and_size(count: int) -> int:
    return lowbias32_(_fold32(torch.initial_seed()) ^ lowbias32_(_fold32(count)))


@torch.library.custom_op("actcomp::seed_and_size_bits", mutates_args=())
def _seed_and_size_tensor(device: torch.device, count: int) -> torch.Tensor:
    # A fill, not torch.tensor(...): that copies from host memory and waits for the device each
    # time the graph runs (the H100 sync check of stop 50).
    return torch.full((), _mix_seed_and_size(count), dtype=torch.int64, device=device)


@_seed_and_size_tensor.register_fake
def _(device: torch.device, count: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device=device)
