"""Linear/Conv mode is bit-identical to plain PyTorch on every memory layout.

A converted layer with a lossless spec (``mink0``) must give the same output, input gradient,
weight gradient and bias gradient as the plain layer, bit for bit, whatever the strides of its
input and of the gradient that reaches it: autograd's own backward picks its kernels and its
reduction order from those strides (a Linear on a non-contiguous input sums its bias gradient
over the N-d gradient as it lies; a convolution runs channels_last kernels when the input's
strides suggest channels_last), so the converted layer has to see the same layouts. The input
gradient must also come back with plain's strides: the layers before it read them.

Layouts are made as views of a larger or differently ordered tensor, as models make them:
permuted (a Linear over NHWC of an NCHW tensor), swapped (sequence-first), transposed-then-
reshaped with a gap (ViT tokens without the class token, back to an image), the feature axis
outermost with a gap, sliced, overlapping (unfold's windows), channels_last and broadcast
(stride 0).
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from models import Conv1D
from torch import nn

import actcomp

pytestmark = pytest.mark.usefixtures("single_thread")


class OwnForwardLinear(nn.Linear):
    """A Linear with a forward of its own, as timm's ``Linear`` (converted through the own-forward path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# (id, builder, input shape). Shapes are small but give each reduction enough terms that a
# different summation order shows in the last bits.
LINEARS = [
    ("linear-4d", lambda: nn.Linear(12, 10), (2, 8, 9, 12)),
    ("linear-3d", lambda: nn.Linear(12, 10), (3, 20, 12)),
    ("linear-2d", lambda: nn.Linear(12, 10), (40, 12)),
    ("linear-1d", lambda: nn.Linear(40, 30), (40,)),
    ("linear-3d-nobias", lambda: nn.Linear(12, 10, bias=False), (3, 20, 12)),
    ("own-forward-linear-4d", lambda: OwnForwardLinear(12, 10), (2, 8, 9, 12)),
    ("gpt2-conv1d-3d", lambda: Conv1D(10, 12), (3, 20, 12)),
]
CONVS = [
    ("conv1d", lambda: nn.Conv1d(6, 8, 3, padding=1), (2, 6, 30)),
    ("conv2d", lambda: nn.Conv2d(6, 8, 3, padding=1), (2, 6, 10, 10)),
    ("conv2d-stride-reflect", lambda: nn.Conv2d(6, 8, 3, stride=2, padding=1, padding_mode="reflect"), (2, 6, 9, 9)),
    ("conv2d-grouped", lambda: nn.Conv2d(6, 8, 3, padding=1, groups=2), (2, 6, 10, 10)),
    ("conv2d-depthwise", lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), (2, 8, 10, 10)),
    ("conv2d-1x1", lambda: nn.Conv2d(6, 8, 1), (2, 6, 10, 10)),
    ("conv3d", lambda: nn.Conv3d(4, 6, 3, padding=1), (2, 4, 5, 6, 6)),
    ("conv3d-depthwise", lambda: nn.Conv3d(4, 4, 3, padding=1, groups=4), (2, 4, 5, 6, 6)),
]
LAYERS = LINEARS + CONVS


def _random(shape, dtype) -> torch.Tensor:
    # With some -0.0 among the values (a dropout's backward makes them): a sum over one
    # element turns -0.0 into 0.0, so the bitwise check also sees a sum plain autograd skips.
    values = torch.randn(shape)
    return values.masked_fill(values.abs() < 0.05, -0.0).to(dtype)


def _permuted(shape, dtype) -> torch.Tensor:
    """Dense, not contiguous: the last axis laid out second (NCHW memory read as NHWC), or the
    transpose of a 2-D tensor."""
    if len(shape) == 2:
        return _random(shape[::-1], dtype).t()
    order = (0, len(shape) - 1, *range(1, len(shape) - 1))
    base = _random([shape[axis] for axis in order], dtype)
    return base.permute(0, *range(2, len(shape)), 1)


def _swapped(shape, dtype) -> torch.Tensor:
    """Dense, first two axes swapped (sequence-first attention outputs, channel-first images)."""
    return _random((shape[1], shape[0], *shape[2:]), dtype).transpose(0, 1)


def _tokens_to_image(shape, dtype) -> torch.Tensor:
    """Not dense: axis 1 read from the last axis of (batch, 1 + rest, shape[1]) after dropping
    its first row, as a ViT's patch tokens without the class token, reshaped back to an image."""
    rest = math.prod(shape[2:]) if len(shape) > 2 else 1
    if len(shape) == 2:
        return _random((shape[1], shape[0] + 1), dtype)[:, 1:].t()  # column-major, with gaps
    tokens = _random((shape[0], rest + 1, shape[1]), dtype)[:, 1:]
    return tokens.transpose(1, 2).reshape(shape)


def _last_axis_outer(shape, dtype) -> torch.Tensor:
    """Not dense: the last axis outermost and the one before it without its first row, so a
    Linear's fold to 2-d copies here but would be a (column-major) view with the gap closed."""
    base = _random((shape[-1], *shape[:-2], shape[-2] + 1), dtype)[..., 1:]
    return base.permute(*range(1, len(shape)), 0)


def _sliced(shape, dtype) -> torch.Tensor:
    """Not dense: every other element of the last axis, and the axis before the features (axis
    1, or axis 0 of a 2-d tensor) without its first row."""
    if len(shape) == 1:
        return _random(2 * shape[0], dtype)[::2]
    axis = 1 if len(shape) > 2 else 0
    base = list(shape)
    base[axis] += 1
    base[-1] *= 2
    return _random(base, dtype)[(slice(None),) * axis + (slice(1, None), ..., slice(None, None, 2))]


def _overlapping(shape, dtype) -> torch.Tensor:
    """Overlapping: consecutive batch elements share half their memory, as windows that
    ``unfold`` slides over a sequence do."""
    stride = list(torch.empty(shape, device="meta").stride())
    stride[0] //= 2
    storage = sum((size - 1) * step for size, step in zip(shape, stride)) + 1
    return _random(storage, dtype).as_strided(shape, stride)


def _channels_last(shape, dtype) -> torch.Tensor:
    memory_format = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    return _random(shape, dtype).contiguous(memory_format=memory_format)


def _broadcast_batch(shape, dtype) -> torch.Tensor:
    return _random((1, *shape[1:]), dtype).expand(shape)


def _broadcast_last(shape, dtype) -> torch.Tensor:
    return _random((*shape[:-1], 1), dtype).expand(shape)


LAYOUTS = {
    "contiguous": _random, "permuted": _permuted, "swapped": _swapped, "tokens-to-image": _tokens_to_image,
    "last-axis-outer": _last_axis_outer, "sliced": _sliced, "overlapping": _overlapping,
    "channels-last": _channels_last, "broadcast-batch": _broadcast_batch,
    "broadcast-last": _broadcast_last,
}


def _applies(layout: str, shape) -> bool:
    if layout == "channels-last":
        return len(shape) in (4, 5)
    return len(shape) > 1 or layout in ("contiguous", "sliced", "broadcast-last")


# Every layout for the input with a contiguous gradient, every layout for the gradient with a
# contiguous input, and both in the same layout (how a permuted model sends its gradient back).
SAME = [(layout, layout) for layout in LAYOUTS]
PAIRS = sorted({(layout, "contiguous") for layout in LAYOUTS} | {("contiguous", layout) for layout in LAYOUTS}
               | set(SAME))


def _cases(pairs) -> list:
    return [pytest.param(build, shape, x_layout, grad_layout, id=f"{case_id}-x={x_layout}-grad={grad_layout}")
            for case_id, build, shape in LAYERS for x_layout, grad_layout in pairs
            if _applies(x_layout, shape) and _applies(grad_layout, shape)]


def _precision(dtype: str):
    if dtype == "autocast-bf16":
        return torch.float32, torch.autocast("cpu", dtype=torch.bfloat16)
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], contextlib.nullcontext()


def _run(layer: nn.Module, make_input, grad_layout: str, autocast):
    """Output, input gradient (as it reached the input, before accumulation), weight and bias
    gradients of one forward/backward; the incoming gradient is drawn in ``grad_layout``."""
    x = make_input()
    seen: list[torch.Tensor] = []
    if x.requires_grad:
        x.register_hook(seen.append)
    with autocast:
        out = layer(x)
    torch.manual_seed(2)
    out.backward(LAYOUTS[grad_layout](out.shape, out.dtype))
    bias_grad = None if layer.bias is None else layer.bias.grad
    return out.detach(), (seen[0] if seen else None), layer.weight.grad, bias_grad


def _assert_identical(got, want, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert got.dtype == want.dtype, what
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=what)
    # assert_close takes -0.0 for 0.0; the bits may not differ either.
    as_bits = {2: torch.int16, 4: torch.int32}[want.element_size()]
    assert torch.equal(got.view(as_bits), want.view(as_bits)), f"{what}: signs of zeros"


