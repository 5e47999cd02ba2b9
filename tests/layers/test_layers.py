"""One compressed layer against the plain layer it replaces.

The compressed layer runs the plain op in forward and saves only a compressed copy of its
input, so: the output, the input gradient and the bias gradient are bit-identical to the
plain layer's whatever the pipeline, and the weight gradient is exactly what plain autograd
computes from the *decompressed* input. The decompressed input is taken from the layer's own
saved state by wrapping its pipeline (see ``RecordingPipeline``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import Conv1D
from torch import nn

import actcomp
import actcomp.layers.ops

pytestmark = [
    pytest.mark.usefixtures("seeded", "single_thread"),
    # torch's own note that an even-kernel 'same' conv pads a copy of its input first.
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths"),
]

# (id, layer builder, input shape). Covers stride, padding, dilation, groups, every padding
# mode, 'same' with even and odd total padding, 'valid', and 3-D Linear inputs.
LAYER_CASES = [
    ("linear-3d", lambda: nn.Linear(12, 6), (3, 5, 12)),
    ("linear-2d-nobias", lambda: nn.Linear(12, 6, bias=False), (7, 12)),
    ("gpt2-conv1d-3d", lambda: Conv1D(6, 12), (3, 5, 12)),
    ("gpt2-conv1d-2d", lambda: Conv1D(6, 12), (7, 12)),
    ("conv1d-stride", lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1), (2, 4, 11)),
    ("conv1d-dilation-reflect", lambda: nn.Conv1d(4, 6, 3, dilation=2, padding=2, padding_mode="reflect"), (2, 4, 11)),
    ("conv1d-same-odd", lambda: nn.Conv1d(4, 6, 4, padding="same"), (2, 4, 11)),
    ("conv1d-valid-groups", lambda: nn.Conv1d(4, 6, 3, padding="valid", groups=2, bias=False), (2, 4, 11)),
    ("conv2d-stride-groups", lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2), (2, 4, 9, 9)),
    ("conv2d-depthwise-circular", lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4, padding_mode="circular"),
     (2, 4, 7, 7)),
    ("conv2d-replicate-asym", lambda: nn.Conv2d(4, 6, (3, 1), stride=(2, 1), padding=(1, 0), padding_mode="replicate"),
     (2, 4, 7, 6)),
    ("conv2d-same-dilation", lambda: nn.Conv2d(4, 6, (2, 3), dilation=(3, 1), padding="same"), (2, 4, 8, 7)),
    ("conv2d-same-even", lambda: nn.Conv2d(4, 6, 3, dilation=2, padding="same"), (2, 4, 8, 7)),
    ("conv3d-stride-groups", lambda: nn.Conv3d(2, 4, 3, stride=(1, 2, 2), padding=1, groups=2), (2, 2, 5, 6, 6)),
    ("conv3d-reflect", lambda: nn.Conv3d(2, 4, (1, 3, 3), padding=(0, 1, 1), padding_mode="reflect"), (2, 2, 3, 5, 5)),
    ("conv3d-same-odd", lambda: nn.Conv3d(2, 4, 2, padding="same", bias=False), (1, 2, 4, 5, 5)),
]
CASE_IDS = [case[0] for case in LAYER_CASES]

# A plain element sparsifier, a sparsifier + stochastic quantizer, and a channel sparsifier
# (which relies on the layer passing the right channel axis).
LOSSY_SPECS = ["mink0.9", "pmink0.9:block=64+int8", "channel0.5"]


class RecordingPipeline(actcomp.Pipeline):
    """The layer's own pipeline (same stage objects), recording what passes through it."""

    def __init__(self, inner: actcomp.Pipeline):
        super().__init__(*inner.stages)
        self.compressed: list[torch.Tensor] = []
        self.decompressed: list[torch.Tensor] = []
        self.channel_dim: int | None = None

    def compress(self, x, *, channel_dim=None):
        self.compressed.append(x.detach().clone())
        self.channel_dim = channel_dim
        return super().compress(x, channel_dim=channel_dim)

    def decompress(self, packed):
        x_hat = super().decompress(packed)
        self.decompressed.append(x_hat.detach().clone())
        return x_hat


def make_pair(build, spec: str):
    """A plain layer and a converted deep copy of it (same parameter values)."""
    plain = build()
    converted = actcomp.to_compressed(copy.deepcopy(plain), spec, first_layer=None)
    assert isinstance(converted, actcomp.layers.compressed_layer.CompressedLayer)
    return plain, converted


