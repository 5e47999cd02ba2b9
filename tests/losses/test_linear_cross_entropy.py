"""The chunked linear cross-entropy against plain PyTorch: values, gradients, every reduction,
ignored targets, softcap, dtypes, bytes kept for backward, and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import actcomp
from actcomp.losses import linear_cross_entropy


def plain_loss(hidden, weight, target, bias=None, *, ignore_index=-100, reduction="mean", softcap=None):
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> float32, as HF's losses
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction)
    return flat.view(target.shape) if reduction == "none" else flat


def inputs(dtype=torch.float64, rows=(3, 11), hidden_size=16, vocabulary=50, ignored=(0, 5, 17), seed=0, bias=False):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*rows, hidden_size, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(vocabulary, hidden_size, generator=generator, dtype=torch.float64) / 4).to(dtype).requires_grad_()
    target = torch.randint(0, vocabulary, rows, generator=generator)
    target.view(-1)[list(ignored)] = -100
    bias_tensor = torch.randn(vocabulary, generator=generator, dtype=torch.float64).to(dtype).requires_grad_() \
        if bias else None
    return hidden, weight, target, bias_tensor


def loss_and_grads(function, hidden, weight, target, bias, **options):
    leaves = [tensor for tensor in (hidden, weight, bias) if tensor is not None]
    for leaf in leaves:
        leaf.grad = None
    loss = function(hidden, weight, target, bias, **options)
    # A fixed, uneven incoming gradient, so that reduction="none" is checked row by row.
    upstream = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).view(loss.shape)
    (loss * upstream).sum().backward()
    return loss.detach(), [leaf.grad.clone() for leaf in leaves]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_rows", [1, 4, 33, None])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_float64_matches_plain_pytorch(reduction, chunk_rows, with_bias, softcap):
    # In float64 only the order of the sums over rows differs: agreement to ~1e-15.
    hidden, weight, target, bias = inputs(bias=with_bias)
    options = {"reduction": reduction, "softcap": softcap}
    expected, expected_grads = loss_and_grads(plain_loss, hidden, weight, target, bias, **options)
    got, got_grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_rows=chunk_rows, **options)
    assert got.shape == expected.shape and got.dtype == torch.float64 == expected.dtype
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-14)
    for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
        assert got_grad.dtype == expected_grad.dtype
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_float32_and_bfloat16_match_plain_pytorch(dtype, tolerance):
    hidden, weight, target, bias = inputs(dtype, rows=(4, 64), hidden_size=32, vocabulary=300, ignored=(3, 70, 200),
                                          bias=True)
    expected, expected_grads = loss_and_grads(plain_loss, hidden, weight, target, bias)
    got, got_grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_rows=50)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
        assert got_grad.dtype == dtype
        cosine = F.cosine_similarity(got_grad.double().view(-1), expected_grad.double().view(-1), dim=0)
        assert cosine > 1 - tolerance**2, cosine


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_target_ignored_behaves_as_plain(reduction):
    # mean is 0 / 0 = NaN, as plain gives it; sum is 0; the gradients are plain's.
    hidden, weight, target, bias = inputs(ignored=range(33))
    expected, expected_grads = loss_and_grads(plain_loss, hidden, weight, target, bias, reduction=reduction)
    got, got_grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, reduction=reduction)
    torch.testing.assert_close(got, expected, equal_nan=True)
    for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(got_grad, expected_grad, equal_nan=True)


def test_a_custom_ignore_index():
    hidden, weight, target, bias = inputs(ignored=())
    target.view(-1)[[1, 2]] = 7
    expected, expected_grads = loss_and_grads(plain_loss, hidden, weight, target, bias, ignore_index=7)
    got, got_grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, ignore_index=7)
    torch.testing.assert_close(got, expected)
    for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(got_grad, expected_grad)


def saved_bytes(function, *args, **options) -> int:
    """Bytes autograd keeps for backward, deduplicated by storage (parameters excluded)."""
    storages = {}
    parameters = {args[1].untyped_storage().data_ptr()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(*args, **options)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_keeps_under_a_twenty_fourth_of_plains_bytes(dtype):
    # Cut Cross-Entropy's ratio, at a language model's proportions (hidden 256, vocabulary 32,000).
    hidden = torch.randn(2, 256, 256, dtype=dtype, requires_grad=True)
    weight = torch.randn(32_000, 256, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 32_000, (2, 256))
    plain = saved_bytes(plain_loss, hidden, weight, target)
    chunked = saved_bytes(linear_cross_entropy, hidden, weight, target)
    assert plain > 24 * chunked, (plain, chunked)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_a_lossless_hidden_codec_gives_the_exact_paths_gradients_bit_for_bit(softcap):
    # With a code that loses nothing, the backward's log-sum-exp recomputed from the decoded
    # states is the forward's own, bit for bit: so are the gradients.
    hidden, weight, target, bias = inputs(torch.float32, bias=True)
    exact = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, softcap=softcap, chunk_rows=4)
    coded = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, softcap=softcap, chunk_rows=4,
                           hidden_codec=actcomp.parse("mink0"))
    assert torch.equal(exact[0], coded[0]) and all(torch.equal(a, b) for a, b in zip(exact[1], coded[1]))


def test_an_int8_hidden_codec_keeps_codes_and_the_gradient():
    hidden, weight, target, bias = inputs(torch.float32, rows=(4, 64), hidden_size=64, vocabulary=500)
    exact = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias)
    coded = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, hidden_codec=actcomp.parse("int8"))
    assert torch.equal(exact[0], coded[0])  # the forward is untouched
    for a, b in zip(exact[1], coded[1]):
        assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9999
    # What backward keeps: int8 codes with their ranges, no float copy of the hidden states.
    assert saved_bytes(linear_cross_entropy, hidden, weight, target, hidden_codec=actcomp.parse("int8")) < \
        saved_bytes(linear_cross_entropy, hidden, weight, target) / 3


def test_whole_model_mode_leaves_its_saved_tensors_exact():
    # The recomputation needs the exact hidden states: under rest="8bit" the gradients are the
    # same bits as without actcomp.
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(16, 16)
            self.out = torch.nn.Linear(16, 50, bias=False)

        def forward(self, x, target):
            return linear_cross_entropy(torch.relu(self.body(x)), self.out.weight, target)

    torch.manual_seed(0)
    model = Head()
    x, target = torch.randn(8, 16), torch.randint(0, 50, (8,))
    model(x, target).backward()
    expected = model.out.weight.grad.clone()
    model.zero_grad()
    actcomp.to_compressed(model, "int8", rest="exact")
    model(x, target).backward()
    assert torch.equal(model.out.weight.grad, expected)


@pytest.mark.parametrize("change, message", [
    ({"reduction": "avg"}, "reduction='avg' is not one of mean, sum, none"),
    ({"softcap": 0.0}, "softcap must be a positive number"),
    ({"chunk_rows": 0}, "chunk_rows must be a positive int"),
    ({"target": torch.tensor([1, 2, 50, 3])}, "target 50 is out of range for a vocabulary of 50"),
    ({"target": torch.tensor([1, 2, -3, 3])}, "target -3 is out of range"),
    ({"target": torch.tensor([1.0, 2.0, 3.0, 4.0])}, "target must hold class indices as int64"),
    ({"target": torch.tensor([1, 2, 3])}, "target (3,) should be hidden's shape without its last dimension, (4,)"),
    ({"weight": torch.randn(50, 15)}, "hidden (4, 16) does not match weight (50, 15)"),
    ({"bias": torch.randn(49)}, "bias (49,) should be (50,)"),
])
def test_bad_input_is_named(change, message):
    arguments = {"hidden": torch.randn(4, 16), "weight": torch.randn(50, 16), "target": torch.tensor([1, 2, 3, 4]),
                 "bias": None, **change}
    options = {key: arguments.pop(key) for key in ("reduction", "softcap", "chunk_rows") if key in arguments}
    with pytest.raises(actcomp.ActcompError, match=__import__("re").escape(message)):
        linear_cross_entropy(**arguments, **options)