def _check(build, shape, input_layout, grad_layout, dtype, train_weight=True, input_needs_grad=True):
    torch.manual_seed(0)
    param_dtype, autocast = _precision(dtype)
    plain = build().to(param_dtype)
    plain.weight.requires_grad_(train_weight)
    converted = actcomp.to_compressed(copy.deepcopy(plain), "mink0", first_layer=None)
    assert isinstance(converted, actcomp.layers.compressed_layer.CompressedLayer)

    def make_input() -> torch.Tensor:
        # A view as the layout makes it (a clone would drop its gaps and broadcast strides).
        torch.manual_seed(1)
        x = LAYOUTS[input_layout](shape, param_dtype)
        assert x.shape == shape
        return x.requires_grad_(input_needs_grad)

    try:
        want = _run(plain, make_input, grad_layout, autocast)
    except RuntimeError as error:
        # GPT-2's Conv1D takes ``x.view(-1, features)``, which some layouts refuse.
        assert "view" in str(error)
        return
    got = _run(converted, make_input, grad_layout, autocast)
    for name, g, w in zip(("output", "input gradient", "weight gradient", "bias gradient"), got, want):
        _assert_identical(g, w, name)
    if want[1] is not None:
        assert got[1].stride() == want[1].stride(), "input gradient strides"


@pytest.mark.parametrize("build, shape, x_layout, grad_layout", _cases(PAIRS))
def test_fp32_is_bit_identical_on_every_layout(build, shape, x_layout, grad_layout):
    _check(build, shape, x_layout, grad_layout, "fp32")


@pytest.mark.parametrize("dtype", ["bf16", "autocast-bf16"])
@pytest.mark.parametrize("build, shape, x_layout, grad_layout", _cases(SAME))
def test_bf16_is_bit_identical_on_every_layout(build, shape, x_layout, grad_layout, dtype):
    _check(build, shape, x_layout, grad_layout, dtype)


@pytest.mark.parametrize("build, shape, x_layout, grad_layout", _cases(SAME))
def test_frozen_weight_is_bit_identical_on_every_layout(build, shape, x_layout, grad_layout):
    # A frozen weight changes the path plain autograd takes (matmul folds a non-contiguous
    # input into one mm only when the weight needs a gradient) and leaves the input unsaved.
    _check(build, shape, x_layout, grad_layout, "fp32", train_weight=False)


@pytest.mark.parametrize("build, shape, x_layout, grad_layout", _cases(SAME))
def test_input_without_grad_is_bit_identical_on_every_layout(build, shape, x_layout, grad_layout):
    _check(build, shape, x_layout, grad_layout, "fp32", input_needs_grad=False)


def test_linear_on_nhwc_view_of_nchw():
    """Issue 15: the bias gradient was summed over a reshaped copy of the gradient, in another
    order than autograd's sum over the N-d gradient as it lies."""
    _check(lambda: nn.Linear(16, 32), (4, 16, 16, 16), "permuted", "permuted", "fp32")


def test_depthwise_conv_on_token_view():
    """Issue 15: the gapped channels_last-like input was rebuilt contiguous, so backward ran
    other kernels than plain autograd's channels_last ones."""
    _check(lambda: nn.Conv2d(16, 16, 3, padding=1, groups=16), (2, 16, 14, 14), "tokens-to-image", "contiguous",
           "fp32")


def test_broadcast_input_is_compressed_once(compress_calls):
    """A broadcast input keeps each of its values once: its compressed copy is of the values
    behind the view, and backward broadcasts them again (the layout plain autograd sees)."""
    layer = actcomp.to_compressed(nn.Linear(12, 10), "mink0.5", first_layer=None)
    layer(torch.randn(1, 20, 12).expand(3, 20, 12)).sum().backward()
    assert compress_calls == [(1, 20, 12)]


class _ViewThenActivation(nn.Module):
    """A conv, a view of its output in ``layout``, an activation and a Linear: whole-model
    mode keeps the activation's tensor in an exact code and must rebuild a stand-in whose
    gradient flows back through the view in plain PyTorch's layout."""

    def __init__(self, layout: str, activation):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(6, 8, 3, padding=1), nn.Linear(8, 5)
        self.layout, self.activation = layout, activation

    def forward(self, x):
        y = self.conv(x)
        y = {"contiguous": lambda t: t.flatten(2).transpose(1, 2).contiguous(),
             "permuted": lambda t: t.permute(0, 2, 3, 1),
             "sliced": lambda t: t[:, :, 1:, ::2].permute(0, 2, 3, 1),
             "transposed": lambda t: t.flatten(2).transpose(1, 2)}[self.layout](y)
        return self.fc(self.activation(y))


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "sliced", "transposed"])
@pytest.mark.parametrize("activation", [F.relu, F.hardtanh, F.leaky_relu, lambda t: F.dropout(t, 0.3)],
                         ids=["relu", "hardtanh", "leaky_relu", "dropout"])
def test_whole_model_exact_codecs_on_every_layout(layout, activation):
    torch.manual_seed(0)
    plain = _ViewThenActivation(layout, activation)
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0", rest="exact")
    x = torch.randn(4, 6, 8, 8)
    results = []
    for net in (plain, model):
        net.train()
        inputs = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        net(inputs).pow(2).sum().backward()
        results.append([inputs.grad, *(p.grad for p in net.parameters())])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
