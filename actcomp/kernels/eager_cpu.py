"""Where a data-sized op costs nothing extra: on a CPU.

The codecs' reference reads nothing back to Python and fixes every shape in advance, so it
runs on a GPU without stalling the launch queue and compiles. On a CPU, ``nonzero`` and other
data-sized ops stall nothing, and the element sparsifiers' CPU implementation (min-k
selection, Elias-Fano positions, registered with :mod:`~actcomp.core.backends`) takes a shorter
path there that gives the reference's outputs bit for bit. :func:`applies` is that
implementation's capability predicate; :func:`static_path_only` turns it off, which is how the
reference runs (:func:`actcomp.core.backends.reference`) and how the tests compare the two.
(No check for ``torch.compile`` here: while Dynamo traces, :mod:`~actcomp.core.backends` runs
the reference and no implementation is asked.)

>>> import torch
>>> applies(torch.zeros(3)), applies(torch.zeros(3, device="meta"))
(True, False)
>>> with static_path_only():
...     applies(torch.zeros(3))
False
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_enabled = True


def applies(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` takes the CPU path: on a CPU, outside :func:`static_path_only`."""
    return _enabled and tensor.device.type == "cpu"


@contextmanager
def static_path_only():
    """Every codec on its static path, also on CPU, inside the ``with`` block."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous
