"""Every private torch internal actcomp uses, each behind one small function named for what it does.

torch promises nothing about these: each is written here once, with the torch versions it was
checked on (the lowest and the highest supported, 2.13.0 and 2.14.1: ``pyproject.toml``) and
what breaks if torch changes it, so that a new torch release is checked in this one file.
``tests/package/test_architecture.py`` fails on a private torch name anywhere else in the package. Torch
submodules are imported inside the functions: ``torch._dynamo`` and ``torch._inductor`` cost
seconds to import, and most users never compile.

>>> import torch
>>> top_saved_tensors_hooks() is None
True
>>> x = torch.ones(2, requires_grad=True)
>>> autograd_node_name((x * 2).grad_fn)
'MulBackward0'
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

_F = TypeVar("_F", bound=Callable)

# --- Autograd ------------------------------------------------------------------------------------


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost saved-tensor hooks in force in this thread, ``(pack, unpack)``, or None.

    >>> with torch.autograd.graph.save_on_cpu():
    ...     top_saved_tensors_hooks()[0].__qualname__
    'save_on_cpu.__init__.<locals>.pack_to_cpu'

    Checked on 2.13.0 and 2.14.1 (``torch._C._autograd._top_saved_tensors_default_hooks``);
    torch has no public way to ask. If it moves, whole-model mode cannot see checkpoint's or a
    user's hooks under its own, and would replace them."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def in_backward_pass() -> bool:
    """Whether autograd's engine is running a backward in this thread (a reentrant checkpoint
    recomputing its forward). Checked on 2.13.0 and 2.14.1 (``torch._C._current_graph_task_id``,
    -1 outside one). If it moves, a recomputed forward would start a whole-model session."""
    return torch._C._current_graph_task_id() != -1


def at_backward_end(callback: Callable[[], None]) -> bool:
    """Have ``callback`` run once the backward this thread is running ends (call it inside one);
    False where this torch cannot. Checked on 2.14.1 (``Variable._execution_engine
    .queue_callback``). If it moves, actcomp's decode buffers kept for reuse within a backward
    are forgotten at the next forward's first decode instead, as before stop 46."""
    queue = getattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback", None)
    if queue is None:
        return False
    queue(callback)
    return True