def plain_forward_on(layer: nn.Module, x_in: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The plain layer's own forward (padding modes included) with ``weight``, on ``x_in``."""
    plain = actcomp.from_compressed(copy.deepcopy(layer))
    bias = layer.bias.detach() if layer.bias is not None else None
    return torch.func.functional_call(plain, {"weight": weight, "bias": bias}, (x_in,))


def reference_weight_grad(layer, x_hat, x, grad) -> torch.Tensor:
    """d/dW <grad, layer(x_hat)>: plain autograd of the plain op on the decompressed input."""
    weight = layer.weight.detach().clone().requires_grad_(True)
    out = plain_forward_on(layer, x_hat, weight)
    (weight_grad,) = torch.autograd.grad(out, weight, grad)
    return weight_grad


def forward_backward(layer, x, grad):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("spec", LOSSY_SPECS)
@pytest.mark.parametrize("case_id, build, shape", LAYER_CASES, ids=CASE_IDS)
def test_lossy_layer_matches_plain_layer(case_id, build, shape, spec):
    plain, layer = make_pair(build, spec)
    recorder = RecordingPipeline(layer.actcomp_pipeline)
    layer.actcomp_pipeline = recorder
    x = torch.randn(shape)
    grad = torch.randn_like(plain(x))

    out, x_grad, weight_grad, bias_grad = forward_backward(layer, x, grad)
    ref_out, ref_x_grad, ref_weight_grad, ref_bias_grad = forward_backward(plain, x, grad)

    assert out.dtype == ref_out.dtype and torch.equal(out, ref_out)
    assert torch.equal(x_grad, ref_x_grad)
    if ref_bias_grad is not None:
        assert torch.equal(bias_grad, ref_bias_grad)

    # The layer compressed exactly its (padded) input, once, and decompressed it once.
    assert len(recorder.compressed) == len(recorder.decompressed) == 1
    assert torch.equal(recorder.compressed[0], x)
    x_hat = recorder.decompressed[0]
    assert x_hat.shape == recorder.compressed[0].shape
    assert recorder.channel_dim == (1 if isinstance(layer, nn.modules.conv._ConvNd) else -1)
    # The compression really was lossy, so the check below can tell the inputs apart.
    assert not torch.equal(x_hat, recorder.compressed[0])
    if spec == "mink0.9":
        kept = x_hat != 0
        assert torch.equal(x_hat[kept], recorder.compressed[0][kept])
        assert kept.sum() == x_hat.numel() - int(0.9 * x_hat.numel() + 1e-9)
    if spec == "channel0.5":
        # Whole channels dropped along the axis the layer named.
        channel_axis = 1 if isinstance(layer, nn.modules.conv._ConvNd) else x_hat.dim() - 1
        other = [d for d in range(x_hat.dim()) if d != channel_axis]
        per_channel = x_hat.abs().sum(dim=other)
        assert (per_channel == 0).sum() == x_hat.shape[channel_axis] // 2

    assert torch.equal(weight_grad, reference_weight_grad(layer, x_hat, x, grad))
    # And the lossy weight gradient is not the plain one (the reference is not vacuous).
    assert not torch.equal(weight_grad, ref_weight_grad)


@pytest.mark.parametrize("case_id, build, shape", LAYER_CASES, ids=CASE_IDS)
def test_lossless_layer_is_bit_identical(case_id, build, shape):
    plain, layer = make_pair(build, "mink0")
    x = torch.randn(shape)
    grad = torch.randn_like(plain(x))
    for got, want in zip(forward_backward(layer, x, grad), forward_backward(plain, x, grad)):
        assert (got is None and want is None) or torch.equal(got, want)


@pytest.fixture
def needs_spy(monkeypatch):
    """Records the ``needs`` mask every op backward is called with."""
    calls: list[tuple[bool, bool, bool]] = []
    for op_class in (actcomp.layers.ops.LinearOp, actcomp.layers.ops.GPT2Conv1DOp, actcomp.layers.ops.ConvOp):
        original = op_class.backward

        def spy(self, grad, x, weight, x_shape, x_dtype, needs, original=original):
            calls.append(tuple(needs))
            return original(self, grad, x, weight, x_shape, x_dtype, needs)

        monkeypatch.setattr(op_class, "backward", spy)
    return calls


@pytest.mark.parametrize("case_id, build, shape", LAYER_CASES, ids=CASE_IDS)
def test_input_without_grad_skips_input_gradient(case_id, build, shape, needs_spy):
    plain, layer = make_pair(build, "mink0.9")
    recorder = RecordingPipeline(layer.actcomp_pipeline)
    layer.actcomp_pipeline = recorder
    x = torch.randn(shape)  # a leaf that does not require grad
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)

    assert x.grad is None
    assert needs_spy == [(False, True, layer.bias is not None)]
    assert torch.equal(layer.weight.grad, reference_weight_grad(layer, recorder.decompressed[0], x, grad))
    if layer.bias is not None:
        plain(x).backward(grad)
        assert torch.equal(layer.bias.grad, plain.bias.grad)


