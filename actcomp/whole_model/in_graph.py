"""Whole-model compression inside ``torch.compile``: saved-tensor hooks AOTAutograd inlines.

The eager whole-model mode (:mod:`~actcomp.whole_model.compressed_model`) learns which op saves
a tensor by watching calls, which a compiled graph never makes. A compiled training step instead
runs under saved-tensor hooks given as ``torch.fx.GraphModule`` s: AOTAutograd then retraces the
pack hook once per tensor the forward graph saves, inlines it at the end of the compiled forward
and the unpack hook at the start of the compiled backward (torch 2.14.1 here,
``maybe_inline_graph_saved_tensors_hooks``): the quantizers' encode as one extern call (their
``torch.library`` op, whose Python body runs the kernel eager mode would, once per tensor and
step), their decode and the other codecs as traced ops Inductor fuses with their neighbours (a
decoded activation is computed inside the kernel that reads it, never stored whole). While a hook is
retraced, torch names the saved node and both graphs. This engine's one part of its own is
reading what the *backward* does with the tensor (:func:`_kept_form`); from that it names the op
and kind as the eager engine's scopes would, and the rest is shared with eager mode: the op table
and the policy (:func:`~actcomp.whole_model.choosing.choose_codec`), the codecs, and the kept forms
(:mod:`~actcomp.whole_model.kept_forms`), handed from hook to hook as their tensors and the key of
a template:

============================================  ==========================================  ======
the backward reads it                          kept as                                     exact?
============================================  ==========================================  ======
as a bool (dropout masks, ReLU's ``x <= 0``)   ``dropout-mask``: 1 bit an element          yes
only through one comparison with a constant    ``comparison-mask``: 1 bit an element       yes
  (a ReLU output the backward tests ``<= 0``)
as an attention op's query or key              ``bf16`` at most (the attention kind's      no
                                               rule); its mask as it is
only as a matrix product's operand (a Linear   ``spec`` (a layer's weight gradient)        no
  layer's input)
only as an average pooling's input             ``shape-only``: no bytes                    yes
through a comparison and otherwise (a ReLU     the comparison's bits beside the values'    the
  output that is the next Linear's input)      code, decoded values moved to the side the  mask:
                                               bits say (:class:`~.kept_forms.Sided`)      yes
any other way, floating point                  the ``"activation"`` kind's choice; a       no
                                               statistic (a quarter of its readers'
                                               largest input or less) as it is
============================================  ==========================================  ======

Inductor's decompositions leave norms and GELU/SiLU as arithmetic in the backward graph, so the
``"normalization"`` kind's choice, rows per norm and derivative codes are eager-mode's alone here;
max-pooling's indices reach the hooks already as Inductor's int8 offsets and are kept as they are.
Tensors of fewer than :data:`MIN_ELEMENTS` elements, integer tensors and what torch does not
hand to the hooks (parameters, the step's inputs and outputs: ``saved_tensors_hooks_filtering_mode
= "donated"``) are kept as they are; so is everything under ``rest="exact"`` except the 1-bit
and shape-only forms, whose gradients are bit-identical to the compiled step without hooks.

Under a plan with a lossy codec the partitioner decides differently what reaches the hooks at
all: it may rebuild in backward a value only a matrix product reads there (a norm's output,
GELU's output, a converted layer's traced codes of them) from what the backward keeps anyway,
except a value compared with a constant, which stays kept with its exact bits
(:mod:`~actcomp.whole_model.recomputation`). A ViT block keeps 6 tensors instead of 9.

>>> import torch, actcomp
>>> net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
>>> step = torch.compile(lambda x: net(x).square().mean())
>>> with actcomp.compress_in_graph("int8", rest="8bit"):
...     loss = step(torch.randn(128, 64))
>>> loss.backward()
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import torch
from torch import fx

from actcomp.core.packed import Packed
from actcomp.core.pipeline import Pipeline, as_pipeline
from actcomp.errors import ActcompError
from actcomp.graph.saved_tensors import Scope
from actcomp.torch_compat import (
    AVERAGE_POOL_BACKWARDS,
    aot_saved_tensor_hook_context,
    argument_names,
    backward_compiled_with_forward,
    backward_graph,
    buffer_reuse,
    custom_graph_pass_base,
    is_inlined_pack_output,
    is_inlined_unpack_input,
    mark_as_wrapped_call,
    post_grad_custom_post_pass,
    recomputing_what_backward_materializes,
    reorder_for_peak_memory,
    saved_node_name,
    set_buffer_reuse,
    set_post_grad_custom_post_pass,
    set_reorder_for_peak_memory,
)
from actcomp.whole_model.choosing import AttentionScope, CodecChoice, choose_codec
from actcomp.whole_model.kept_forms import Compressed, Sided
from actcomp.whole_model.policy import Lossy, RestPolicy
from actcomp.whole_model.recomputation import SCALAR_COMPARISONS, KeepComparedValues

# Below this, a saved tensor costs less than the code that would compress it.
MIN_ELEMENTS = 4096
# Scalar comparisons whose result is all a tensor's backward needs.
_COMPARISONS = SCALAR_COMPARISONS
# A Linear layer's weight gradient reads its input through one matrix product; a batched one is
# attention's (its operands take the kinds' choices, as eager mode's attention scope gives them).
_MATMULS = {torch.ops.aten.mm.default}
# Average pooling's backward reads its input (argument "self") for the shape alone: the op
# table's avg_pool entry keeps only that, as eager mode does.
_AVERAGE_POOL = Scope("pooling", op="avg_pool")


@functools.cache
def _source_hash() -> str:
    """A hash of the package's code: part of every cache key the compiled graphs are stored
    under. All of it, not this module alone: the hooks inline the codecs (kernels, compressors,
    the chain), and a graph cached before a codec changed would otherwise be served after it.
    The files are read, not imported."""
    package = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class _Plan:
    """What the in-graph hooks do: the Linear inputs' pipeline (None: as they are) and the
    whole-model policy for the others."""

    linear: Pipeline | None
    policy: RestPolicy

    @property
    def lossy(self) -> bool:
        """Whether any tensor may be kept in a lossy code (else every form is exact)."""
        return self.linear is not None or any(isinstance(choice, Lossy) for choice in _choices(self.policy))

    @property
    def cache_hash(self) -> str:
        """Stable across processes, so AOTAutograd's cache keeps the compiled graphs."""
        text = f"actcomp in-graph {_source_hash()} {self.linear and self.linear.spec} {self.policy}"
        return hashlib.sha256(text.encode()).hexdigest()


