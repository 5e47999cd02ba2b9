"""Where a data-sized op costs nothing extra: on a CPU, outside ``torch.compile``.

The codecs' static path reads nothing back to Python and fixes every shape in advance, so it
runs on a GPU without stalling the launch queue and compiles; it is the reference. Where the
tensor is on a CPU and no graph is being traced, ``nonzero`` and other data-sized ops stall
nothing, and a few codecs (min-k selection, Elias-Fano positions) take a shorter path there
that gives the static path's outputs bit for bit; :func:`static_path_only` turns it off, which
is how the tests compare the two.

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
    """Whether ``tensor`` takes the eager CPU path: on a CPU, outside ``torch.compile``."""
    return _enabled and tensor.device.type == "cpu" and not torch.compiler.is_compiling()


@contextmanager
def static_path_only():
    """Every codec on its static path, also on CPU, inside the ``with`` block."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous
