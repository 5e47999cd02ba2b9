"""Whole-model mode entered without the root's forward: ``model.forward_head(model.forward_features(x))``,
a wrapper calling the converted model's submodules, a submodule called directly.

What must hold, each against ``model(x)`` or plain PyTorch:

- each entry keeps about as few bytes as ``model(x)`` (it used to keep 1.0-1.4x fewer than plain
  instead of 6-9x, with no warning), and ``rest="exact"`` stays bit-identical there;
- eval, no_grad and backward (a reentrant checkpoint recomputing) start nothing; checkpoint's and
  other saved-tensor hooks win as at the root (the latter with one warning); only the outermost
  call of a submodule ends what it started, also when it raises;
- the hooks follow the model through deepcopy and pickle, are replaced (never added twice) by a
  new conversion, go with ``from_compressed``, and leave ``torch.compile`` as it was, with one
  warning where a compiled training call enters through a submodule.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import actcomp
from actcomp.graph.saved_tensors import listening

pytestmark = [
    pytest.mark.usefixtures("seeded", "single_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@dataclass(frozen=True)
class Family:
    """A timm model, what a wrapper does with its submodules, and one block with its input."""

    id: str
    build: Callable[[], nn.Module]
    through_submodules: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    block: Callable[[nn.Module], nn.Module]
    block_input: tuple[int, ...]
    # Codecs rest=LOSSY (below) uses at each entry, and those rest="exact" must use: without them a
    # bit-identical result would prove nothing (tensors kept as is are exact too).
    codecs_8bit: set[str]
    exact_codecs: set[str]


# The "8bit" preset with GELU inputs as 3-bit derivative codes: a codec of their own to look for.
LOSSY = {"fewbit": 3}

FAMILIES = [
    Family("vit",
           # Dropout after attention and MLP projections: 1-bit masks under rest="exact".
           lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=3,
                                     proj_drop_rate=0.1),
           lambda model, x: model.blocks(model.patch_embed(x)).mean(1),
           lambda model: model.blocks[0], (2, 5, 192), {"int8:group=64", "fewbit3", "dropout-mask"}, {"dropout-mask"}),
    Family("resnet18",
           lambda: timm.create_model("resnet18", pretrained=False, num_classes=3),
           lambda model, x: model.layer1(model.maxpool(model.act1(model.bn1(model.conv1(x))))).mean((2, 3)),
           lambda model: model.layer1[0], (2, 64, 8, 8), {"int8:group=64", "relu-mask"}, {"relu-mask"}),
]


class Split(nn.Module):
    """Runs a timm model as ``forward_head(forward_features(x))``, never its ``forward``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model.forward_head(self.model.forward_features(x))


