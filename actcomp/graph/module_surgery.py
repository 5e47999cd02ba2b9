"""Module surgery shared by both modes: a module's class swapped, in place, for its own class with a
mixin in front, and swapped back; hooks that a conversion added, found again and removed.

The swapped module keeps everything but its class: parameters stay the same objects, state_dict
keys and values are unchanged and ``isinstance(m, nn.Linear)`` still holds. One subclass is made
per (mixin, class) pair and reused; a swapped module pickles as its plain class plus the mixin,
so unpickling makes the same swap again wherever actcomp is importable.

>>> import torch
>>> class Doubled(SwappedModule):
...     def forward(self, x):
...         return 2 * super().forward(x)
>>> layer = torch.nn.Linear(2, 2)
>>> swap_class(layer, Doubled) is layer
True
>>> type(layer).__name__, isinstance(layer, torch.nn.Linear)
('CompressedLinear', True)
>>> torch.equal(layer(torch.ones(2)), 2 * (layer.weight.sum(1) + layer.bias))
True
>>> unswap_class(layer, Doubled, ())
>>> type(layer) is torch.nn.Linear
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from torch import nn

from actcomp.torch_compat import forward_hook_tables


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


Mixin = TypeVar("Mixin", bound=SwappedModule)

_CLASSES: dict[tuple[type, type], type] = {}


def swapped_class(mixin: type[SwappedModule], base: type[nn.Module]) -> type:
    """The (cached) class ``Compressed<base>``: ``mixin`` in front of ``base``."""
    key = (mixin, base)
    if key not in _CLASSES:
        namespace = {"__module__": mixin.__module__, "actcomp_base": base, "actcomp_mixin": mixin,
                     **mixin.swapped_attributes(base)}
        _CLASSES[key] = type(f"Compressed{base.__name__}", (mixin, base), namespace)
    return _CLASSES[key]


def swap_class(module: nn.Module, mixin: type[Mixin]) -> Mixin:
    """Put ``mixin`` in front of ``module``'s class, in place; a module that has it already keeps
    it. Returns ``module`` (typed as the mixin)."""
    if not isinstance(module, mixin):
        module.__class__ = swapped_class(mixin, type(module))
    # The class changed under the type checker's eyes: module is a mixin instance now.
    return cast(Mixin, module)


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


def remove_forward_hooks(module: nn.Module, ours: Callable[[Callable], bool]) -> None:
    """Remove the forward pre-hooks and forward hooks of ``module`` for which ``ours(hook)`` holds.

    Found by what they are rather than through kept handles: handles do not follow the model
    through deepcopy or pickle, the hooks themselves do.

    >>> layer = nn.Linear(2, 2)
    >>> def hook(module, args):
    ...     pass
    >>> _ = layer.register_forward_pre_hook(hook, with_kwargs=True)
    >>> remove_forward_hooks(layer, lambda found: found is hook)
    >>> len(layer._forward_pre_hooks), len(layer._forward_pre_hooks_with_kwargs)
    (0, 0)
    """
    for hooks, options in forward_hook_tables(module):
        for hook_id, hook in list(hooks.items()):
            if ours(hook):
                del hooks[hook_id]
                for option in options:
                    option.pop(hook_id, None)