def compress_checkpoint_recomputation(capture: Callable[[], Any], recompute: Callable[[Any], Any]) -> bool:
    """Have non-reentrant ``torch.utils.checkpoint`` keep what a block's recomputation saves in
    the form actcomp chooses, instead of whole until the block's backward reads it; False where
    this torch's checkpoint is not the one checked (nothing installed, it runs as it is).

    - ``capture()`` runs as a checkpointed block's forward starts; what it returns (None: leave
      this block alone) travels with the block;
    - ``recompute(captured, inputs)``, a context manager entered around the block's
      recomputation in backward (``inputs``: the block's, which checkpoint holds anyway), gives
      ``(pack, unpack)``: each recomputed tensor is kept as ``pack(tensor)`` (which must not hold
      the tensor whole) and handed back to backward as ``unpack(form)``.

    Installed once for the process; blocks whose ``capture()`` gave None run exactly as torch's.
    Checked on 2.13.0 and 2.14.1, and on 2.11.0 (the GPU image), whose frame has no
    ``get_inputs()`` (:func:`_block_inputs`): ``_checkpoint_hook`` (made per checkpointed forward, by name,
    from ``torch.utils.checkpoint``'s globals), its frame (``weak_holders``, ``recomp_counter``,
    ``recomputed[gid][handle]``, ``get_inputs()`` called just before the recomputation),
    ``_recomputation_hook`` (its pack stores the recomputed tensor in the frame and returns it,
    which the recomputation's own graph holds) and ``_StopRecomputationError``. If they move,
    recomputed blocks are kept whole, as before; if they stay but behave otherwise, the frame
    keeps what torch's pack stored there (whole), and checkpoint's unpack returns it as it is."""
    from torch.utils import checkpoint

    names = ("_checkpoint_hook", "_recomputation_hook", "_StopRecomputationError", "_CheckpointFrame")
    if not all(hasattr(checkpoint, name) for name in names):
        return False
    _CHECKPOINT_CALLS[:] = [capture, recompute]
    if getattr(checkpoint._checkpoint_hook, "actcomp_compressing", False):
        return True
    torch_hook, torch_recomputation = checkpoint._checkpoint_hook, checkpoint._recomputation_hook

    # No closure below holds the frame or a hook strongly: a reference cycle through the frame
    # would keep the block's inputs alive until the garbage collector runs.
    class _CompressingCheckpointHook(torch_hook):
        actcomp_compressing = True

        def __init__(self, frame) -> None:
            super().__init__(frame)
            frame.actcomp_captured = _CHECKPOINT_CALLS[0]()
            if frame.actcomp_captured is None:
                return
            unpack_kept, frame_ref = self.unpack_hook, weakref.ref(frame)

            def unpack_hook(holder):
                kept = unpack_kept(holder)
                return kept.unpack() if isinstance(kept, _RecomputedForm) else kept

            self.unpack_hook = unpack_hook
            get_inputs = getattr(type(frame), "get_inputs", None)
            if get_inputs is None:
                return  # torch before 2.13: the recomputation hook reads them off input_saver

            def inputs():  # the recomputation's, read by the recomputation hook made next
                kept_by = frame_ref()
                kept_by.actcomp_inputs = get_inputs(kept_by)
                return kept_by.actcomp_inputs

            frame.get_inputs = inputs

    class _CompressingRecomputationHook(torch_recomputation):
        def __init__(self, target_frame_ref, gid) -> None:
            super().__init__(target_frame_ref, gid)
            frame = target_frame_ref()
            self.actcomp_context = None
            if frame is None or getattr(frame, "actcomp_captured", None) is None:
                return
            inputs = [value for value in _block_inputs(frame) if isinstance(value, torch.Tensor)]
            frame.actcomp_inputs = None  # not held past the recomputation
            self.actcomp_context = _CHECKPOINT_CALLS[1](frame.actcomp_captured, inputs)
            self.actcomp_calls = calls = []  # (pack, unpack), once entered
            store = self.pack_hook

            def pack_hook(tensor):
                form = _RecomputedForm(calls[1], calls[0](tensor), tensor)
                try:
                    store(tensor)
                finally:  # also when the last tensor stops the recomputation early
                    kept_by = target_frame_ref()
                    index = kept_by.recomp_counter[gid] - 1
                    holder = kept_by.weak_holders[index]() if index < len(kept_by.weak_holders) else None
                    handle = None if holder is None else holder.handles.get(gid)
                    if handle is not None and handle in kept_by.recomputed[gid]:
                        kept_by.recomputed[gid][handle] = form
                return form

            pack_hook.actcomp_checkpoint = True  # checkpoint's own, to whole-model mode
            self.pack_hook, self.unpack_hook = pack_hook, _RecomputedForm.unpack

        def __enter__(self):
            if self.actcomp_context is not None:
                self.actcomp_calls[:] = self.actcomp_context.__enter__()
            return super().__enter__()

        def __exit__(self, *exc_info):
            super().__exit__(*exc_info)
            if self.actcomp_context is not None:
                self.actcomp_context.__exit__(*exc_info)

    checkpoint._checkpoint_hook = _CompressingCheckpointHook
    checkpoint._recomputation_hook = _CompressingRecomputationHook
    return True


def _block_inputs(frame) -> Any:
    """A checkpointed block's inputs, as its frame's ``get_inputs()`` gave them just before the
    recomputation (2.13 and later), or read again off the frame's ``input_saver`` (2.11: the
    recomputation reads them there, ``ctx.get_args(ctx.saved_tensors)``; the H100 image of stop
    50 runs 2.11)."""
    kept = getattr(frame, "actcomp_inputs", None)
    saver = getattr(frame, "input_saver", None)
    if kept is None and saver is not None and hasattr(saver.grad_fn, "get_args"):
        kept = saver.grad_fn.get_args(saver.grad_fn.saved_tensors)
    return kept or ()


