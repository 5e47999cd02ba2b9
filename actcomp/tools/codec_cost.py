"""What the codecs cost a training step, in figures a loaded machine does not move.

Wall-clock ratios on a shared machine swing with its load; these do not (or barely):

- **ATen operations** the codecs run, and the **bytes** those operations read and write, per
  byte of activations the compression frees (the tensors' bytes minus their packed bytes);
- **host syncs**: reads of tensor values back to Python (``.item()``, ``int()``, ``bool()`` of a
  tensor) and ops whose output size depends on the data (``nonzero``, ``masked_select``), which
  on a GPU each stall the launch queue: in the whole step, and inside the codecs;
- **Python microseconds** per compressed tensor (its pack and unpack): the codecs' time minus
  the time inside their ATen operations, as the profiler splits it. The one timed figure.

Bytes are those of the tensors each non-view operation takes and returns: an upper bound of the
memory traffic (a gather is charged its whole source). A native kernel
(:mod:`~actcomp.kernels.native_cpu`) counts as one operation, charged the tensors it reads and
writes, a host sync when its result's size depends on the data (as ``nonzero``), and its time
as an operation's, not Python's. The step runs twice: once under the
profiler (each top-level codec call, noted through :mod:`actcomp.core.watchers`, a range), once
under a ``TorchDispatchMode`` that counts.

>>> import torch, actcomp
>>> model = actcomp.to_compressed(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
...                               torch.nn.Linear(64, 4)), "int8", rest="8bit", first_layer=None)
>>> x = torch.randn(32, 64)
>>> cost = codec_cost(lambda: model(x).sum().backward())
>>> cost.packs, cost.unpacks, cost.host_syncs_in_codecs  # the CPU's shortcut: a read of each finite flag
(2, 3, 2)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from actcomp.core import watchers
from actcomp.kernels import native_cpu
from actcomp.torch_compat import dispatch_mode_base, private_host_reading_ops, tree_leaves

_aten = torch.ops.aten
# Ops that read values back to the host, or whose output size depends on the data.
SYNC_OPS = frozenset({
    _aten.is_nonzero.default, _aten.equal.default, _aten.nonzero.default, _aten.masked_select.default,
    _aten.repeat_interleave.Tensor, _aten.unique_consecutive.default,
}) | private_host_reading_ops()


@dataclass(frozen=True)
class CodecCost:
    """One step's codec work (see the module docstring)."""

    packs: int
    unpacks: int
    bytes_freed: int
    bytes_moved: int
    aten_ops: int
    host_syncs: int
    host_syncs_in_codecs: int
    python_us_per_tensor: float

    @property
    def moved_per_byte_freed(self) -> float:
        """Bytes the codecs read and write per byte of activations they free."""
        return self.bytes_moved / max(self.bytes_freed, 1)

    @property
    def ops_per_tensor(self) -> float:
        return self.aten_ops / max(self.packs, 1)


class _Marker:
    """Marks each top-level codec call as a profiler range, whose ATen children it then subtracts."""

    def __init__(self) -> None:
        self.depth, self.ranges = 0, []

    def begin(self, direction: str) -> None:
        if self.depth == 0:
            self.ranges.append(torch.autograd.profiler.record_function(_RANGE))
            self.ranges[-1].__enter__()
        self.depth += 1

    def end(self, direction: str, source: Any, result: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.ranges.pop().__exit__(None, None, None)

    def kernel(self, name: str, tensors: tuple[torch.Tensor, ...], data_sized: bool) -> Any:
        # A range of its own, a child of the codec's: its time is a kernel's, not Python's.
        return torch.autograd.profiler.record_function(f"actcomp.native.{name}")


_RANGE = "actcomp.codec"


class _Counter(dispatch_mode_base()):
    """Counts ATen operations, their bytes and time, and host syncs; codec calls told by watchers."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = self.packs = self.unpacks = self.freed = 0
        self.ops = self.moved = self.syncs = self.codec_syncs = 0

    def begin(self, direction: str) -> None:
        self.depth += 1

    def end(self, direction: str, source: Any, result: Any) -> None:
        self.depth -= 1
        if self.depth:
            return
        if direction == "pack":
            self.packs += 1
            self.freed += source.numel() * source.element_size() - result.nbytes
        else:
            self.unpacks += 1

    @contextlib.contextmanager
    def kernel(self, name: str, tensors: tuple[torch.Tensor, ...], data_sized: bool) -> Iterator[None]:
        yield
        self.ops += 1
        self.moved += sum(t.nbytes for t in tensors)
        self.syncs += data_sized
        self.codec_syncs += data_sized and self.depth > 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.depth:
            out = func(*args, **kwargs)
            self.syncs += func in SYNC_OPS
            return out
        out = func(*args, **kwargs)
        self.ops += 1
        if not func.is_view:  # a view moves no bytes
            self.moved += sum(t.nbytes for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        if func in SYNC_OPS:
            self.syncs += 1
            self.codec_syncs += 1
        return out


def codec_cost(step: Callable[[], Any]) -> CodecCost:
    """:class:`CodecCost` of ``step`` (a training step: forward and backward), run twice."""
    marker = _Marker()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile, \
            watchers.watching(marker), native_cpu.observed(marker):
        step()
    # Python time: a codec call's range minus its ATen operations, the gaps between them.
    ranges = [event for event in profile.events() if event.name == _RANGE]
    python_us = sum(event.cpu_time_total - sum(child.cpu_time_total for child in event.cpu_children)
                    for event in ranges)
    counter = _Counter()
    with watchers.watching(counter), native_cpu.observed(counter), counter:
        step()
    return CodecCost(packs=counter.packs, unpacks=counter.unpacks, bytes_freed=counter.freed,
                     bytes_moved=counter.moved, aten_ops=counter.ops, host_syncs=counter.syncs,
                     host_syncs_in_codecs=counter.codec_syncs,
                     python_us_per_tensor=python_us / max(counter.packs, 1))
