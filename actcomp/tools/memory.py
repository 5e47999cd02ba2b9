"""Honest accounting of the bytes autograd keeps for backward.

:func:`memory_report` runs one training-mode forward pass while a :class:`SavedTensorRecorder`
(a ``torch.autograd.graph.saved_tensors_hooks`` pack hook) records every tensor saved for
backward, and :meth:`MemoryReport.from_recorder` builds the report from what it recorded. Saved
tensors are deduplicated by storage (a tensor saved by two ops, or two views of one buffer, count
once, at the size of the whole storage), attributed to the innermost module running when
it was saved. Parameters are not activations and are left out, including the unsharded
parameters FSDP2 all-gathers for the forward (so a sharded model reports what the same model
reports unsharded on the same per-rank batch). The model's own inputs are reported apart
(the caller keeps them anyway), and so are copies of parameters (autocast's low-precision
weights): real bytes, but they scale with the model, not the batch.

For each compressed layer it also checks whether the layer's *input* storage is still
kept by another op (ReLU keeps its output, which is the next conv's input): then the
compression frees nothing and the compressed copy is an extra cost. Those show up in
:attr:`MemoryReport.not_freed`.

>>> import torch, actcomp
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
>>> report = memory_report(model, torch.randn(32, 64))
>>> report.total_bytes  # ReLU's output (saved by ReLU and by the second Linear, counted once)
8192
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from actcomp.errors import ActcompError
from actcomp.graph.op_kinds import KINDS, is_parameter
from actcomp.graph.saved_tensors import (
    SavedEvent,
    in_compressed_layer,
    innermost_kind,
    innermost_module,
    is_parameter_copy,
    listening,
    tracking_scopes,
)
from actcomp.kernels.layouts import local_part, storage_key
from actcomp.layers.compressed_layer import CompressedLayer, autocast_casts


@dataclass(frozen=True)
class SavedStorage:
    """One distinct storage that autograd keeps, and every module whose ops saved it.

    ``kind`` is ``"activation"``, ``"input"`` (a model input) or ``"parameter_copy"``
    (a parameter after casts/views, e.g. autocast's bf16 weight). ``op_kind`` is the kind of the
    op that saved it first (see :mod:`actcomp.graph.op_kinds`) and ``codec`` what it is: the spec or
    exact codec it was compressed with, None for a tensor kept as is.
    """

    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    savers: tuple[str, ...]
    kind: str = "activation"
    op_kind: str = "other"
    codec: str | None = None


@dataclass(frozen=True)
class KindRow:
    """Bytes kept for one op kind: what plain PyTorch keeps, what is kept, and how.

    A storage saved by ops of two kinds (a ReLU output that a conv also keeps) counts in
    ``plain_bytes`` once, for the kind that saved it first.
    """

    kind: str
    plain_bytes: int
    kept_bytes: int
    codecs: tuple[str, ...]


@dataclass(frozen=True)
class ModuleRow:
    """Bytes attributed to one module: storages it was the first to save."""

    name: str
    type: str
    nbytes: int
    compressed: str | None = None


@dataclass(frozen=True)
class NotFreed:
    """A compressed layer whose input is also kept by another module."""

    layer: str
    input_bytes: int
    kept_by: tuple[str, ...]


@dataclass
class MemoryReport:
    """Result of :func:`memory_report`; ``print(report)`` shows a table."""

    rows: list[ModuleRow]
    storages: list[SavedStorage]
    input_bytes: int
    parameter_copy_bytes: int = 0
    not_freed: list[NotFreed] = field(default_factory=list)
    # Converted layers that ran plain because they read the model input (first_layer="auto").
    plain_on_input: list[str] = field(default_factory=list)
    kinds: list[KindRow] = field(default_factory=list)
    # Compressed layers that read one input (a ResNet block's conv1 and downsample, an LLM's q/k/v
    # projections), each group in the order they ran: one spec for a group codes that input once.
    shared_inputs: list[tuple[str, ...]] = field(default_factory=list)

    @classmethod
    def from_recorder(cls, recorder: SavedTensorRecorder) -> MemoryReport:
        """The report on what ``recorder`` saw (it reads the recorder and changes nothing).

        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> recorder = SavedTensorRecorder(model, [])
        >>> with recorder.recording():
        ...     output = model(torch.randn(4, 8))  # not a model input: the first Linear's input counts
        >>> report = MemoryReport.from_recorder(recorder)
        >>> [(row.name, row.nbytes) for row in report.rows], report.input_bytes
        ([('0', 128), ('1', 128)], 0)
        """
        storages = list(recorder.storages.values())
        modules = {name: module for module, name in recorder.names.items()}
        not_freed, plain_on_input = _layer_input_fates(recorder, modules)
        return cls(_module_rows(storages, modules), storages,
                   input_bytes=sum(s.nbytes for s in storages if s.kind == "input"),
                   parameter_copy_bytes=sum(s.nbytes for s in storages if s.kind == "parameter_copy"),
                   not_freed=not_freed, plain_on_input=plain_on_input,
                   kinds=_kind_rows(storages, recorder.plain.values()),
                   shared_inputs=_shared_inputs(recorder.layer_inputs))

    @property
    def total_bytes(self) -> int:
        """Saved activation bytes, deduplicated, without parameters and model inputs."""
        return sum(row.nbytes for row in self.rows)

    @property
    def plain_bytes(self) -> int:
        """What plain PyTorch would keep for the same forward (deduplicated, without parameters
        and model inputs): the bytes before compression."""
        return sum(row.plain_bytes for row in self.kinds)

    def kept_as_is(self) -> list[SavedStorage]:
        """Activation storages kept whole (no codec), largest first: what compression left."""
        whole = [s for s in self.storages if s.kind == "activation" and s.codec is None]
        return sorted(whole, key=lambda s: -s.nbytes)

    def kind_table(self) -> str:
        """Plain vs kept bytes per op kind, and the codecs that kept them."""
        lines = [f"{'op kind':<14} {'plain':>10} {'kept':>10} {'ratio':>7}  kept as"]
        for row in self.kinds:
            ratio = f"{row.plain_bytes / row.kept_bytes:.1f}x" if row.kept_bytes else "-"
            lines.append(f"{row.kind:<14} {format_bytes(row.plain_bytes):>10} {format_bytes(row.kept_bytes):>10} "
                         f"{ratio:>7}  {', '.join(row.codecs)}")
        ratio = f"{self.plain_bytes / self.total_bytes:.1f}x" if self.total_bytes else "-"
        lines.append(f"{'total':<14} {format_bytes(self.plain_bytes):>10} {format_bytes(self.total_bytes):>10} {ratio:>7}")
        return "\n".join(lines)

    def by_type(self) -> dict[str, int]:
        """Bytes per module type (``"Conv2d"``, ``"ReLU"``, ...), largest first."""
        totals: dict[str, int] = defaultdict(int)
        for row in self.rows:
            totals[row.type] += row.nbytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def table(self, limit: int = 30) -> str:
        """The largest ``limit`` modules, then totals and the not-freed warnings."""
        rows = sorted(self.rows, key=lambda row: -row.nbytes)[:limit]
        width = max([len(row.name) for row in rows] + [6])
        lines = [f"{'module':<{width}}  {'type':<22} {'saved':>10}  compressed"]
        for row in rows:
            lines.append(f"{row.name:<{width}}  {row.type:<22} {format_bytes(row.nbytes):>10}  {row.compressed or ''}")
        if len(self.rows) > limit:
            rest = sum(row.nbytes for row in sorted(self.rows, key=lambda row: -row.nbytes)[limit:])
            lines.append(f"{'... ' + str(len(self.rows) - limit) + ' more':<{width}}  {'':<22} {format_bytes(rest):>10}")
        lines.append(f"{'total':<{width}}  {'':<22} {format_bytes(self.total_bytes):>10}")
        lines.append(f"(model inputs, kept by the caller: {format_bytes(self.input_bytes)}; "
                     f"parameter copies such as autocast weights: {format_bytes(self.parameter_copy_bytes)})")
        for item in self.not_freed:
            lines.append(
                f"! {item.layer}: input ({format_bytes(item.input_bytes)}) is also kept by "
                f"{', '.join(item.kept_by)}, so compressing it frees nothing"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.kind_table()


def format_bytes(count: float) -> str:
    """A byte count as people read it, in powers of 1024.

    >>> format_bytes(1536), format_bytes(100), format_bytes(5 * 2**40)
    ('1.5 KiB', '100 B', '5120.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``"4GiB"`` -> ``4294967296``: a size as people write it (KB/MB/GB are powers of 1000,
    KiB/MiB/GiB and bare K/M/G powers of 1024, case-insensitive, a plain number is bytes).

    >>> parse_bytes("4GiB"), parse_bytes("1.5 GB"), parse_bytes("512M")
    (4294967296, 1500000000, 536870912)
    """
    cleaned = text.strip().replace(" ", "").lower()
    number = cleaned.rstrip("kmgtib")
    unit = cleaned[len(number):] or "b"
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not 0 < value < float("inf"):
        raise ActcompError(f"cannot read {text!r} as a memory size: write a positive number and a unit, e.g. "
                           "'4GiB', '3.5GB', '512MiB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, K, M, G, T)")
    return int(value * _UNITS[unit])


def memory_report(model: nn.Module, *inputs, **kwargs) -> MemoryReport:
    """Run ``model(*inputs, **kwargs)`` once in training mode and account its saved tensors.

    The model is put in training mode for the pass and restored afterwards, and an FSDP2 model
    is left sharded, as after a training step. Run it under ``torch.autocast`` to account mixed
    precision.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> memory_report(model, torch.randn(4, 8)).by_type()  # GELU keeps its input: 4 x 8 fp32
    {'GELU': 128}
    """
    was_training = model.training
    try:
        output, report = forward_and_report(model, *inputs, **kwargs)
        del output
    finally:
        model.train(was_training)
        _reshard(model)
    return report


def forward_and_report(model: nn.Module, *inputs, **kwargs) -> tuple[Any, MemoryReport]:
    """``model(*inputs, **kwargs)`` in training mode: its output, whose graph a backward can still
    run (the report's hook hands autograd each saved tensor back as it is), and the report of
    what the forward saved. A step that wants its gradients and its bytes runs one forward, not
    two (:meth:`actcomp.tools.user_batch.UserBatch.gradients_and_memory`); the model is left in
    training mode.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> output, report = forward_and_report(model, torch.randn(4, 8))
    >>> output.sum().backward(); report.total_bytes
    128
    """
    recorder = SavedTensorRecorder(model, [*inputs, *kwargs.values()])
    model.train()
    with recorder.recording():
        output = model(*inputs, **kwargs)
    return output, MemoryReport.from_recorder(recorder)


class SavedTensorRecorder:
    """Listens to the tensors autograd saves during a forward and keeps the facts a report needs.

    What it records, by storage (two views of one buffer, or a tensor saved by two ops, are one
    entry): :attr:`storages`, what is really kept, with every module that saved it;
    :attr:`plain`, what plain PyTorch would have kept instead, and for which op kind;
    :attr:`layer_inputs`, the storage each compressed layer read. It sees through whole-model
    mode, whose hooks tell it what each saved tensor became (:func:`listening`), and through
    compressed layers, which save their own packed form. :meth:`MemoryReport.from_recorder`
    turns the facts into a report.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> x = torch.randn(4, 8)
    >>> recorder = SavedTensorRecorder(model, [x])
    >>> with recorder.recording():
    ...     output = model(x)
    >>> [(s.kind, s.savers, s.nbytes) for s in recorder.storages.values()]  # x, and ReLU's output
    [('input', ('0',), 128), ('activation', ('1', '2'), 128)]
    """

    # The recorder is itself the pack hook; whole-model mode puts its own hooks on top of it
    # (and reports to it) instead of stepping aside as it does for anyone else's hooks.
    actcomp_observer = True

    def __init__(self, model: nn.Module, inputs: list) -> None:
        self.names = {module: name or "(model)" for name, module in model.named_modules()}
        self.excluded = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
        self.input_keys = {storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
        self.storages: dict[tuple, SavedStorage] = {}
        # Keyed by storage (with an "autocast" tag for autocast's own low-precision copy of an input).
        self.plain: dict[tuple, tuple[int, str]] = {}
        self.layer_inputs: dict[str, tuple | None] = {}
        # Holding every saved tensor (and the compressed layers' inputs) until the forward ends
        # keeps their addresses from being reused by later tensors, which would make storage
        # keys collide.
        self._alive: list[torch.Tensor] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record what the forward passes run in the block save (gradients on)."""
        layers = [module for module in self.names if isinstance(module, CompressedLayer)]
        handles = [layer.register_forward_pre_hook(self._layer_input) for layer in layers]
        try:
            with tracking_scopes(), listening(self.record), torch.enable_grad():
                with torch.autograd.graph.saved_tensors_hooks(self, lambda tensor: tensor):
                    yield
        finally:
            for handle in handles:
                handle.remove()
            self._alive.clear()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """The pack hook: plain tensors and the compressed layers' own packed tensors (whole-model
        mode's hooks tell :meth:`record` about theirs directly)."""
        scope = innermost_kind()
        kind = "linear" if in_compressed_layer() else scope.kind if scope is not None else "other"
        self.record(SavedEvent(tensor, (tensor,), kind, None))
        # Detached: an op's saved output holds the op's grad_fn, which holds what this hook
        # returns; the tensor itself would close a cycle through C++ that keeps the report's
        # whole forward graph alive after the report returns.
        return tensor.detach()

    def record(self, event: SavedEvent) -> None:
        """Account one save: what plain PyTorch would keep, and what is kept instead."""
        tensor = event.tensor
        local = local_part(tensor)
        key = storage_key(local)
        if key is None or key in self.excluded or is_parameter(tensor):
            return
        self._alive.append(tensor)
        module = innermost_module()
        copy = is_parameter_copy(tensor)
        codec = event.codec
        if in_compressed_layer():
            # A compressed layer's packed input: plain PyTorch would keep the input itself
            # (recorded by ``_layer_input``), not these. The layer also keeps its weight, which
            # under autocast is a low-precision copy, and under autocast a layer reading the
            # model input keeps that input: both kept as they are, not compressed.
            if not copy and key not in self.input_keys:
                codec = _spec_of(module) if module is not None else "layer"
        elif not copy and key not in self.input_keys:
            self.plain.setdefault(key, (local.untyped_storage().nbytes(), event.kind))
        saver = self.names.get(module, "(model)")
        for kept in event.kept:
            self._keep(kept, saver, event.kind, codec, parameter_copy=copy and kept is tensor)

    def _keep(self, kept: torch.Tensor, saver: str, op_kind: str, codec: str | None, parameter_copy: bool) -> None:
        local = local_part(kept)
        key = storage_key(local)
        if key is None:
            return
        storage = self.storages.get(key)
        if storage is None:
            kind = "input" if key in self.input_keys else "parameter_copy" if parameter_copy else "activation"
            self.storages[key] = SavedStorage(local.untyped_storage().nbytes(), tuple(kept.shape), kept.dtype,
                                              (saver,), kind, op_kind, codec)
        elif saver not in storage.savers:
            self.storages[key] = replace(storage, savers=(*storage.savers, saver))

    def _layer_input(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of each compressed layer: the input it reads, which plain PyTorch keeps."""
        if not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]
        key = storage_key(x)
        self.layer_inputs[self.names[module]] = key
        self._alive.append(x)
        if key is None:
            return
        if autocast_casts(x):
            # Plain autocast keeps a low-precision copy of its own, of a model input too.
            itemsize = torch.get_autocast_dtype(x.device.type).itemsize
            self.plain.setdefault((key, "autocast"), (x.numel() * itemsize, "linear"))
        elif key not in self.input_keys:
            self.plain.setdefault(key, (local_part(x).untyped_storage().nbytes(), "linear"))


def _module_rows(storages: list[SavedStorage], modules: dict[str, nn.Module]) -> list[ModuleRow]:
    """Activation bytes per module, each storage counted for the first module that saved it."""
    per_module: dict[str, int] = defaultdict(int)
    for storage in storages:
        if storage.kind == "activation":
            per_module[storage.savers[0]] += storage.nbytes
    return [ModuleRow(name, _type_name(modules[name]), nbytes, _spec_of(modules[name]))
            for name, nbytes in per_module.items()]


def _shared_inputs(layer_inputs: dict[str, tuple | None]) -> list[tuple[str, ...]]:
    """The compressed layers that read one input storage, grouped (groups of two or more).

    >>> _shared_inputs({"q": (1, 0), "k": (1, 0), "o": (2, 0), "x": None, "y": None})
    [('q', 'k')]
    """
    readers: dict[tuple, list[str]] = defaultdict(list)
    for layer, key in layer_inputs.items():
        if key is not None:
            readers[key].append(layer)
    return [tuple(names) for names in readers.values() if len(names) > 1]


def _layer_input_fates(recorder: SavedTensorRecorder,
                       modules: dict[str, nn.Module]) -> tuple[list[NotFreed], list[str]]:
    """The compressed layers whose input another module keeps too, and those that ran plain on
    the model input."""
    not_freed, plain_on_input = [], []
    for layer, key in recorder.layer_inputs.items():
        storage = recorder.storages.get(key)
        if key in recorder.input_keys:
            if modules[layer].actcomp_plain_on_model_input:
                plain_on_input.append(layer)
        elif storage is not None:
            # A lossless pipeline keeps (a view of) the input itself: then the layer is its only
            # saver, and no other module keeps the input.
            others = tuple(saver for saver in storage.savers if saver != layer)
            if others:
                not_freed.append(NotFreed(layer, storage.nbytes, others))
    return not_freed, plain_on_input


def _kind_rows(storages: list[SavedStorage], plain) -> list[KindRow]:
    """Bytes per op kind, plain (what PyTorch alone would keep) and kept, with the codecs used."""
    plain_bytes: dict[str, int] = defaultdict(int)
    for nbytes, op_kind in plain:
        plain_bytes[op_kind] += nbytes
    kept_bytes: dict[str, int] = defaultdict(int)
    codecs: dict[str, dict[str, None]] = defaultdict(dict)
    for storage in storages:
        if storage.kind == "activation":
            kept_bytes[storage.op_kind] += storage.nbytes
            codecs[storage.op_kind][storage.codec or "as is"] = None
    order = [kind for kind in KINDS if kind in plain_bytes or kind in kept_bytes]
    return [KindRow(kind, plain_bytes[kind], kept_bytes[kind], tuple(codecs[kind])) for kind in order]


def _reshard(model: nn.Module) -> None:
    """Shard FSDP2 parameters again, as the backward that never follows the report would.

    The root (and any module sharded with ``reshard_after_forward=False``) keeps its all-gathered
    parameters registered after a forward: an optimizer built then would step those, and the
    shards would never train.
    """
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _type_name(module: nn.Module) -> str:
    # A compressed layer reports its plain type, so plain and compressed reports line up; so
    # does a module that fully_shard gave an FSDP<Class> subclass (before or after conversion).
    cls = getattr(type(module), "actcomp_base", type(module))
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        cls = next(base for base in cls.__mro__ if not issubclass(base, FSDPModule))
    return cls.__name__


def _spec_of(module: nn.Module) -> str | None:
    pipeline = getattr(module, "actcomp_pipeline", None)
    return None if pipeline is None else pipeline.spec