def drops_saved_tensors(pack_hook: Callable) -> bool:
    """Whether ``pack_hook`` (the innermost saved-tensor pack hook) is non-reentrant checkpoint's
    forward one, which keeps a placeholder for each saved tensor and recomputes it in backward.
    Checked on 2.13.0 and 2.14.1 (the hook is defined in ``_checkpoint_hook.__init__``). If it
    moves, a converted layer inside a checkpointed block compresses its input in the forward
    too, work checkpoint then drops (as before stop 48)."""
    return getattr(pack_hook, "__qualname__", "") == "_checkpoint_hook.__init__.<locals>.pack_hook"


# compress_checkpoint_recomputation's (capture, recompute), the latest installed.
_CHECKPOINT_CALLS: list[Callable[..., Any]] = []


class _RecomputedForm:
    """A recomputed tensor as checkpoint's frame keeps it: the form actcomp packed and what
    checkpoint's determinism check reads (shape, dtype, device), not the tensor."""

    __slots__ = ("decode", "form", "shape", "dtype", "device")

    def __init__(self, decode: Callable[[Any], torch.Tensor], form: Any, tensor: torch.Tensor) -> None:
        self.decode, self.form = decode, form
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device

    def unpack(self) -> torch.Tensor:
        return self.decode(self.form)


def storage_shared(tensor: torch.Tensor) -> bool:
    """Whether a tensor or storage besides ``tensor`` holds ``tensor``'s storage (a view of it,
    anything that kept it). Checked on 2.14.1 (``torch._C._storage_Use_Count``, the storage's
    reference count: ``tensor`` holds one, the wrapper this asks through another). If it moves,
    actcomp's reuse of the buffers it decodes into in backward stops (each is fresh), nothing else."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) > 2


def torch_function_disabled() -> contextlib.AbstractContextManager:
    """A block whose torch calls skip every ``__torch_function__`` handler (modes included).
    Checked on 2.13.0 and 2.14.1 (``torch._C.DisableTorchFunction``). If it moves, the codecs'
    operations go through whole-model mode's scope-tracking mode: slower, not wrong."""
    return torch._C.DisableTorchFunction()


def version_of(tensor: torch.Tensor) -> int:
    """``tensor``'s in-place version counter. Checked on 2.13.0 and 2.14.1 (``Tensor._version``,
    the counter autograd's own "modified by an inplace operation" check reads). If it moves,
    in-place changes to a saved tensor go unseen."""
    return tensor._version


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of, or None. Checked on 2.13.0 and 2.14.1
    (``Tensor._base``). If it moves, a view of a parameter counts as an activation."""
    return tensor._base


def autograd_node_name(node: Any) -> str:
    """The class name of an autograd graph node: ``"MulBackward0"``, ``"AccumulateGrad"``.
    Checked on 2.13.0 and 2.14.1: the names are generated from ``derivatives.yaml`` and are not
    API; each one actcomp reads is named in this module."""
    return type(node).__name__


def is_accumulate_grad(node: Any) -> bool:
    """Whether ``node`` is a leaf's gradient accumulator (its ``variable`` is the leaf).
    Checked on 2.13.0 and 2.14.1. If renamed, autocast's weight copies count as activations."""
    return autograd_node_name(node) == "AccumulateGrad"


# Nodes of ops that only cast or re-view a tensor (checked on 2.13.0 and 2.14.1). A renamed one
# makes autocast's copy of a weight count as an activation (compressed: correct, lossier).
_CAST_OR_VIEW_NODES = frozenset({
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "PermuteBackward0", "ExpandBackward0", "AliasBackward0", "ReshapeAliasBackward0",
})


def is_cast_or_view_node(node: Any) -> bool:
    """Whether ``node`` is the backward of a cast or a view (one input, values unchanged)."""
    return autograd_node_name(node) in _CAST_OR_VIEW_NODES


