"""Whole-model mode: compress every tensor autograd keeps, not only Linear/Conv inputs.

``to_compressed(model, "mink0.9+int8", rest="8bit")`` converts the Linear/Conv layers as always
and makes the model's forward run under saved-tensor hooks that choose, per saved tensor, by the
kind of op saving it (:mod:`actcomp.graph.op_kinds`):

==============  ================================================  =========
kind            kept as                                           exact?
==============  ================================================  =========
activation      ReLU / ReLU6 / Hardtanh / LeakyReLU: 1-bit mask   yes
                GELU, SiLU: the ``rest`` spec ("8bit": int8), or  no
                few-bit derivative codes ("4bit": 4 bits)
                Sigmoid, Tanh, Mish, ...: the ``rest`` spec        no
normalization   Batch/Layer/Group/RMS norm inputs: ``rest`` spec,  no
                in groups inside each normalized unit
attention       SDPA query and key: bf16 at most (fp32 -> bf16)     no
                SDPA value and output: ``rest`` spec, >= 8 bits   no
                softmax, the rest: ``rest`` spec                  no
                SDPA's own dropout mask (CPU): 1-bit mask         yes
pooling         MaxPool2d: window offsets, input shape only       yes
dropout         1-bit mask (and any saved bool tensor)            yes
linear          the layer's own pipeline (never these hooks)      as today
other           as is, unless ``rest={"other": spec}``            yes
==============  ================================================  =========

Parameters, buffers, autocast's weight copies, the model's own inputs and small statistics (a
norm's mean and rstd, attention's log-sum-exp) are always kept as they are. A tensor saved by
several ops gets one compressed form per saver, so no full-size copy survives; a tensor saved
twice under the same :class:`Codec` (function and every setting it reads: a clamp's range,
GELU's approximation, a norm's unit) is compressed once. Norm inputs are laid out in rows
inside the unit the norm normalizes (:mod:`actcomp.whole_model.normalized_units`) and quantized in groups
that divide a row: a group spanning a tiny-spread row and a wide one would round the tiny one
away, and the norm's backward multiplies that error by ``1/std``.

Why saved-tensor hooks and not one autograd Function per op: the forward and the backward stay
PyTorch's own kernels (cuDNN batch norm, flash attention, fused dropout), so a 1-bit mask gives
bit-identical gradients and functional calls inside timm and transformers blocks are covered
without re-deriving any backward formula. The hooks run only in training with grad enabled; in
a ``torch.utils.checkpoint`` region checkpoint's own hooks win (nothing is stored there), and
what the region's recomputation saves in backward is kept in the codecs the forward would have
chosen (:mod:`~actcomp.whole_model.checkpointed`).

The model's forward is not the only way in: ``model.forward_head(model.forward_features(x))``, a
wrapper calling ``model.blocks(...)`` or ``model.blocks[0](h)`` compress the same. Each submodule
carries a forward pre-hook that starts a whole-model forward when none is running and a forward
hook that ends it when that call returns (also on an exception); there, the submodule's inputs
without autograd history (the caller's data) are kept as they are. Under ``torch.compile`` only the
model's own forward does this (eagerly): a compiled training call entering through a submodule
warns once.

>>> import torch, actcomp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> actcomp.to_compressed(model, "int8", rest="8bit")
CompressedSequential(
  rest='8bit'
  (0): CompressedLinear(in_features=8, out_features=8, bias=True, compress='int8')
  (1): ReLU()
  (2): CompressedLinear(in_features=8, out_features=2, bias=True, compress='int8')
)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
import weakref
from typing import Any

import torch
from torch import nn

from actcomp.errors import WARNED, ActcompError, warn_once
from actcomp.graph.model_inputs import record_model_inputs, tensors_in
from actcomp.graph.module_surgery import (
    SwappedModule,
    rebuild_swapped,
    remove_forward_hooks,
    swap_class,
    unswap_class,
)
from actcomp.graph.not_compiled import WHOLE_MODEL_FALLBACK, not_compiled, warn_if_leaving_graph
from actcomp.graph.saved_tensors import (
    checkpoint_hooks_on_top,
    enter_running_module,
    top_saved_tensors_hooks,
    tracking_scopes,
)
from actcomp.layers.compressed_layer import IN_GRAPH_LINEAR, traces_into_graphs
from actcomp.torch_compat import called_from_compiled_code, not_compiled_frame
from actcomp.whole_model.checkpointed import forward_session
from actcomp.whole_model.policy import RestPolicy
from actcomp.whole_model.session import open_session


class CompressedModel(SwappedModule):
    """Mixin placed in front of the root model's class; see :func:`compress_whole_model`."""

    actcomp_rest: RestPolicy

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            # Eval and no_grad save nothing: the plain forward, no saved-tensor hooks.
            return super().forward(*args, **kwargs)
        warn_if_leaving_graph(WHOLE_MODEL_FALLBACK)
        return _whole_model_forward(self, args, kwargs)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        rest = f"rest={str(self.actcomp_rest)!r}"
        return f"{base}, {rest}" if base else rest

    @classmethod
    def swapped_attributes(cls, base: type[nn.Module]) -> dict[str, Any]:
        return {"forward": _forward_like(base)}


