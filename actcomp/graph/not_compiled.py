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

from actcomp.errors import WARNED, warn_once
from actcomp.torch_compat import lazily_not_compiled

_F = TypeVar("_F", bound=Callable)


def not_compiled(function: _F) -> _F:
    """``function``, run eagerly even where a compiled caller traces through it."""
    return lazily_not_compiled(function)


# The keys of the two fallbacks' warnings. Traced code reads ``key not in WARNED`` (dynamo
# guards on it): after the one warning and one recompilation, compiled code no longer calls
# the warning, which would otherwise be a graph break at every call.
WHOLE_MODEL_FALLBACK = "a whole-model forward left the compiled graph"
LAYER_FALLBACK = "a converted Linear/Conv layer left the compiled graph"
_HOW = ("to compress inside one graph with no break, compile the plain model (not to_compressed) and run its "
        "training forward under `with actcomp.compress_in_graph(spec, rest=...):` (docs/guide/compiled.md); "
        "this is said once a process")


def warn_if_leaving_graph(key: str) -> None:
    """Say once that a converted model's training forward runs outside ``torch.compile``'s graph:
    call it from traced code, where ``torch.compiler.is_compiling()``; does nothing elsewhere."""
    if torch.compiler.is_compiling() and key not in WARNED:
        _warn_leaving_graph(key)


@not_compiled
def _warn_leaving_graph(key: str) -> None:
    what = ("the whole-model forward of this converted model compiles as a graph of its own under "
            "compress_in_graph's hooks, its rest policy chosen inside the graph (one graph break at the model's "
            "entry; fullgraph=True cannot hold it)" if key == WHOLE_MODEL_FALLBACK else
            "each converted Linear/Conv layer runs eagerly, outside the compiled graph (a graph break at "
            "every converted layer whose codec cannot run in a graph: Rice-coded positions, running ranges, "
            "random draws)")
    warn_once(key, f"torch.compile of a model converted by actcomp.to_compressed: {what}; {_HOW}", stacklevel=3)
