"""Module surgery shared by both modes: a module's class swapped, in place, for its own class with a
mixin in front, and swapped back.

The swapped module keeps everything but its class: parameters stay the same objects, state_dict
keys and values are unchanged and ``isinstance(m, nn.Linear)`` still holds. One subclass is made
per (mixin, class) pair and reused; a swapped module pickles as its plain class plus the mixin,
so unpickling makes the same swap again wherever actcomp is importable.

>>> import torch
>>> class Doubled(SwappedModule):
...     def forward(self, x):
...         return 2 * super().forward(x)
>>> layer = torch.nn.Linear(2, 2)
>>> swap_class(layer, Doubled)
>>> type(layer).__name__, isinstance(layer, torch.nn.Linear)
('CompressedLinear', True)
>>> unswap_class(layer, Doubled, ())
>>> type(layer) is torch.nn.Linear
True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


class SwappedModule(nn.Module):
    """Base of the mixins :func:`swap_class` places in front of a module's class.

    Deriving from ``nn.Module`` only types ``super()`` calls: in a swapped class the mixin sits in
    front of the module's own class, so ``super().forward`` is that class's forward.
    """

    actcomp_base: type[nn.Module]
    actcomp_mixin: type[SwappedModule]

    @classmethod
    def swapped_attributes(cls, base: type[nn.Module]) -> dict[str, Any]:
        """Class attributes the swapped subclass of ``base`` adds (none here)."""
        return {}

    def __reduce_ex__(self, protocol):
        # Pickle as the plain class plus state: unpickling swaps again, so a pickle never names a
        # class made at run time.
        swapped = type(self)
        return rebuild_swapped, (swapped.actcomp_mixin, swapped.actcomp_base), self.__getstate__()


_CLASSES: dict[tuple[type, type], type] = {}


def swapped_class(mixin: type[SwappedModule], base: type[nn.Module]) -> type:
    """The (cached) class ``Compressed<base>``: ``mixin`` in front of ``base``."""
    key = (mixin, base)
    if key not in _CLASSES:
        namespace = {"__module__": mixin.__module__, "actcomp_base": base, "actcomp_mixin": mixin,
                     **mixin.swapped_attributes(base)}
        _CLASSES[key] = type(f"Compressed{base.__name__}", (mixin, base), namespace)
    return _CLASSES[key]


def swap_class(module: nn.Module, mixin: type[SwappedModule]) -> None:
    """Put ``mixin`` in front of ``module``'s class, in place; a module that has it already keeps it."""
    if not isinstance(module, mixin):
        module.__class__ = swapped_class(mixin, type(module))


def unswap_class(module: nn.Module, mixin: type[SwappedModule], attributes: Iterable[str]) -> None:
    """Undo :func:`swap_class` and drop the instance ``attributes`` the mixin's users set."""
    if isinstance(module, mixin):
        module.__class__ = type(module).actcomp_base
        for attribute in attributes:
            module.__dict__.pop(attribute, None)


def rebuild_swapped(mixin: type[SwappedModule], base: type[nn.Module]) -> nn.Module:
    """An empty swapped module for unpickling (the state is set afterwards)."""
    module = base.__new__(base)
    module.__class__ = swapped_class(mixin, base)
    return module
