"""memory_report on small graphs whose saved bytes are known by construction."""

import pytest
import torch
from models import SMALL_MODELS, free_port, fsdp_memory_worker
from torch import nn

import actcomp
from actcomp.layers.compressed_layer import compress_layer
from actcomp.tools.memory import SavedTensorRecorder

BATCH, WIDTH = 16, 32
FP32 = 4


def linear_relu_linear() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))


def test_tensor_saved_by_two_ops_counts_once():
    # ReLU keeps its output; the second Linear keeps the same tensor as its input.
    model, x = linear_relu_linear(), torch.randn(BATCH, WIDTH)

    report = actcomp.memory_report(model, x)

    assert report.total_bytes == BATCH * WIDTH * FP32
    [relu_output] = [s for s in report.storages if s.shape == (BATCH, WIDTH) and s.savers != ("0",)]
    assert relu_output.savers == ("1", "2")
    assert {row.name: row.nbytes for row in report.rows} == {"1": BATCH * WIDTH * FP32}
    # The first Linear keeps the model input: reported apart, not as an activation.
    assert report.input_bytes == x.numel() * FP32


def test_a_tensor_saved_twice_by_one_op_counts_once():
    class Square(nn.Module):
        def forward(self, x):
            hidden = x * 2
            return hidden * hidden  # mul saves both operands: one storage

    report = actcomp.memory_report(Square(), torch.randn(10, 10, requires_grad=True))

    assert report.total_bytes == 10 * 10 * FP32
    assert len(report.storages) == 1


def test_views_of_one_buffer_count_at_the_size_of_the_buffer():
    class SaveViews(nn.Module):
        def forward(self, x):
            buffer = x.exp()  # exp saves its output: the whole (8, 8) buffer
            return (buffer[:2].sin() + buffer[2:].cos().sum()).sum()  # sin/cos save views of it

    report = actcomp.memory_report(SaveViews(), torch.randn(8, 8, requires_grad=True))

    assert report.total_bytes == 8 * 8 * FP32


def test_parameters_are_not_activations():
    model, x = nn.Linear(WIDTH, 4), torch.randn(BATCH, WIDTH, requires_grad=True)

    report = actcomp.memory_report(model, x)

    # Linear saves its weight (for the input gradient) and its input (a model input).
    assert report.total_bytes == 0
    assert report.input_bytes == x.numel() * FP32


def test_compressed_layer_whose_input_another_op_keeps_frees_nothing():
    model, x = linear_relu_linear(), torch.randn(BATCH, WIDTH)
    relu_output = torch.relu(model[0](x)).detach()
    plain_bytes = actcomp.memory_report(model, x).total_bytes
    actcomp.to_compressed(model, "mink0.9")  # the first Linear is skipped: only "2" converts

    report = actcomp.memory_report(model, x)

    packed = actcomp.parse("mink0.9").compress(relu_output)
    # ReLU still keeps its output, and the compressed copy comes on top of it.
    assert report.total_bytes == plain_bytes + packed.nbytes
    [lost] = report.not_freed
    assert (lost.layer, lost.input_bytes, lost.kept_by) == ("2", BATCH * WIDTH * FP32, ("1",))
    assert "compressing it frees nothing" in report.table()


def test_compressed_layer_whose_input_nobody_else_keeps_is_freed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 4))
    x = torch.randn(BATCH, WIDTH)
    gelu_output = nn.functional.gelu(model[0](x)).detach()
    actcomp.to_compressed(model, "mink0.9+int8")

    torch.manual_seed(1)
    report = actcomp.memory_report(model, x)

    # GELU keeps its input (the first Linear's output); the second Linear keeps only its
    # compressed input. The int8 codes' size does not depend on the random draw.
    packed = actcomp.parse("mink0.9+int8").compress(gelu_output)
    assert report.total_bytes == BATCH * WIDTH * FP32 + packed.nbytes
    assert report.not_freed == []
    assert {row.name: row.compressed for row in report.rows} == {"1": None, "2": "mink0.9+int8"}
    assert report.by_type() == {"GELU": BATCH * WIDTH * FP32, "Linear": packed.nbytes}


def test_autocast_weight_copies_are_reported_apart():
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 4))
    x = torch.randn(BATCH, WIDTH, requires_grad=True)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = actcomp.memory_report(model, x)

    bf16 = 2
    assert report.parameter_copy_bytes == (WIDTH * WIDTH + 4 * WIDTH) * bf16
    # Activations: the bf16 copy of x (Linear 0), its output (GELU's input), GELU's output.
    assert report.total_bytes == 3 * BATCH * WIDTH * bf16