class _Running(threading.local):
    """The whole-model forward running in this thread, if any: ``owner`` is the module whose call
    started it (a converted root's forward, or a submodule called from outside it), ``close`` ends
    its session (None where it declined: under checkpoint or other saved-tensor hooks) and
    ``reentered`` counts calls of ``owner`` inside its own call, whose end must not close it."""

    owner: nn.Module | None = None
    close: contextlib.ExitStack | None = None
    reentered: int = 0


_RUNNING = _Running()


# Storage keys, saved-tensor hooks and the op-kind mode are not traceable. Under torch.compile
# this frame runs eagerly (a graph break at the model's entry) and the model's own forward, which
# it calls, compiles as a graph of its own under compress_in_graph's hooks (the same rest policy,
# chosen in the graph: in_graph.py). Linear layers sharing one pipeline leave their inputs to the
# hooks, which code them with it (the partitioner may then rebuild one in backward instead of
# keeping its codes); other converted layers compress their inputs in it as they do eagerly.
@not_compiled_frame
def _whole_model_forward(module: CompressedModel, args: tuple, kwargs: dict):
    forward = super(CompressedModel, module).forward
    if _RUNNING.owner is not None:
        return forward(*args, **kwargs)  # a whole-model inside another: the outer one's hooks decide
    if called_from_compiled_code():
        hooks = _enter_in_graph(module.actcomp_rest, _shared_linear_spec(module))
        try:
            return _compiled_forward_of(module)(forward, args, kwargs)
        finally:
            _exit_in_graph(hooks)
    # Called from a compiled caller, the model-input hook was traced and recorded nothing.
    record_model_inputs(tensors_in((args, kwargs)))
    try:
        _start(module, module.actcomp_rest, [*module.buffers(), *tensors_in((args, kwargs))],
               type(module).actcomp_base)
        return forward(*args, **kwargs)
    finally:
        _finish()


def _compiled_forward(forward, args: tuple, kwargs: dict):
    """A frame of actcomp's own for the compiled caller to start a graph at, ``forward`` inlined
    in it: a forward of torch's own (``nn.Sequential``'s), called straight from the eager frame
    above, ran eagerly (Dynamo starts no graph in torch's files), and with it every layer, under
    hooks that keep what eager code saves as it is. Every model's forward goes through it, so
    no test of where a forward is defined is needed."""
    return forward(*args, **kwargs)


# Each model's copy of _compiled_forward, with a code object of its own: Dynamo keeps a code
# object's graphs up to its recompile limit (8), and with one frame for every model the ninth
# converted nn.Sequential a process compiled ran eagerly. Weak keys: a model's copy goes with it,
# and nothing is added to the model (a function made here would not pickle).
_FRAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_forward_of(module: nn.Module):
    frame = _FRAMES.get(module)
    if frame is None:
        name = f"_compiled_forward_{len(_FRAMES)}"
        code = _compiled_forward.__code__.replace(co_name=name)  # a new code object (3.10 has no co_qualname)
        frame = _FRAMES[module] = types.FunctionType(code, _compiled_forward.__globals__, name)
    return frame


class _InGraph:
    """Whether a converted model's forward is compiling under compress_in_graph's hooks: read by
    the submodules' traced pre-hooks, which then know they are not an entry from outside."""

    active = False


_IN_GRAPH = _InGraph()


_LINEAR_SPEC = "actcomp_linear_in_graph"  # the root's cache of _shared_linear_spec


def _shared_linear_spec(model: nn.Module) -> str | None:
    """The pipeline every converted ``nn.Linear`` of ``model`` that compiles into graphs shares,
    if they share one (``to_compressed(model, spec)``'s usual result); else None. Found once per
    conversion (a ViT-S's 49 layers take 0.3 ms, every compiled step would pay it): converting
    again forgets it. A layer converted apart later keeps its own Function, which is correct."""
    if _LINEAR_SPEC not in model.__dict__:
        specs = {module.actcomp_pipeline.spec for module in model.modules()
                 if isinstance(module, nn.Linear) and traces_into_graphs(module)}
        model.__dict__[_LINEAR_SPEC] = specs.pop() if len(specs) == 1 else None
    return model.__dict__[_LINEAR_SPEC]