def record_saved_tensors(fn) -> tuple[object, list[torch.Tensor]]:
    """Run ``fn`` recording every tensor autograd saves for backward."""
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, saved


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


FROZEN_CASES = [
    pytest.param(*case, id=case[0])
    for case in LAYER_CASES
]


@pytest.mark.parametrize("case_id, build, shape", FROZEN_CASES)
def test_frozen_weight_saves_only_the_weight(case_id, build, shape, compress_calls):
    plain, layer = make_pair(build, "mink0.9")
    for module in (plain, layer):
        module.weight.requires_grad_(False)
    x = torch.randn(shape, requires_grad=True)

    out, saved = record_saved_tensors(lambda: layer(x))
    grad = torch.randn_like(out)
    out.backward(grad)
    x_plain = x.detach().clone().requires_grad_(True)
    plain(x_plain).backward(grad)

    assert compress_calls == []
    assert torch.equal(x.grad, x_plain.grad)
    assert layer.weight.grad is None
    # Nothing input-sized is kept: only (views of) the frozen weight, needed for the input gradient.
    assert nbytes(saved) <= nbytes([layer.weight])
    assert all(t.numel() == layer.weight.numel() for t in saved)


SAVED_BYTES_CASES = [
    pytest.param(*case, id=case[0])
    for case in LAYER_CASES
]


@pytest.mark.parametrize("spec", ["mink0.9", "mink0.9+int8"])
@pytest.mark.parametrize("case_id, build, shape", SAVED_BYTES_CASES)
def test_saved_bytes_are_weight_plus_compressed_input(case_id, build, shape, spec):
    _, layer = make_pair(build, spec)
    x = torch.randn(shape, requires_grad=True)
    _, saved = record_saved_tensors(lambda: layer(x))
    seen = x.detach()
    packed = actcomp.parse(spec).compress(seen, channel_dim=1 if isinstance(layer, nn.modules.conv._ConvNd) else -1)
    assert nbytes(saved) == packed.nbytes + nbytes([layer.weight])
    assert packed.nbytes < nbytes([seen])


