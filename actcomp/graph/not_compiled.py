"""Marking functions that ``torch.compile`` must run as they are, without importing Dynamo.

``torch.compiler.disable`` imports ``torch._dynamo`` at once: that import was 1.9 s of the 4 s
``import actcomp`` took on a 2-core machine, paid before any user code ran, by every user,
compiling or not. torch's own lazy form wraps the function and imports Dynamo at its first
call; a torch without that private helper gets the eager form.

>>> import torch
>>> @not_compiled
... def double(x):
...     return 2 * x
>>> double(torch.ones(2))
tensor([2., 2.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

_F = TypeVar("_F", bound=Callable)


def not_compiled(function: _F) -> _F:
    """``function``, run eagerly even where a compiled caller traces through it."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(function) if lazy is not None else torch.compiler.disable(function)
