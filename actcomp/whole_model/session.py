"""The eager engine of whole-model mode: one training forward's saved-tensor hooks
(:class:`_Session`). It names the op and kind that save each tensor from the scopes
:mod:`~actcomp.graph.saved_tensors` watches, asks :func:`~actcomp.whole_model.choosing.choose_codec`
for the codec, encodes each tensor once per choice, and keeps the forms of
:mod:`~actcomp.whole_model.kept_forms`, undone in backward by :func:`_unpack`.
The compiled engine (:mod:`~actcomp.whole_model.in_graph`) shares the choosing and the forms.

>>> import torch, actcomp
>>> net = actcomp.to_compressed(torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU()), "int8", rest="exact")
>>> net(torch.randn(4, 8)).sum().backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from actcomp import host_allocator
from actcomp.core.pipeline import Pipeline
from actcomp.graph.not_compiled import not_compiled
from actcomp.graph.op_kinds import is_parameter
from actcomp.graph.saved_tensors import (
    SavedEvent,
    Scope,
    TensorCache,
    announce,
    in_compressed_layer,
    innermost_kind,
    is_parameter_copy,
    listened,
    refuse_double_backward,
    saving_for_a_custom_function,
    unseen_by_scopes,
)
from actcomp.kernels.layouts import storage_key
from actcomp.torch_compat import activation_of_node, autograd_node_name, gelu_node_approximate, product_inputs
from actcomp.whole_model.attention_recompute import (
    AttentionCall,
    RecomputedAttention,
    input_codec,
    warn_not_recomputed,
)
from actcomp.whole_model.choosing import (
    CodecChoice,
    argument,
    choose_codec,
    frees_memory,
    grouped_by_rows,
    sdpa_inputs,
    sdpa_roles,
)
from actcomp.whole_model.kept_forms import AsIs, Compressed, Recomputed, Rescaled
from actcomp.whole_model.policy import Derivative, Lossy, RestPolicy


@not_compiled
def _unpack(holder) -> torch.Tensor:
    if isinstance(holder, AsIs):
        return holder.unpack()
    refuse_double_backward("a whole-model compressed tensor",
                           "the saved tensor is rebuilt from its compressed form, without its autograd history",
                           "Convert the model back with actcomp.from_compressed(model) for this computation")
    return holder.unpack()


class _Session:
    """One training forward of a whole-model: chooses and applies codecs as tensors are saved."""

    def __init__(self, policy: RestPolicy, excluded: Iterable[torch.Tensor]):
        self.policy = policy
        # Buffers and the caller's data stay alive anyway: a compressed copy would only add bytes.
        self.excluded = {storage_key(t) for t in excluded}
        self.excluded.discard(None)
        # (saved tensor, codec choice) -> compressed form: one tensor saved twice under one
        # choice (RMSNorm's input, by pow and by mul) is compressed once.
        self.cache = TensorCache()
        # (autograd node, output index) of a SiLU/GELU input -> its compressed form and the op's
        # settings, for the gate product that saves the activation's output (Recomputed).
        self.activation_inputs: dict[tuple[Any, int], tuple[Compressed, str, str]] = {}
        # (autograd node, output index) of a norm's input kept in a value code, and of a norm's
        # statistic kept as it is, for the product of the two that the norm saves (Rescaled).
        self.norm_inputs: dict[tuple[Any, int], Compressed] = {}
        self.norm_statistics: dict[tuple[Any, int], torch.Tensor] = {}
        # Fused attention calls whose inputs are coded for recomputation, by the call's scope,
        # until the call's output is saved (attention_recompute).
        self.attention_calls: dict[Scope, AttentionCall] = {}

    unpack = staticmethod(_unpack)  # the saved-tensor hooks' unpack, beside pack

    def close(self) -> None:
        """Forget the forward's tensors: the saved variables alone now decide what stays alive."""
        self.cache.clear()
        self.excluded.clear()
        self.activation_inputs.clear()
        self.norm_inputs.clear()
        self.norm_statistics.clear()
        self.attention_calls.clear()
        host_allocator.forget_copy_buffer()

    def pack(self, tensor: torch.Tensor):
        if in_compressed_layer() and not listened():
            # Most saves of a converted model are a compressed layer's own packed form, kept as
            # they are: no choosing, not even the scope guard below (a few µs, 5 saves a layer).
            return AsIs(tensor)
        # The hook's operations are not the model's: the scope-tracking mode does not see them.
        with unseen_by_scopes():
            # Most saves of a converted model are a compressed layer's own packed form, kept as
            # they are: they skip choosing (and its grad-mode switch) altogether.
            kind, kept = ("linear", None) if in_compressed_layer() else self.choose(tensor)
            holder = AsIs(tensor) if kept is None else kept
            if listened():
                if kept is None:
                    event = SavedEvent(tensor, (tensor,), kind, None)
                elif isinstance(kept, Recomputed):
                    # Its bytes are its source's, counted once where the activation saved them.
                    event = SavedEvent(tensor, kept.source.packed.tensors, kind, f"{kept.op} of a kept input")
                elif isinstance(kept, Rescaled):
                    # Its source's and its statistic's, both counted where the norm saved them.
                    event = SavedEvent(tensor, (*kept.source.packed.tensors, kept.statistic), kind,
                                       "rescaled kept input")
                elif isinstance(kept, RecomputedAttention):
                    # Nothing of its own: the log-sum-exp the call may still hold is a row statistic.
                    event = SavedEvent(tensor, (), kind, "recomputed")
                else:
                    event = SavedEvent(tensor, kept.packed.tensors, kind, kept.packed.layout.spec)
                announce(event)
        return holder

    def choose(self, tensor: torch.Tensor) -> tuple[str, Compressed | None]:
        if type(tensor) is not torch.Tensor:
            return "other", None  # tensor subclasses (DTensor activations, ...) keep their own semantics
        if is_parameter(tensor) or storage_key(tensor) in self.excluded or is_parameter_copy(tensor):
            return "kept", None
        # A custom autograd Function's saves are its own business (a fused loss's gradients
        # computed in the forward, a fused kernel's input): "other", kept exactly unless the
        # user opts in with rest={"other": spec}, whatever module it runs in.
        scope = None if saving_for_a_custom_function() else innermost_kind()
        kind = "other" if scope is None else scope.kind
        if kind == "linear" or not frees_memory(tensor):
            return kind, None
        if scope is not None and scope.op == "gate":
            recomputed = self.recomputed(tensor)
            if recomputed is not None:
                return kind, recomputed
        if scope is not None and scope.op == "sdpa" and kind == "attention":
            held = self.attention_save(tensor, scope)
            if held is not None:
                return kind, held
        if kind == "normalization" and tensor.grad_fn is not None:
            rescaled = self.rescaled(tensor)
            if rescaled is not None:
                return kind, rescaled
        kept = self.cached(tensor, kind, scope)
        if scope is not None and scope.op in ("silu", "gelu"):
            self.note_activation_input(tensor, kept, scope)
        elif kind == "normalization" and tensor.grad_fn is not None:
            self.note_norm_save(tensor, kept)
        return kind, kept

    def note_norm_save(self, tensor: torch.Tensor, kept: Compressed | None) -> None:
        """Remember a norm's input kept in a value code, or a statistic (a row's ``rstd``) kept
        as it is, for :meth:`rescaled`."""
        key = (tensor.grad_fn, tensor.output_nr)
        if isinstance(kept, Compressed) and isinstance(kept.codec, Pipeline):
            self.norm_inputs[key] = kept
        elif kept is None and tensor.dim() and tensor.shape[-1] == 1:
            self.norm_statistics[key] = tensor.detach()

    def rescaled(self, tensor: torch.Tensor) -> Rescaled | None:
        """``tensor`` as :class:`Rescaled` when it is the product (maybe cast) of a norm input this
        forward compressed and a statistic it kept as it is, of ``tensor``'s shape; else None."""
        inputs = product_inputs(tensor.grad_fn)
        if inputs is None:
            return None
        for first, second in (inputs, inputs[::-1]):
            source, statistic = self.norm_inputs.get(first), self.norm_statistics.get(second)
            if source is None or statistic is None:
                continue
            layout = source.packed.layout
            if layout.shape != tensor.shape or torch.broadcast_shapes(layout.shape, statistic.shape) != tensor.shape:
                return None
            return Rescaled(source, statistic, tensor.dtype)
        return None

    def note_activation_input(self, tensor: torch.Tensor, kept: Compressed | None, scope: Scope) -> None:
        """Remember a SiLU/GELU input kept in a value code (not as it is: exact modes stay
        bit for bit; not as derivative codes: they cannot give the values back)."""
        if (isinstance(kept, Compressed) and isinstance(kept.codec, Pipeline) and tensor.grad_fn is not None
                and tensor.numel() == scope.reference):
            approximate = str(argument(scope, 1, "approximate", "none")) if scope.op == "gelu" else "none"
            self.activation_inputs[(tensor.grad_fn, tensor.output_nr)] = (kept, scope.op, approximate)

    def recomputed(self, tensor: torch.Tensor) -> Recomputed | None:
        """``tensor`` as :class:`Recomputed` when it is SiLU/GELU of an input this forward
        compressed, of its shape and dtype; else None."""
        node = tensor.grad_fn
        op = activation_of_node(node) if node is not None else None
        if op is None or len(node.next_functions) != 1:
            return None
        found = self.activation_inputs.get(node.next_functions[0])
        if found is None or found[1] != op:
            return None
        source, _, approximate = found
        if op == "gelu" and gelu_node_approximate(node) != approximate:
            return None
        layout = source.packed.layout
        if layout.shape != tensor.shape or layout.dtype != tensor.dtype:
            return None
        return Recomputed(source, op, approximate)

    def attention_save(self, tensor: torch.Tensor, scope: Scope) -> Compressed | AsIs | RecomputedAttention | None:
        """What a fused attention call keeps of ``tensor`` when the call is recomputed in
        backward (:mod:`~actcomp.whole_model.attention_recompute`): its query, key and value
        coded, its log-sum-exp and output as :class:`RecomputedAttention`; None for a save this
        leaves to the kind's choice."""
        choice = self.policy.attention
        choice = choice.fallback if isinstance(choice, Derivative) else choice
        if not isinstance(choice, Lossy) or not _recomputable_call(scope):
            return None
        call = self.attention_calls.get(scope)
        roles = sdpa_roles(tensor, scope)
        if roles:
            if call is None:
                call = self.attention_calls[scope] = AttentionCall()
            role = "value" if roles == ("value",) else "query"
            pipeline = input_codec(choice, role)
            kept = self.encoded(tensor, CodecChoice(grouped_by_rows(pipeline, tensor.shape[-1]) or pipeline))
            held = AsIs(tensor) if kept is None else kept
            call.inputs.update(dict.fromkeys(roles, held))
            return held
        if call is None or not call.complete:
            return None
        if tensor.grad_fn is None:  # the log-sum-exp (the node's only save without history)
            call.logsumexp = AsIs(tensor)
            return RecomputedAttention(call, 1)
        del self.attention_calls[scope]
        if call.confirm(tensor):
            return RecomputedAttention(call, 0)
        warn_not_recomputed(autograd_node_name(tensor.grad_fn))
        return None

    def cached(self, tensor: torch.Tensor, kind: str, scope: Scope | None) -> Compressed | None:
        choice = choose_codec(self.policy, tensor, kind, scope)
        return None if choice is None else self.encoded(tensor, choice)

    def encoded(self, tensor: torch.Tensor, choice: CodecChoice) -> Compressed | None:
        """``tensor`` under ``choice``, encoded once per forward and choice: the key is everything
        the codec reads besides the tensor's values (its settings: a clamp's range, GELU's
        approximation, a pool's geometry, a norm's unit), so two saves of one tensor under one op
        with other arguments never share a code."""
        kept = self.cache.get(tensor, choice)
        if kept is None:
            # Compressing must not record autograd history (nor save tensors of its own).
            with torch.no_grad():
                kept = choice.encode(tensor)
            if kept is not None:
                self.cache.put(tensor, choice, kept)
        return kept