def test_output_of_a_layer_whose_input_needs_no_grad_is_an_activation():
    # conv1's output has the weight as its only autograd input; it is still an activation.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

    report = actcomp.memory_report(model, torch.randn(2, 3, 8, 8))

    assert report.parameter_copy_bytes == 0
    conv_output = 2 * 4 * 6 * 6 * FP32
    assert report.total_bytes >= conv_output  # kept by BatchNorm (plus its small statistics)
    assert report.rows[0].name == "1"


def test_report_restores_training_mode_and_leaves_no_hooks():
    model = linear_relu_linear().eval()

    actcomp.memory_report(model, torch.randn(2, WIDTH))

    assert not model.training
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_report_of_frozen_compressed_layer_counts_no_compressed_bytes():
    model, x = linear_relu_linear(), torch.randn(BATCH, WIDTH)
    compress_layer(model[2], actcomp.parse("mink0.5"))
    model[2].weight.requires_grad_(False)

    report = actcomp.memory_report(model, x)

    assert report.total_bytes == BATCH * WIDTH * FP32  # ReLU's output only


def test_report_of_fsdp2_sharded_model_equals_unsharded_report(tmp_path):
    # Two gloo processes shard each model (layers, blocks, root) and report on their half of
    # the batch. Sharded parameters are DTensors, and the unsharded ones FSDP2 all-gathers
    # for the forward are parameters too: the report is the unsharded model's, field by field.
    # After it every parameter is sharded again, as after a training step: a forward without its
    # backward leaves the root's all-gathered parameters registered, and an optimizer built then
    # would step those instead of the shards.
    torch.manual_seed(0)
    cases = []
    for _, build, batch in SMALL_MODELS:
        state, (inputs, _) = build().state_dict(), batch()
        cases += [(build, state, spec, inputs) for spec in (None, "mink0.9+int8")]
    torch.multiprocessing.spawn(fsdp_memory_worker, args=(2, free_port(), cases, str(tmp_path)), nprocs=2, join=True)

    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for (build, state, spec, inputs), (report, parameter_types) in zip(cases, results, strict=True):
            model = build()
            model.load_state_dict(state)
            if spec is not None:
                actcomp.to_compressed(model, spec)

            expected = actcomp.memory_report(model, inputs.chunk(2)[rank])

            assert report == expected
            assert report.total_bytes > 0
            assert {row.compressed for row in report.rows} - {None} == ({spec} if spec else set())
            assert parameter_types == {"DTensor"}


def test_kind_rows_of_a_relu_output_that_a_plain_linear_also_keeps():
    # Whole-model mode alone (no layer converted): ReLU keeps a 1-bit mask of its output, but
    # the plain second Linear keeps that output whole, so it is not freed. Plain PyTorch keeps
    # it once, counted for the kind that saved it first (activation).
    model, x = linear_relu_linear(), torch.randn(BATCH, WIDTH)
    actcomp.to_compressed(model, "int8", rest="exact", filter_fn=lambda module, name: False)

    report = actcomp.memory_report(model, x)

    full, mask = BATCH * WIDTH * FP32, BATCH * WIDTH // 8
    assert [(row.kind, row.plain_bytes, row.kept_bytes, row.codecs) for row in report.kinds] == [
        ("activation", full, mask, ("relu-mask",)),
        ("linear", 0, full, ("as is",)),
    ]
    assert (report.plain_bytes, report.total_bytes) == (full, full + mask)
    assert [s.nbytes for s in report.kept_as_is()] == [full]


def test_kind_rows_when_the_linear_compresses_too():
    model, x = linear_relu_linear(), torch.randn(BATCH, WIDTH)
    relu_output = torch.relu(model[0](x)).detach()
    actcomp.to_compressed(model, "int8", rest="exact")  # "0" reads the model input: runs plain

    report = actcomp.memory_report(model, x)

    packed = actcomp.parse("int8").compress(relu_output).nbytes
    full, mask = BATCH * WIDTH * FP32, BATCH * WIDTH // 8
    assert [(row.kind, row.plain_bytes, row.kept_bytes, row.codecs) for row in report.kinds] == [
        ("activation", full, mask, ("relu-mask",)),
        ("linear", 0, packed, ("int8",)),
    ]
    assert report.kept_as_is() == [] and report.not_freed == []
    assert "relu-mask" in report.kind_table() and "total" in report.kind_table()