@pytest.mark.parametrize("case_id, build, shape", LAYER_CASES, ids=CASE_IDS)
def test_bf16_autocast_matches_plain_layer(case_id, build, shape):
    plain, layer = make_pair(build, "mink0.9+int8")
    x = torch.randn(shape)
    x_layer, x_plain = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x_layer)
        ref_out = plain(x_plain)
    assert out.dtype == ref_out.dtype == torch.bfloat16
    assert torch.equal(out, ref_out)

    grad = torch.randn_like(out)
    out.backward(grad)
    ref_out.backward(grad)
    assert x_layer.grad.dtype == torch.float32
    assert torch.equal(x_layer.grad, x_plain.grad)
    assert layer.weight.grad.dtype == torch.float32 and layer.weight.grad.isfinite().all()
    if layer.bias is not None:
        assert torch.equal(layer.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("case_id, build, shape", SAVED_BYTES_CASES)
def test_bf16_autocast_saves_compressed_bf16_copy(case_id, build, shape):
    spec = "mink0.9+int8"
    _, layer = make_pair(build, spec)
    x = torch.randn(shape, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, saved = record_saved_tensors(lambda: layer(x))
    # Saved: the bf16 weight copy (plain autocast keeps it too) plus the compressed bf16 input.
    low = x.detach().to(torch.bfloat16)
    packed = actcomp.parse(spec).compress(low, channel_dim=1 if isinstance(layer, nn.modules.conv._ConvNd) else -1)
    assert nbytes(saved) == packed.nbytes + layer.weight.numel() * 2
    assert packed.nbytes < nbytes([low])
    assert not any(t.dtype == torch.float32 for t in saved)


@pytest.mark.parametrize("case_id, build, shape", LAYER_CASES, ids=CASE_IDS)
def test_bf16_layer_trains(case_id, build, shape):
    plain, layer = make_pair(build, "mink0.9+int8")
    plain.to(torch.bfloat16)
    layer.to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    out, x_grad, weight_grad, bias_grad = forward_backward(layer, x, torch.ones_like(plain(x)))
    ref_out, ref_x_grad, _, ref_bias_grad = forward_backward(plain, x, torch.ones_like(plain(x)))
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out)
    assert torch.equal(x_grad, ref_x_grad)
    assert weight_grad.dtype == torch.bfloat16 and weight_grad.isfinite().all()
    if bias_grad is not None:
        assert torch.equal(bias_grad, ref_bias_grad)


def channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


# (id, layer builder, input shape, view that makes the input non-contiguous)
NON_CONTIGUOUS = [
    ("linear-transposed", lambda: nn.Linear(12, 6), (5, 3, 12), lambda x: x.transpose(0, 1)),
    ("gpt2-conv1d-sliced", lambda: Conv1D(6, 12), (3, 5, 24), lambda x: x[..., ::2]),
    ("conv1d-transposed", lambda: nn.Conv1d(4, 6, 3, padding=1), (2, 11, 4), lambda x: x.transpose(1, 2)),
    ("conv2d-sliced", lambda: nn.Conv2d(4, 6, 3, stride=2), (2, 4, 9, 18), lambda x: x[..., ::2]),
    ("conv2d-channels-last", lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (2, 4, 7, 7), channels_last),
    ("conv2d-channels-last-reflect", lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"), (2, 4, 7, 7),
     channels_last),
    ("conv3d-channels-last", lambda: nn.Conv3d(2, 4, 3, padding=1), (2, 2, 4, 5, 5), channels_last),
]


@pytest.mark.parametrize("spec", ["mink0", "mink0.9+int8"])
@pytest.mark.parametrize("case_id, build, shape, view", NON_CONTIGUOUS, ids=[case[0] for case in NON_CONTIGUOUS])
def test_non_contiguous_and_channels_last_inputs(case_id, build, shape, view, spec):
    x = view(torch.randn(shape))
    assert not x.is_contiguous()
    plain, layer = make_pair(build, spec)
    grad = torch.randn_like(plain(x))
    # Two leaves over the same strided storage.
    x_layer, x_plain = x.detach().requires_grad_(True), x.detach().requires_grad_(True)
    out, ref_out = layer(x_layer), plain(x_plain)
    assert torch.equal(out, ref_out) and out.stride() == ref_out.stride()
    out.backward(grad)
    ref_out.backward(grad)
    assert torch.equal(x_layer.grad, x_plain.grad)
    if spec == "mink0":
        # Lossless: the decompressed input gets the forward input's memory format back (and
        # plain autograd makes strided inputs contiguous too), so the weight gradient takes
        # the same kernels as plain PyTorch.
        assert torch.equal(layer.weight.grad, plain.weight.grad)
    # A few SGD steps on a fixed target lower the loss.
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    target = torch.randn_like(ref_out)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = F.mse_loss(layer(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_ambiguous_channels_last_strides_keep_gradients_exact():
    # A channels_last batch with 1x1 spatial size (the last ConvNeXt stage at small inputs): its
    # strides (16, 1, 16, 16) satisfy both is_contiguous() and channels_last.
    x = torch.randn(2, 1, 1, 16).permute(0, 3, 1, 2)
    assert x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    plain, layer = make_pair(lambda: nn.Conv2d(16, 32, 3, padding=1), "mink0")
    grad = torch.randn(2, 32, 1, 1)
    got = forward_backward(layer, x, grad)
    want = forward_backward(plain, x, grad)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])  # the input gradient, promised exact whatever the pipeline
    assert torch.equal(got[2], want[2])
    # The cause: the plain backward computes in channels_last (its input gradient comes back in
    # the forward input's strides), the converted one in contiguous format.
    assert got[1].stride() == want[1].stride()


@pytest.mark.parametrize(
    "build, shape",
    [
        (lambda: nn.Conv1d(3, 4, 3, padding=1), (3, 7)),
        (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (3, 7, 7)),
        (lambda: nn.Conv3d(3, 4, 3, padding=1), (3, 4, 5, 5)),
    ],
    ids=["conv1d", "conv2d-reflect", "conv3d"],
)
def test_unbatched_conv_input(build, shape):
    # nn.Conv*d accept an input without a batch dimension; the plain layer trains on it.
    plain, layer = make_pair(build, "mink0")
    x = torch.randn(shape)
    grad = torch.randn_like(plain(x))
    for got, want in zip(forward_backward(layer, x, grad), forward_backward(plain, x, grad)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("case_id, build, shape", LAYER_CASES, ids=CASE_IDS)
def test_double_backward_raises_clear_error(case_id, build, shape):
    _, layer = make_pair(build, "mink0.9")
    x = torch.randn(shape, requires_grad=True)
    (first,) = torch.autograd.grad(layer(x).pow(2).sum(), x)  # first order is fine
    assert first.shape == x.shape
    with pytest.raises(actcomp.ActcompError, match="double backward"):
        torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)


def test_retain_graph_backward_twice_gives_identical_gradients():
    layer = actcomp.to_compressed(nn.Conv2d(3, 4, 3, padding=1), "mink0.9+int8", first_layer=None)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    loss = layer(x).square().mean()
    loss.backward(retain_graph=True)
    first = x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()
    x.grad = None
    layer.zero_grad(set_to_none=True)
    loss.backward()
    for a, b in zip(first, (x.grad, layer.weight.grad, layer.bias.grad)):
        assert torch.equal(a, b)


class _TwoReaders(torch.nn.Module):
    """Two layers reading one tensor, like a ResNet block's conv1 and downsample conv."""

    def __init__(self, second_spec_differs: bool = False):
        super().__init__()
        self.stem = torch.nn.Linear(64, 64)
        self.a, self.b = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)

    def forward(self, x):
        hidden = self.stem(x)
        return self.a(hidden) + self.b(hidden)


