"""Linear/Conv subclasses with a forward of their own run it unchanged; only the saved input of
the op that uses their weight is compressed. And errors raised while compressing name the layer.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from timm.layers import Conv2dSame, ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d, StdConv2dSame
from timm.layers import Linear as TimmLinear
from torch import nn

import actcomp
from actcomp.compressors import Compressor, Encoded

pytestmark = pytest.mark.usefixtures("seeded", "single_thread")


class ScaledInputLinear(nn.Linear):
    """A user subclass: transforms its input before the matmul."""

    def forward(self, x):
        return F.linear(torch.tanh(x) * 2, self.weight, self.bias)


class TwiceConv(nn.Conv2d):
    """Applies its (shared) weight twice, with a ReLU in between: two calls to compress."""

    def forward(self, x):
        return self._conv_forward(F.relu(self._conv_forward(x, self.weight, self.bias)), self.weight, self.bias)


class HeadAndOther(nn.Linear):
    """Calls linear on its own weight and on a weight that is not its own: only the first counts."""

    def __init__(self):
        super().__init__(6, 6)
        self.other = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return F.linear(F.linear(x, self.other), self.weight, self.bias)


# (id, builder, input shape, how many calls use the layer's weight)
OWN_FORWARD_CASES = [
    ("StdConv2d", lambda: StdConv2d(4, 6, 3), (2, 4, 9, 9), 1),
    ("StdConv2dSame-stride2", lambda: StdConv2dSame(4, 6, 3, stride=2), (2, 4, 9, 9), 1),
    ("ScaledStdConv2d", lambda: ScaledStdConv2d(4, 6, 3), (2, 4, 9, 9), 1),
    ("ScaledStdConv2dSame-stride2", lambda: ScaledStdConv2dSame(4, 6, 3, stride=2), (2, 4, 9, 9), 1),
    ("Conv2dSame-stride2", lambda: Conv2dSame(4, 6, 3, stride=2), (2, 4, 9, 9), 1),
    ("Conv2dSame-even-kernel", lambda: Conv2dSame(4, 6, 4, dilation=2), (2, 4, 9, 8), 1),
    ("timm-Linear", lambda: TimmLinear(8, 5), (3, 4, 8), 1),
    ("user-ScaledInputLinear", lambda: ScaledInputLinear(8, 5), (3, 8), 1),
    ("user-TwiceConv", lambda: TwiceConv(4, 4, 3, padding=1), (2, 4, 6, 6), 2),
    ("user-HeadAndOther", HeadAndOther, (3, 6), 1),
]
CASE_IDS = [case[0] for case in OWN_FORWARD_CASES]


def run(layer, x, grad):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


@pytest.mark.parametrize("spec", ["mink0", "mink0.9+int8"])
@pytest.mark.parametrize("case_id, build, shape, calls", OWN_FORWARD_CASES, ids=CASE_IDS)
def test_own_forward_runs_unchanged_and_compresses_each_weight_call(case_id, build, shape, calls, spec,
                                                                    compress_calls):
    plain = build()
    layer = actcomp.to_compressed(copy.deepcopy(plain), spec, first_layer=None)
    assert type(layer).actcomp_own_forward
    x = torch.randn(shape)
    grad = torch.randn_like(plain(x))
    out, x_grad, grads = run(layer, x, grad)
    ref_out, ref_x_grad, ref_grads = run(plain, x, grad)
    assert len(compress_calls) == calls
    # The forward and the input gradient never depend on the pipeline.
    assert torch.equal(out, ref_out)
    assert torch.equal(x_grad, ref_x_grad)
    if spec == "mink0":
        for name, ref in ref_grads.items():
            assert torch.equal(grads[name], ref), name
    else:
        # Lossy: the weight gradient differs, but stays close to the exact one.
        weight_grad, ref_weight_grad = grads["weight"], ref_grads["weight"]
        cosine = F.cosine_similarity(weight_grad.flatten(), ref_weight_grad.flatten(), dim=0)
        assert 0.5 < cosine < 1


def test_own_forward_under_bf16_autocast_is_bit_identical():
    plain = StdConv2dSame(4, 6, 3, stride=2)
    layer = actcomp.to_compressed(copy.deepcopy(plain), "mink0", first_layer=None)
    x = torch.randn(2, 4, 9, 9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grad = torch.randn_like(plain(x))
        results = [run(m, x, grad) for m in (layer, plain)]
    (out, x_grad, grads), (ref_out, ref_x_grad, ref_grads) = results
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out)
    assert torch.equal(x_grad, ref_x_grad)
    for name, ref in ref_grads.items():
        assert torch.equal(grads[name], ref), name


class NoWeightCall(nn.Linear):
    def forward(self, x):
        return x[..., : self.out_features] * 2


def test_own_forward_without_a_weight_call_runs_unchanged_and_warns(compress_calls):
    layer = actcomp.to_compressed(NoWeightCall(4, 2), "mink0.9", first_layer=None)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.warns(UserWarning, match="has its own forward.*nothing was compressed"):
        out = layer(x)
    assert torch.equal(out, x[..., :2] * 2) and compress_calls == []


def test_frozen_own_forward_layer_runs_unchanged_without_warning(recwarn):
    plain = StdConv2d(4, 6, 3).requires_grad_(False)
    layer = actcomp.to_compressed(copy.deepcopy(plain), "mink0.9", first_layer=None)
    x = torch.randn(2, 4, 7, 7)
    grad = torch.randn_like(plain(x))
    for got, want in zip(run(layer, x, grad)[:2], run(plain, x, grad)[:2]):
        assert torch.equal(got, want)
    assert not [w for w in recwarn if "own forward" in str(w.message)]


def test_compression_error_names_the_layer_its_type_and_input_shape():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    actcomp.to_compressed(model, "mesa8:groups=3", first_layer=None)
    with pytest.raises(actcomp.ActcompError) as error:
        model(torch.randn(2, 3, 9, 9))
    message = str(error.value)
    # Layer '0' has 3 input channels (3 groups divide them); layer '2' has 8.
    assert message.startswith("in layer '2' (Conv2d), input of shape (2, 8, 7, 7) torch.float32: ")
    assert "mesa8:groups=3 does not divide the 8 channels" in message


@dataclasses.dataclass(frozen=True)
class BrokenDecode(Compressor):
    name = "broken_decode_for_test"
    kind = "quantizer"

    def encode(self, x, hints):
        return Encoded(x.clone(), (), None)

    def decode(self, payload, saved, meta):
        raise actcomp.ActcompError("cannot decode")


@pytest.fixture
def broken_decode():
    # Registered only for this test: registry-parametrized tests must not see it.
    actcomp.register_compressor(BrokenDecode)
    yield BrokenDecode.name
    actcomp.unregister_compressor(BrokenDecode.name)


def test_backward_error_names_the_layer(broken_decode):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    actcomp.to_compressed(model, {"1": broken_decode})
    out = model(torch.randn(3, 4))
    with pytest.raises(actcomp.ActcompError, match=r"in the backward of layer '1' \(Linear\): cannot decode"):
        out.sum().backward()


def test_gpt2_conv1d_subclass_with_its_own_forward_is_never_replaced():
    from models import Conv1D

    class ScaledConv1D(Conv1D):
        def forward(self, x):
            return super().forward(x) * 3

    layer = actcomp.to_compressed(ScaledConv1D(4, 6), "mink0.9", first_layer=None)
    assert type(layer).actcomp_own_forward
    x = torch.randn(2, 6, requires_grad=True)
    with pytest.warns(UserWarning, match="has its own forward"):
        out = layer(x)
    assert torch.equal(out, (torch.addmm(layer.bias, x, layer.weight) * 3))
