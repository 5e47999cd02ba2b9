"""actcomp.check and ``actcomp check``: a layer or op kind known to bend is flagged with the change
that lifts it, nothing else is, and the model checked is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import actcomp
from actcomp.tools.check import expected_layer_cosine
from actcomp.tools.cli import main


class OutlierChannel(nn.Module):
    """Multiplies one channel by 50 on every row: a trained LLM's outlier feature."""

    def forward(self, x):
        scale = torch.ones(x.shape[-1])
        scale[3] = 50.0
        return x * scale


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), OutlierChannel(), nn.GELU(),
                         nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


BATCH = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))


def test_the_layer_whose_input_has_an_outlier_channel_is_flagged_with_its_fix():
    # Group scales alone on every layer: only layer 5 reads the 50x channel (through GELU). The
    # others' int4 of a GELU output keeps 0.985-0.997, so the floor here is 0.97.
    report = actcomp.check(net(), BATCH, "int4:scale=group", rest=None, rounds=1, layer_floor=0.97)

    cosines = {row.name: row.cosine for row in report.layers}
    assert [row.name for row in report.flagged() if not row.kind] == ["5"], cosines
    assert cosines["5"] < 0.96 and min(cosines["2"], cosines["7"]) > 0.98
    assert "{'5': 'int8', '*': 'int4:scale=group'}" in report.suggestions[0]
    # The fix it names does lift it, and a mapping's suggestion keeps the mapping's other rules.
    fixed = actcomp.check(net(), BATCH, {"5": "int8", "*": "int4:scale=group"}, rest=None, rounds=1, layer_floor=0.97)
    assert not [row for row in fixed.layers if row.below]
    mapped = actcomp.check(net(), BATCH, {"5": "int4:scale=group", "*": "int8"}, rest=None, rounds=1)
    assert [row.name for row in mapped.layers if row.below] == ["5"]
    assert "{'5': 'int8', '*': 'int8'}" in mapped.suggestions[0]


def test_an_op_kind_that_bends_is_flagged_alone_with_more_bits():
    report = actcomp.check(net(), BATCH, "int8", rest={"activation": "int2", "normalization": "int8"}, rounds=1)

    kinds = {row.name: row for row in report.kinds}
    assert kinds["activation"].below and kinds["activation"].spec == "int2"
    assert not kinds["linear (Linear/Conv inputs)"].below
    assert any("rest={..., 'activation': 'int8'}" in text for text in report.suggestions)
    assert kinds["activation"].plain_bytes > 4 * kinds["activation"].kept_bytes > 0


def test_nothing_is_flagged_where_nothing_bends_and_the_model_is_left_as_it_was():
    model = net()
    before = {name: value.clone() for name, value in model.state_dict().items()}

    report = actcomp.check(model, BATCH, "int8", rest="8bit", rounds=1)

    assert report.cosine > 0.999 and report.flagged() == [] and report.suggestions == []
    assert "nothing under its floor" in str(report)
    assert report.plain_bytes > 2 * report.kept_bytes
    assert actcomp.compressed_layers(model) == {} and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_a_sparsifiers_layers_are_held_to_what_a_gaussian_input_keeps():
    # One Linear layer on a Gaussian input (not the model's own input: first_layer=auto would
    # keep that plain): mink0.9 keeps sqrt(44%) of the gradient's direction, as computed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 64))
    x = torch.randn(512, 512)
    with torch.no_grad():  # layer 0 passes the Gaussian input through unchanged
        model[0].weight.copy_(torch.eye(512))
        model[0].bias.zero_()
    report = actcomp.check(model, x, "mink0.9", rest=None, rounds=1)

    row = next(row for row in report.layers if row.name == "1")
    assert row.cosine == pytest.approx(expected_layer_cosine("mink0.9"), abs=0.02)
    assert row.floor == pytest.approx(0.95 * expected_layer_cosine("mink0.9")) and not row.below


def test_the_loss_is_the_outputs_or_the_users():
    model = net()
    calls = []

    def loss_fn(output):
        calls.append(output.shape)
        return output.square().mean()

    actcomp.check(model, BATCH, "int8", rest=None, rounds=1, loss_fn=loss_fn)
    assert calls and all(shape == (256, 10) for shape in calls)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: actcomp.check(actcomp.to_compressed(net(), "int8"), BATCH), "converted already"),
    (lambda: actcomp.check(net(), BATCH, floor=1.5), r"floor and layer_floor must be in \(0, 1\]"),
    (lambda: actcomp.check(net(), BATCH, rounds=0), "rounds must be at least 1"),
    (lambda: actcomp.check(net(), BATCH, loss_fn=lambda output: output.detach().sum().requires_grad_()),
     "no parameter got a gradient"),
], ids=["converted", "floor", "rounds", "no-gradient"])
def test_bad_calls_say_what_is_wrong(call, message):
    with pytest.raises(actcomp.ActcompError, match=message):
        call()


def test_the_command_names_a_bad_factory(capsys, tmp_path):
    assert main(["check", "--model", "no_colon_here"]) == 2
    assert "FILE.py:FUNCTION" in capsys.readouterr().err
    assert main(["check", "--model", f"{tmp_path}/missing.py:build"]) == 2
    assert "no file" in capsys.readouterr().err
    factory = tmp_path / "models.py"
    factory.write_text("def build():\n    return 42\n")
    assert main(["check", "--model", f"{factory}:build"]) == 2
    assert "must return (model, batch)" in capsys.readouterr().err


@pytest.mark.parametrize("factory", ["quickstart", "llama_with_outliers"])
def test_the_command_runs_on_the_example_models(factory, capsys):
    pytest.importorskip("timm" if factory == "quickstart" else "transformers")
    assert main(["check", "--model", f"examples/check_models.py:{factory}", "--rounds", "1"]) == 0
    output = capsys.readouterr().out
    assert output.startswith("actcomp check: to_compressed(model, 'mink0.9+int8', rest='8bit')")
    assert "attention" in output and "layer (its weight gradient)" in output


def test_a_layer_without_a_gradient_in_plain_is_shown_so_not_scored():
    # A random-init ResNet block whose last BatchNorm starts at zero gives its convs no gradient:
    # here the layer after "1" starts at zero, so "1" has none.
    model = net()
    with torch.no_grad():
        model[5].weight.zero_()
    report = actcomp.check(model, BATCH, "int8", rest=None, rounds=1)

    row = next(row for row in report.layers if row.name == "2")
    assert row.cosine != row.cosine and not row.below  # NaN
    assert "no grad" in str(report)