# The activations whole-model mode rebuilds from their compressed input, by node name (checked
# on 2.13.0 and 2.14.1). A renamed one is kept in its own codec instead: more bytes, correct.
_ACTIVATION_NODES = {"SiluBackward0": "silu", "GeluBackward0": "gelu"}


def activation_of_node(node: Any) -> str | None:
    """``"silu"`` or ``"gelu"`` when ``node`` is that activation's backward, else None."""
    return _ACTIVATION_NODES.get(autograd_node_name(node))


def gelu_node_approximate(node: Any) -> str:
    """The ``approximate`` setting a GELU backward node saved. Checked on 2.13.0 and 2.14.1
    (``_saved_approximate``); "none" where absent, which only stops a tanh GELU's rebuild."""
    return getattr(node, "_saved_approximate", "none")


def product_inputs(node: Any) -> tuple[tuple[Any, int], tuple[Any, int]] | None:
    """The two inputs' ``(node, output_nr)`` of an elementwise product's backward ``node``, seen
    through one cast after it (an RMSNorm's ``(x * rstd).to(dtype)``); None for any other node.
    Checked on 2.13.0 and 2.14.1 (``MulBackward0``, ``ToCopyBackward0``). A renamed node keeps
    the product in its own code: more bytes, correct."""
    if autograd_node_name(node) == "ToCopyBackward0":
        node = node.next_functions[0][0]
    if autograd_node_name(node) != "MulBackward0" or len(node.next_functions) != 2:
        return None
    return node.next_functions[0], node.next_functions[1]


# Fused attention whose output and log-sum-exp whole-model mode recomputes in backward from the
# node's own (compressed) query, key and value, by node name (checked on 2.13.0 and 2.14.1): the
# CPU's flash kernel. The CUDA kernels (flash, memory-efficient, cuDNN) are not on this list
# until a GPU run has checked them; theirs keep the attention floors. A renamed node is treated
# as unknown: the floors again, correct and larger.
# The backward ops of average pooling as a compiled graph holds them (1-d pools reach it as
# 2-d; the adaptive ones are aten's private ops): each reads its input argument ("self", the
# second) for the shape alone.
AVERAGE_POOL_BACKWARDS = frozenset({
    torch.ops.aten.avg_pool2d_backward.default, torch.ops.aten.avg_pool3d_backward.default,
    torch.ops.aten._adaptive_avg_pool2d_backward.default, torch.ops.aten._adaptive_avg_pool3d_backward.default,
})


_RECOMPUTABLE_ATTENTION_NODES = frozenset({"ScaledDotProductFlashAttentionForCpuBackward0"})


def recomputable_attention(node: Any) -> tuple[bool, float | None, torch.Tensor | None] | None:
    """``(is_causal, scale, attn_mask)`` of a fused attention backward node whose forward
    :func:`recompute_attention` can run again, or None (another node, or dropout on: its mask
    cannot be drawn again). Checked on 2.13.0 and 2.14.1 (``_saved_is_causal``, ``_saved_scale``,
    ``_saved_attn_mask``, ``_saved_dropout_p``)."""
    if autograd_node_name(node) not in _RECOMPUTABLE_ATTENTION_NODES or getattr(node, "_saved_dropout_p", 1.0):
        return None
    return bool(node._saved_is_causal), node._saved_scale, node._saved_attn_mask


def recompute_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                        scale: float | None, attn_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's forward again: ``(output, logsumexp)`` in the layouts its backward
    reads. Checked on 2.13.0 and 2.14.1 (``aten._scaled_dot_product_flash_attention_for_cpu``)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


# --- nn.Module ----------------------------------------------------------------------------------


def forward_hook_tables(module: nn.Module) -> tuple[tuple[dict, tuple[dict, ...]], ...]:
    """``module``'s forward pre-hooks and forward hooks, each with the dicts that hold per-hook
    options under the same handle id: ``((pre, (with_kwargs,)), (post, (with_kwargs,
    always_called)))``. Checked on 2.13.0 and 2.14.1 (``Module._forward_pre_hooks`` and its
    siblings). If they move, removing actcomp's hooks on unconversion fails loudly."""
    return ((module._forward_pre_hooks, (module._forward_pre_hooks_with_kwargs,)),
            (module._forward_hooks, (module._forward_hooks_with_kwargs, module._forward_hooks_always_called)))


