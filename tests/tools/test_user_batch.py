"""UserBatch, the runs check and plan_budget measure with: one step that gives the gradients and
the kept bytes equals the two separate runs it replaces."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from torch import nn

import actcomp
from actcomp.tools.user_batch import UserBatch, copy_model


def vit_with_dropout() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=3, img_size=32, drop_rate=0.1, proj_drop_rate=0.1)
    return model, torch.randn(4, 3, 32, 32)


@pytest.mark.parametrize(("spec", "rest"), [(None, None), ("int8", None), ("mink0.9+int4", "4bit"), (None, "8bit")],
                         ids=["plain", "int8 layers", "min-k layers, 4-bit rest", "8-bit rest"])
def test_one_step_gives_the_gradients_and_bytes_of_the_two_runs_it_replaces(spec, rest):
    """The forward that counts the bytes is the one the backward runs through: the same dropout
    masks and rounding noise, so the gradients are bit for bit those of a step alone, and the
    report the bytes of a forward alone."""
    model, batch = vit_with_dropout()
    if spec is not None or rest is not None:
        model = actcomp.to_compressed(model, spec or "mink0", rest=rest or "exact")
    run = UserBatch(batch)
    gradients, report = run.gradients_and_memory(copy.deepcopy(model))
    expected = run.gradients(copy.deepcopy(model))
    assert list(gradients) == list(expected)
    assert all(torch.equal(gradients[name], expected[name]) for name in expected)
    alone = run.memory(copy.deepcopy(model))
    assert report.total_bytes == alone.total_bytes > 0
    assert [(row.kind, row.kept_bytes) for row in report.kinds] == [(row.kind, row.kept_bytes) for row in alone.kinds]


def test_the_step_takes_the_users_loss():
    torch.manual_seed(0)
    model, batch, target = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 2)), torch.randn(8, 6), torch.randn(8, 2)
    run = UserBatch(batch, loss_fn=lambda output: (output - target).square().mean())
    gradients, report = run.gradients_and_memory(model)
    expected = run.gradients(copy.deepcopy(model))
    assert all(torch.equal(gradients[name], expected[name]) for name in expected)
    assert report.total_bytes == run.memory(model).total_bytes


def test_the_first_tokens_cut_the_tensors_of_the_sequence_only():
    ids = torch.arange(24).reshape(2, 12)
    table = torch.ones(2, 5)
    cut = UserBatch({"input_ids": ids, "labels": ids, "attention_mask": torch.ones(2, 12), "table": table}).first_tokens(4)
    assert torch.equal(cut.kwargs["input_ids"], ids[:, :4]) and torch.equal(cut.kwargs["labels"], ids[:, :4])
    assert cut.kwargs["attention_mask"].shape == (2, 4) and cut.kwargs["table"] is table
    assert cut.loss_fn is None and cut.tokens == 4 and cut.kwargs["labels"].is_contiguous()
    assert UserBatch({"input_ids": ids}).first_tokens(12) is None
    assert UserBatch(torch.ones(2, 12)).first_tokens(4) is None  # no input_ids: not a language model's batch
    assert UserBatch({"input_ids": ids.float()}).tokens == 0


def test_a_causal_models_first_tokens_are_computed_as_in_the_whole_sequence():
    """Why the budget may measure a language model's errors on its first tokens: the logits of a
    sequence's first tokens are those of the whole sequence's first tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    cut = UserBatch({"input_ids": ids}).first_tokens(8)
    with torch.no_grad():
        assert torch.allclose(model(**cut.kwargs).logits, model(input_ids=ids).logits[:, :8], atol=1e-5)


def test_a_measuring_copy_shares_the_values_and_owns_its_gradients_buffers_and_ties():
    """copy_model's parameters are new objects over the original's storage: a converted step on
    the copy leaves the original's values, BatchNorm statistics and gradients as they were, and a
    tied weight stays tied in the copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 8),
                          nn.Linear(8, 8))
    tied = nn.Linear(8, 8, bias=False)
    model.append(tied)
    model.append(nn.Linear(8, 8, bias=False))
    model[-1].weight = tied.weight  # tied, as a language model's head and embedding
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {name: value.clone() for name, value in model.state_dict().items()}

    copied = copy_model(model)
    assert all(mine is not theirs and mine.data_ptr() == theirs.data_ptr()
               for mine, theirs in zip(copied.parameters(), model.parameters()))
    assert copied[-1].weight is copied[-2].weight and copied[0].weight.grad is None
    assert copied[1].running_mean.data_ptr() != model[1].running_mean.data_ptr()
    UserBatch(torch.randn(4, 3, 8, 8)).step(actcomp.to_compressed(copied, "mink0.9+int8", rest="8bit"))

    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert not torch.equal(copied[1].running_mean, model[1].running_mean)  # the copy's own statistics moved
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight)) and copied[0].weight.grad is not None
    assert all(p.grad is None for p in list(model.parameters())[1:])
