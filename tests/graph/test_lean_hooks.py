"""The codecs' own operations never pass through the scope-tracking mode.

Whole-model mode watches the model's torch calls with a ``TorchFunctionMode`` to learn which op
saves each tensor. A codec runs a few dozen torch operations per saved tensor (shifts, masks,
gathers); were the mode to see them, each would cost a Python call into it, on every saved
tensor of every step (16,234 calls per ViT-S step at batch 4 where the model makes ~1,000).
"""

from contextlib import nullcontext

import pytest
import timm
import torch

import actcomp
from actcomp.layers import compressed_layer, function
from actcomp.whole_model import session
from tests.models import TinyGPT2, names_seen_by_scopes, small_cnn

# Operations the codecs use and none of these models calls in its forward.
CODEC_ONLY = {"__rshift__", "__lshift__", "__and__", "__or__", "__ixor__", "__ior__", "__iand__", "cumsum",
              "scatter_", "scatter_add_", "index_select", "nonzero", "topk", "bitwise_and", "bitwise_or",
              "bitwise_left_shift", "bitwise_right_shift", "flip", "view_as_real", "aminmax", "amin", "amax"}


MODELS = {
    "vit": (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, img_size=32),
            lambda: (torch.randn(2, 3, 32, 32),)),
    "cnn": (lambda: small_cnn(), lambda: (torch.randn(4, 1, 8, 8),)),
    "gpt": (lambda: TinyGPT2(), lambda: (torch.randint(0, 50, (2, 16)),)),
}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("spec, rest", [("mink0.9+int8", "8bit"), ("smink0.9+int8", "4bit"), ("int8", "exact")])
def test_the_scope_mode_sees_the_models_calls_and_none_of_the_codecs(name, spec, rest):
    build, inputs = MODELS[name]
    torch.manual_seed(0)
    model = actcomp.to_compressed(build(), spec, rest=rest)

    seen = names_seen_by_scopes(model, *inputs())

    # The mode watched the model (its norms and activations: a compressed Linear/Conv layer's
    # own calls are unseen too, tests/graph/test_lean_forward.py).
    assert any(n in {"relu", "layer_norm"} for n in seen)
    assert sorted(CODEC_ONLY.intersection(seen)) == []


def test_the_witness_sees_codec_calls_made_under_the_mode():
    # Without unseen_by_scopes and call_unseen, the same names do reach the mode: the check above can fail.
    build, inputs = MODELS["vit"]
    model = actcomp.to_compressed(build(), "mink0.9+int8", rest="8bit")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session, "unseen_by_scopes", nullcontext)
        patch.setattr(function, "unseen_by_scopes", nullcontext)
        patch.setattr(compressed_layer, "call_unseen", lambda function, *args: function(*args))
        seen = names_seen_by_scopes(model, *inputs())
    assert CODEC_ONLY.intersection(seen)
