"""Shared bookkeeping for code that watches the tensors autograd saves for backward.

Two users: :func:`actcomp.memory_report` (which module and op kind keeps how many bytes) and
whole-model mode (which codec a saved tensor gets). Both need the same facts:

- **scopes**: which modules and which recognised torch functions are running right now, the
  innermost last (:func:`tracking_scopes`, :func:`current_scopes`). Saved-tensor hooks fire
  inside the op that saves, so the innermost scope with a kind is the saver's kind;
- **what is not an activation**: parameters, views of them, FSDP2's unsharded parameters and
  autocast's low-precision weight copies (:func:`is_parameter`, :func:`is_parameter_copy`);
- **whose hooks are on top**: a checkpoint region's hooks must not be overridden
  (:func:`top_saved_tensors_hooks`, :func:`checkpoint_hooks_on_top`);
- **one encoding per tensor**: a tensor saved twice for one use is encoded once, while it lives
  unmodified (:class:`TensorCache`);
- **no double backward** through a tensor rebuilt from its compressed form
  (:func:`refuse_double_backward`);
- **listeners** that are told what every saved tensor became (:func:`listening`), so the
  memory report sees through whole-model mode's own hooks;
- the tensors the compressed Linear/Conv Function saves are its own compressed form
  (:func:`saving_compressed_layer`): nobody compresses them again;
- the codecs' own operations run unseen by the scope-tracking mode (:func:`unseen_by_scopes`).

>>> import torch
>>> with tracking_scopes():
...     _ = torch.nn.Sequential(torch.nn.LayerNorm(4))(torch.randn(2, 4))
...     current_scopes()
[]
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from actcomp.errors import ActcompError
from actcomp.graph.model_inputs import tensors_in
from actcomp.graph.op_kinds import (
    GATE,
    PRODUCTS,
    SCALE,
    is_gate_product,
    is_scale,
    known_functions,
    module_kind,
)
from actcomp.torch_compat import (
    drops_saved_tensors,
    is_accumulate_grad,
    is_cast_or_view_node,
    top_saved_tensors_hooks,
    torch_function_disabled,
    version_of,
)


class Scope:
    """A running module or recognised torch function.

    ``reference`` is the element count of its largest tensor argument: a saved tensor far
    smaller than that is a statistic (a norm's mean, attention's log-sum-exp), not the
    activation itself. It is counted when first asked for (a pack hook asks, a few scopes in
    a hundred): the arguments are alive and unchanged in size while their scope runs, and
    counting at every module's entry cost a torch call per argument.

    >>> Scope("activation", op="gelu", args=(torch.ones(2, 3), 0.5)).reference
    6
    """

    __slots__ = ("kind", "module", "op", "args", "kwargs", "_reference")

    def __init__(self, kind: str | None, module: nn.Module | None = None, op: str | None = None, args: tuple = (),
                 kwargs: dict | None = None, reference: int | None = None) -> None:
        self.kind, self.module, self.op, self.args = kind, module, op, args
        self.kwargs = {} if kwargs is None else kwargs
        self._reference = reference

    @property
    def reference(self) -> int:
        if self._reference is None:
            self._reference = _largest_numel(self.args)
        return self._reference

    def __repr__(self) -> str:
        module = None if self.module is None else type(self.module).__name__
        return f"Scope(kind={self.kind!r}, module={module}, op={self.op!r})"


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.scopes: list[Scope] = []
        self.tracking = 0
        self.compressed_layer = 0
        self.listeners: list[Callable[[SavedEvent], None]] = []
        # Whether the last torch call the scope-tracking mode saw ran with grad mode on.
        self.last_call_recorded = True


_STATE = _ThreadState()
# The recognised functions' kinds, read by the mode at every call (the table itself, so
# functions registered later are seen).
_KIND_OF = known_functions().get


def current_scopes() -> list[Scope]:
    """The running scopes, outermost first (empty unless :func:`tracking_scopes` is on)."""
    return _STATE.scopes


def innermost_kind() -> Scope | None:
    """The innermost running scope that has a kind, or None."""
    for scope in reversed(_STATE.scopes):
        if scope.kind is not None:
            return scope
    return None


def saving_for_a_custom_function() -> bool:
    """Whether the tensor being saved now is a custom autograd Function's (``ctx.save_for_backward``).

    A built-in op saves right after its own call, which runs with grad mode on; a Function's
    forward runs its torch calls with grad mode off, and its saves follow the last of them.
    (A forward with no torch call at all is not caught: the save then takes the scope it runs in.)

    >>> class Double(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x * 2
    >>> seen = []
    >>> with tracking_scopes(), torch.autograd.graph.saved_tensors_hooks(
    ...         lambda t: seen.append(saving_for_a_custom_function()) or t, lambda t: t):
    ...     x = torch.ones(2, requires_grad=True)
    ...     _ = Double.apply(torch.sigmoid(x))
    >>> seen  # sigmoid's output, then Double's input
    [False, True]
    """
    return not _STATE.last_call_recorded


def innermost_module() -> nn.Module | None:
    """The innermost running module, or None."""
    for scope in reversed(_STATE.scopes):
        if scope.module is not None:
            return scope.module
    return None


def _largest_numel(values) -> int:
    return max((tensor.numel() for tensor in tensors_in(values)), default=0)


# The global hooks take what a with-kwargs hook is given too: torch passes it to a global hook
# whose id a module's own with-kwargs hooks also use (ids come from one counter per process,
# and a module unpickled from another process keeps that process's ids).
def _enter_module(module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
    if _STATE.tracking:
        _STATE.scopes.append(Scope(module_kind(module), module=module, args=args))


def _leave_module(module: nn.Module, args: tuple, *kwargs_and_output: Any) -> None:
    if not _STATE.tracking:
        return
    scopes = _STATE.scopes
    # Pop through the module's own scope: a function scope left open by an exception goes too.
    while scopes:
        if scopes.pop().module is module:
            break


class _FunctionScopes(TorchFunctionMode):
    """Opens a scope around every torch function :func:`~actcomp.graph.op_kinds.function_kind` recognises.

    This runs for every torch call of the model, most of which no kind claims: those pay one
    grad-mode read and two look-ups, and build nothing.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _STATE.last_call_recorded = torch.is_grad_enabled()
        try:
            known = _KIND_OF(func)
            product = known is None and func in PRODUCTS
        except TypeError:  # an unhashable callable
            known, product = None, False
        if product and _STATE.tracking and innermost_kind() is None:
            # A gated MLP's product, or a LayerScale's or squeeze-excitation's, outside any kind's scope (inside attention
            # it stays attention's, inside a norm module the norm's).
            known = GATE if is_gate_product(func, args) else SCALE if is_scale(func, args) else None
        if known is None or not _STATE.tracking:
            return func(*args, **kwargs) if kwargs else func(*args)
        scopes = _STATE.scopes
        depth = len(scopes)
        scopes.append(Scope(known.kind, op=known.op, args=args, kwargs=kwargs))
        try:
            return func(*args, **kwargs) if kwargs else func(*args)
        finally:
            del scopes[depth:]


def unseen_by_scopes() -> contextlib.AbstractContextManager:
    """A block whose torch calls skip every ``__torch_function__`` handler, the scope-tracking
    mode's included: a codec's own operations (a few dozen per saved tensor) are no op of the
    model, and each would cost a Python call into the mode. Codecs see plain tensors only (a
    tensor subclass keeps its own semantics and is never encoded), so nothing else changes.

    >>> with tracking_scopes(), unseen_by_scopes():
    ...     _ = torch.relu(torch.ones(2))
    """
    return torch_function_disabled()


def call_unseen(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, whose torch calls the scope-tracking mode (when on) does not see: to
    the mode it is one call, made with grad mode as it is now. For a compressed layer's forward,
    a dozen torch calls (reading its input's metadata, the op, its saves, marked by
    :func:`saving_compressed_layer`) that each would cost a Python call into the mode. Every
    torch-function handler is off inside, as in :func:`unseen_by_scopes`: for plain tensors only,
    code that pushes no torch-function mode of its own, and tensors made from others or on a
    named device (a user's ``with torch.device(...)`` does not reach inside either).

    >>> with tracking_scopes():
    ...     call_unseen(torch.relu, torch.ones(2))
    tensor([1., 1.])
    """
    if not _STATE.tracking:
        return function(*args)
    _STATE.last_call_recorded = torch.is_grad_enabled()
    with unseen_by_scopes():
        return function(*args)


def enter_running_module(module: nn.Module, args: tuple) -> None:
    """Open the scope of ``module``, whose forward pre-hooks are running, when tracking began in
    one of them (after the global pre-hook that opens scopes had passed the module by); the global
    forward hook closes it as for any module. Where tracking was on already, that pre-hook opened it."""
    scopes = _STATE.scopes
    if not scopes or scopes[-1].module is not module:
        _enter_module(module, args)


@contextlib.contextmanager
def tracking_scopes() -> Iterator[None]:
    """Keep :func:`current_scopes` up to date in this thread while the block runs (nests)."""
    if _STATE.tracking:
        yield
        return
    pre = nn.modules.module.register_module_forward_pre_hook(_enter_module)
    # always_call: an exception inside a module still closes its scope.
    post = nn.modules.module.register_module_forward_hook(_leave_module, always_call=True)
    _STATE.tracking += 1
    try:
        with _FunctionScopes():
            yield
    finally:
        _STATE.tracking -= 1
        _STATE.scopes.clear()
        pre.remove()
        post.remove()


def is_parameter_copy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter after casts and views only (autocast's bf16 weight).

    Only cast/view nodes are followed: a conv output whose input needs no gradient also has
    the weight as its only autograd input, yet it is an activation.
    """
    node = tensor.grad_fn
    for _ in range(8):
        if node is None:
            return False
        if is_accumulate_grad(node):
            return isinstance(node.variable, nn.Parameter)
        if not is_cast_or_view_node(node) or len(node.next_functions) != 1:
            return False
        node = node.next_functions[0][0]
    return False


def checkpoint_hooks_on_top() -> bool:
    """Whether the innermost saved-tensor hooks are ``torch.utils.checkpoint``'s: tensors saved
    now are to be recomputed (or are being recomputed, where whole-model mode compresses what
    the recomputation keeps: :mod:`~actcomp.whole_model.checkpointed`), so nothing else may
    replace its hooks."""
    top = top_saved_tensors_hooks()
    return top is not None and (getattr(top[0], "__module__", "") == "torch.utils.checkpoint"
                                or getattr(top[0], "actcomp_checkpoint", False))


def saves_dropped_by_checkpoint() -> bool:
    """Whether what is saved now is dropped at once and recomputed in backward: the forward of a
    block under non-reentrant ``torch.utils.checkpoint``."""
    top = top_saved_tensors_hooks()
    return top is not None and drops_saved_tensors(top[0])


class TensorCache:
    """Values made from tensors, keyed by the tensor and a key of the caller's, found again only
    while that tensor lives and is not modified in place. Entries go when their tensor does.

    >>> cache, x = TensorCache(), torch.ones(3)
    >>> cache.put(x, "doubled", x * 2)
    >>> cache.get(x, "doubled")
    tensor([2., 2., 2.])
    >>> _ = x.add_(1)
    >>> cache.get(x, "doubled") is None
    True
    >>> del x, _  # (the name _ holds x too)
    >>> len(cache)
    0
    """

    def __init__(self) -> None:
        # (id of the tensor, key) -> (weak reference to it, its version then, value). The weak
        # reference tells an id reused by a new tensor from the old one; the version, an
        # in-place change since.
        self._entries: dict[tuple[int, Any], tuple[weakref.ref, int, Any]] = {}

    def get(self, tensor: torch.Tensor, key: Any) -> Any:
        """The value put for ``tensor`` and ``key``, or None."""
        hit = self._entries.get((id(tensor), key))
        if hit is not None and hit[0]() is tensor and hit[1] == version_of(tensor):
            return hit[2]
        return None

    def put(self, tensor: torch.Tensor, key: Any, value: Any) -> None:
        """Keep ``value`` for ``tensor`` (held weakly) and ``key``."""
        entry_key, entries = (id(tensor), key), self._entries
        entries[entry_key] = (weakref.ref(tensor, lambda _: entries.pop(entry_key, None)), version_of(tensor), value)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def refuse_double_backward(through: str, why: str, remedy: str) -> None:
    """Raise when the backward running now records a graph (``create_graph=True``): a tensor
    rebuilt from a compressed form has lost its autograd history, so a second backward through
    it would be silently wrong. ``through`` names the tensor, ``why`` and ``remedy`` complete it.

    >>> with torch.no_grad():  # a plain backward runs with grad mode off
    ...     refuse_double_backward("a tensor", "it is rebuilt", "Do not")
    >>> refuse_double_backward("a tensor", "it is rebuilt", "Do not")
    Traceback (most recent call last):
    actcomp.errors.ActcompError: double backward (create_graph=True) through a tensor is not supported: it is rebuilt. Do not
    """
    if torch.is_grad_enabled():
        raise ActcompError(f"double backward (create_graph=True) through {through} is not supported: {why}. {remedy}")


@contextlib.contextmanager
def saving_compressed_layer() -> Iterator[None]:
    """Mark tensors saved in the block as a compressed layer's own compressed form."""
    _STATE.compressed_layer += 1
    try:
        yield
    finally:
        _STATE.compressed_layer -= 1


def in_compressed_layer() -> bool:
    """Whether a compressed Linear/Conv Function is saving its tensors right now."""
    return _STATE.compressed_layer > 0


@dataclass(frozen=True)
class SavedEvent:
    """What one save became: the tensor autograd asked to keep, and what is really kept."""

    tensor: torch.Tensor
    kept: tuple[torch.Tensor, ...]
    kind: str
    codec: str | None


@contextlib.contextmanager
def listening(listener: Callable[[SavedEvent], None]) -> Iterator[None]:
    """Call ``listener`` for every tensor whole-model mode's hooks keep in this thread."""
    _STATE.listeners.append(listener)
    try:
        yield
    finally:
        _STATE.listeners.remove(listener)


def announce(event: SavedEvent) -> None:
    """Tell every listener about ``event``."""
    for listener in _STATE.listeners:
        listener(event)


def listened() -> bool:
    """Whether anyone is listening (so callers can skip building events)."""
    return bool(_STATE.listeners)