def _recomputable_call(scope: Scope) -> bool:
    """Whether an SDPA call may run the CPU's flash kernel, which whole-model mode recomputes:
    CPU tensors of 4 dimensions, one floating dtype, unit last strides, no dropout. The
    output's node confirms it (:meth:`AttentionCall.confirm`)."""
    tensors = sdpa_inputs(scope)
    if not all(isinstance(tensor, torch.Tensor) for tensor in tensors) or argument(scope, 4, "dropout_p", 0.0):
        return False
    query = tensors[0]
    return (query.device.type == "cpu" and query.dtype.is_floating_point and query.dim() == 4
            and all(tensor.dtype == query.dtype and tensor.dim() == 4 and tensor.stride(-1) == 1 for tensor in tensors))


class _Rungs:
    """The policies every whole-model forward packs under at once (none outside
    :func:`several_policies`), and the one whose forms the backward running now unpacks. Not
    thread-local: on a GPU autograd runs the backward, with its unpack hooks and a checkpointed
    block's recomputation, in a thread of its own per device, which must see the selection made
    in the caller's thread."""

    policies: tuple[RestPolicy, ...] = ()
    current: int = 0


_RUNGS = _Rungs()


def open_session(policy: RestPolicy, excluded: Iterable[torch.Tensor], excluded_keys: Iterable = ()) -> _Session | _Sessions:
    """The session a whole-model forward (or a checkpointed block's recomputation) packs
    through: ``policy``'s, or inside :func:`several_policies` one per policy given there.
    ``excluded`` are kept as they are, as are the storages of ``excluded_keys``."""
    excluded, excluded_keys = list(excluded), set(excluded_keys)
    sessions = [_Session(rung, excluded) for rung in (_RUNGS.policies or (policy,))]
    for session in sessions:
        session.excluded.update(excluded_keys)
    return _Sessions(sessions) if _RUNGS.policies else sessions[0]