class Wrapper(nn.Module):
    """A plain module that calls a model's submodules itself."""

    def __init__(self, model: nn.Module, body: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model, self.body = model, body

    def forward(self, x):
        return self.body(self.model, x)


def entries(family: Family, model: nn.Module) -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """Each way into ``model`` other than its forward: the module to call and its input shape."""
    return {
        "forward_features": (Split(model), (2, 3, 32, 32)),
        "wrapper": (Wrapper(model, family.through_submodules), (2, 3, 32, 32)),
        "submodule": (family.block(model), family.block_input),
    }


def step(module: nn.Module, parameters_of: nn.Module, inputs: torch.Tensor, seed: int = 1):
    """One training forward/backward through ``module``; (output, {name: grad of parameters_of})."""
    parameters_of.train()
    module.train()
    parameters_of.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    output = module(inputs)
    weights = torch.linspace(-1, 1, output.numel()).view(output.shape)
    (output * weights).sum().backward()
    return output.detach(), {name: p.grad for name, p in parameters_of.named_parameters()}


def assert_same(output, grads, ref_output, ref_grads) -> None:
    torch.testing.assert_close(output, ref_output, rtol=0, atol=0)
    assert list(grads) == list(ref_grads)
    for name, grad in ref_grads.items():
        assert (grads[name] is None) == (grad is None), name
        if grad is not None:
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def codecs_of(call: Callable[[], object]) -> set[str]:
    """The codecs whole-model hooks used while ``call`` ran."""
    events = []
    with listening(events.append):
        call()
    return {event.codec for event in events if event.codec is not None}


def entry_hook_counts(model: nn.Module) -> set[tuple[int, int]]:
    """(pre-hooks, post-hooks) of whole-model entry per submodule, as a set over submodules."""
    from actcomp.whole_model.compressed_model import _enter_submodule, _leave_submodule

    return {
        (sum(getattr(hook, "func", None) is _enter_submodule for hook in module._forward_pre_hooks.values()),
         sum(hook is _leave_submodule for hook in module._forward_hooks.values()))
        for module in list(model.modules())[1:]
    }


# ---------------------------------------------------------------------------------------------
# Memory: entering another way keeps as little as model(x)


@pytest.mark.parametrize("family", FAMILIES, ids=[f.id for f in FAMILIES])
def test_forward_features_then_head_keeps_as_little_as_forward(family):
    model = family.build()
    x = torch.randn(2, 3, 32, 32)
    plain = actcomp.memory_report(model, x).total_bytes
    actcomp.to_compressed(model, "mink0.9+int8", rest=LOSSY)

    torch.manual_seed(1)
    forward = actcomp.memory_report(model, x.clone()).total_bytes
    torch.manual_seed(1)
    split = actcomp.memory_report(Split(model), x.clone()).total_bytes

    # Measured: ViT-tiny 9.09x fewer bytes than plain through forward and through forward_features
    # (1.35x before entries started a session); resnet18 5.99x both ways (1.03x). The entry counts
    # the image as the model's input, so the first layer reads it plain there too (it compressed
    # it, 0.4-0.7% more bytes and min-k on raw data, before).
    assert plain / forward > 5
    assert split == forward


@pytest.mark.parametrize("family", FAMILIES, ids=[f.id for f in FAMILIES])
@pytest.mark.parametrize("entry", ["wrapper", "submodule"])
def test_wrapper_and_submodule_calls_keep_several_times_less_than_plain(family, entry):
    plain = family.build()
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0.9+int8", rest=LOSSY)
    plain_module, shape = entries(family, plain)[entry]
    module, _ = entries(family, model)[entry]
    inputs = torch.randn(shape)

    plain_bytes = actcomp.memory_report(plain_module, inputs).total_bytes
    kept = actcomp.memory_report(module, inputs)

    # Measured: ViT-tiny 9.1x through the wrapper, 9.7x through its first block; resnet18 7.1x and
    # 5.9x. Without a session only Linear/Conv inputs were compressed: 0.98-1.4x.
    assert plain_bytes / kept.total_bytes > 4
    assert family.codecs_8bit <= {codec for row in kept.kinds for codec in row.codecs}


# ---------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("family", FAMILIES, ids=[f.id for f in FAMILIES])
@pytest.mark.parametrize("entry", ["forward_features", "wrapper", "submodule"])
def test_exact_rest_is_bit_identical_at_every_entry(family, entry):
    plain = family.build()
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0", first_layer=None, rest="exact")
    plain_module, shape = entries(family, plain)[entry]
    module, _ = entries(family, model)[entry]
    inputs = torch.randn(shape)

    events = []
    with listening(events.append):
        output, grads = step(module, model, inputs)
    ref_output, ref_grads = step(plain_module, plain, inputs)

    assert family.exact_codecs <= {event.codec for event in events}
    assert_same(output, grads, ref_output, ref_grads)


# ---------------------------------------------------------------------------------------------
# When a session starts, and when not


def test_entries_start_a_session_only_in_training_with_grad():
    model = actcomp.to_compressed(FAMILIES[0].build(), "int8", rest=LOSSY)
    x = torch.randn(2, 3, 32, 32)
    seen = []
    model.blocks[0].norm1.register_forward_pre_hook(
        lambda module, args: seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False)))

    Split(model).train()(x)
    assert getattr(seen.pop()[0], "__qualname__", "") == "_Session.pack"
    events = []
    with listening(events.append):
        Split(model).eval()(x)
        model.train()
        with torch.no_grad():
            Split(model)(x)
        with torch.inference_mode():
            Split(model)(x)
    assert seen == [None, None, None] and events == []


class Recursive(nn.Module):
    """Calls itself ``depth`` times: only the outermost call may end the session."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, depth: int = 0):
        if depth:
            x = self(x, depth - 1)
        return F.gelu(self.fc(x))


def test_a_submodule_calling_itself_keeps_the_session_to_its_outermost_return():
    model = actcomp.to_compressed(nn.Sequential(Recursive(), nn.Linear(8, 2)), "int8", rest=LOSSY)
    events = []
    with listening(events.append):
        model[0](torch.randn(4, 8), depth=2)
    assert [event.codec for event in events if event.kind == "activation"] == ["fewbit3"] * 3
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_an_exception_inside_a_submodule_ends_its_session():
    model = actcomp.to_compressed(FAMILIES[1].build(), "int8", rest=LOSSY)
    with pytest.raises(RuntimeError):
        model.layer1(torch.randn(2, 5, 8, 8))  # 5 channels where 64 are expected
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not nn.modules.module._global_forward_hooks  # the op-kind tracking is off again
    assert "relu-mask" in codecs_of(lambda: model.layer1(torch.randn(2, 64, 8, 8)))


class BetweenEntries(nn.Module):
    """Calls two submodules of a converted model with an op of its own between them."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model[1](torch.sigmoid(self.model[0](x)))


