"""Honest accounting of the bytes autograd keeps for backward.

:func:`memory_report` runs one training-mode forward pass under
``torch.autograd.graph.saved_tensors_hooks`` and records every tensor saved for backward,
deduplicated by storage (a tensor saved by two ops, or two views of one buffer, count
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

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from actcomp.storage import local_part, storage_key


@dataclass(frozen=True)
class SavedStorage:
    """One distinct storage that autograd keeps, and every module whose ops saved it.

    ``kind`` is ``"activation"``, ``"input"`` (a model input) or ``"parameter_copy"``
    (a parameter after casts/views, e.g. autocast's bf16 weight).
    """

    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    savers: tuple[str, ...]
    kind: str = "activation"


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

    @property
    def total_bytes(self) -> int:
        """Saved activation bytes, deduplicated, without parameters and model inputs."""
        return sum(row.nbytes for row in self.rows)

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
        return self.table()


def format_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _is_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one, including the unsharded parameters
    FSDP2 all-gathers for the forward (``model.parameters()`` returns the shards meanwhile)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


# Autograd nodes of ops that only cast or re-view a tensor.
_CAST_OR_VIEW = {
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "PermuteBackward0", "ExpandBackward0", "AliasBackward0", "ReshapeAliasBackward0",
}


def _parameter_copy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter after casts and views only (autocast's bf16 weight).

    Only cast/view nodes are followed: a conv output whose input needs no gradient also has
    the weight as its only autograd input, yet it is an activation.
    """
    node = tensor.grad_fn
    for _ in range(8):
        if node is None:
            return False
        if type(node).__name__ == "AccumulateGrad":
            return isinstance(node.variable, nn.Parameter)
        if type(node).__name__ not in _CAST_OR_VIEW or len(node.next_functions) != 1:
            return False
        node = node.next_functions[0][0]
    return False


def memory_report(model: nn.Module, *inputs, **kwargs) -> MemoryReport:
    """Run ``model(*inputs, **kwargs)`` once in training mode and account its saved tensors.

    The model is put in training mode for the pass and restored afterwards. Run it under
    ``torch.autocast`` to account mixed precision.
    """
    from actcomp.layers import CompressedLayer

    names = {module: name or "(model)" for name, module in model.named_modules()}
    excluded = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    input_keys = {storage_key(t) for t in [*inputs, *kwargs.values()] if isinstance(t, torch.Tensor)}
    copy_keys: set[tuple] = set()
    stack: list[nn.Module] = []
    order: list[tuple] = []
    seen: dict[tuple, dict] = {}
    layer_inputs: dict[str, tuple] = {}
    # Holding the compressed layers' inputs until the end keeps their addresses from being
    # reused by later tensors, which would make storage keys collide.
    alive: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = local_part(tensor)
        key = storage_key(local)
        if key is None or key in excluded or _is_parameter(tensor):
            return tensor
        saver = names[stack[-1]] if stack else "(model)"
        entry = seen.get(key)
        if entry is None:
            entry = seen[key] = {
                "nbytes": local.untyped_storage().nbytes(), "shape": tuple(local.shape),
                "dtype": tensor.dtype, "savers": [],
            }
            order.append(key)
            if _parameter_copy(tensor):
                copy_keys.add(key)
        if saver not in entry["savers"]:
            entry["savers"].append(saver)
        return tensor

    def before(module: nn.Module, args) -> None:
        stack.append(module)
        if isinstance(module, CompressedLayer) and args and isinstance(args[0], torch.Tensor):
            layer_inputs[names[module]] = storage_key(args[0])
            alive.append(args[0])

    def after(module: nn.Module, args, output) -> None:
        stack.pop()

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    was_training = model.training
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), torch.enable_grad():
            output = model(*inputs, **kwargs)
        del output, alive[:]
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()

    def kind(key: tuple) -> str:
        return "input" if key in input_keys else "parameter_copy" if key in copy_keys else "activation"

    storages = [
        SavedStorage(seen[k]["nbytes"], seen[k]["shape"], seen[k]["dtype"], tuple(seen[k]["savers"]), kind(k))
        for k in order
    ]
    per_module: dict[str, int] = defaultdict(int)
    for storage in storages:
        if storage.kind == "activation":
            per_module[storage.savers[0]] += storage.nbytes
    input_bytes = sum(s.nbytes for s in storages if s.kind == "input")
    copy_bytes = sum(s.nbytes for s in storages if s.kind == "parameter_copy")
    modules = {name: module for module, name in names.items()}
    rows = [
        ModuleRow(name, _type_name(modules[name]), nbytes, _spec_of(modules[name]))
        for name, nbytes in per_module.items()
    ]
    not_freed, plain_on_input = [], []
    for layer, key in layer_inputs.items():
        entry = seen.get(key)
        if key in input_keys:
            if modules[layer].actcomp_plain_on_model_input:
                plain_on_input.append(layer)
        elif entry is not None:
            not_freed.append(NotFreed(layer, entry["nbytes"], tuple(s for s in entry["savers"] if s != layer)))
    return MemoryReport(rows, storages, input_bytes, copy_bytes, not_freed, plain_on_input)


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
