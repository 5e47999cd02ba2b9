"""Who watches the codecs work: a measuring tool is told when each pack and unpack begins and
ends, and nothing is done for it otherwise (one list checked per call).

:func:`~actcomp.core.chain.pack` and :func:`~actcomp.core.chain.unpack` are the one door every
codec passes through, in Linear/Conv mode and in whole-model mode alike, so a watcher there sees
all of the compression work of a step and none of the model's own (see
:mod:`actcomp.tools.codec_cost`).

>>> import torch, actcomp
>>> calls = []
>>> class Recorder:
...     def begin(self, direction): calls.append(direction)
...     def end(self, direction, source, result): calls.append(type(result).__name__)
>>> with watching(Recorder()):
...     _ = actcomp.parse("int8").compress(torch.randn(8))
>>> calls
['pack', 'Packed']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Watcher(Protocol):
    def begin(self, direction: str) -> None: ...

    def end(self, direction: str, source: Any, result: Any) -> None: ...


_WATCHERS: list[Watcher] = []


def active() -> bool:
    """Whether anyone watches (the codec loop's only cost when nobody does)."""
    return bool(_WATCHERS)


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[Watcher]:
    """``watcher`` is told of every pack (``source`` the tensor, ``result`` the Packed) and
    unpack (``source`` the Packed, ``result`` the tensor) inside the block."""
    _WATCHERS.append(watcher)
    try:
        yield watcher
    finally:
        _WATCHERS.remove(watcher)


def watched(direction: str, source: Any, run: Callable[[], Any]) -> Any:
    """``run()``, its beginning and end told to every watcher."""
    for watcher in _WATCHERS:
        watcher.begin(direction)
    result = run()
    for watcher in reversed(_WATCHERS):
        watcher.end(direction, source, result)
    return result