def test_the_memory_report_attributes_what_a_wrapper_saves_between_entries_to_the_wrapper():
    model = actcomp.to_compressed(nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Linear(8, 2)), "int8",
                                  rest=LOSSY)
    report = actcomp.memory_report(BetweenEntries(model), torch.randn(4, 8))

    assert "fewbit3" in {codec for row in report.kinds for codec in row.codecs}
    # The sigmoid's output is the wrapper's: the first entry's scope ended with it.
    sigmoid = [s for s in report.storages if s.op_kind == "activation" and s.codec is None]
    assert [s.savers[0] for s in sigmoid] == ["(model)"]


class CheckpointedLayer1(nn.Module):
    """Checkpoints a converted resnet's layer1 and runs its layer2 plainly."""

    def __init__(self, model: nn.Module, use_reentrant: bool):
        super().__init__()
        self.model, self.use_reentrant = model, use_reentrant

    def forward(self, x):
        x = checkpoint(self.model.layer1, x, use_reentrant=self.use_reentrant)
        return self.model.layer2(x).mean((2, 3))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_submodules_recompute_and_the_rest_is_compressed(use_reentrant):
    plain = FAMILIES[1].build()
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0", first_layer=None, rest="exact")
    inputs = torch.randn(2, 64, 8, 8, requires_grad=True)  # reentrant checkpoint needs one
    calls = []
    model.layer1.register_forward_pre_hook(lambda module, args: calls.append(module))
    weights = torch.linspace(-1, 1, 2 * 128).view(2, 128)

    forward_events, backward_events = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(1)
        with listening(forward_events.append):
            output = CheckpointedLayer1(model, use_reentrant).train()(inputs)
        with listening(backward_events.append):
            (output * weights).sum().backward()
    ref_output, ref_grads = step(CheckpointedLayer1(plain, use_reentrant), plain, inputs)

    assert len(calls) == 2  # forward and recomputation
    # layer2's ReLU outputs as masks; layer1 stores nothing under checkpoint. Its recomputation
    # in backward: a reentrant one calls layer1 as from outside the model, which compresses as
    # the forward would; a non-reentrant one began outside any whole-model forward (the
    # checkpoint wraps the entry itself), so nothing names its policy: it keeps what torch keeps.
    assert {event.codec for event in forward_events if event.codec is not None} == {"relu-mask"}
    recomputed = {event.codec for event in backward_events if event.codec is not None}
    assert recomputed == ({"relu-mask"} if use_reentrant else set())
    assert not [w for w in caught if "whole-model compression is off" in str(w.message)]
    assert_same(output.detach(), {name: p.grad for name, p in model.named_parameters()}, ref_output, ref_grads)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_hugging_face_gradient_checkpointing_under_rest_exact_is_bit_identical(use_reentrant):
    # What LLM fine-tunes run: HF's own gradient_checkpointing_enable, both modes, on a causal LM
    # converted in whole-model mode (the loss kept as the model's for bit-identity).
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    plain = transformers.LlamaForCausalLM(config).train()
    model = copy.deepcopy(plain)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    actcomp.to_compressed(model, "mink0", rest="exact", loss="plain")
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    for each in (plain, model):
        each(input_ids=ids, labels=ids).loss.backward()
    for (name, got), expected in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(got.grad, expected.grad), name


def test_foreign_saved_tensor_hooks_win_at_an_entry_with_one_warning():
    class OwnHooksNet(nn.Sequential):  # a class of its own: the warning is given once per model class
        pass

    model = actcomp.to_compressed(OwnHooksNet(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), "int8", rest=LOSSY)
    packed = []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor

    with pytest.warns(UserWarning, match="whole-model compression is off for this forward: other saved-tensor hooks"):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model[1](torch.randn(4, 8, requires_grad=True) * 1)
    assert packed  # the user's hooks saw the tensors
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model[1](torch.randn(4, 8))


# ---------------------------------------------------------------------------------------------
# The hooks through conversion, copies and compile


def test_from_compressed_removes_the_hooks():
    plain = FAMILIES[1].build()
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0", first_layer=None, rest="exact")
    inputs = torch.randn(2, 3, 32, 32)
    assert "relu-mask" in codecs_of(lambda: Split(model).train()(inputs))

    actcomp.from_compressed(model)

    assert all(not module._forward_pre_hooks and not module._forward_hooks for module in model.modules())
    events = []
    with listening(events.append):
        output, grads = step(Split(model), model, inputs)
    assert events == []
    assert_same(output, grads, *step(Split(plain), plain, inputs))