@not_compiled
def _enter_in_graph(policy: RestPolicy, linear: str | None) -> contextlib.AbstractContextManager:
    """compress_in_graph's hooks for ``policy`` entered (eagerly: Dynamo must not trace this),
    coding the converted Linear layers' inputs with ``linear``, the pipeline they share."""
    # Imported here: in_graph imports Inductor (2 s), which `import actcomp` must not pay.
    from actcomp.whole_model.in_graph import compress_in_graph

    hooks = compress_in_graph(linear, rest=policy)
    hooks.__enter__()
    _IN_GRAPH.active = True
    IN_GRAPH_LINEAR.spec = linear
    return hooks


@not_compiled
def _exit_in_graph(hooks: contextlib.AbstractContextManager) -> None:
    _IN_GRAPH.active = False
    IN_GRAPH_LINEAR.spec = None
    hooks.__exit__(None, None, None)


def _start(owner: nn.Module, policy: RestPolicy, excluded: list, model_class: type, entered: tuple | None = None):
    """Start a whole-model forward owned by ``owner``: a session compressing what is saved until
    :func:`_finish`, unless checkpoint's or someone else's saved-tensor hooks are on top.
    ``entered``: the arguments of a submodule whose pre-hook starts it (its own scope opens too)."""
    _RUNNING.owner, _RUNNING.reentered = owner, 0
    if checkpoint_hooks_on_top():
        return  # checkpoint recomputes these tensors: nothing is stored
    top = top_saved_tensors_hooks()
    if top is not None and not getattr(top[0], "actcomp_observer", False):
        warn_once(
            ("foreign saved-tensor hooks", model_class),
            f"whole-model compression is off for this forward: other saved-tensor hooks "
            f"({getattr(top[0], '__qualname__', top[0])}) are active and would be overridden; Linear/Conv layers "
            "are still compressed",
            stacklevel=3,
        )
        return
    session = open_session(policy, excluded)
    close = contextlib.ExitStack()
    # Autograd keeps the pack hook (this session) with every saved variable until backward
    # releases the last one. Holding the compressed tensors in the cache past the forward
    # would keep every one of them alive to the end of backward instead of freeing each as
    # its node runs: on ViT-S at batch 32 that was the whole kept size on top of the peak.
    close.callback(session.close)
    close.enter_context(tracking_scopes())
    # Checkpointed blocks inside this forward compress what their recomputation saves.
    close.enter_context(forward_session(session))
    if entered is not None:
        enter_running_module(owner, entered)
    close.enter_context(torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack))
    _RUNNING.close = close


def _finish() -> None:
    close = _RUNNING.close
    _RUNNING.owner, _RUNNING.close, _RUNNING.reentered = None, None, 0
    if close is not None:
        close.close()


# Entry points other than the root's forward. A converted model's submodules can be called from
# outside it: timm's ``model.forward_head(model.forward_features(x))``, a wrapper calling
# ``model.blocks(...)``, ``model.blocks[0](x)``. Each submodule carries a pre-hook that starts a
# whole-model forward when none is running (training, grad enabled) and a post-hook that ends
# the one its module started. Inside a running one (the root's forward, or an outer submodule's)
# both return at once.


