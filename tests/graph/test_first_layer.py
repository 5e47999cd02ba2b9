"""first_layer="auto": a layer runs plain exactly when what it receives is the model's input.

The rule is decided by data flow, not module order: a CNN's stem and a ViT's patch embedding
read the image and stay plain; in BERT, GPT-2, Llama and T5 the first Linear reads a LayerNorm
(or RMSNorm) output, so every layer compresses, and the first attention's sibling projections
really free their shared input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from zoo import ZOO, train_step

import actcomp
from actcomp.layers.compressed_layer import is_supported

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# Model -> the layers that read the model input (and so run plain under "auto").
EXPECTED_PLAIN = {
    "resnet18": {"conv1"},
    "vit_tiny_patch16_224": {"patch_embed.proj"},
    "bert": set(),
    "gpt2": set(),
    "llama": set(),
    "t5": set(),
}
ENTRIES = {entry.id: entry for entry in ZOO}


@pytest.mark.parametrize("model_id", list(EXPECTED_PLAIN))
def test_auto_runs_plain_exactly_the_layers_that_read_the_model_input(model_id, compressing_layers):
    entry = ENTRIES[model_id]
    torch.manual_seed(0)
    # loss="plain": a causal LM's lm_head runs (the routed loss would pass it by).
    model = actcomp.to_compressed(entry.build(), "mink0.9", loss="plain")
    supported = {name for name, module in model.named_modules() if is_supported(module)}
    train_step(model, entry.batch())
    assert supported - compressing_layers(model) == EXPECTED_PLAIN[model_id]


@pytest.mark.parametrize("model_id, projections", [
    ("bert", [f"bert.encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value")]),
    ("llama", [f"model.layers.0.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj")]),
])
def test_first_attention_projections_free_their_shared_input(model_id, projections):
    # The bug this guards: "auto" used to leave the first Linear in module order (BERT's query,
    # Llama's q_proj) plain; it then kept the LayerNorm output whole and its siblings (key,
    # value) freed nothing.
    entry = ENTRIES[model_id]
    torch.manual_seed(0)
    model = actcomp.to_compressed(entry.build(), "mink0.9")
    batch = entry.batch()
    report = actcomp.memory_report(model, **batch)
    assert set(projections) <= set(actcomp.compressed_layers(model))
    assert [item.layer for item in report.not_freed if item.layer in projections] == []


def test_explicit_names_and_none_still_work(compressing_layers):
    entry = ENTRIES["resnet18"]
    torch.manual_seed(0)
    everything = actcomp.to_compressed(entry.build(), "mink0.9", first_layer=None)
    train_step(everything, entry.batch())
    assert compressing_layers(everything) == set(actcomp.compressed_layers(everything))
    named = actcomp.to_compressed(entry.build(), "mink0.9", first_layer="fc")
    assert "fc" not in actcomp.compressed_layers(named)


def test_views_of_the_input_count_as_the_input_and_casts_do_not(compressing_layers):
    class TwoReads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.reads_view, self.reads_copy = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.reads_view(x[:, 1:]) + self.reads_copy(x[:, 1:] * 1.0)

    model = actcomp.to_compressed(TwoReads(), "mink0.5")
    model(torch.randn(3, 5, 8)).sum().backward()
    assert compressing_layers(model) == {"reads_copy"}


def test_input_layer_inside_a_checkpoint_recomputes_consistently():
    # Recomputation sees the same tensor (the checkpoint keeps the inputs), so the plain/compressed
    # decision is the same as in the forward: no checkpoint mismatch, gradients as without it.
    entry = ENTRIES["resnet18"]
    torch.manual_seed(0)
    model = actcomp.to_compressed(entry.build(), "mink0")
    batch = entry.batch()
    _, expected = train_step(model, batch)

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    wrapped = Checkpointed(model)
    _, grads = train_step(wrapped, batch)
    for name, grad in expected.items():
        assert torch.equal(grads["inner." + name], grad), name


def test_from_compressed_removes_the_input_hook():
    model = actcomp.to_compressed(ENTRIES["resnet18"].build(), "mink0.9")
    assert len(model._forward_pre_hooks) == 1
    copied = copy.deepcopy(model)
    assert len(copied._forward_pre_hooks) == 1  # the hook travels with deepcopy
    actcomp.to_compressed(model, "int8")  # converting again does not add a second hook
    assert len(model._forward_pre_hooks) == 1
    actcomp.from_compressed(model)
    assert len(model._forward_pre_hooks) == 0
    actcomp.to_compressed(copied, "int8", first_layer=None)  # no layer needs it any more
    assert len(copied._forward_pre_hooks) == 0


def test_memory_report_names_the_layers_that_ran_plain_on_the_model_input():
    entry = ENTRIES["resnet18"]
    torch.manual_seed(0)
    plain = entry.build()
    x = entry.batch()["x"]
    auto = actcomp.memory_report(actcomp.to_compressed(copy.deepcopy(plain), "mink0.9"), x)
    assert auto.plain_on_input == ["conv1"]
    assert "conv1" not in {item.layer for item in auto.not_freed}
    everything = actcomp.memory_report(actcomp.to_compressed(copy.deepcopy(plain), "mink0.9", first_layer=None), x)
    assert everything.plain_on_input == []


@pytest.mark.parametrize("model_id", ["resnet18", "vit_tiny_patch16_224", "resnetv2_50x1_bit"])
def test_under_autocast_the_input_layer_keeps_no_low_precision_copy(model_id):
    # Plain autocast keeps the bf16 copy of the image that the first conv reads; the caller keeps
    # the fp32 image anyway, so the layer keeps that and casts it again in backward (exact: the
    # zoo harness checks the gradients bit for bit under autocast).
    entry = next(e for e in ZOO if e.id == model_id)
    torch.manual_seed(0)
    plain = entry.build()
    compressed = actcomp.to_compressed(copy.deepcopy(plain), "mink0.9")
    x = entry.batch()["x"]
    image_copies = []
    for model in (plain, compressed):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            report = actcomp.memory_report(model, x)
        image_copies.append([s for s in report.storages if s.shape == tuple(x.shape) and s.dtype == torch.bfloat16])
        assert any(s.shape == tuple(x.shape) and s.kind == "input" for s in report.storages) == (model is compressed)
    assert len(image_copies[0]) == 1 and image_copies[1] == []
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compressed(x).float().sum().backward()
    first = next(m for m in compressed.modules() if getattr(m, "actcomp_name", None) in report.plain_on_input)
    assert first.weight.grad is not None and first.weight.grad.isfinite().all()