def conv_padding_for_mode(module: nn.Module) -> tuple[int, ...]:
    """The ``F.pad`` amounts a convolution with ``padding_mode != "zeros"`` applies. Checked on
    2.13.0 and 2.14.1 (``_ConvNd._reversed_padding_repeated_twice``). If it moves, converting a
    convolution fails at its first training forward."""
    return module._reversed_padding_repeated_twice


def norm_and_conv_bases() -> tuple[type, type]:
    """The private base classes of BatchNorm/InstanceNorm and of Conv/ConvTranspose.
    Checked on 2.13.0 and 2.14.1 (``_NormBase``, ``_ConvNd``). If they move, import fails here."""
    return nn.modules.batchnorm._NormBase, nn.modules.conv._ConvNd


# --- torch.compile ------------------------------------------------------------------------------


def lazily_not_compiled(function: _F) -> _F:
    """``function``, run eagerly even where a compiled caller traces through it, without importing
    Dynamo now (1.9 s of ``import actcomp`` on 2 cores). Checked on 2.13.0 and 2.14.1
    (``torch._disable_dynamo``); without it, the public ``torch.compiler.disable``, which imports
    Dynamo at once."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(function) if lazy is not None else torch.compiler.disable(function)


def not_compiled_frame(function: _F) -> _F:
    """``function``'s own frame run eagerly where a compiled caller traces through it, while
    the frames it calls are still compiled by that caller's ``torch.compile`` (``recursive=False``).
    Checked on 2.13.0 and 2.14.1 (``torch._disable_dynamo``'s ``recursive``); without it, the
    public ``torch.compiler.disable(recursive=False)``."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(function, recursive=False) if lazy is not None else torch.compiler.disable(function, recursive=False)


def called_from_compiled_code() -> bool:
    """Whether a ``torch.compile`` d caller is running this frame's callees through Dynamo: true
    inside a :func:`not_compiled_frame` function that a compiled function called. Checked on
    2.13.0 and 2.14.1 (``torch._C._dynamo.eval_frame.get_eval_frame_callback``: Dynamo's frame
    callback, None outside compiled code and inside a recursively disabled frame). If it moves,
    False: a compiled caller runs the whole-model forward eagerly, as before."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except (ImportError, AttributeError):
        return False
    callback = get_eval_frame_callback()
    return callback is not None and callback is not False


def skip_frame_but_inline(code: Any) -> None:
    """Tell dynamo never to compile ``code`` as a frame of its own, while still inlining it into
    a compiled caller. Checked on 2.13.0 and 2.14.1 (``torch._C._dynamo.eval_frame.
    set_code_exec_strategy``, then ``torch._dynamo.eval_frame.skip_code``). If both move, compile
    still works, with recompile warnings at every converted layer's frame."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
        return
    except (ImportError, AttributeError, TypeError):
        pass
    try:
        from torch._dynamo.eval_frame import skip_code

        skip_code(code)
    except (ImportError, AttributeError):
        pass


def recompile_limit_raises() -> contextlib.AbstractContextManager:
    """A block in which reaching dynamo's recompile limit raises instead of quietly running the
    frame eagerly. Checked on 2.13.0 and 2.14.1 (``torch._dynamo.config.fail_on_recompile_limit_hit``).
    If it moves, ``config.patch`` raises and the codec runs eagerly, said once."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Fail with ``message`` where the 0-d bool ``condition`` is false, checked on its device
    without a read back to the host (a CUDA kernel's device-side assert). Checked on 2.14.1
    (``torch._assert_async`` with a message). If it moves, a bad target goes unchecked.

    >>> assert_on_device(torch.tensor(True), "never raised")
    """
    torch._assert_async(condition, message)


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Hint dynamo that ``tensor``'s size ``dim`` varies. Checked on 2.13.0 and 2.14.1
    (``torch._dynamo.maybe_mark_dynamic``). If it moves, one graph per size."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def aot_saved_tensor_hook_context() -> dict | None:
    """While AOTAutograd retraces a saved-tensor hook: ``{"_node": the forward node saved,
    "_bw_graph": the backward graph, ...}``; None elsewhere. Checked on 2.13.0 and 2.14.1
    (``torch._functorch._aot_autograd.graph_compile._get_saved_tensor_hook_context``). If it
    moves, compress_in_graph keeps every tensor as it is (correct, no memory saved)."""
    try:
        from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
    except ImportError:
        return None
    return _get_saved_tensor_hook_context()


def saved_node_name(context: dict) -> str:
    """The name of the forward node whose output the hook retraced now saves (its placeholder's
    name in the backward graph)."""
    return context["_node"].name


def backward_graph(context: dict) -> torch.fx.Graph:
    """The backward graph that will read what the hook retraced now saves."""
    return context["_bw_graph"]


def argument_names(target: Any) -> tuple[str, ...] | None:
    """The argument names of an ATen op (an ``OpOverload``) in order, or None for any other
    callable. Checked on 2.13.0 and 2.14.1 (``OpOverload._schema.arguments``). If it moves,
    compress_in_graph no longer tells an attention mask from other tensors (it codes it)."""
    schema = getattr(target, "_schema", None)
    return None if schema is None else tuple(argument.name for argument in schema.arguments)


def is_inlined_unpack_input(node: torch.fx.Node) -> bool:
    """Whether a backward graph's placeholder is a saved tensor's packed form, which AOTAutograd
    names ``<saved>_hook_<i>`` when it inlines the hooks. Checked on 2.13.0 and 2.14.1; if the
    naming changes, decoding is not moved to its first use (a higher backward peak)."""
    return node.op == "placeholder" and "_hook_" in node.name


def is_inlined_pack_output(node: torch.fx.Node) -> bool:
    """Whether a forward graph's node is a saved tensor's packed form, the output of a pack hook
    AOTAutograd inlined (named ``<saved>_hook_<i>`` like the backward's input it becomes).
    Checked on 2.13.0 and 2.14.1; if the naming changes, packing is not moved next to the
    tensor it codes (a higher forward peak where Inductor's reordering does not move it)."""
    return node.op == "call_function" and "_hook_" in node.name


def mark_as_wrapped_call(node: torch.fx.Node, cache_hash: str) -> None:
    """Mark ``node`` as ``torch.fx.wrap`` would, with a hash under which compiled graphs holding
    it may be cached. Checked on 2.13.0 and 2.14.1 (meta ``is_wrapped``, ``user_cache_hash``);
    if ignored, graphs holding the hooks are not cached across processes."""
    node.meta["is_wrapped"] = True
    node.meta["user_cache_hash"] = cache_hash


def custom_graph_pass_base() -> type:
    """Inductor's base class for a post-grad pass with a cache ``uuid``. Checked on 2.13.0 and
    2.14.1 (``torch._inductor.custom_graph_pass.CustomGraphPass``)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def reorder_for_peak_memory() -> bool:
    """Inductor's ``reorder_for_peak_memory`` setting (checked on 2.13.0 and 2.14.1)."""
    import torch._inductor.config

    return torch._inductor.config.reorder_for_peak_memory


def set_reorder_for_peak_memory(value: bool) -> None:
    """Set Inductor's ``reorder_for_peak_memory``; set from inside a post-grad pass, it applies to
    the graph being compiled (checked on 2.13.0 and 2.14.1: it is read when the graph is
    scheduled, after the pass). If that changes, the backward peak is higher, nothing is wrong."""
    import torch._inductor.config

    torch._inductor.config.reorder_for_peak_memory = value


def buffer_reuse() -> bool:
    """Inductor's ``allow_buffer_reuse`` setting (checked on 2.14.1)."""
    import torch._inductor.config

    return torch._inductor.config.allow_buffer_reuse


def set_buffer_reuse(value: bool) -> None:
    """Set Inductor's ``allow_buffer_reuse``; set from inside a post-grad pass, it applies to the
    graph being compiled (checked on 2.14.1: the wrapper's memory planning reads it after the
    passes). If that changes, the peak is higher, nothing is wrong."""
    import torch._inductor.config

    torch._inductor.config.allow_buffer_reuse = value


def post_grad_custom_post_pass() -> Any:
    """Inductor's ``post_grad_custom_post_pass`` (checked on 2.13.0 and 2.14.1)."""
    import torch._inductor.config

    return torch._inductor.config.post_grad_custom_post_pass


def set_post_grad_custom_post_pass(graph_pass: Any) -> None:
    """Set Inductor's ``post_grad_custom_post_pass`` (checked on 2.13.0 and 2.14.1)."""
    import torch._inductor.config

    torch._inductor.config.post_grad_custom_post_pass = graph_pass


@contextlib.contextmanager
def backward_compiled_with_forward(reorder_for_peak_memory: bool) -> Iterator[None]:
    """A block in which AOTAutograd compiles the backward graph with the forward, not at the
    first backward, under Inductor's ``reorder_for_peak_memory`` as given. Checked on 2.13.0 and
    2.14.1 (``torch._functorch.config.force_non_lazy_backward_lowering``). If it moves,
    ``config.patch`` raises on entering compress_in_graph."""
    import torch._functorch.config
    import torch._inductor.config

    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), \
            torch._inductor.config.patch(reorder_for_peak_memory=reorder_for_peak_memory,
                                         allow_buffer_reuse=torch._inductor.config.allow_buffer_reuse):
        yield


