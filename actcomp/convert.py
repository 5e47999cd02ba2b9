"""Model surgery: ``to_compressed(model, pipeline)`` and ``from_compressed(model)``.

>>> import torch, actcomp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> actcomp.to_compressed(model, "mink0.9")
Sequential(
  (0): Linear(in_features=8, out_features=8, bias=True)
  (1): ReLU()
  (2): CompressedLinear(in_features=8, out_features=2, bias=True, compress='mink0.9')
)

The first layer (``0``) is left alone: see :func:`to_compressed`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping

from torch import nn

from actcomp.errors import ActcompError
from actcomp.layers import compress_layer, is_supported, uncompress_layer
from actcomp.pipeline import Pipeline, parse

PipelineLike = str | Pipeline
PipelineChoice = PipelineLike | Mapping[str, PipelineLike | None]


def to_compressed(
    model: nn.Module,
    pipeline: PipelineChoice,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    first_layer: str | None = "auto",
) -> nn.Module:
    """Convert supported layers of ``model`` in place to cache compressed inputs; returns it.

    ``pipeline`` is a spec string, a :class:`Pipeline`, or a mapping from module-name
    patterns (``fnmatch`` style, e.g. ``"blocks.*.mlp.fc1"``) to specs; the first pattern
    that matches a name wins, and a ``None`` spec leaves the layer alone. Every converted
    layer gets its own fresh pipeline instance (stateful stages such as ``mesa8`` keep
    per-layer ranges).

    ``filter_fn(module, name)`` may veto layers. ``first_layer`` is the layer that consumes
    the raw input, left uncompressed as in DropIT §3.4 (the caller keeps the input anyway,
    so compressing its copy frees nothing): ``"auto"`` skips the first supported layer in
    ``model.named_modules()`` order (definition order: ``conv1`` of a ResNet,
    ``patch_embed.proj`` of a ViT), a module name skips that layer, ``None`` skips none.

    Converting an already converted model replaces the pipelines of the layers it selects
    (never nests); other layers keep theirs.
    """
    if not isinstance(model, nn.Module):
        raise ActcompError(f"to_compressed expects an nn.Module, got {type(model).__name__}")
    choose = _chooser(pipeline)
    candidates = [(name, module) for name, module in model.named_modules() if is_supported(module)]
    for name, module in candidates:
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ActcompError(
                f"layer {name!r} is an uninitialized {type(module).__name__}: lazy layers change class on "
                "their first forward, which would drop compression; run one forward pass before to_compressed"
            )
    skipped = _first_layer_name(candidates, first_layer)
    for name, module in candidates:
        if name == skipped or (filter_fn is not None and not filter_fn(module, name)):
            continue
        chosen = choose(name)
        if chosen is not None:
            compress_layer(module, chosen.fresh())
    return model


def from_compressed(model: nn.Module) -> nn.Module:
    """Restore every converted layer of ``model`` to its plain class, in place; returns it."""
    for module in model.modules():
        uncompress_layer(module)
    return model


def compressed_layers(model: nn.Module) -> dict[str, Pipeline]:
    """Names of the converted layers and their pipelines."""
    from actcomp.layers import CompressedLayer

    return {name: m.actcomp_pipeline for name, m in model.named_modules() if isinstance(m, CompressedLayer)}


def _as_pipeline(spec: PipelineLike, where: str) -> Pipeline:
    if isinstance(spec, Pipeline):
        return spec
    if isinstance(spec, str):
        return parse(spec)
    raise ActcompError(f"{where}: expected a spec string or Pipeline, got {type(spec).__name__}: {spec!r}")


def _chooser(pipeline: PipelineChoice) -> Callable[[str], Pipeline | None]:
    if isinstance(pipeline, Mapping):
        rules = [
            (pattern, None if spec is None else _as_pipeline(spec, f"pattern {pattern!r}"))
            for pattern, spec in pipeline.items()
        ]

        def choose(name: str) -> Pipeline | None:
            return next((p for pattern, p in rules if fnmatch.fnmatchcase(name, pattern)), None)

        return choose
    single = _as_pipeline(pipeline, "to_compressed")
    return lambda name: single


def _first_layer_name(candidates: list[tuple[str, nn.Module]], first_layer: str | None) -> str | None:
    if first_layer is None:
        return None
    if first_layer == "auto":
        return candidates[0][0] if candidates else None
    names = [name for name, _ in candidates]
    if first_layer not in names:
        raise ActcompError(
            f"first_layer={first_layer!r} is not a supported layer of this model; "
            f"use 'auto', None, or one of: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}"
        )
    return first_layer
