"""Which tensors are the caller's data: the inputs of a converted model's forward.

``to_compressed(model, ..., first_layer="auto")`` leaves a layer uncompressed on any call where
the tensor it receives *is* data passed to the model (DropIT §3.4: the caller keeps that data
anyway, so compressing the layer's copy frees nothing, and dropping elements of raw input data
hurts learning). What a layer receives decides, not module order: a ViT's ``patch_embed.proj``
reads the image, but BERT's first Linear reads a LayerNorm output and is compressed.

A forward pre-hook on the converted model records its tensor arguments in a weak registry
keyed by storage; a layer asks :func:`is_model_input` about its own input. Entries die with the
caller's tensors, so a freed input's address, reused by an activation, never matches. Views of
an input share its storage and count as the input; casts and other new tensors do not.

>>> import torch
>>> model = torch.nn.Linear(4, 4)
>>> watch_model_inputs(model)
>>> x = torch.randn(2, 4)
>>> _ = model(x)
>>> is_model_input(x[0]), is_model_input(x * 2)
(True, False)
>>> unwatch_model_inputs(model)
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from actcomp.graph.module_surgery import remove_forward_hooks
from actcomp.kernels.layouts import storage_key
from actcomp.torch_compat import forward_hook_tables

_INPUTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def tensors_in(value):
    """Every tensor in ``value``, a tensor or nested lists, tuples and dicts of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _record_model_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    # Storage addresses are not traceable, and while dynamo traces nothing reads them: a
    # converted layer there tells the caller's data by its lack of autograd history, and a
    # whole-model forward, run eagerly, records its own inputs.
    if not torch.compiler.is_compiling():
        record_model_inputs(tensors_in((args, kwargs)))


def record_model_inputs(tensors) -> None:
    """Count ``tensors`` as data passed to a watched model (while they live)."""
    for tensor in tensors:
        key = storage_key(tensor)
        if key is not None:
            _INPUTS[key] = tensor


def is_model_input(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` shares storage with a live tensor passed to a watched model."""
    key = storage_key(tensor)
    return key is not None and key in _INPUTS


def watch_model_inputs(model: nn.Module) -> None:
    """Record ``model``'s tensor arguments on every call (idempotent)."""
    if _record_model_inputs not in forward_hook_tables(model)[0][0].values():
        model.register_forward_pre_hook(_record_model_inputs, with_kwargs=True)


def unwatch_model_inputs(model: nn.Module) -> None:
    """Undo :func:`watch_model_inputs` on ``model`` and its submodules."""
    for module in model.modules():
        remove_forward_hooks(module, lambda hook: hook is _record_model_inputs)