@contextlib.contextmanager
def recomputing_what_backward_materializes(joint_pass: Any) -> Iterator[None]:
    """A block in which AOTAutograd's min-cut partitioner may recompute in backward a forward
    value the backward must materialize (``torch._functorch.config.
    ban_recompute_materialized_backward`` off: by default it keeps every value a matrix product
    reads in backward), and Inductor runs ``joint_pass`` on the joint graph before partitioning
    (``torch._inductor.config.joint_custom_post_pass``; ``joint_pass.previous`` is set to the
    user's own pass, which it must run first). Checked on 2.13.0 and 2.14.1. If the flag moves,
    ``config.patch`` raises on entering compress_in_graph; if the pass stops running, the
    partitioner may recompute a compared value from a lossy code (a ReLU mask that flips)."""
    import torch._functorch.config
    import torch._inductor.config

    joint_pass.previous = torch._inductor.config.joint_custom_post_pass
    with torch._functorch.config.patch(ban_recompute_materialized_backward=False), \
            torch._inductor.config.patch(joint_custom_post_pass=joint_pass):
        yield


def keep_for_backward(node: torch.fx.Node) -> None:
    """Tell AOTAutograd's partitioner to keep ``node``'s value for backward, never to recompute
    it: the tag selective activation checkpointing sets (``node.meta["recompute"]``, read by the
    min-cut partitioner; checked on 2.13.0 and 2.14.1)."""
    from torch.utils.checkpoint import CheckpointPolicy

    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


# --- Dispatch -----------------------------------------------------------------------------------


def dispatch_mode_base() -> type:
    """The base class of a mode that sees every aten call. Checked on 2.13.0 and 2.14.1
    (``torch.utils._python_dispatch.TorchDispatchMode``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of nested lists, tuples and dicts. Checked on 2.13.0 and 2.14.1
    (``torch.utils._pytree.tree_leaves``; torch has no public pytree module yet)."""
    from torch.utils._pytree import tree_leaves as leaves

    return leaves(tree)


def private_host_reading_ops() -> frozenset:
    """The private aten ops that read a tensor's values back to the host (``.item()``'s) or
    whose output size depends on them (``unique``'s). Checked on 2.13.0 and 2.14.1."""
    aten = torch.ops.aten
    return frozenset({aten._local_scalar_dense.default, aten._unique2.default})