def torch_save_round_trip(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model)),
                                   torch_save_round_trip], ids=["deepcopy", "pickle", "torch.save"])
def test_copies_keep_their_entries_and_train_identically(clone):
    model = actcomp.to_compressed(FAMILIES[0].build(), "int8", rest=LOSSY)
    state = list(model.state_dict())
    copied = clone(model)
    inputs = torch.randn(2, 3, 32, 32)

    assert {"int8:group=64", "fewbit3", "dropout-mask"} <= codecs_of(lambda: step(Split(copied), copied, inputs))
    assert entry_hook_counts(copied) == {(1, 1)}
    assert list(copied.state_dict()) == state and isinstance(copied, timm.models.VisionTransformer)
    assert_same(*step(Split(copied), copied, inputs), *step(Split(model), model, inputs))


def test_converting_again_replaces_the_entry_policy_without_adding_hooks():
    plain = FAMILIES[0].build()
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0", first_layer=None, rest=LOSSY)
    parameters = list(model.parameters())
    actcomp.to_compressed(model, "mink0", first_layer=None, rest="exact")
    inputs = torch.randn(2, 5, 192)

    assert codecs_of(lambda: step(model.blocks[0], model, inputs)) == {"dropout-mask"}  # no int8, no fewbit3
    assert entry_hook_counts(model) == {(1, 1)}
    assert all(a is b for a, b in zip(model.parameters(), parameters))
    assert_same(*step(model.blocks[0], model, inputs), *step(plain.blocks[0], plain, inputs))


def test_submodules_of_a_converted_model_inside_another_follow_their_own_root():
    inner = actcomp.to_compressed(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), "int8",
                                  rest={"fewbit": 2})
    outer = actcomp.to_compressed(nn.Sequential(nn.Linear(8, 8), nn.GELU(), inner), "int8", rest=LOSSY)
    hidden = torch.randn(4, 8, requires_grad=True) * 1  # an activation: a submodule's data input is kept

    assert codecs_of(lambda: outer[1](hidden)) == {"fewbit3"}
    assert codecs_of(lambda: outer[2][1](hidden)) == {"fewbit2"}
    assert codecs_of(lambda: inner(hidden)) >= {"fewbit2"}
    assert codecs_of(lambda: outer(hidden)) >= {"fewbit3"} and "fewbit2" not in codecs_of(lambda: outer(hidden))


class Tiny(nn.Module):
    """forward_features / forward_head like timm's, small enough to compile in a few seconds."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward_features(self, x):
        return self.stem(x)

    def forward_head(self, x):
        return self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


def test_torch_compile_traces_the_hooks_away_and_warns_once_for_a_compiled_training_entry():
    from torch._dynamo.utils import counters

    import actcomp.whole_model.compressed_model

    model = actcomp.to_compressed(Tiny(), "int8", rest=LOSSY, filter_fn=lambda module, name: False)
    inputs = torch.randn(4, 8)
    compiled = torch.compile(lambda x: model.forward_head(model.forward_features(x)))

    torch._dynamo.reset()
    counters.clear()
    model.eval()
    with torch.no_grad():
        compiled(inputs)
    assert counters["frames"]["ok"] == 1 and not counters["graph_break"]  # one graph, as before

    model.train()
    actcomp.errors.WARNED.discard(actcomp.whole_model.compressed_model._COMPILED_ENTRY)
    with pytest.warns(UserWarning, match="whole-model compression is off for a Tiny submodule called inside "
                                         "torch.compile"):
        compiled(inputs).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            compiled(inputs).sum().backward()
    # Eager, the same call compresses.
    assert "relu-mask" in codecs_of(lambda: model.forward_head(model.forward_features(inputs)))


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "resnet18"])
@pytest.mark.parametrize("spec, rest", [("mink0.9+int8", "8bit"), ("int8", None)])
def test_a_converted_model_is_freed_by_its_reference_count(name, spec, rest):
    """No reference cycle through the conversion's hooks: a dropped model (a search's copy, a
    user's rebuilt one) frees its parameters and gradients at once, not when the garbage
    collector next runs (a routed language model's loss held its model so until stop 58)."""
    import gc
    import weakref

    kwargs = {"img_size": 32, "patch_size": 8} if name.startswith("vit") else {}
    gc.collect()
    gc.disable()
    try:
        model = actcomp.to_compressed(timm.create_model(name, num_classes=4, **kwargs), spec, rest=rest)
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        alive = weakref.ref(model)
        del model
        assert alive() is None
    finally:
        gc.enable()
