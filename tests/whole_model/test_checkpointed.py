"""Whole-model compression inside activation checkpointing (``actcomp.whole_model.checkpointed``).

What must hold, for torch's non-reentrant and reentrant checkpoint alike:

- a checkpointed block's recomputation keeps what it saves in the forward's codecs (not whole);
- under ``rest="exact"`` gradients equal plain checkpointing's bit for bit (dropout included:
  checkpoint restores the RNG state);
- under a lossy policy the recomputation rounds as the forward would: gradients equal those of
  the same converted model without checkpointing, bit for bit, where the block's input is saved
  only by converted layers (which code it themselves);
- checkpointed blocks of models that are not converted run exactly as torch's, and no reference
  cycle keeps a checkpointed block's inputs alive after its backward.
"""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import actcomp
from actcomp.graph.saved_tensors import listening

pytestmark = [
    pytest.mark.usefixtures("seeded", "single_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
MODES = pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])


class Block(nn.Module):
    """A pre-norm MLP block with a ReLU branch and dropout: every kind of save a block makes."""

    def __init__(self, width: int = 32, norm: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.gate = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.norm(x)
        return x + self.drop(self.down(self.act(self.up(h)) * torch.relu(self.gate(h))))


class Net(nn.Module):
    """Blocks run under ``torch.utils.checkpoint`` inside the model's forward (as timm's
    ``set_grad_checkpointing`` and HF's ``gradient_checkpointing_enable`` run them), or not."""

    def __init__(self, use_reentrant: bool | None, norm: bool = True):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block(norm=norm) for _ in range(3))
        self.head = nn.Linear(32, 4)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) if self.use_reentrant is None else checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