class _CodecsWhereUsed(custom_graph_pass_base()):
    """Inductor's post-grad pass that moves the inlined hooks next to the tensors they code.

    AOTAutograd inlines every pack hook at the *end* of the forward graph and every unpack hook
    at the *start* of the backward graph: as they stand, every saved tensor would live whole
    until the forward ends, and be decoded whole when the backward starts, and the step's peak
    would be the uncompressed one. In a forward graph (one whose outputs are ``<saved>_hook_<i>``
    nodes) this pass moves each pack's nodes up to where their inputs are ready (Inductor's
    peak-memory reordering moves generated loops there, but leaves an extern call at the end:
    ViT-S's step peak was plain's, 302 MiB); in a backward graph (one with the ``_hook_``
    inputs) it moves each unpack node down to just before its first user, and turns that
    reordering off for the graph, which would undo it. Graphs without inlined hooks are left as
    they are."""

    previous: _CodecsWhereUsed | None = None  # or any other CustomGraphPass

    def __call__(self, graph: fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        backward = any(is_inlined_unpack_input(node) for node in graph.find_nodes(op="placeholder"))
        if backward:
            _sink_decoding(graph)
        else:
            _hoist_packing(graph)
        if _REORDER.user is not None:
            # Inductor's buffer reuse, read when this graph's code is written: a freed buffer is
            # kept for a later one of its size wherever Inductor's peak estimate allows. That
            # estimate counts a fused decode's per-group offsets and scales at the size of the
            # loop reading them (6 MiB for 25 KiB), so it put ViT-S's backward at 240 MiB and let
            # MLP-sized buffers live from block to block: a step peak of 117 MiB, 95 with reuse
            # off (the fp8 pass's: 93-95; stop 59). The backward frees each buffer at its last use.
            set_buffer_reuse(_REORDER.reuse and not backward)
            # Inductor's peak-memory reordering, read when this graph is scheduled next, moves
            # the decoding back to the top of a backward graph (measured on ViT-S: a backward
            # peak of 251 MiB with it, 106 MiB without); the forward keeps it (103 MiB with it,
            # 294 MiB without: it moves each pack next to the tensor it codes).
            set_reorder_for_peak_memory(_REORDER.user and not backward)

    def uuid(self):
        # Compiled graphs cached with an older version of this pass must not be reused.
        previous = self.previous.uuid() if self.previous is not None else None
        return ("actcomp codecs where used", _source_hash(), previous)


def _hoist_packing(graph: fx.Graph) -> None:
    """Each pack hook's nodes as soon as their inputs are there, so that the tensor they code
    can be freed at its last use in the forward rather than at the forward's end, where the
    inlining put them. Inductor's peak-memory reordering does this for generated loops but leaves
    an extern call (a codec's graph op) where it stands."""
    output = graph.output_node()
    if not any(is_inlined_pack_output(node) for node in output.all_input_nodes):
        return  # not a forward graph with inlined hooks
    # An output of a codec's op nobody reads would keep the op from counting as packing alone.
    graph.eliminate_dead_code()
    packing: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op != "call_function" or not node.users or node.is_impure():
            continue
        # Only what serves packed outputs alone: every user a pack node, or the output where the
        # node is itself a packed form.
        if all(user in packing or (user is output and is_inlined_pack_output(node)) for user in node.users):
            packing.add(node)
    if not packing:
        return
    # Nodes made from nothing (an empty buffer, an arange) go just before their first user: moved
    # up, they would live through the whole forward.
    made_from_nothing = {node for node in packing if not node.all_input_nodes}
    waiting = {node: len(node.all_input_nodes) - len(made_from_nothing.intersection(node.all_input_nodes))
               for node in packing if node not in made_from_nothing}
    placed: dict[fx.Node, None] = {}  # the new order

    def place(node: fx.Node) -> None:
        for source in node.all_input_nodes:
            if source in made_from_nothing and source not in placed:
                place(source)
        placed[node] = None
        for user in () if node in made_from_nothing else node.users:
            if user in waiting and user not in placed:
                waiting[user] -= 1
                if waiting[user] == 0:
                    place(user)  # as soon as its last input is there

    for node in list(graph.nodes):
        if node not in placed and (node not in packing or waiting.get(node) == 0):
            place(node)
    previous = None
    for node in placed:
        if previous is not None and previous.next is not node:
            previous.append(node)
        previous = node


def _sink_decoding(graph: fx.Graph) -> None:
    """Each unpack hook's nodes (computed from the ``_hook_`` inputs alone) right before their first user."""
    decoded = {node for node in graph.find_nodes(op="placeholder") if is_inlined_unpack_input(node)}
    # Views nobody reads would count as a decode's first user and pin it at the top.
    graph.eliminate_dead_code()
    # Constants (an empty buffer, an arange: nodes made from nothing) may feed a decode too.
    constants = {node for node in graph.nodes if node.op == "call_function" and not node.all_input_nodes}
    decode = []
    for node in graph.nodes:
        if (node.op == "call_function" and node.all_input_nodes and decoded.intersection(node.all_input_nodes)
                and set(node.all_input_nodes) <= decoded | constants):
            decoded.add(node)
            decode.append(node)
    # Constants made only for the decoding (an arange, an empty buffer) go with it.
    decode += [node for node in graph.nodes if node.op == "call_function" and not node.all_input_nodes
               and node.users and set(node.users) <= decoded]
    order = {node: index for index, node in enumerate(graph.nodes)}
    decode.sort(key=order.__getitem__)
    for node in reversed(decode):
        first = min(node.users, key=order.__getitem__, default=None)
        if first is not None and first.op != "output":
            first.prepend(node)
            order[node] = order[first] - 0.5


def compress_in_graph(spec: str | Pipeline | None = "int8", rest: str | Mapping | RestPolicy | None = "8bit"):
    """A context manager under which ``torch.compile`` d training compresses what it saves for
    backward, inside the compiled graphs (see the module docstring).

    ``spec``: the pipeline for tensors the backward reads only as a (not batched) matrix product's operand
    (Linear inputs; None keeps them); it must compile (``Pipeline`` stages whose ``compiles()``).
    ``rest``: what :func:`actcomp.to_compressed` takes (``"8bit"``: int8 for the other
    floating-point tensors, attention's query and key bf16; ``"4bit"``: int4 in groups of 64;
    ``"exact"``: only the exact 1-bit forms; a spec string; a mapping of kinds), read as eager
    whole-model mode reads it, or None (as ``"exact"``). The same arguments give the same hooks, so compiled code
    recompiles only when they change. Eager code run under the hooks keeps what it saves as it is.
    """
    plan = _plan(spec, rest)
    _install_decode_where_used()
    return _in_graph_context(_hooks(plan), plan.lossy)


class _Reorder:
    """The user's ``reorder_for_peak_memory`` (``user``) and ``allow_buffer_reuse`` (``reuse``)
    while a :func:`compress_in_graph` block runs; the pass sets both per graph from them."""

    user: bool | None = None
    reuse: bool = True


_REORDER = _Reorder()


@contextlib.contextmanager
def _in_graph_context(hooks, lossy: bool):
    # The backward graph compiles with the forward (not at the first backward, after this block
    # has closed), so that the per-graph setting of the pass applies to it.
    outer, outer_reuse = _REORDER.user, _REORDER.reuse
    _REORDER.user = reorder_for_peak_memory() if outer is None else outer
    _REORDER.reuse = buffer_reuse() if outer is None else outer_reuse
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(backward_compiled_with_forward(_REORDER.user))
            if lossy:  # the backward rebuilds what a code of its own would only approximate
                stack.enter_context(recomputing_what_backward_materializes(KeepComparedValues()))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
            yield
    finally:
        _REORDER.user, _REORDER.reuse = outer, outer_reuse


def _install_decode_where_used() -> None:
    """Put :class:`_CodecsWhereUsed` in Inductor's post-grad passes for good, in front of any
    pass already there: the backward graph compiles at the first backward, after the ``with``
    block has closed, and the pass leaves every graph without inlined hooks as it is."""
    current = post_grad_custom_post_pass()
    if not isinstance(current, _CodecsWhereUsed):
        decode_late = _CodecsWhereUsed()
        decode_late.previous = current
        set_post_grad_custom_post_pass(decode_late)


def _plan(spec, rest) -> _Plan:
    linear = None if spec is None else as_pipeline(spec, "compress_in_graph's spec")
    # None keeps only the exact forms, as "exact" does.
    policy = RestPolicy.parse("exact" if rest is None else rest)
    lossy = [(linear, "spec")] + [(choice.pipeline, "rest") for choice in _choices(policy) if isinstance(choice, Lossy)]
    for pipeline, where in lossy:
        if pipeline is not None and not all(stage.compiles() for stage in pipeline.stages):
            raise ActcompError(
                f"compress_in_graph's {where} {pipeline.spec!r} has a stage that cannot run inside a compiled graph "
                "(Rice-coded positions, running ranges); use a static form such as 'int8', 'fp8' or 'smink0.9+int8'"
            )
    return _Plan(linear, policy)


def _choices(policy: RestPolicy) -> list:
    """The policy's choices, a derivative code's fallback in its place (the graph never names
    GELU or SiLU: Inductor's decompositions leave their backward as arithmetic)."""
    return [getattr(choice, "fallback", choice) for choice in (getattr(policy, item.name) for item in fields(policy))]


# The plans hooks were made for, by cache hash: the graph's node names its plan by that string.
_PLANS: dict[str, _Plan] = {}
# The templates of the forms packed while compiling (the kept form less its tensors: codecs and
# layouts, which a compiled graph cannot carry), named by their own text (the string the pack
# hook hands the unpack hook): one entry per distinct form, however often graphs recompile. A
# layout's sizes may be a compile's symbols, so the latest template of a text is kept: the
# unpack hook is traced in the same compile as its pack.
_TEMPLATES: dict[str, Compressed | Sided] = {}


@functools.cache
def _hooks(plan: _Plan) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The pack and unpack graph modules of ``plan``, made once: dynamo guards on their ids."""
    _PLANS[plan.cache_hash] = plan
    return _one_call_module(_pack, plan), _one_call_module(_unpack, plan)


def _one_call_module(function, plan: _Plan) -> fx.GraphModule:
    """A graph module whose one node calls ``function(saved, plan's hash)``, as ``torch.fx.wrap``
    would make it, with a cache hash so that compiled graphs holding it can be cached."""
    graph = fx.Graph()
    node = graph.call_function(function, (graph.placeholder("saved"), plan.cache_hash))
    mark_as_wrapped_call(node, plan.cache_hash)
    graph.output(node)
    return fx.GraphModule(torch.nn.Module(), graph)


def _pack(saved: torch.Tensor, plan_hash: str):
    """The saved tensor as it is, or ``(template key, its shape, *packed tensors)``."""
    # Outside a compiled graph's tracing (eager code: a loss computed outside the compiled model,
    # a graph break) nothing says which op saves the tensor: kept as it is, and quietly, since a
    # loss outside the model is the usual way to train a compiled one.
    context = aot_saved_tensor_hook_context()
    if context is None or saved.numel() < MIN_ELEMENTS:
        return saved
    kept = _kept_form(_PLANS[plan_hash], saved, _backward_users(context), saved_node_name(context))
    if kept is None:
        return saved
    key = kept.key()
    _TEMPLATES[key] = kept.template()
    # The shape travels with the tensors: under dynamic shapes its sizes are the forward's
    # symbols, which the unpack hook's trace can name only as the hook's own inputs.
    return (key, tuple(saved.shape), *kept.packed_tensors())


def _unpack(packed, plan_hash: str) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    key, shape, *tensors = packed
    return _TEMPLATES[key].refill(iter(tensors), shape).unpack()


def _kept_form(plan: _Plan, saved: torch.Tensor, users: list[fx.Node], name: str) -> Compressed | Sided | None:
    """What ``saved`` is kept as, from how the backward graph reads it: the compiled engine's one
    part of its own. It names the kind and op as the eager engine's scopes would and asks the
    same :func:`~actcomp.whole_model.choosing.choose_codec` (the same op table, policy and
    codecs), but reads the graph:

    - a bool tensor: a mask (dropout's);
    - read only through one comparison with a constant: the op ``"compared"`` (its exact bits);
    - read by an attention op: kind ``"attention"``, knowing which argument it is;
    - read only as a (not batched) matrix product's operand: a Linear input, ``spec``'s;
    - read only as an average pooling's input: op ``"avg_pool"``, its shape alone;
    - otherwise the ``"activation"`` kind's choice (decomposed norms and activations look alike
      here), a statistic kept as it is against the largest tensor its readers take.

    A tensor compared and read otherwise keeps the comparison's bits beside its values."""
    policy = plan.policy
    if saved.dtype == torch.bool or not saved.is_floating_point():
        choice = choose_codec(policy, saved, "activation", None) if saved.dtype == torch.bool else None
        return _encoded(choice, saved)
    comparisons = [user for user in users if user.target in _COMPARISONS]
    comparison = _one_comparison(comparisons)
    if comparisons and comparison is None:
        return None  # several comparisons: lossy values could cross any of them
    mask = None
    if comparison is not None:
        mask = _encoded(choose_codec(policy, saved, "activation", Scope("activation", op="compared", args=comparison)),
                        saved)
        if len(comparisons) == len(users) or mask is None:
            return mask
    others = [user for user in users if user not in comparisons]
    if others and not comparisons and all(_pools_shape_only(user, name) for user in others):
        return _encoded(choose_codec(policy, saved, "pooling", _AVERAGE_POOL), saved)
    attention = _attention_scope(others, name)
    if attention is not None:
        values = _encoded(choose_codec(policy, saved, "attention", attention), saved)
    elif others and all(user.target in _MATMULS for user in others):
        values = _encoded(None if plan.linear is None else CodecChoice(plan.linear), saved)
    else:
        scope = Scope("activation", reference=_largest_input(others))
        values = _encoded(choose_codec(policy, saved, "activation", scope), saved)
    if values is None:
        return None  # kept whole, the comparison is in it
    return values if mask is None else Sided(values, mask)


def _pools_shape_only(user: fx.Node, name: str) -> bool:
    """Whether ``user`` is an average pooling's backward reading the saved node ``name`` as its
    input alone, whose shape is all it reads."""
    positions = [index for index, value in enumerate(user.args) if isinstance(value, fx.Node) and value.name == name]
    return user.target in AVERAGE_POOL_BACKWARDS and positions == [1]


def _encoded(choice: CodecChoice | None, saved: torch.Tensor) -> Compressed | None:
    """``saved`` encoded by ``choice``, decoding in its memory order's dense layout without the
    strides eager mode restores: under dynamic shapes those strides are expressions of the
    forward's symbols (``256*s77``), which the unpack hook's trace cannot name."""
    kept = None if choice is None else choice.encode(saved)
    if kept is None:
        return None  # no choice, or one that would not save memory
    return Compressed(kept.codec, Packed(kept.packed.tensors, replace(kept.packed.layout, strides=None)))


def _largest_input(users: list[fx.Node]) -> int | None:
    """The most elements among the tensors ``users`` read (None where a size is a compile's
    symbol): a saved tensor a quarter of that or less is a statistic (a norm's mean)."""
    sizes = [value.numel() for user in users for node in user.all_input_nodes
             if isinstance(value := node.meta.get("val"), torch.Tensor)]
    return max(sizes) if sizes and all(isinstance(size, int) for size in sizes) else None


def _backward_users(context: dict) -> list[fx.Node]:
    """The nodes of the backward graph that read the saved node (its placeholder there)."""
    name = saved_node_name(context)
    for node in backward_graph(context).find_nodes(op="placeholder"):
        if node.name == name:
            return list(node.users)
    return []


# The arguments attention's backward ops (memory-efficient, cuDNN, CPU flash) read an additive
# mask or bias from. A mask holds -inf or the lowest float where attention is off: any finite-range
# code turns it to NaN or to steps of 1e36 over the logits, and the backward recomputes the
# probabilities with it (the H200 zoo run of stop 44 found it in eager mode's twin of this).
_MASK_ARGUMENTS = frozenset({"attn_bias", "attn_mask"})
# And the per-row log-sum-exp they recompute the probabilities from (memory-efficient attention
# pads it with +inf past the sequence): kept as it is, as in eager mode.
_STATISTIC_ARGUMENTS = frozenset({"logsumexp"})


def _attention_scope(users: list[fx.Node], name: str) -> AttentionScope | None:
    """The scope of an attention op among ``users`` reading the saved node ``name``, knowing
    which of its arguments that is (by the op's schema); None when no attention op reads it."""
    for user in users:
        names = argument_names(user.target)
        if names is None or not {"query", "key"} <= set(names):
            continue
        bound = [*zip(names, user.args), *user.kwargs.items()]
        roles = {argument for argument, value in bound if isinstance(value, fx.Node) and value.name == name}
        role = ("mask" if roles & _MASK_ARGUMENTS else "statistic" if roles & _STATISTIC_ARGUMENTS
                else "query or key" if roles & {"query", "key"} else None)
        return AttentionScope(role, _largest_input([user]))
    return None


def _one_comparison(users: list[fx.Node]) -> tuple[str, float] | None:
    """``(name, threshold)`` when every user is the same comparison with the same constant."""
    found = {(_COMPARISONS.get(user.target), user.args[1] if len(user.args) > 1 else None) for user in users}
    if len(found) != 1:
        return None
    name, threshold = found.pop()
    if name is None or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        return None
    return name, float(threshold)
