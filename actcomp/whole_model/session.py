"""One whole-model forward's saved-tensor hooks: which codec each saved tensor gets
(:func:`choose_codec`), applied once per tensor and codec (:class:`_Session`), undone in backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

import torch

from actcomp.core.pipeline import Packed, Pipeline
from actcomp.errors import ActcompError
from actcomp.graph.saved_tensors import (
    SavedEvent,
    announce,
    in_compressed_layer,
    innermost_kind,
    is_parameter,
    is_parameter_copy,
    listened,
)
from actcomp.kernels.layouts import dense_strides_like, local_part, restride, storage_key
from actcomp.whole_model.derivative_codes import derivative_code
from actcomp.whole_model.exact_codecs import (
    Kept,
    dropout_mask,
    hardtanh_mask,
    leaky_relu_mask,
    pool_offsets,
    relu_mask,
    shape_only,
)
from actcomp.whole_model.normalized_units import Unit, normalized_unit, row_group
from actcomp.whole_model.policy import RestPolicy


class _AsIs:
    """A saved tensor kept as it is; unpacking checks it was not modified in place since."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        # Detached: a tensor autograd saves is often its op's own output, whose grad_fn holds
        # this object; holding the tensor itself would close a reference cycle through C++ that
        # the garbage collector cannot see, leaking the whole graph of a forward that never runs
        # backward. The detached alias shares the storage and the version counter, and autograd
        # re-attaches the grad_fn when it unpacks.
        self.tensor, self.version = tensor.detach(), tensor._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise ActcompError(
                f"a tensor of shape {tuple(self.tensor.shape)} saved for backward was modified by an in-place "
                f"operation after it was saved (version {self.version}, now {self.tensor._version}); plain PyTorch "
                "raises here too: make the in-place op out of place"
            )
        return self.tensor


class _Session:
    """One training forward of a whole-model: chooses and applies codecs as tensors are saved."""

    def __init__(self, policy: RestPolicy, excluded: Iterable[torch.Tensor]):
        self.policy = policy
        # Buffers and the caller's data stay alive anyway: a compressed copy would only add bytes.
        self.excluded = {storage_key(t) for t in excluded}
        self.excluded.discard(None)
        # (id of the saved tensor, codec) -> (weak reference, version, Kept): one tensor saved
        # twice under one codec (RMSNorm's input, by pow and by mul) is compressed once.
        self.cache: dict[tuple[int, str], tuple[weakref.ref, int, Kept]] = {}

    def close(self) -> None:
        """Forget the forward's tensors: the saved variables alone now decide what stays alive."""
        self.cache.clear()
        self.excluded.clear()

    def pack(self, tensor: torch.Tensor):
        # Compressing must not record autograd history (nor save tensors of its own).
        with torch.no_grad():
            kind, kept = self.choose(tensor)
        holder = _AsIs(tensor) if kept is None else kept
        if listened():
            announce(SavedEvent(tensor, (tensor,) if kept is None else kept.tensors, kind,
                                None if kept is None else kept.codec))
        return holder

    def choose(self, tensor: torch.Tensor) -> tuple[str, Kept | None]:
        if in_compressed_layer():
            return "linear", None
        if type(tensor) is not torch.Tensor:
            return "other", None  # tensor subclasses (DTensor activations, ...) keep their own semantics
        if is_parameter(tensor) or storage_key(local_part(tensor)) in self.excluded or is_parameter_copy(tensor):
            return "kept", None
        scope = innermost_kind()
        kind = "other" if scope is None else scope.kind
        if kind == "linear" or not _frees_memory(tensor):
            return kind, None
        return kind, self.cached(tensor, kind, scope)

    def cached(self, tensor: torch.Tensor, kind: str, scope) -> Kept | None:
        codec = choose_codec(self.policy, tensor, kind, scope)
        if codec is None:
            return None
        # The key is everything the codec reads besides the tensor's values (its function and
        # settings: a clamp's range, GELU's approximation, a norm's unit), so two saves of one
        # tensor under one op with other arguments never share a code.
        key = (id(tensor), codec)
        hit = self.cache.get(key)
        if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
            return hit[2]
        kept = codec.encode(tensor)
        if kept is not None:
            self.cache[key] = (weakref.ref(tensor), tensor._version, kept)
        return kept


