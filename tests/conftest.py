"""Fixtures, and the two test tiers.

``python -m pytest`` runs the default tier; ``python -m pytest -m ""`` runs both (CI does), and
``python -m pytest -m full`` only the full tier: the tests that cost seconds each because they
start processes (the examples, torchrun, DDP and FSDP2, fresh-process memory probes), train to
an accuracy or compile, and the zoo's models beyond the three the default tier sweeps.
"""

import os
import shutil
import sys

# Idle OpenMP threads sleep rather than spin, unless the caller chose: with another process on
# the cores, a spinning thread waits for one that is not running, and a two-thread training step
# of a small model took 50x longer (2.5 s against 0.05 s). Read once, when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Without a GPU, the Triton kernels run on CPU tensors under Triton's interpreter, which must be
# on before triton is first imported (use_backend("triton") then picks them; unasked, CPU tensors
# keep the native kernels). Reading /proc is enough to know: torch is not imported yet.
if not (os.path.exists("/proc/driver/nvidia") or shutil.which("nvidia-smi")) and \
        os.environ.get("ACTCOMP_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import actcomp  # noqa: E402

if os.environ.get("ACTCOMP_TEST_DEVICE", "cpu").startswith("cuda"):
    # The zoo harness on a GPU (tests/zoo.py): plain and converted models must run the same
    # kernels in the same order for bit-identity, so no autotuning and no atomics-ordered sums.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)

if "PYTEST_XDIST_WORKER" in os.environ:
    # Under pytest-xdist each worker is one process of several: more than one thread apiece
    # oversubscribes the cores. Tests that need more threads ask for them.
    torch.set_num_threads(1)

# The full tier, by file or file::test (every parametrization), with why each is there.
FULL_TIER = {
    "test_triton_compiles.py": "compiles every Triton kernel specialization for a GPU target (a minute)",
    "test_triton_steps.py": "three models' training steps through Triton's interpreter (about a minute)",
    "test_examples.py::test_hf_trainer": "an example script end to end",
    "test_examples.py::test_amp_loop": "an example script end to end",
    "test_examples.py::test_lora_trainer": "an example script end to end",
    "test_examples.py::test_distributed": "an example script end to end, under torchrun",
    "test_check.py::test_the_command_runs_on_the_example_models": "a ViT-S and two Llamas checked end to end",
    "test_readme.py::test_the_quickstart_prints_what_the_readme_shows": "the Quickstart in a fresh interpreter",
    "test_examples.py::test_lightning_trainer": "an example script end to end",
    "test_temporaries.py": "fresh-process peak-memory probes of every pipeline",
    "test_training.py::test_ddp_two_processes_match_single_process": "two processes",
    "test_training.py::test_fsdp2_two_processes_match_single_process": "two processes",
    "test_memory.py::test_report_of_fsdp2_sharded_model_equals_unsharded_report": "two processes",
    "test_memory.py::test_peak_rss_of_a_whole_model_step_in_a_fresh_process": "fresh-process probe",
    "test_memory.py::test_peak_rss_passes_rest_and_first_layer_to_to_compressed": "fresh-process probe",
    "test_max_batch.py::test_probe_stops_early_above_a_limit_and_checkpoint_runs": "fresh-process probes",
    "test_max_batch.py::test_a_small_warmup_step_then_one_step_peaks_like_two_full_steps": "fresh-process probes",
    "test_cli.py::test_report_measures_peak_rss_in_fresh_processes": "fresh-process probes",
    # The same error in process: test_unknown_model_is_a_clear_error.
    "test_cli.py::test_module_entry_point_runs": "a fresh interpreter (python -m actcomp)",
    "test_packaging.py": "builds the wheel and sdist, installs the wheel into a fresh virtual environment",
    "test_docs.py": "builds the documentation site",
    "test_packed.py::test_stages_used_alone_never_import_the_pipeline": "a fresh interpreter",
    "test_import_cost.py": "a fresh interpreter",
    "test_benchmark_probes.py": "a benchmark in fresh processes",
    "test_cli.py::test_demo_runs_end_to_end": "trains to an accuracy",
    "test_training.py::test_digits_mink08_trains_as_well_as_baseline": "trains to an accuracy",
    "test_training.py::test_torch_compile_converted_model_trains": "torch.compile",
    "test_whole_model.py::test_torch_compile_of_a_training_step_compresses_in_the_graph_within_compiles_drift": "torch.compile",
    "test_entry_points.py::test_torch_compile_traces_the_hooks_away_and_warns_once_for_a_compiled_training_entry":
        "torch.compile",
    "test_positions.py::test_rice_refuses_to_compile_and_says_why": "torch.compile",
    "test_in_graph.py::test_exact_forms_give_the_compiled_steps_gradients_bit_for_bit": "torch.compile",
    "test_in_graph.py::test_int8_inside_the_graph_keeps_the_gradients_close": "torch.compile",
    "test_in_graph.py::test_a_relu_output_feeding_a_linear_keeps_its_mask_exact_under_int8": "torch.compile",
    "test_in_graph.py::test_a_nan_in_a_linear_input_makes_the_compiled_weight_gradient_nan": "torch.compile",
    "test_in_graph.py::test_the_template_table_holds_one_entry_per_distinct_form": "torch.compile",
    "test_in_graph.py::test_the_compiled_engine_reads_the_policy_as_eager_mode_does": "torch.compile",
    "test_in_graph.py::test_dynamic_shapes_compile_once_and_keep_the_exact_gradients": "torch.compile",
    "test_in_graph.py::test_a_lossy_plan_rebuilds_the_norms_and_gelus_outputs_instead_of_keeping_them": "torch.compile",
    "test_in_graph.py::test_a_compiled_converted_model_keeps_no_codes_of_what_the_backward_rebuilds": "torch.compile",
    "test_causal_lm_loss.py::test_a_compiled_model_computes_the_routed_loss": "torch.compile",
}

# The compile tier: every registered codec compiled by Inductor (fullgraph, dynamic) against its
# eager codes. Cold, on 2 cores: the min-k sparsifiers take 9-17 minutes each (symbolic-shape
# simplification while tracing, then C++ builds), all 21 tests 27 minutes: past what CI can
# spend, so they run when asked, ACTCOMP_COMPILE_TESTS=1, before a change to a codec lands.
# Marked `full` and `compile`.
COMPILE_TIER = {
    "test_codecs.py::test_codec_encode_and_decode_compile_to_the_eager_codes",
    "test_quantizers.py::test_encode_and_decode_compile_to_the_eager_codes",
    "test_positions.py::test_every_sparsifier_compiles_to_its_eager_codes",
    "test_backends.py::test_compiled_backend_gives_the_eager_codes_and_compiles_once_over_shapes",
}
_RUN_COMPILE_TIER = os.environ.get("ACTCOMP_COMPILE_TESTS") == "1"

# Sweeps over the zoo: the default tier runs them on the models in zoo.FAST_ZOO_IDS only. Tests
# parametrized over a zoo ``entry`` are sweeps; these name their model by the parameter given.
ZOO_SWEEPS = {
    "test_whole_model.py::test_lossy_rest_keeps_the_forward_and_gradients_close": "model_id",
    "test_first_layer.py::test_auto_runs_plain_exactly_the_layers_that_read_the_model_input": "model_id",
}


def _full_tier_reason(item: pytest.Item) -> str | None:
    file = item.path.name
    test = f"{file}::{item.originalname}" if isinstance(item, pytest.Function) else None
    reason = FULL_TIER.get(file) or FULL_TIER.get(test)
    params = item.callspec.params if hasattr(item, "callspec") else {}
    # The zoo (and timm, which it needs) is there only if a collected test module imported it.
    zoo = sys.modules.get("zoo")
    if reason is None and zoo is not None:
        entry = params.get("entry")
        model_id = entry.id if isinstance(entry, zoo.ZooModel) else params.get(ZOO_SWEEPS.get(test))
        if model_id is not None and model_id not in zoo.FAST_ZOO_IDS:
            reason = "zoo sweep beyond the default tier's models"
    return reason


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    modules = {}
    for item in items:
        if isinstance(item, pytest.Function):
            modules[item.path.name] = item.module
        reason = _full_tier_reason(item)
        if reason is not None:
            item.add_marker(pytest.mark.full(reason=reason))
        if isinstance(item, pytest.Function) and f"{item.path.name}::{item.originalname}" in COMPILE_TIER:
            item.add_marker(pytest.mark.full(reason="torch.compile of a codec"))
            item.add_marker(pytest.mark.compile)
            if not _RUN_COMPILE_TIER:
                item.add_marker(pytest.mark.skip(reason="compiles a codec (minutes): set ACTCOMP_COMPILE_TESTS=1"))
    # A renamed test must leave the tables too, or it silently changes tier.
    stale = [key for key in [*FULL_TIER, *ZOO_SWEEPS, *COMPILE_TIER] if "::" in key and key.split("::")[0] in modules
             and not hasattr(modules[key.split("::")[0]], key.split("::")[1])]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py names tests that do not exist: {stale}")


@pytest.fixture
def seeded():
    """Start from a fixed global RNG state (random inputs, stochastic rounding)."""
    torch.manual_seed(0)


@pytest.fixture
def single_thread():
    """Run on one intra-op thread: tiny ops on a shared 2-core machine are many times faster,
    and plain and converted models then run the same kernels either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def compress_calls(monkeypatch):
    """Shapes of every tensor any pipeline compresses while the test runs."""
    calls: list[tuple[int, ...]] = []
    original = actcomp.Pipeline.compress

    def counting(self, x, **kwargs):
        calls.append(tuple(x.shape))
        return original(self, x, **kwargs)

    monkeypatch.setattr(actcomp.Pipeline, "compress", counting)
    return calls


@pytest.fixture
def compressing_layers(monkeypatch):
    """A function ``model -> names of its converted layers that kept a compressed input`` while
    the test ran (each converted layer has its own pipeline instance; a layer that reuses the
    copy another layer made of the same input counts too)."""
    compressed_by: set[int] = set()
    original = actcomp.layers.function._compress_once

    def recording(pipeline, *args, **kwargs):
        compressed_by.add(id(pipeline))
        return original(pipeline, *args, **kwargs)

    monkeypatch.setattr(actcomp.layers.function, "_compress_once", recording)

    def names(model) -> set[str]:
        return {name for name, pipeline in actcomp.compressed_layers(model).items() if id(pipeline) in compressed_by}

    return names
