"""Model surgery: to_compressed / from_compressed / compressed_layers, and the eval bypass."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from models import Conv1D, TinyGPT2, loss_and_grads
from torch import nn

import actcomp
from actcomp.layers.compressed_layer import CompressedLayer

pytestmark = pytest.mark.usefixtures("seeded", "single_thread")


class Mixed(nn.Module):
    """Every supported layer kind plus unsupported ones (BatchNorm, LayerNorm, Embedding)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.ReLU())
        self.seq = nn.Conv1d(8, 8, 3, padding=1, padding_mode="circular")
        self.vol = nn.Conv3d(1, 2, 3, padding=1)
        self.proj = Conv1D(16, 8)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16 + 2, 4)

    def forward(self, x):
        x = self.body(F.relu(self.bn(self.stem(x))))  # (N, 8, 4, 4)
        seq = self.seq(x.flatten(2))  # (N, 8, 16)
        vol = self.vol(x[:, :1].unsqueeze(1)).mean((2, 3, 4))  # (N, 2)
        tokens = self.norm(self.proj(seq.transpose(1, 2).contiguous()))  # (N, 16, 16)
        return self.head(torch.cat([tokens.mean(1), vol], dim=1))


SUPPORTED = ["stem", "body.0", "seq", "vol", "proj", "head"]


def mixed_batch():
    return torch.randn(2, 3, 8, 8), torch.tensor([1, 3])


def test_converts_every_supported_kind_and_runs_the_input_layer_plain(compress_calls):
    model = actcomp.to_compressed(Mixed(), "mink0.9")
    assert sorted(actcomp.compressed_layers(model)) == sorted(SUPPORTED)
    for module in (model.bn, model.norm, model.body[1]):
        assert not isinstance(module, CompressedLayer)
    # "stem" reads the model input (first_layer="auto"): it runs plain, every other layer compresses.
    x, _ = mixed_batch()
    model(x)
    assert len(compress_calls) == len(SUPPORTED) - 1
    assert (2, 3, 8, 8) not in compress_calls