@dataclass(frozen=True)
class Codec:
    """A codec function and every setting it reads: ``encode(t)`` is ``function(t, *settings)``.

    Frozen and hashable: whole-model mode shares one encoding between saves of one tensor
    only when their ``Codec`` values are equal.

    >>> x = torch.randn(4, 8)
    >>> Codec(hardtanh_mask, (-1.0, 1.0)) == Codec(hardtanh_mask, (0.0, 0.5))
    False
    >>> Codec(hardtanh_mask, (-1.0, 1.0)).encode(x)
    Kept('clamp-mask', 4 bytes)
    """

    function: object
    settings: tuple = ()

    def encode(self, tensor: torch.Tensor) -> Kept | None:
        return self.function(tensor, *self.settings)


def choose_codec(policy: RestPolicy, tensor: torch.Tensor, kind: str, scope) -> Codec | None:
    """The codec whole-model mode applies to ``tensor``, saved by an op of ``kind`` in
    ``scope``, under ``policy``; None to keep it as it is. Reads the tensor's metadata only
    (its values are the codec's business), so choosing costs nothing per element."""
    op = scope.op if scope is not None else None
    if tensor.dtype == torch.bool:
        return Codec(dropout_mask) if policy.dropout else None
    if not tensor.is_floating_point():
        if kind == "pooling" and op == "max_pool2d" and policy.pooling:
            input_shape = tuple(_argument(scope, 0, "input", None).shape)
            return Codec(pool_offsets, (input_shape, *(_hashable(value) for value in _pool_settings(scope))))
        return None
    if kind == "activation":
        if policy.activation is None:
            return None
        if op == "relu":
            return Codec(relu_mask)
        if op == "leaky_relu":
            return Codec(leaky_relu_mask)
        if op in ("hardtanh", "relu6"):
            return Codec(hardtanh_mask, _clamp_range(scope))
        if op in ("gelu", "silu") and policy.fewbit is not None and tensor.numel() == scope.reference:
            approximate = _argument(scope, 1, "approximate", "none") if op == "gelu" else "none"
            return Codec(_derivative_or_lossy, (op, approximate, policy.fewbit, policy.pipeline("activation")))
    if kind == "dropout":
        return Codec(dropout_mask) if policy.dropout else None
    if kind == "pooling":
        return Codec(shape_only) if op == "max_pool2d" and policy.pooling else None
    if kind == "attention" and op == "sdpa" and policy.dropout and _sdpa_dropout_mask(tensor, scope):
        # SDPA's math path (CPU) multiplies by a 0-or-1/(1-p) tensor it drew and saves it: a
        # dropout mask, one exact bit an element, or the pipeline if it is not of that form.
        return Codec(_dropout_or_lossy, (policy.pipeline("attention"),))
    pipeline = policy.pipeline(kind)
    if pipeline is None or (scope is not None and tensor.numel() * 4 < scope.reference):
        return None  # kept as is, or a statistic (a norm's mean and rstd, a log-sum-exp)
    unit = _normalized_unit(tensor, scope) if kind == "normalization" else None
    return Codec(_lossy, (pipeline, unit))


def _hashable(value):
    return tuple(value) if isinstance(value, (list, torch.Size)) else value


def _sdpa_dropout_mask(tensor: torch.Tensor, scope) -> bool:
    """Whether ``tensor``, saved inside ``F.scaled_dot_product_attention``, can be its dropout
    mask: dropout is on and the tensor is not on autograd's path (the mask needs no gradient)."""
    return float(_argument(scope, 4, "dropout_p", 0.0)) > 0 and tensor.grad_fn is None and not tensor.requires_grad


def _normalized_unit(tensor: torch.Tensor, scope) -> Unit | None:
    op = scope.op if scope is not None and scope.op is not None else None
    if scope is None or (op is None and scope.module is None):
        return None
    setting = None
    if op in ("layer_norm", "rms_norm"):
        setting = _hashable(_argument(scope, 1, "normalized_shape", None))
    elif op == "group_norm":
        setting = _argument(scope, 1, "num_groups", None)
    return normalized_unit(op, tensor.shape, setting)


def _frees_memory(tensor: torch.Tensor) -> bool:
    """Whether compressing ``tensor`` can free memory: not for an expanded (broadcast) view, whose
    compressed form at full size can outweigh its small storage. A small slice of a large
    storage (a head reading ``x[:, 0]``) does qualify: kept as is, it would pin the storage."""
    return tensor.numel() > 0 and all(stride != 0 or size == 1 for size, stride in zip(tensor.shape, tensor.stride()))


def _all_finite(tensor: torch.Tensor) -> bool:
    # Derivative codes have no code for NaN or inf; such a tensor goes to the pipeline, which
    # keeps them exactly. One reduction: any non-finite element makes the sum non-finite.
    return bool(tensor.sum(dtype=torch.float32).isfinite())


