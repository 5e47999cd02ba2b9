"""Model surgery: ``to_compressed(model, pipeline)`` and ``from_compressed(model)``.

>>> import torch, actcomp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> actcomp.to_compressed(model, "mink0.9")
Sequential(
  (0): CompressedLinear(in_features=8, out_features=8, bias=True, compress='mink0.9')
  (1): ReLU()
  (2): CompressedLinear(in_features=8, out_features=2, bias=True, compress='mink0.9')
)

Layer ``0`` reads the model's input, so it runs plain (``first_layer="auto"``, see
:func:`to_compressed`); ``2`` keeps 10% of its input.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace

from torch import nn

from actcomp import host_allocator
from actcomp.core.pipeline import Pipeline, as_pipeline, parse
from actcomp.errors import ActcompError
from actcomp.graph.adapters import adapter_part, adapter_pipeline
from actcomp.graph.model_inputs import unwatch_model_inputs, watch_model_inputs
from actcomp.layers.compressed_layer import compress_layer, is_supported, uncompress_layer
from actcomp.losses.causal_lm import route_causal_lm_loss, unroute_causal_lm_loss
from actcomp.whole_model.compressed_model import check_whole_model_root, compress_whole_model, uncompress_whole_model
from actcomp.whole_model.policy import Lossy, RestPolicy

PipelineLike = str | Pipeline
PipelineChoice = PipelineLike | Mapping[str, PipelineLike | None]
RestLike = PipelineLike | Mapping[str, PipelineLike | None] | RestPolicy
LOSS_CHOICES = ("auto", "chunked", "plain")


def to_compressed(
    model: nn.Module,
    pipeline: PipelineChoice,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    first_layer: str | None = "auto",
    rest: RestLike | None = None,
    loss: str = "auto",
    return_freed_memory: bool = True,
) -> nn.Module:
    """Convert supported layers of ``model`` in place to cache compressed inputs; returns it.

    ``pipeline`` is a spec string, a :class:`Pipeline`, or a mapping from module-name
    patterns (``fnmatch`` style, e.g. ``"blocks.*.mlp.fc1"``) to specs; the first pattern
    that matches a name wins, and a ``None`` spec leaves the layer alone. Every converted
    layer gets its own fresh pipeline instance (stateful stages such as ``mesa8`` keep
    per-layer ranges).

    ``filter_fn(module, name)`` may veto layers. ``first_layer`` keeps the layer that reads the
    raw input uncompressed (DropIT §3.4: the caller keeps that data anyway, so compressing the
    layer's copy frees nothing, and dropping elements of raw data hurts learning):

    - ``"auto"`` (default): decided by what a layer actually receives, on every call. A layer
      whose input is (a view of) a tensor passed to ``model``'s forward runs plain for that call;
      every other call is compressed. A ResNet's ``conv1`` and a ViT's ``patch_embed.proj`` read
      the image and stay plain; BERT's or Llama's first projections read a LayerNorm output and
      are compressed. (A forward pre-hook on ``model`` records its inputs; see
      :mod:`actcomp.graph.model_inputs`.)
    - a module name: that layer is not converted at all;
    - ``None``: every layer is compressed.

    ``rest`` switches on whole-model mode (:mod:`actcomp.whole_model`): every other tensor autograd
    keeps is compressed too, by the kind of op saving it. The presets: ``rest="8bit"`` keeps
    ReLU-family outputs, dropout masks and MaxPool argmaxes exactly in 1-4 bits and norm, other
    activation (GELU/SiLU too) and attention tensors in int8 (norm inputs in groups inside each
    normalized unit; a bf16 or fp16 BatchNorm input in ``int4:group=64``, a quarter of its bytes);
    ``"4bit"`` the same with int4 in groups of 64 (LayerNorm and RMSNorm inputs
    in groups of 16, where a trained LLM's sink token shares a row with outlier channels) and
    GELU/SiLU inputs as 4-bit derivative codes; ``"exact"`` only the exact codecs (bit-identical gradients). A spec string
    applies that spec to norms, activations and attention; a mapping overrides kinds of the
    ``"8bit"`` preset one by one, e.g. ``rest={"normalization": "int4", "fewbit": 3}``.
    ``None`` (default) leaves the rest as it is (Linear/Conv mode), or as a previous conversion
    set it.

    A PEFT LoRA model's adapters get what keeps their gradients (the whole training signal)
    accurate: each ``lora_A`` the pipeline's quantizers alone (``"mink0.9+int8"`` -> ``"int8"``),
    each ``lora_B`` (whose input is r values a token) nothing; the frozen base layers keep nothing
    anyway; under a ``rest`` preset (or one spec) attention is kept in bf16 at most, where a
    trained LLM's outliers would bend the adapters' gradient (a mapping chooses otherwise).
    Convert after PEFT has added the adapters (:mod:`actcomp.graph.adapters`).

    ``loss`` decides a Hugging Face causal LM's ``labels=`` loss (:mod:`actcomp.losses.causal_lm`):
    ``"chunked"`` computes it by :func:`~actcomp.losses.linear_cross_entropy`, the logits a
    chunk of tokens at a time and again in backward, never kept whole (then ``output.logits`` is
    a placeholder in training calls with labels, which names this option when used);
    ``"plain"`` leaves the model's own; ``"auto"`` (default) is ``"chunked"`` where the
    conversion is lossy anyway (a lossy layer pipeline or ``rest``) and ``"plain"`` where it is
    exact (the chunked loss sums in another order: equal to float rounding, not bit for bit).
    Models whose forward changes the logits before the loss (a Gemma-2 softcap) keep their own.

    ``return_freed_memory`` (default True) makes glibc give freed buffers of 1 MiB and up back to
    the operating system (:mod:`actcomp.host_allocator`), without which a process keeps the pages
    the freed full-size tensors held and its peak shows little of the saving (ViT-S, batch 32:
    1.33x lower instead of 2.15x). The setting is the process's, made when actcomp first
    compresses a tensor outside a compiled graph (a model only ever compiled keeps glibc's
    allocator as it comes, where the setting's page faults cost more than its buffers); ``False`` or
    ``ACTCOMP_RETURN_FREED_MEMORY=0`` leave the allocator alone.

    Converting an already converted model replaces the pipelines of the layers it selects
    (never nests); other layers keep theirs. A call that changes nothing (no layer selected, no
    ``rest``) warns.
    """
    if not isinstance(model, nn.Module):
        raise ActcompError(f"to_compressed expects an nn.Module, got {type(model).__name__}")
    if loss not in LOSS_CHOICES:
        raise ActcompError(f"to_compressed: loss={loss!r} is not one of {', '.join(map(repr, LOSS_CHOICES))}")
    choose = _chooser(pipeline)
    policy = None if rest is None else _for_adapters(model, rest, RestPolicy.parse(rest))
    if policy is not None:
        check_whole_model_root(model)  # before any layer is converted: a refusal changes nothing
    candidates = [(name, module) for name, module in model.named_modules() if is_supported(module)]
    for name, module in candidates:
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ActcompError(
                f"layer {name!r} is an uninitialized {type(module).__name__}: lazy layers change class on "
                "their first forward, which would drop compression; run one forward pass before to_compressed"
            )
    skipped = _first_layer_name(candidates, first_layer)
    converted, lossy = 0, policy is not None and not policy.is_exact()
    for name, module in candidates:
        if name == skipped or (filter_fn is not None and not filter_fn(module, name)):
            continue
        chosen = choose(name)
        if chosen is not None:
            # A LoRA adapter's layers: lora_A keeps the quantizers alone, lora_B stays plain.
            chosen = adapter_pipeline(name, chosen)
        if chosen is not None:
            lossy = lossy or not chosen.lossless()
            compress_layer(module, chosen.fresh())
            module.actcomp_name = name
            module.actcomp_plain_on_model_input = first_layer == "auto"
            converted += 1
    if loss == "chunked" or (loss == "auto" and lossy):
        routed = route_causal_lm_loss(model)
        if loss == "chunked" and not routed:
            warnings.warn(f"to_compressed(loss='chunked'): the loss of this {type(model).__name__} stays its own: only a "
                          "Hugging Face causal LM whose forward takes lm_head's output straight to transformers' "
                          "default causal-LM loss is routed (call actcomp.linear_cross_entropy yourself otherwise)",
                          UserWarning, stacklevel=2)
    else:
        routed = False
        unroute_causal_lm_loss(model)
    if policy is not None:
        compress_whole_model(model, policy)
    elif not converted and not routed:
        # rest= alone still compresses what the other ops save: only a call that changes nothing warns.
        _warn_nothing_converted(model, [name for name, _ in candidates])
    if any(getattr(m, "actcomp_plain_on_model_input", False) for m in model.modules()):
        watch_model_inputs(model)
    else:
        unwatch_model_inputs(model)
    if return_freed_memory and (converted or routed or policy is not None):
        host_allocator.request()  # set at the first eager compression (a compiled model never needs it)
    return model


def _warn_nothing_converted(model: nn.Module, supported: list[str]) -> None:
    if supported:
        shown = ", ".join(repr(name) for name in supported[:5]) + (" ..." if len(supported) > 5 else "")
        why = (f"it has {len(supported)} Linear/Conv layer{'s' * (len(supported) > 1)} ({shown}), but the "
               "pipeline's patterns, filter_fn or first_layer selected none")
    else:
        why = ("it has no layer to convert (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, their subclasses, "
               "transformers' GPT-2 Conv1D); rest='8bit' would compress the tensors its other ops save for backward")
    warnings.warn(f"to_compressed left this {type(model).__name__} unchanged: {why}", UserWarning, stacklevel=3)


def from_compressed(model: nn.Module) -> nn.Module:
    """Restore every converted layer of ``model`` (and a whole-model root) to its plain class, in
    place; returns it."""
    uncompress_whole_model(model)
    unroute_causal_lm_loss(model)
    for module in model.modules():
        uncompress_layer(module)
    unwatch_model_inputs(model)
    return model


def compressed_layers(model: nn.Module) -> dict[str, Pipeline]:
    """Names of the converted layers and their pipelines."""
    from actcomp.layers.compressed_layer import CompressedLayer

    return {name: m.actcomp_pipeline for name, m in model.named_modules() if isinstance(m, CompressedLayer)}


def _chooser(pipeline: PipelineChoice) -> Callable[[str], Pipeline | None]:
    if isinstance(pipeline, Mapping):
        rules = [
            (pattern, None if spec is None else as_pipeline(spec, f"pattern {pattern!r}"))
            for pattern, spec in pipeline.items()
        ]

        def choose(name: str) -> Pipeline | None:
            return next((p for pattern, p in rules if fnmatch.fnmatchcase(name, pattern)), None)

        return choose
    single = as_pipeline(pipeline, "to_compressed")
    return lambda name: single


# A LoRA fine-tune's whole training signal is its adapters' gradient, and attention's backward
# is where a trained LLM's outliers bend it: with them built in, the preset's int8 attention gave
# the adapters' gradient cosine 0.9963 (nf4 base 0.9943), all of SDPA's tensors in bf16 0.9989
# (0.9991), query and key as they are with value and output in bf16 0.9999: bench_lora.py. Where
# the call is run again in backward (whole_model/attention_recompute.py), query, key and value in
# bf16 give 0.9997 at 3.78x fewer bytes (query and key in int8: 0.9936).
_ADAPTERS_ATTENTION = Lossy(parse("bf16"), query_key_as_is=True)


def _for_adapters(model: nn.Module, rest: RestLike, policy: RestPolicy) -> RestPolicy:
    """``policy``, with attention's query and key kept as they are and its value and output in
    bf16 at most where ``model`` carries LoRA adapters and ``rest`` named no choice for attention
    (a preset or one spec; a mapping or policy is taken as given)."""
    if isinstance(rest, (Mapping, RestPolicy)) or not isinstance(policy.attention, Lossy):
        return policy
    if not any(getattr(stage, "bits", None) for stage in policy.attention.pipeline.stages):
        return policy  # a float format already
    if not any(adapter_part(name) for name, _ in model.named_modules()):
        return policy
    return replace(policy, attention=_ADAPTERS_ATTENTION)


def _first_layer_name(candidates: list[tuple[str, nn.Module]], first_layer: str | None) -> str | None:
    if first_layer is None or first_layer == "auto":
        return None
    names = [name for name, _ in candidates]
    if first_layer not in names:
        raise ActcompError(
            f"first_layer={first_layer!r} is not a supported layer of this model; "
            f"use 'auto', None, or one of: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}"
        )
    return first_layer
