"""A Hugging Face causal LM's ``labels=`` loss through :func:`linear_cross_entropy`.

``LlamaForCausalLM.forward`` (and Mistral's, Qwen2's, Phi3's, ... alike) computes
``logits = self.lm_head(hidden_states)`` and then ``self.loss_function(logits=logits, labels=...)``:
a (tokens, vocabulary) tensor, upcast to float32 and kept whole for backward. Routed, a training
call with ``labels`` passes the hidden states past ``lm_head`` untouched, and the loss computes
the logits chunk by chunk from them and ``lm_head.weight``, with the same shift, ``ignore_index``
and ``num_items_in_batch`` as ``transformers.loss.loss_utils.ForCausalLMLoss``. The output's
``logits`` is then :data:`NOT_COMPUTED`, a stand-in whose use raises an error that says why (they
were never made; Liger Kernel's fused loss returns None there); eval, ``no_grad`` and calls
without ``labels`` run the model's own forward.

Only forwards whose source goes straight from ``self.lm_head(hidden_states)`` to
``self.loss_function(logits=logits, ...)`` are routed (a Gemma-2 softcap in between is not), and
only while the model's loss function is transformers' default causal-LM loss.

>>> route_causal_lm_loss(torch.nn.Linear(2, 2))  # not a causal LM: left alone
False
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import threading
import weakref

import torch
from torch import nn

from actcomp.core.pipeline import Pipeline, parse
from actcomp.errors import ActcompError
from actcomp.losses.linear_cross_entropy import linear_cross_entropy


class _Deferred(threading.local):
    """The routed model whose forward is running in this thread with labels, if any, and the
    ``forward`` its ``lm_head`` held as an instance attribute before (accelerate's device hooks
    wrap a module's forward that way), to put back afterwards."""

    model: nn.Module | None = None
    head_forward: object | None = None


_DEFERRED = _Deferred()
_HANDLES = "_actcomp_loss_hooks"


def route_causal_lm_loss(model: nn.Module) -> bool:
    """Route the ``labels=`` loss of ``model``, or of the outermost causal LM inside it (a PEFT
    model wraps one), through :func:`linear_cross_entropy`, in place; True where there is a
    causal LM whose forward allows it (see the module docstring)."""
    for module in model.modules():
        if getattr(module, _HANDLES, None) is not None:
            return True
        if _routable(module):
            _route(module)
            return True
    return False


def _route(model: nn.Module) -> None:
    plain_loss = model.loss_function
    model.loss_function = _RoutedLoss(model, plain_loss)
    handles = (model.register_forward_pre_hook(_enter, with_kwargs=True),
               model.register_forward_hook(_leave, with_kwargs=True, always_call=True))
    setattr(model, _HANDLES, (handles, plain_loss))


class _RoutedLoss:
    """A routed model's ``loss_function``: :func:`_loss` bound to the model by a weak reference.
    A strong one (the ``functools.partial`` of stop 57 and before) made every routed model a
    reference cycle, freed only when the garbage collector next ran: ``plan_budget``'s copies
    piled up, 200 MB each on an 8-layer Llama, and each later step faulted in fresh pages.
    A deep copy of the model binds its copy's loss to the copy; a pickle stores the model."""

    __slots__ = ("_model", "plain_loss")

    def __init__(self, model: nn.Module, plain_loss) -> None:
        self._model, self.plain_loss = weakref.ref(model), plain_loss

    def __call__(self, *args, **kwargs):
        model = self._model()
        if model is None:  # held past its model's life: nothing routes through it any more
            return self.plain_loss(*args, **kwargs)
        return _loss(model, self.plain_loss, *args, **kwargs)

    def __deepcopy__(self, memo: dict):
        model, plain_loss = self._model(), copy.deepcopy(self.plain_loss, memo)
        if model is None:
            return plain_loss  # as it computes: the plain loss
        # Copied with its model (copy.deepcopy registers the new model before copying its
        # attributes): bound to the copy. Copied alone: bound to the same model.
        return _RoutedLoss(memo.get(id(model), model), plain_loss)

    def __reduce__(self):
        model = self._model()
        return (_RoutedLoss, (model, self.plain_loss)) if model is not None else (_plain, (self.plain_loss,))


def _plain(plain_loss):
    """What a routed loss whose model is gone unpickles to: the plain loss it computes."""
    return plain_loss


def unroute_causal_lm_loss(model: nn.Module) -> None:
    """Undo :func:`route_causal_lm_loss` (nothing where it was not routed)."""
    for module in model.modules():
        installed = getattr(module, _HANDLES, None)
        if installed is not None:
            handles, plain_loss = installed
            for handle in handles:
                handle.remove()
            module.loss_function = plain_loss
            delattr(module, _HANDLES)


def has_routable_loss(model: nn.Module) -> bool:
    """Whether :func:`route_causal_lm_loss` would route a loss of ``model`` (or has)."""
    return is_routed(model) or any(_routable(module) for module in model.modules())


def is_routed(model: nn.Module) -> bool:
    """Whether :func:`route_causal_lm_loss` routed the loss of ``model`` or of a module inside it."""
    return any(getattr(module, _HANDLES, None) is not None for module in model.modules())


def _routable(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Linear) or getattr(config, "vocab_size", None) != head.out_features:
        return False
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    return getattr(model, "loss_function", None) is ForCausalLMLoss and _forward_goes_straight(_model_class(model))


def _model_class(model: nn.Module) -> type:
    """The model's own class, past any actcomp put in front of it (whole-model mode)."""
    for cls in type(model).__mro__:
        if "forward" in vars(cls) and not cls.__module__.startswith("actcomp."):
            return cls
    return type(model)


@functools.lru_cache(maxsize=None)
def _forward_goes_straight(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``self.lm_head(hidden_states)`` to the loss unchanged."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    # Older transformers (5.17) slice the rows first (``logits_to_keep``; all rows in training):
    # the loss then reads the sliced hidden states, as plain's reads the sliced logits.
    head = re.search(r"^\s*logits = self\.lm_head\(hidden_states(\[[\w\s:,]*\])?\)\s*$", source, re.MULTILINE)
    loss = re.search(r"self\.loss_function\(\s*logits=logits,\s*labels=labels,\s*vocab_size=self\.config\.vocab_size",
                     source)
    if head is None or loss is None or loss.start() < head.end():
        return False
    # Nothing may rewrite the logits in between (a softcap, a scale).
    return re.search(r"^\s*logits\s*[-+*/]?=", source[head.end():loss.start()], re.MULTILINE) is None


def _enter(model: nn.Module, args: tuple, kwargs: dict) -> None:
    labels = kwargs.get("labels")
    if labels is None or not (model.training and torch.is_grad_enabled()) or _DEFERRED.model is not None:
        return
    _DEFERRED.model = model
    _DEFERRED.head_forward = vars(model.lm_head).get("forward")
    # The hidden states pass lm_head untouched; the loss reads the weight itself.
    model.lm_head.forward = _hidden_states


def _leave(model: nn.Module, args: tuple, kwargs: dict, output):
    if _DEFERRED.model is not model:
        return None
    _DEFERRED.model = None
    if _DEFERRED.head_forward is None:
        del model.lm_head.forward
    else:
        model.lm_head.forward, _DEFERRED.head_forward = _DEFERRED.head_forward, None
    if output is None:  # the forward raised: its error goes on
        return None
    # Never hand out the hidden states as logits: a stand-in that says why there are none.
    if isinstance(output, tuple):
        return (output[0], NOT_COMPUTED, *output[2:])
    output.logits = NOT_COMPUTED
    return output


class LogitsNotComputed:
    """What a routed model returns as ``logits`` in a training call with labels: the logits
    were never made. Any use raises an :class:`~actcomp.errors.ActcompError` that says so.

    >>> NOT_COMPUTED.argmax(-1)
    Traceback (most recent call last):
    ...
    actcomp.errors.ActcompError: the logits were not computed: actcomp computed this training call's loss ...
    """

    def __getattr__(self, name: str):
        raise ActcompError(
            "the logits were not computed: actcomp computed this training call's loss chunk by chunk from the "
            "hidden states (to_compressed routes a causal LM's labels= loss, never holding its logits); call the "
            "model without labels (or under no_grad / eval) for logits, or convert with "
            "to_compressed(..., loss='plain') to keep them")

    def __repr__(self) -> str:
        return "LogitsNotComputed()"


NOT_COMPUTED = LogitsNotComputed()


def _hidden_states(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states


# What the loss keeps of the hidden states, lm_head's input, where lm_head's own spec is lossy:
# its quantizer alone (a sparsifier would drop values the input's gradient needs too), 8 bits at
# least, as a LoRA adapter's lora_A keeps its input. On a LoRA model with outliers built in the
# adapters' gradient cosine stays 0.99969 and the model keeps 4.06x fewer bytes instead of 3.78x
# (bench_lora.py); at the preset's bytes a full model's loss keeps a quarter.
_HIDDEN_FLOOR, _KEPT_AS_GIVEN = parse("int8"), frozenset({"int8", "bf16", "fp16"})


def _hidden_codec(head: nn.Module) -> Pipeline | None:
    """The code the loss keeps the hidden states in, after lm_head's spec; None: as they are.

    >>> head = nn.Linear(4, 8)
    >>> _hidden_codec(head), _hidden_codec(type("H", (), {"actcomp_pipeline": parse("mink0.9+int8")})())
    (None, Pipeline('int8'))
    """
    pipeline = getattr(head, "actcomp_pipeline", None)
    if pipeline is None or pipeline.lossless():
        return None
    quantizers = [stage for stage in pipeline.stages if stage.kind == "quantizer"]
    if quantizers and quantizers[-1].name in _KEPT_AS_GIVEN:
        return Pipeline(quantizers[-1])
    return _HIDDEN_FLOOR


def _loss(model: nn.Module, plain_loss, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
          shift_labels=None, **kwargs):
    if _DEFERRED.model is not model:
        return plain_loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                          ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    hidden = logits  # lm_head passed them through
    if shift_labels is None:
        # ForCausalLMLoss's shift: token t predicts token t + 1, the last predicts nothing.
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    shift_labels = shift_labels.to(hidden.device)
    head = model.lm_head
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(hidden, head.weight, shift_labels.view(hidden.shape[:-1]), head.bias,
                                ignore_index=ignore_index, reduction=reduction, hidden_codec=_hidden_codec(head))
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