class _Sessions:
    """One forward packed under several policies: each save keeps one form per policy, and a
    backward unpacks the forms of the policy :func:`several_policies` selected. The forward's
    values do not depend on the policy (a code only changes what backward reads), so each
    backward over the retained graph gives the gradient that policy's own step gives, bit for
    bit (``tests/whole_model/test_several_policies.py``), for one forward instead of one each."""

    def __init__(self, sessions: list[_Session]):
        self.sessions = sessions
        # What a checkpointed block inside takes to its recomputation (checkpointed._captured),
        # which opens a _Sessions of its own through open_session.
        self.policy, self.excluded = sessions[0].policy, sessions[0].excluded

    def pack(self, tensor: torch.Tensor) -> tuple:
        return tuple(session.pack(tensor) for session in self.sessions)

    @staticmethod
    def unpack(holders: tuple) -> torch.Tensor:
        return _unpack(holders[_RUNGS.current])

    def close(self) -> None:
        for session in self.sessions:
            session.close()


@contextlib.contextmanager
def several_policies(policies: Sequence[RestPolicy]) -> Iterator[Callable[[int], None]]:
    """Every whole-model forward started inside (in any thread: the budget search's own tool, not
    for concurrent training) packs each saved tensor under each of ``policies``; the function
    yielded selects the policy whose forms the next backward reads.
    The budget search measures its op kinds' rungs so: one forward, then one backward per rung
    over the retained graph (``retain_graph=True``).

    >>> import torch, actcomp
    >>> from actcomp.whole_model.policy import RestPolicy
    >>> net = actcomp.to_compressed(torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(),
    ...                                                 torch.nn.Linear(64, 1)), {"*": None}, rest="exact")
    >>> gradients = []
    >>> with several_policies([RestPolicy.parse("exact"), RestPolicy.parse("4bit")]) as select:
    ...     loss = net(torch.randn(4, 8)).sum()
    ...     for rung in range(2):
    ...         select(rung)
    ...         loss.backward(retain_graph=rung == 0)
    ...         gradients.append(net[0].weight.grad.clone())
    ...         net.zero_grad()
    >>> torch.equal(*gradients)  # the 4-bit derivative code of GELU's input bends the second
    False
    """
    if not policies:
        raise ValueError("several_policies needs at least one policy")

    def select(index: int) -> None:
        if not 0 <= index < len(policies):
            raise IndexError(f"policy {index} of {len(policies)}")
        _RUNGS.current = index

    outer = _RUNGS.policies, _RUNGS.current
    _RUNGS.policies, _RUNGS.current = tuple(policies), 0
    try:
        yield select
    finally:
        _RUNGS.policies, _RUNGS.current = outer