def step(model: nn.Module, inputs: torch.Tensor, events: list | None = None) -> dict:
    """One training step's gradients; the saves its backward makes (recomputations) in ``events``."""
    model.train().zero_grad(set_to_none=True)
    torch.manual_seed(3)
    output = model(inputs)
    weights = torch.linspace(-1, 1, output.numel()).view(output.shape)
    with listening(events.append if events is not None else lambda event: None):
        (output * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same(grads: dict, expected: dict) -> None:
    assert list(grads) == list(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def inputs() -> torch.Tensor:
    return torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)


@MODES
def test_exact_recomputation_is_compressed_and_bit_identical_to_plain_checkpointing(use_reentrant):
    plain = Net(use_reentrant)
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0", first_layer=None, rest="exact")
    events = []

    grads = step(model, inputs(), events)
    expected = step(plain, inputs())

    assert_same(grads, expected)
    # Each block's recomputation keeps ReLU's output and dropout's mask in their 1-bit codes.
    codecs = [event.codec for event in events if event.codec is not None]
    assert codecs.count("relu-mask") == 3 and codecs.count("dropout-mask") == 3, codecs


@MODES
def test_lossy_recomputation_rounds_as_the_forward_does(use_reentrant):
    # The blocks' inputs are saved only by converted Linear layers, which code them themselves:
    # every other save is the session's, so a recomputation that chose or rounded otherwise than
    # the forward would give other gradients.
    torch.manual_seed(0)
    uncheckpointed = actcomp.to_compressed(Net(None, norm=False), "int8", first_layer=None, rest="8bit")
    model = copy.deepcopy(uncheckpointed)
    model.use_reentrant = use_reentrant
    events = []

    grads = step(model, inputs(), events)
    expected = step(uncheckpointed, inputs())

    assert_same(grads, expected)
    # The GELU inputs in int8 and the ReLU outputs as masks, in each block's recomputation.
    codecs = [event.codec for event in events if event.codec is not None]
    assert sum(codec.startswith("int8") for codec in codecs) >= 3 and codecs.count("relu-mask") == 3, codecs


@MODES
def test_recomputation_keeps_fewer_bytes_than_it_saves(use_reentrant):
    torch.manual_seed(0)
    model = actcomp.to_compressed(Net(use_reentrant), "int8", first_layer=None, rest="8bit")
    events = []
    step(model, inputs(), events)

    saved = sum(event.tensor.numel() * event.tensor.element_size() for event in events)
    kept = sum(t.numel() * t.element_size() for event in events if event.codec is not None for t in event.kept)
    kept += sum(event.tensor.numel() * event.tensor.element_size() for event in events if event.codec is None)
    assert events and kept < saved / 2, (kept, saved)


@MODES
def test_checkpointed_blocks_of_a_model_not_converted_run_as_torchs(use_reentrant):
    converted = actcomp.to_compressed(Net(use_reentrant), "int8", first_layer=None, rest="8bit")
    step(converted, inputs())  # installs the recomputation hooks for the process
    plain = Net(use_reentrant)
    reference = copy.deepcopy(plain)
    events = []

    grads = step(plain, inputs(), events)

    expected = step(reference, inputs())

    assert events == []
    assert_same(grads, expected)


def test_no_reference_cycle_keeps_a_checkpointed_block_alive():
    model = actcomp.to_compressed(Net(False), "int8", first_layer=None, rest="8bit")
    step(model, inputs())
    gc.collect()
    gc.disable()
    try:
        step(model, inputs())
        frames = [o for o in gc.get_objects() if type(o).__name__ == "_CheckpointFrame"]
    finally:
        gc.enable()
    assert frames == []


def test_checkpoints_stored_inputs_are_the_other_kind_kept_unless_asked():
    torch.manual_seed(0)
    kept, coded = [], []
    for rest, events in (("8bit", kept), ({"activation": "int8", "other": "int8"}, coded)):
        model = actcomp.to_compressed(Net(False), "int8", first_layer=None, rest=rest)
        with listening(events.append):
            model.train()(inputs()).sum().backward()
    block_input = (4, 24, 32)

    def stored(events):
        return [event.codec for event in events if event.kind == "other" and tuple(event.tensor.shape) == block_input]

    assert stored(kept) == [None] * 3
    assert all(codec is not None and codec.startswith("int8") for codec in stored(coded)) and len(stored(coded)) == 3


def test_stored_inputs_in_bf16_are_coded_so_and_bend_the_gradient_least():
    """The opt-in that halves the stored inputs: coded in bf16 (half their bytes), the gradient
    within bf16's rounding of the inputs-whole one's, closer than int8's."""
    torch.manual_seed(0)
    model, batch = Net(False), inputs()
    gradients, codecs = {}, {}
    for spec in (None, "bf16", "int8"):
        events = []
        converted = actcomp.to_compressed(copy.deepcopy(model), "int8", first_layer=None,
                                          rest="8bit" if spec is None else {"other": spec})
        with listening(events.append):
            gradients[spec] = step(converted, batch)
        codecs[spec] = [event.codec for event in events if event.kind == "other" and tuple(event.tensor.shape) == (4, 24, 32)]

    def distance(spec):
        return sum(float((gradients[spec][name] - grad).square().sum()) for name, grad in gradients[None].items())

    assert codecs[None] == [None] * 3 and len(codecs["bf16"]) == 3
    assert all(codec is not None and codec.startswith("bf16") for codec in codecs["bf16"])
    assert 0 < distance("bf16") < distance("int8")


@MODES
def test_a_checkpointed_forward_does_not_compress_what_checkpoint_drops(use_reentrant, monkeypatch):
    # Non-reentrant checkpoint drops what the forward saves and recomputes it: a converted layer
    # inside the block saves memoryless stand-ins there (a reentrant forward saves nothing at all),
    # and the backward decodes the recomputed codes with the layout of the same compression.
    from actcomp.layers import function

    torch.manual_seed(0)
    uncheckpointed = actcomp.to_compressed(Net(None, norm=False), "mink0.5+int8", first_layer=None, rest="8bit")
    model = copy.deepcopy(uncheckpointed)
    model.use_reentrant = use_reentrant
    step(model, inputs())  # the first forward compresses: nothing known of the layouts yet
    calls = []
    compress_once = function._compress_once
    monkeypatch.setattr(function, "_compress_once", lambda *args: calls.append(args[0].spec) or compress_once(*args))

    model.train().zero_grad(set_to_none=True)
    torch.manual_seed(3)
    output = model(inputs())
    forward_calls = len(calls)
    weights = torch.linspace(-1, 1, output.numel()).view(output.shape)
    (output * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    step_calls = len(calls)
    expected = step(uncheckpointed, inputs())

    assert forward_calls == 2  # the embedding and the head, outside the blocks
    assert step_calls == 2 + 3 * 3  # each block's three Linear layers, in its recomputation
    assert_same(grads, expected)


def test_a_layout_that_changed_between_compressions_raises(monkeypatch):
    from actcomp.core.packed import Packed
    from actcomp.errors import ActcompError
    from actcomp.layers import function

    model = actcomp.to_compressed(nn.Sequential(nn.Linear(16, 8)), "int8", first_layer=None)
    model(inputs()).sum().backward()
    compress_once = function._compress_once

    def another_layout(*args):
        packed = compress_once(*args)
        return Packed(packed.tensors, dataclasses.replace(packed.layout, flagged=not packed.layout.flagged))

    monkeypatch.setattr(function, "_compress_once", another_layout)
    with pytest.raises(ActcompError, match="packed layout of 'int8' for a \\(4, 24, 16\\) input changed"):
        model(inputs())


def test_a_pipeline_whose_layout_depends_on_the_values_compresses_in_the_checkpointed_forward():
    # Rice-coded positions take a size that depends on the values: no stand-ins (their layout
    # could not be known before the recomputation), the forward compresses as before it had them.
    torch.manual_seed(0)
    uncheckpointed = actcomp.to_compressed(Net(None, norm=False), "mink0.5:rice=1", first_layer=None, rest="8bit")
    model = copy.deepcopy(uncheckpointed)
    model.use_reentrant = False
    for seed in (0, 1):  # another batch each step: another Rice layout for the same shapes
        x = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        assert_same(step(model, x), step(uncheckpointed, x))