def _enter_submodule(policy: RestPolicy, model_class: type, module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():
        # Dynamo traces module hooks into the graph, where no session can run: an eval forward
        # compiles as before; a compiled training call that enters here is told once.
        if module.training and torch.is_grad_enabled() and _COMPILED_ENTRY not in WARNED and not _IN_GRAPH.active:
            _warn_compiled_entry(model_class)
        return
    owner = _RUNNING.owner
    if owner is not None:
        if owner is module:
            _RUNNING.reentered += 1
        return
    # Eval and no_grad save nothing. In backward, a reentrant checkpoint recomputing a block
    # calls it as from outside the model: it compresses what it saves as the forward would
    # have (whole, the block would hold the step's peak in its backward).
    if not (module.training and torch.is_grad_enabled()):
        return
    # Inputs without autograd history are the caller's data (an image, a cached feature): kept
    # anyway, as the root's inputs are. An input with history is an activation of the caller's
    # graph (forward_features' output reaching forward_head, the patch embedding a wrapper hands
    # to ``blocks``), which the caller rarely holds past the call: compressed, its saved copies
    # free it, as inside the root's forward; excluded, every entry would keep one more tensor
    # whole (on ViT-tiny via forward_features, the first block's and the final norm's inputs).
    data = [tensor for tensor in tensors_in((args, kwargs)) if tensor.grad_fn is None]
    # They are the model's inputs for first_layer="auto" too: the layer reading the image runs
    # plain, as when the root's forward is called, instead of dropping elements of raw data.
    record_model_inputs(data)
    try:
        _start(module, policy, [*module.buffers(), *data], model_class, args)
    except BaseException:
        _finish()
        raise


def _leave_submodule(module: nn.Module, args: tuple, output) -> None:
    if torch.compiler.is_compiling() or _RUNNING.owner is not module:
        return
    if _RUNNING.reentered:
        _RUNNING.reentered -= 1
        return
    _finish()


# Read by the traced pre-hook: dynamo guards on whether the key is in the set, so after the one
# warning (and one recompilation) compiled code calls the warning no more; a call each time would
# be a graph break at every submodule.
_COMPILED_ENTRY = "whole-model entry under torch.compile"


@not_compiled
def _warn_compiled_entry(model_class: type) -> None:
    warn_once(
        _COMPILED_ENTRY,
        f"whole-model compression is off for a {model_class.__name__} submodule called inside torch.compile: "
        "only the model's own forward runs whole-model mode there (eagerly); Linear/Conv layers are still "
        "compressed",
        stacklevel=2,
    )


def _forward_like(base: type[nn.Module]):
    """:meth:`CompressedModel.forward` with ``base.forward``'s docstring and signature.

    Callers read the signature: Hugging Face's Trainer passes on only the batch keys that
    ``forward`` names and finds the label names there; ``(*args, **kwargs)`` would make it drop
    every input. A copy of the function, not a wrapper: a wrapper would be one more frame for
    torch.compile to trace and break in.
    """
    shared = CompressedModel.forward
    forward = types.FunctionType(shared.__code__, shared.__globals__, "forward", shared.__defaults__, shared.__closure__)
    forward.__qualname__ = f"Compressed{base.__name__}.forward"
    forward.__doc__ = base.forward.__doc__
    forward.__signature__ = inspect.signature(base.forward)
    return forward


def check_whole_model_root(model: nn.Module) -> None:
    """Raise if ``model`` cannot take whole-model mode: a bare Linear/Conv layer is its own root."""
    from actcomp.layers.compressed_layer import is_supported

    if is_supported(model):
        base = getattr(type(model), "actcomp_base", type(model))
        raise ActcompError(
            f"rest= needs a model that contains layers; this model is a single {base.__name__}, "
            "whose input the main pipeline already compresses"
        )


def compress_whole_model(model: nn.Module, policy: RestPolicy) -> None:
    """Make ``model``'s training forward compress every saved tensor per ``policy``, in place,
    and its submodules' too when they are called from outside it."""
    check_whole_model_root(model)
    root = swap_class(model, CompressedModel)
    root.actcomp_rest = policy
    root.__dict__.pop(_LINEAR_SPEC, None)  # the layers may have been converted anew
    _remove_entry_hooks(model)  # a root was maybe a submodule of another converted model
    enter = functools.partial(_enter_submodule, policy, type(root).actcomp_base)
    for module in _entry_modules(model):
        _remove_entry_hooks(module)  # converting again replaces the policy, never adds hooks
        module.register_forward_pre_hook(enter, with_kwargs=True)
        # always_call: a submodule that raises still ends the forward it started.
        module.register_forward_hook(_leave_submodule, always_call=True)


def uncompress_whole_model(model: nn.Module) -> None:
    """Undo :func:`compress_whole_model`."""
    if isinstance(model, CompressedModel):
        for module in _entry_modules(model):
            _remove_entry_hooks(module)
    unswap_class(model, CompressedModel, ("actcomp_rest", _LINEAR_SPEC))


def _entry_modules(model: nn.Module):
    """``model``'s submodules, but not those of a converted model inside it, which answer to
    their own root's policy (that root's forward starts its whole-model forwards)."""
    for child in model.children():
        if not isinstance(child, CompressedModel):
            yield child
            yield from _entry_modules(child)


def _remove_entry_hooks(module: nn.Module) -> None:
    remove_forward_hooks(module, _is_entry_hook)


def _is_entry_hook(hook) -> bool:
    return hook is _leave_submodule or getattr(hook, "func", None) is _enter_submodule


# Pickles made before the class swap was shared name this (with the base class as argument).
_rebuild_compressed_model = functools.partial(rebuild_swapped, CompressedModel)