def _derivative_or_lossy(tensor: torch.Tensor, function: str, approximate: str, bits: int,
                         fallback: Pipeline | None) -> Kept | None:
    if _all_finite(tensor):
        return derivative_code(tensor, function, approximate, bits=bits)
    return None if fallback is None else _lossy(tensor, fallback, None)


def _dropout_or_lossy(tensor: torch.Tensor, fallback: Pipeline | None) -> Kept | None:
    kept = dropout_mask(tensor)
    if kept is not None or fallback is None:
        return kept
    return _lossy(tensor, fallback, None)


_REGROUPED: dict[tuple[Pipeline, int], Pipeline] = {}


def _grouped_by_rows(pipeline: Pipeline, row: int) -> Pipeline | None:
    """``pipeline`` with its quantizer's groups dividing rows of ``row`` elements (cached), or
    None when rows do not apply: a sparsifier first (its kept values have lost their rows) or
    a quantizer without groups (fp8, fp16, bf16 scale nothing across elements)."""
    stages = pipeline.stages
    if len(stages) != 1 or not any(item.name == "group" for item in fields(stages[0])):
        return None
    group = row_group(row, stages[0].group)
    if group == stages[0].group:
        return pipeline
    key = (pipeline, group)
    if key not in _REGROUPED:
        _REGROUPED[key] = Pipeline(replace(stages[0], group=group))
    return _REGROUPED[key]


def _lossy(tensor: torch.Tensor, pipeline: Pipeline, unit: Unit | None) -> Kept | None:
    """``tensor`` through ``pipeline``; with a normalized ``unit``, laid out in its rows and
    quantized in groups that never straddle two rows. None when that would not save memory
    (rows of a few elements, each with a range of its own)."""
    # The rebuild closure must not capture ``tensor``: that would keep the full tensor alive.
    # The pipeline works a chunk at a time, so its temporaries stay small (actcomp.tools.temporaries).
    # Rebuilt dense in the tensor's own axis order (a slice's gaps closed), as Linear/Conv
    # inputs are: backward kernels choose by strides.
    stride, permutation = dense_strides_like(tensor), None
    values = tensor.detach()
    if unit is not None:
        grouped = _grouped_by_rows(pipeline, unit.row)
        if grouped is not None:
            pipeline, permutation = grouped, unit.permutation
            if permutation is not None:
                values = values.permute(permutation)
    packed = pipeline.compress(values.reshape(-1))
    if unit is not None and packed.nbytes >= tensor.numel() * tensor.element_size():
        return None
    layout, laid_out = packed.layout, values.shape
    inverse = None if permutation is None else tuple(sorted(range(len(permutation)), key=permutation.__getitem__))

    def rebuild(tensors: tuple) -> torch.Tensor:
        out = pipeline.decompress(Packed(tensors, layout)).view(laid_out)
        if inverse is not None:
            out = out.permute(inverse)  # back to the tensor's dimension order
        return restride(out, stride)

    return Kept(pipeline.spec, packed.tensors, rebuild)


def _argument(scope, index: int, name: str, default):
    if len(scope.args) > index:
        return scope.args[index]
    return scope.kwargs.get(name, default)


def _clamp_range(scope) -> tuple[float, float]:
    if scope.op == "relu6":
        return 0.0, 6.0
    return float(_argument(scope, 1, "min_val", -1.0)), float(_argument(scope, 2, "max_val", 1.0))


def _pool_settings(scope) -> tuple:
    kernel = _argument(scope, 1, "kernel_size", None)
    stride = _argument(scope, 2, "stride", None)
    padding = _argument(scope, 3, "padding", 0)
    dilation = _argument(scope, 4, "dilation", 1)
    return kernel, stride, padding, dilation


# A backward called inside a torch.compile'd step runs these unpack calls with dynamo's frame
# hook on: it would compile _unpack once per holder type, closure and size (recompiling until
# its limit, 110 frames for a resnet18 step) for tensors that are mostly bit operations.
@torch.compiler.disable
def _unpack(holder) -> torch.Tensor:
    if isinstance(holder, _AsIs):
        return holder.unpack()
    if torch.is_grad_enabled():
        raise ActcompError(
            "double backward (create_graph=True) through a whole-model compressed tensor is not supported: the "
            "saved tensor is rebuilt from its compressed form, without its autograd history. Convert the model "
            "back with actcomp.from_compressed(model) for this computation"
        )
    return holder.unpack()