@pytest.mark.parametrize("specs, shared", [
    (("mink0.9+int8", "mink0.9+int8"), True),
    (("int8", "int8"), True),
    (("mink0.9+int8", "int8"), False),
    (("random0.5", "random0.5"), False),  # draws from the global generator: each copy is its own
])
def test_layers_reading_one_input_with_one_pipeline_share_its_compressed_copy(specs, shared):
    torch.manual_seed(0)
    model = _TwoReaders()
    plain = copy.deepcopy(model)
    actcomp.to_compressed(model, {"a": specs[0], "b": specs[1], "stem": None})
    x = torch.randn(256, 64)
    packed = [s for s in actcomp.memory_report(model, x).storages if s.codec is not None]
    savers = [s.savers for s in packed if "a" in s.savers or "b" in s.savers]
    assert any(set(saver) == {"a", "b"} for saver in savers) == shared
    # Sharing changes no number: the gradients equal those of two separate compressions.
    torch.manual_seed(1)
    model(x).square().sum().backward()
    separate = copy.deepcopy(plain)
    actcomp.to_compressed(separate, {"a": specs[0], "stem": None})
    actcomp.to_compressed(separate, {"b": specs[1]}, first_layer=None)
    hidden = separate.stem(x)
    torch.manual_seed(1)
    out_a = separate.a(hidden)
    out_b = separate.b(hidden.clone())  # a different tensor: compressed on its own
    (out_a + out_b).square().sum().backward()
    if "random" not in specs[0]:
        assert torch.equal(model.a.weight.grad, separate.a.weight.grad)
        assert torch.equal(model.b.weight.grad, separate.b.weight.grad)


def test_shared_copy_is_not_reused_after_an_in_place_change():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
    actcomp.to_compressed(a, "fp16", first_layer=None)
    actcomp.to_compressed(b, "fp16", first_layer=None)
    x = torch.randn(64, 16)
    a(x).sum().backward()
    x.mul_(3)  # a new version: b must compress the new values, not reuse a's copy
    b(x).sum().backward()
    # With a sum loss the weight gradient is the column sum of the (fp16-stored) input.
    expected = x.half().float().sum(0).expand(4, 16)
    assert torch.allclose(b.weight.grad, expected, rtol=1e-5)
    assert torch.allclose(a.weight.grad * 3, expected, rtol=1e-2, atol=0.05)  # a saw the old values


def test_shared_copy_goes_with_its_input():
    from actcomp.layers.function import _SHARED

    layer = actcomp.to_compressed(torch.nn.Linear(16, 4), "int8", first_layer=None)
    before = len(_SHARED)
    x = torch.randn(64, 16)
    layer(x).sum().backward()
    assert len(_SHARED) == before + 1
    del x  # the cache holds the input weakly: its entry, and the packed copy, go with it
    assert len(_SHARED) == before