def test_whole_resnet18_keeps_over_5x_less_and_plain_keeps_what_it_keeps():
    import timm

    torch.manual_seed(0)
    plain = timm.create_model("resnet18", pretrained=False, num_classes=3)
    x = torch.randn(2, 3, 64, 64)
    plain_report = actcomp.memory_report(plain, x)
    model = actcomp.to_compressed(plain, "mink0.9+int8", rest="8bit")

    report = actcomp.memory_report(model, x)

    assert plain_report.plain_bytes == plain_report.total_bytes > 0
    assert all(row.plain_bytes == row.kept_bytes and row.codecs == ("as is",) for row in plain_report.kinds)
    assert report.plain_bytes == plain_report.plain_bytes  # what plain PyTorch would keep
    # Measured 6.24x: ReLU masks (32x), MaxPool offsets (16x), BatchNorm inputs in int8 (3.8x,
    # the bulk of what is left) and the convs' mink0.9+int8 copies.
    assert report.plain_bytes / report.total_bytes > 5
    kinds = {row.kind: row for row in report.kinds}
    assert kinds["activation"].plain_bytes == 32 * kinds["activation"].kept_bytes
    assert kinds["pooling"].codecs == ("pool-offsets4",)
    # int8 in groups inside each channel: 16x16 planes (256), 8x8 planes, and channel rows of
    # the batch's 2 x 4x4 and 2 x 2x2 values (BatchNorm's statistics stay as is).
    assert set(kinds["normalization"].codecs) == {"int8", "int8:group=64", "int8:group=32", "int8:group=8", "as is"}


def test_a_report_built_from_a_recorder_is_the_report_memory_report_returns():
    # The caller runs the forward; the recorder only listens, and building the report changes nothing.
    model, x = linear_relu_linear(), torch.randn(BATCH, WIDTH)
    actcomp.to_compressed(model, "int8", rest="exact")
    recorder = SavedTensorRecorder(model, [x])

    with recorder.recording():
        model(x)

    facts = dict(recorder.storages)
    report = actcomp.MemoryReport.from_recorder(recorder)
    assert report == actcomp.MemoryReport.from_recorder(recorder) == actcomp.memory_report(model, x)
    assert recorder.storages == facts
    assert [row.codecs for row in report.kinds] == [("relu-mask",), ("int8",)]


def test_a_recorder_leaves_no_hooks_when_the_forward_raises():
    model = linear_relu_linear()
    actcomp.to_compressed(model, "int8")
    recorder = SavedTensorRecorder(model, [])
    hooks = [dict(m._forward_pre_hooks) for m in model.modules()]

    with pytest.raises(RuntimeError, match="shape"), recorder.recording():
        model(torch.randn(2, WIDTH + 1))

    assert [dict(m._forward_pre_hooks) for m in model.modules()] == hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert recorder._alive == []


@pytest.mark.parametrize("count, text", [(0, "0 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB")])
def test_format_bytes(count, text):
    assert actcomp.tools.memory.format_bytes(count) == text


def test_peak_rss_of_a_whole_model_step_in_a_fresh_process():
    from actcomp.tools.peak_rss import peak_rss

    peak = peak_rss("resnet18", "int8", rest="8bit", first_layer=None, batch=2, img_size=32, steps=1)

    # The process imported torch and trained: well over 50 MiB, far under the machine's memory.
    assert 50 * 2**20 < peak < 16 * 2**30


@pytest.mark.parametrize("choice, message", [
    ({"rest": "nonsense8"}, "unknown stage 'nonsense8'"),
    ({"first_layer": "nope"}, "first_layer='nope' is not a supported layer"),
])
def test_peak_rss_passes_rest_and_first_layer_to_to_compressed(choice, message):
    from actcomp.tools.peak_rss import peak_rss

    # The probe's own to_compressed rejects them: proof that they reached it.
    with pytest.raises(actcomp.ActcompError, match=message):
        peak_rss("resnet18", "int8", batch=1, img_size=32, steps=1, **choice)


def test_peak_rss_rest_without_a_spec_is_an_error():
    from actcomp.tools.peak_rss import peak_rss

    with pytest.raises(actcomp.ActcompError, match="rest='8bit' needs a spec"):
        peak_rss("resnet18", None, rest="8bit", batch=1, img_size=32)
