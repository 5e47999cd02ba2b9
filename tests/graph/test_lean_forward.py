"""The scope-tracking mode sees the model's own torch calls, not a compressed layer's.

A compressed Linear/Conv layer runs a dozen torch calls per forward (its input's metadata, the
op inside its autograd Function, the storage look-up of a model input); whole-model mode needs
none of them to choose a codec (the layer's saves are its own compressed form). Counted in
``benchmarks/bench_forward_overhead.py``.
"""

import pytest
import timm
import torch

import actcomp
from actcomp.graph.saved_tensors import Scope, call_unseen, current_scopes, saving_for_a_custom_function, tracking_scopes
from tests.models import TinyGPT2, names_seen_by_scopes, small_cnn

# What a compressed layer's forward calls and none of these models calls outside such a layer.
LAYER_ONLY = {"linear", "conv2d", "addmm", "empty_strided", "untyped_storage", "stride"}


@pytest.mark.parametrize("build, inputs", [
    (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, img_size=32),
     lambda: (torch.randn(2, 3, 32, 32),)),
    (small_cnn, lambda: (torch.randn(4, 1, 8, 8),)),
    (TinyGPT2, lambda: (torch.randint(0, 50, (2, 16)),)),
])
def test_a_compressed_layers_own_calls_do_not_reach_the_mode(build, inputs):
    torch.manual_seed(0)
    model = actcomp.to_compressed(build(), "mink0.9+int8", rest="8bit")

    seen = names_seen_by_scopes(model, *inputs())

    assert seen  # the mode watched the model
    assert sorted(LAYER_ONLY.intersection(seen)) == []


def test_an_unseen_call_counts_as_one_call_with_grad_mode_as_it_was():
    with tracking_scopes():
        with torch.no_grad():
            torch.ones(1).add(1)
        assert saving_for_a_custom_function()  # the last call ran with grad mode off
        out = call_unseen(torch.nn.functional.relu, torch.ones(2, requires_grad=True))
        assert not saving_for_a_custom_function()
        assert current_scopes() == []  # relu, unseen, opened no scope
    assert out.grad_fn is not None


def test_a_scope_counts_its_reference_when_asked():
    big, small = torch.ones(4, 5), torch.ones(3)
    scope = Scope("normalization", op="layer_norm", args=(small, [big, 2.0]))
    assert scope.reference == 20
    assert Scope("other", reference=7).reference == 7
