"""Which kind of op is saving a tensor: the tables whole-model mode and the memory report share.

Autograd's saved-tensor hooks see a tensor, never the op that saves it. So the ops that matter
are recognised where they are called: a torch function (``F.relu``, ``F.layer_norm``,
``F.scaled_dot_product_attention``, ``Tensor.softmax``, ...) or a module whose class is
one of a kind (``nn.BatchNorm2d``, Hugging Face's ``LlamaRMSNorm``, an ``...Attention``
block). :func:`function_kind` and :func:`module_kind` answer for each.

Kinds:

==============  ===========================================================================
kind            ops
==============  ===========================================================================
activation      ReLU family (exact 1-bit masks), smooth activations (GELU, SiLU, ...) and
                gate products (a gated MLP's ``act(gate) * up``: see :func:`is_gate_product`)
normalization   batch, layer, group, instance and RMS norms, and an activation scaled by a
                parameter or an activation of fewer elements (LayerScale, squeeze-excitation:
                :func:`is_scale`)
attention       softmax, scaled-dot-product attention, everything inside attention modules
pooling         max pooling (exact window offsets), average pooling (its input's shape)
dropout         dropout masks (exact 1-bit)
linear          Linear / Conv inputs (the layer's own pipeline, never these hooks)
other           any other op (kept as is unless asked)
==============  ===========================================================================

>>> import torch.nn.functional as F
>>> function_kind(F.gelu), function_kind(F.relu), function_kind(torch.add)
(FunctionKind(kind='activation', op='gelu'), FunctionKind(kind='activation', op='relu'), None)
>>> module_kind(torch.nn.BatchNorm2d(3)), module_kind(torch.nn.Sequential())
('normalization', None)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from actcomp.errors import ActcompError
from actcomp.torch_compat import norm_and_conv_bases, view_base

KINDS = ("activation", "normalization", "attention", "pooling", "dropout", "linear", "other")


class FunctionKind(NamedTuple):
    """A recognised torch function: its kind and the op name the codecs know it by."""

    kind: str
    op: str


def _table() -> dict:
    entries = {
        "activation": {
            "relu": [F.relu, F.relu_, torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_],
            "hardtanh": [F.hardtanh, F.hardtanh_],
            "relu6": [F.relu6],
            "leaky_relu": [F.leaky_relu, F.leaky_relu_],
            "gelu": [F.gelu],
            "silu": [F.silu],
            "smooth": [
                F.mish, F.hardswish, F.elu, F.selu, F.celu, F.softplus, F.logsigmoid,
                F.sigmoid, F.tanh, torch.sigmoid, torch.tanh, torch.Tensor.sigmoid, torch.Tensor.tanh,
            ],
        },
        # Each norm by name: the unit it normalizes decides the quantization groups.
        "normalization": {
            "batch_norm": [F.batch_norm],
            "layer_norm": [F.layer_norm],
            "group_norm": [F.group_norm],
            "instance_norm": [F.instance_norm],
            "rms_norm": [F.rms_norm],
        },
        # SDPA apart: with dropout_p > 0 on CPU it saves its dropout mask, kept as bits.
        "attention": {
            "sdpa": [F.scaled_dot_product_attention],
            "softmax": [F.softmax, torch.softmax, torch.Tensor.softmax],
        },
        "pooling": {
            "max_pool2d": [F.max_pool2d, F.max_pool2d_with_indices, torch.max_pool2d],
            "pool": [F.max_pool1d, F.max_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d],
            # Average pooling's backward reads its input's shape and layout only.
            "avg_pool": [F.avg_pool2d, F.avg_pool1d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
                         F.adaptive_avg_pool3d],
        },
        "dropout": {
            "dropout": [F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout],
        },
        "linear": {
            "linear": [F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
                       F.conv_transpose3d, F.bilinear],
        },
    }
    return {
        function: FunctionKind(kind, op)
        for kind, ops in entries.items()
        for op, functions in ops.items()
        for function in functions
    }


_FUNCTIONS = _table()

_NORM_BASE, _CONV_BASE = norm_and_conv_bases()
_NORMS = (_NORM_BASE, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)
_LINEAR = (nn.Linear, nn.Bilinear, _CONV_BASE)
# Modules written in Python from elementwise ops (Hugging Face's LlamaRMSNorm, T5LayerNorm,
# NewGELUActivation; an Attention block's matmuls and masks) are known by their class name.
_NAMED_KINDS = (
    ("normalization", ("Norm",)),
    ("attention", ("Attention",)),
    ("activation", ("GELU", "SiLU", "Swish", "Mish", "Activation")),
)


# The elementwise product, as a function and as the Tensor methods ``a * b`` calls.
PRODUCTS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})
GATE = FunctionKind("activation", "gate")
SCALE = FunctionKind("normalization", "scale")


def is_product(function) -> bool:
    """Whether ``function`` is the elementwise product (one set lookup: asked of every torch call)."""
    try:
        return function in PRODUCTS
    except TypeError:  # unhashable callables
        return False


def is_gate_product(function, args: tuple) -> bool:
    """Whether ``function(*args)`` multiplies two activations of one shape: a gated MLP's
    ``act(gate) * up`` (SwiGLU, GeGLU, a chunked projection's halves), found by what it is, not
    by a class name. Both operands are floating-point tensors that require grad and are not
    parameters (a LayerScale's ``x * gamma`` is not a gate), of the same shape (no broadcast:
    a scale or a mask is not a gate either). The product saves both, each as big as the MLP's
    hidden layer: the largest tensors a language model keeps.

    >>> a, b = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    >>> is_gate_product(torch.mul, (a, b)), is_gate_product(torch.mul, (a, torch.randn(8)))
    (True, False)
    """
    if not is_product(function) or len(args) < 2:
        return False
    first, second = args[0], args[1]
    return all(isinstance(operand, torch.Tensor) and not isinstance(operand, nn.Parameter)
               and operand.is_floating_point() and operand.requires_grad for operand in (first, second)) \
        and first.shape == second.shape


def is_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one, including the unsharded parameters
    FSDP2 all-gathers for the forward (``model.parameters()`` returns the shards meanwhile).

    >>> is_parameter(torch.nn.Linear(2, 2).weight.t()), is_parameter(torch.randn(2))
    (True, False)
    """
    return isinstance(tensor, nn.Parameter) or isinstance(view_base(tensor), nn.Parameter)


def is_scale(function, args: tuple) -> bool:
    """Whether ``function(*args)`` scales an activation by a factor of fewer elements, broadcast:
    a parameter (or a view of one), or another activation that requires grad.

    - A LayerScale's ``x * gamma`` (timm's ``LayerScale``, ConvNeXt's
      ``x.mul(gamma.reshape(1, -1, 1, 1))``, DINOv2, DeiT-III, CaiT): 37-43% of what
      ``rest="8bit"`` kept on those models, as it was, until stop 63.
    - A squeeze-excitation's ``x * gate`` (a per-channel sigmoid of the pooled activation:
      EfficientNet, MobileNetV3, RegNetY, CoAtNet, MaxViT, GhostNet), or a spatial gate: kept as
      it was until stop 64.

    Either product saves the activation for the factor's gradient alone (a sum over the
    broadcast positions), as a Linear saves its input for its weight's: it is coded as a norm's
    input (the factor is a norm's affine weight, or a norm's statistic, on its own). A factor
    that does not require grad (a mask, a constant) is no scale: the product then saves only
    the factor. Two activations of one shape are a gate (:func:`is_gate_product`).

    >>> x, gamma = torch.randn(2, 8, requires_grad=True), nn.Parameter(torch.ones(8))
    >>> is_scale(torch.mul, (x, gamma)), is_scale(torch.mul, (gamma.reshape(1, 8), x))
    (True, True)
    >>> gate = torch.randn(2, 1, requires_grad=True).sigmoid()
    >>> is_scale(torch.mul, (x, gate)), is_scale(torch.mul, (x, torch.ones(8))), is_scale(torch.mul, (x, x))
    (True, False, False)
    """
    if not is_product(function) or len(args) < 2:
        return False
    first, second = args[0], args[1]
    if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
        return False
    for scale, activation in ((first, second), (second, first)):
        if (is_parameter(scale) or scale.requires_grad) and not isinstance(activation, nn.Parameter) \
                and activation.is_floating_point() and activation.requires_grad and scale.numel() < activation.numel():
            return True
    return False


def register_function(function, kind: str, op: str) -> None:
    """Recognise ``function`` (a torch function, a Tensor method or any callable that dispatches
    through ``__torch_function__``) as op ``op`` of ``kind``; for :func:`actcomp.register_op_codec`."""
    if kind not in KINDS:
        raise ActcompError(f"unknown op kind {kind!r}; kinds: {', '.join(KINDS)}")
    _FUNCTIONS[function] = FunctionKind(kind, op)


def unregister_function(function) -> None:
    """Forget what :func:`register_function` said of ``function``."""
    _FUNCTIONS.pop(function, None)


def known_functions() -> dict:
    """The table :func:`function_kind` reads, itself (kept up to date by registration): the
    scope-tracking mode looks a function up in it directly, a Python call less per torch call.
    Read it; change it through :func:`register_function` only.

    >>> known_functions()[F.relu]
    FunctionKind(kind='activation', op='relu')
    """
    return _FUNCTIONS


def function_kind(function) -> FunctionKind | None:
    """The kind of a torch function (or Tensor method), None for one no kind claims."""
    try:
        return _FUNCTIONS.get(function)
    except TypeError:  # unhashable callables
        return None


def module_kind(module: nn.Module) -> str | None:
    """The kind of every op run inside ``module`` that no inner function or module claims."""
    return _class_kind(type(module))


# Asked at every module call while scopes are tracked; the answer is the class's. Bounded, so
# classes made on the fly (a converted or sharded model's) are not all kept alive.
@functools.lru_cache(maxsize=1024)
def _class_kind(cls: type[nn.Module]) -> str | None:
    if issubclass(cls, _LINEAR) or any(base.__name__ == "Conv1D" for base in cls.__mro__):
        return "linear"
    if issubclass(cls, _NORMS):
        return "normalization"
    if issubclass(cls, nn.MultiheadAttention):
        return "attention"
    name = getattr(cls, "actcomp_base", cls).__name__
    for kind, parts in _NAMED_KINDS:
        if any(part in name for part in parts):
            return kind
    return None
