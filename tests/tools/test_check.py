"""actcomp.check and ``actcomp check``: a layer or op kind known to bend is flagged with the change
that lifts it, nothing else is, and the model checked is left as it was."""

from __future__ import annotations

import re

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
    # The verdict comes first: the count, then the problem with the change that lifts it.
    lines = str(report).splitlines()
    assert lines[0] == "1 problem, each with the change that lifts it:"
    assert lines[1] == f"- {report.suggestions[0]}" and lines[1].startswith("- layer 5 (weight-gradient cosine 0.9")
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
    # One verdict line per problem, each problem named with its floor, then the details.
    count = len(report.suggestions)
    lines = str(report).splitlines()
    assert lines[0] == f"{count} problem{'s' if count > 1 else ''}, each with the change that lifts it:"
    assert lines[1:count + 1] == [f"- {text}" for text in report.suggestions]
    assert lines[count + 2].startswith("actcomp check: to_compressed(model, 'int8'")
    assert f"activation (cosine {kinds['activation'].cosine:.4f} < floor 0.990)" in lines[1]


def test_nothing_is_flagged_where_nothing_bends_and_the_model_is_left_as_it_was():
    model = net()
    before = {name: value.clone() for name, value in model.state_dict().items()}

    report = actcomp.check(model, BATCH, "int8", rest="8bit", rounds=1)

    assert report.cosine > 0.999 and report.flagged() == [] and report.suggestions == [] and report.ok
    assert str(report).splitlines()[0] == "OK to train: every gradient checked is at or above its floor"
    assert report.plain_bytes > 2 * report.kept_bytes
    assert actcomp.compressed_layers(model) == {} and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def identity_then_linear(x: torch.Tensor) -> nn.Sequential:
    """Layer 0 passes ``x`` through unchanged, so layer 1 (not the model's input: first_layer=auto
    would keep that plain) reads exactly ``x``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(x.shape[1], x.shape[1]), nn.Linear(x.shape[1], 64))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(x.shape[1]))
        model[0].bias.zero_()
    return model


def test_a_sparsifiers_layer_keeps_what_a_gaussian_input_predicts_and_its_floor_is_random_selections():
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    report = actcomp.check(identity_then_linear(x), x, "mink0.9", rest=None, rounds=1)

    row = next(row for row in report.layers if row.name == "1")
    # mink0.9 keeps sqrt(44%) of a Gaussian input's direction, as computed.
    assert row.cosine == pytest.approx(expected_layer_cosine("mink0.9"), abs=0.02)
    # The floor: what dropping 90% at random keeps, sqrt(0.1), less 5%. The Linear/Conv inputs
    # together and the whole gradient are held to the same floor, and the report prints it.
    assert row.floor == pytest.approx(0.95 * 0.1 ** 0.5) and not row.below
    assert report.floor == pytest.approx(row.floor) and report.kinds[0].floor == pytest.approx(row.floor)
    assert f"against plain's (floor {row.floor:.3f})" in str(report)
    assert "floor 0.300 under mink0.9: what dropping 90% of the values at random keeps (0.316), less 5%." in str(report)


def test_an_untrained_models_less_spread_input_is_no_problem():
    # A uniform input is less spread than a Gaussian, as inputs on random weights often are:
    # min-k keeps sqrt(1 - 0.9^3) = 0.52 of it, under the Gaussian's 0.663 less 5% (0.630, the
    # floor before, which flagged an untrained Llama's layer at 0.615) and above random's 0.300.
    x = 2 * torch.rand(512, 512, generator=torch.Generator().manual_seed(0)) - 1
    report = actcomp.check(identity_then_linear(x), x, "mink0.9+int8", rest=None, rounds=1)

    row = next(row for row in report.layers if row.name == "1")
    assert row.cosine == pytest.approx((1 - 0.9 ** 3) ** 0.5, abs=0.02)
    assert row.cosine < 0.95 * expected_layer_cosine("mink0.9") and not row.below
    assert report.ok and str(report).startswith("OK to train")


def test_a_sparsifier_that_drops_the_values_the_gradient_lives_in_is_flagged():
    # A tenth of the channels hold a large constant; a BatchNorm after the layer centres its
    # output gradient, so those channels' weight gradient is zero and the whole gradient lives in
    # the small values min-k drops: it keeps less than dropping at random would.
    x = 0.1 * torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
    x[:, :26] = 5.0
    model = identity_then_linear(x)
    model.append(nn.BatchNorm1d(64))
    report = actcomp.check(model, x, "mink0.9+int8", rest=None, rounds=1)

    row = next(row for row in report.layers if row.name == "1")
    assert row.below and row.cosine < 0.2
    assert report.suggestions == [f"layer 1 (weight-gradient cosine {row.cosine:.4f} < floor 0.300): "
                                  "to_compressed(model, {'1': 'int8', '*': 'mink0.9+int8'}, ...) (None leaves it plain)"]
    assert str(report).startswith(f"1 problem, each with the change that lifts it:\n- {report.suggestions[0]}\n")


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


@pytest.mark.parametrize("factory", ["quickstart", "llama", "llama_with_outliers"])
def test_the_command_runs_on_the_example_models(factory, capsys):
    pytest.importorskip("timm" if factory == "quickstart" else "transformers")
    assert main(["check", "--model", f"examples/check_models.py:{factory}", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Random weights: their noise is no problem (mink0.9's layers measured 0.65-0.91 on the Llama).
    assert lines[0] == "OK to train: every gradient checked is at or above its floor"
    assert lines[2] == "actcomp check: to_compressed(model, 'mink0.9+int8', rest='8bit')"
    assert any(line.startswith("attention ") for line in lines)
    assert any(line.startswith("layer (its weight gradient)") for line in lines)


def test_a_layer_without_a_gradient_in_plain_is_shown_so_not_scored_and_the_note_says_why():
    # A weight that starts at zero after layers "0" and "2" (layer 5 here) gives them no gradient
    # in plain.
    model = net()
    with torch.no_grad():
        model[5].weight.zero_()
    report = actcomp.check(model, BATCH, "int8", rest=None, rounds=1)

    row = next(row for row in report.layers if row.name == "2")
    assert row.cosine != row.cosine and row.no_gradient and not row.below and row.zeroed_by is None  # NaN
    text = str(report)
    assert re.search(r"^2 +int8 +no grad", text, re.MULTILINE)
    assert "no grad (2 layers): the weight gradient is zero in plain PyTorch too" in text
    assert "nothing after them passes a gradient back" in text.replace("\n  ", " ")


def test_no_grad_names_the_zero_initialised_norm_after_the_layer():
    # timm's resnets zero-initialise each residual block's last BatchNorm (zero_init_last): the
    # convs inside the block get no gradient in plain PyTorch until the model has trained.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
            nn.init.zeros_(self.bn2.weight)

        def forward(self, x):
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Block(), Block(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    report = actcomp.check(model, torch.randn(4, 3, 8, 8), "int8", rest=None, rounds=1)

    zeroed = {row.name: row.zeroed_by for row in report.layers if row.no_gradient}
    assert zeroed == {"1.conv1": "1.bn2", "1.conv2": "1.bn2", "2.conv1": "2.bn2", "2.conv2": "2.bn2"}
    assert report.ok
    note = str(report).split("no grad (4 layers): ", 1)[1].replace("\n  ", " ")
    assert note.startswith("the weight gradient is zero in plain PyTorch too, so there is nothing to compare: a norm "
                           "after each starts with all-zero weights (1.bn2, 2.bn2; timm's zero_init_last")
    assert note.endswith("They are checked once the model has trained a step.")


def test_columns_hold_long_layer_names():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(32, 64))
    model.add_module("a_rather_long_module_name_for_a_projection_layer", nn.Linear(64, 64))
    model.add_module("head", nn.Linear(64, 10))
    text = str(actcomp.check(model, BATCH, {"head": "int8:scale=group", "*": "int8"}, rest="8bit", rounds=1))

    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("layer (its weight gradient)"))
    rows = [line for line in lines if line.split(" ")[0] in ("embed", "head") or line.startswith("a_rather_long")]
    assert len(rows) == 3
    # Every column starts where its header does, and the op kinds' table lines up with it.
    for column in ("spec", "floor"):
        at = header.index(column)
        assert all(row[at - 1] == " " and row[at] != " " for row in rows), (column, rows)
    kinds = next(line for line in lines if line.startswith("op kind (alone)"))
    assert kinds.index("spec") == header.index("spec") == len("a_rather_long_module_name_for_a_projection_layer") + 1


def test_a_mapping_and_a_dict_rest_print_as_a_call_that_pastes_and_a_short_layers_row():
    """The header's call is the one checked, as Python writes it (it printed the mapping as one
    quoted string, which to_compressed cannot read, and a dict rest as the string of a dict), and
    the Linear/Conv row names the specs once instead of every layer's rule, which had widened
    the spec column of both tables to the whole mapping's length."""
    layers, rest = {"5": "int8", "7": None, "*": "int4"}, {"activation": "int8", "normalization": "exact"}
    report = actcomp.check(net(), BATCH, layers, rest=rest, rounds=1)
    call = next(line for line in str(report).splitlines() if line.startswith("actcomp check: "))
    pasted = eval(call.removeprefix("actcomp check: "), {"to_compressed": actcomp.to_compressed, "model": net()})
    assert {name: layer.spec for name, layer in actcomp.compressed_layers(pasted).items()} == {
        "0": "int4", "2": "int4", "5": "int8"}
    assert pasted.actcomp_rest == actcomp.to_compressed(net(), layers, rest=rest).actcomp_rest
    linear = next(row for row in report.kinds if row.name.startswith("linear"))
    assert linear.spec == "per layer: int8, None, int4"
    assert max(len(line) for line in str(report).splitlines() if not line.startswith(("actcomp check", "-", "  "))) < 120


def test_a_layer_scaled_convnexts_tiny_gradients_are_not_read_as_cosine_zero():
    """ConvNeXt's blocks start with a layer scale of 1e-6, so their layers' weight gradients are
    about 1e-9: a floor of 1e-8 under the norms' product read them as cosine 0 against
    themselves, and check flagged 36 of convnext_atto's 40 layers under mink0.9+int8."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model, images = timm.create_model("convnext_atto", num_classes=3), torch.randn(2, 3, 64, 64)
    report = actcomp.check(model, images, "int8", rest="8bit", rounds=1,
                           loss_fn=lambda logits: torch.nn.functional.cross_entropy(logits, torch.arange(2)))
    assert report.ok and min(row.cosine for row in report.layers) > 0.999, report
    tiny = {"w": torch.tensor([3e-9, 4e-9, 0.0], dtype=torch.float64)}
    assert actcomp.tools.user_batch.gradient_cosine(tiny, tiny) == pytest.approx(1.0, abs=1e-12)