def test_parameters_state_dict_isinstance_and_repr_unchanged():
    model = Mixed()
    params_before = dict(model.named_parameters())
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    classes_before = {name: type(m) for name, m in model.named_modules()}

    assert actcomp.to_compressed(model, "pmink0.9+int8", first_layer=None) is model

    assert all(p is params_before[name] for name, p in model.named_parameters())
    state = model.state_dict()
    assert list(state) == list(state_before)
    assert all(torch.equal(state[k], state_before[k]) for k in state)
    for name, module in model.named_modules():
        assert isinstance(module, classes_before[name])
        if name in SUPPORTED:
            assert type(module) is not classes_before[name]
            assert type(module).__name__ == "Compressed" + classes_before[name].__name__
    assert isinstance(model.head, nn.Linear) and isinstance(model.vol, nn.Conv3d)
    assert type(model.proj).__name__ == "CompressedConv1D" and isinstance(model.proj, Conv1D)
    text = repr(model)
    assert text.count("compress='pmink0.9+int8'") == len(SUPPORTED)
    assert "CompressedLinear(in_features=18, out_features=4, bias=True, compress='pmink0.9+int8')" in text

    actcomp.from_compressed(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes_before
    assert all(p is params_before[name] for name, p in model.named_parameters())
    state = model.state_dict()
    assert list(state) == list(state_before) and all(torch.equal(state[k], state_before[k]) for k in state)
    assert actcomp.compressed_layers(model) == {}
    assert "compress=" not in repr(model)
    assert not any(hasattr(m, "actcomp_pipeline") for m in model.modules())


def test_load_plain_state_dict_into_converted_model():
    source = Mixed()
    target = actcomp.to_compressed(Mixed(), "mink0.9")
    assert not torch.equal(target.head.weight, source.head.weight)
    target.load_state_dict(source.state_dict())
    for (name, a), (_, b) in zip(target.state_dict().items(), source.state_dict().items()):
        assert torch.equal(a, b), name
    # And the other way: a converted model's state dict loads into a plain one (strict).
    plain = Mixed()
    plain.load_state_dict(target.state_dict())
    assert torch.equal(plain.proj.weight, source.proj.weight)


def test_from_compressed_gives_the_plain_model_back():
    plain = Mixed()
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0.9+int8", first_layer=None)
    actcomp.from_compressed(model)
    x, y = mixed_batch()
    loss, grads = loss_and_grads(model, x, y)
    ref_loss, ref_grads = loss_and_grads(plain, x, y)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def _check_copy(original: nn.Module, clone: nn.Module):
    layers, clone_layers = actcomp.compressed_layers(original), actcomp.compressed_layers(clone)
    assert list(layers) == list(clone_layers)
    for name in layers:
        assert clone_layers[name].spec == layers[name].spec
        assert clone_layers[name] is not layers[name]
        assert type(clone.get_submodule(name)) is type(original.get_submodule(name))
    for (name, a), (_, b) in zip(original.state_dict().items(), clone.state_dict().items()):
        assert torch.equal(a, b), name
    # The clone trains exactly as the original (mink is deterministic) and saves compressed.
    x, y = mixed_batch()
    calls = []
    for layer in clone.modules():
        if isinstance(layer, CompressedLayer):
            layer.register_forward_hook(lambda *args: calls.append(1))
    loss, grads = loss_and_grads(clone, x, y)
    ref_loss, ref_grads = loss_and_grads(original, x, y)
    assert len(calls) == len(layers)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    torch.optim.SGD(clone.parameters(), lr=0.1).step()


def test_deepcopy_keeps_conversion():
    model = actcomp.to_compressed(Mixed(), {"seq": "channel0.5", "*": "mink0.9"})
    _check_copy(model, copy.deepcopy(model))


def test_pickle_keeps_conversion():
    model = actcomp.to_compressed(Mixed(), {"seq": "channel0.5", "*": "mink0.9"})
    _check_copy(model, pickle.loads(pickle.dumps(model)))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    _check_copy(model, torch.load(buffer, weights_only=False))


def test_converting_twice_replaces_the_pipeline():
    model = actcomp.to_compressed(Mixed(), "mink0.9")
    first_classes = {name: type(model.get_submodule(name)) for name in actcomp.compressed_layers(model)}
    actcomp.to_compressed(model, {"head": "int8", "seq": None, "*": "pmink0.5"})
    layers = actcomp.compressed_layers(model)
    assert layers["head"].spec == "int8"
    assert layers["seq"].spec == "mink0.9"  # not selected this time: keeps its pipeline
    assert layers["vol"].spec == "pmink0.5"
    assert layers["stem"].spec == "pmink0.5"  # "auto" converts it too (it runs plain on the model input)
    for name, cls in first_classes.items():
        module = model.get_submodule(name)
        assert type(module) is cls  # same subclass, no CompressedCompressed...
        assert type(module).__mro__.count(CompressedLayer) == 1
        assert repr(module).count("compress=") == 1
    assert "compress='int8'" in repr(model.head)
    actcomp.from_compressed(model)
    assert type(model.head) is nn.Linear


def test_converting_gpt2_conv1d_twice_replaces_the_pipeline():
    model = actcomp.to_compressed(TinyGPT2(), "mink0.9", first_layer=None)
    actcomp.to_compressed(model, "int8", first_layer=None)
    specs = {name: p.spec for name, p in actcomp.compressed_layers(model).items()}
    assert specs["h.0.c_attn"] == "int8"
    assert set(specs.values()) == {"int8"}


def test_pattern_mapping_first_match_wins_and_none_leaves_alone():
    model = TinyGPT2()
    mapping = {"h.0.*": None, "h.*.c_attn": "mink0.9", "*.c_fc": "int8", "lm_head": "pmink0.9+int8"}
    actcomp.to_compressed(model, mapping, first_layer=None)
    specs = {name: p.spec for name, p in actcomp.compressed_layers(model).items()}
    assert specs == {"h.1.c_attn": "mink0.9", "h.1.c_fc": "int8", "lm_head": "pmink0.9+int8"}


def test_every_layer_gets_its_own_pipeline_instance():
    shared = actcomp.parse("mesa8")
    model = actcomp.to_compressed(Mixed(), shared, first_layer=None)
    pipelines = list(actcomp.compressed_layers(model).values())
    assert len(pipelines) == len(SUPPORTED)
    assert all(p == shared and p is not shared for p in pipelines)
    assert len({id(p) for p in pipelines}) == len(pipelines)
    stages = [stage for p in pipelines for stage in p.stages]
    assert len({id(s) for s in stages}) == len(stages)


def test_first_layer_by_name_and_bad_name():
    model = actcomp.to_compressed(Mixed(), "mink0.9", first_layer="proj")
    assert set(actcomp.compressed_layers(model)) == set(SUPPORTED) - {"proj"}
    with pytest.raises(actcomp.ActcompError, match="first_layer='nope'"):
        actcomp.to_compressed(Mixed(), "mink0.9", first_layer="nope")
    with pytest.raises(actcomp.ActcompError, match="first_layer='bn'"):
        actcomp.to_compressed(Mixed(), "mink0.9", first_layer="bn")  # exists, but unsupported
    # Nothing supported: "auto" has nothing to skip and nothing is converted (and it says so).
    with pytest.warns(UserWarning, match="left this Sequential unchanged"):
        assert actcomp.compressed_layers(actcomp.to_compressed(nn.Sequential(nn.ReLU()), "mink0.9")) == {}


def test_filter_fn_vetoes_layers():
    seen = []

    def only_convs(module, name):
        seen.append(name)
        return isinstance(module, nn.modules.conv._ConvNd)

    model = actcomp.to_compressed(Mixed(), "mink0.9", filter_fn=only_convs)
    assert set(actcomp.compressed_layers(model)) == {"stem", "body.0", "seq", "vol"}
    assert set(seen) == set(SUPPORTED)  # asked about supported layers only


@pytest.mark.parametrize(
    "pipeline",
    ["mnk0.9", "mink0.9+", "int8+mink0.9", "mink1.5", "", {"head": "mnk0.9"}, {"head": 3}, 0.9],
)
def test_bad_pipeline_raises(pipeline):
    model = Mixed()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(actcomp.ActcompError):
        actcomp.to_compressed(model, pipeline)
    assert actcomp.compressed_layers(model) == {}
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_non_module_raises():
    with pytest.raises(actcomp.ActcompError, match="nn.Module"):
        actcomp.to_compressed([nn.Linear(2, 2)], "mink0.9")


def test_eval_and_no_grad_never_compress(compress_calls):
    plain = Mixed()
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0.9+int8", first_layer=None)
    x, _ = mixed_batch()

    model.eval()
    plain.eval()
    out = model(x)
    assert compress_calls == []
    assert torch.equal(out, plain(x))
    out.sum().backward()  # eval mode still has exact gradients (the plain op ran)
    assert compress_calls == []

    model.train()
    plain.train()
    with torch.no_grad():
        out = model(x)
    assert compress_calls == []
    with torch.no_grad():
        assert torch.equal(out, plain(x))

    with torch.inference_mode():
        model(x)
    assert compress_calls == []

    # Control: training with grad does compress, once per converted layer.
    model(x)
    assert len(compress_calls) == len(SUPPORTED)


def test_uninitialized_lazy_layer_is_refused_and_works_once_materialized():
    # A lazy layer swaps its own class on its first forward, which would silently drop
    # compression: to_compressed refuses it until it has run once.
    model = nn.Sequential(nn.Linear(3, 4), nn.LazyLinear(5))
    with pytest.raises(actcomp.ActcompError, match="uninitialized LazyLinear.*run one forward pass"):
        actcomp.to_compressed(model, "mink0.9", first_layer=None)
    assert actcomp.compressed_layers(model) == {}

    model(torch.randn(2, 3))
    actcomp.to_compressed(model, "mink0.9", first_layer=None)
    model(torch.randn(2, 3)).sum().backward()
    assert set(actcomp.compressed_layers(model)) == {"0", "1"}


class NoLinearOrConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return F.gelu(self.norm(x))


def test_a_model_with_nothing_to_convert_warns_naming_what_is_supported():
    with pytest.warns(UserWarning, match=r"to_compressed left this NoLinearOrConv unchanged: it has no layer to "
                                         r"convert \(nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, .*GPT-2 Conv1D\); "
                                         r"rest='8bit' would compress"):
        actcomp.to_compressed(NoLinearOrConv(), "int8")


@pytest.mark.parametrize("pipeline, kwargs", [({"blocks.*": "int8"}, {}), ("int8", {"filter_fn": lambda m, n: False})])
def test_a_selection_that_converts_nothing_warns(pipeline, kwargs):
    with pytest.warns(UserWarning, match=r"left this Mixed unchanged: it has 6 Linear/Conv layers \('stem', "
                                         r"'body.0', .* \.\.\.\), but the pipeline's patterns, filter_fn or first_layer "
                                         r"selected none"):
        actcomp.to_compressed(Mixed(), pipeline, **kwargs)


def test_whole_model_mode_without_linear_or_conv_is_no_warning(recwarn):
    # rest= still compresses what the other ops save: the GELU input in int8.
    model = actcomp.to_compressed(NoLinearOrConv(), "int8", rest="8bit")
    actcomp.to_compressed(Mixed(), "int8")
    assert not [w for w in recwarn if "to_compressed" in str(w.message)]
    activation = next(row for row in actcomp.memory_report(model, torch.randn(4, 8)).kinds if row.kind == "activation")
    assert activation.codecs == ("int8",) and activation.kept_bytes < activation.plain_bytes
