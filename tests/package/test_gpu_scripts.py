"""The GPU scripts run where no GPU is: gpu_check's step runner (the test steps side by side,
the time budget) and gpu_profile's tables, on a CPU at tiny sizes. A GPU session has minutes:
a script that breaks there costs them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(autouse=True)
def benchmarks_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))


def _sleeping(seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds}); print('slept')"]


def test_gpu_check_runs_the_test_steps_together_and_skips_past_its_budget(monkeypatch):
    import gpu_check

    monkeypatch.setattr(gpu_check, "MIN_STEP_SECONDS", 1)
    steps = [("tests on cuda", _sleeping(1.5), {}, 10), ("zoo exactness on cuda", _sleeping(1.5), {}, 10),
             ("slow", _sleeping(30), {}, 2), ("late", _sleeping(0), {}, 10)]
    started = time.perf_counter()
    done = gpu_check.run_steps(steps, budget=4)
    elapsed = time.perf_counter() - started
    verdicts = {name: verdict for name, verdict, *_ in done}
    assert verdicts["tests on cuda"] == verdicts["zoo exactness on cuda"] == "passed"
    assert verdicts["slow"].startswith("TIMED OUT") and verdicts["late"].startswith("SKIPPED")
    assert elapsed < 1.5 + 1.5 + 2 + 1  # side by side, not one after the other


def test_gpu_profile_writes_its_tables_on_a_cpu(tmp_path):
    import gpu_profile

    gpu_profile.main(["--device", "cpu", "--batch", "2", "--img-size", "32", "--shape", "2x8x64", "--models",
                      "resnet18", "--specs", "int8@8bit", "--steps", "1", "--codecs", "int8", "codec:relu-mask",
                      "--out-dir", str(tmp_path)])
    text = next(tmp_path.glob("gpu_profile_*.md")).read_text()
    assert "### `int8`, 2x8x64 float32" in text and "### `codec:relu-mask`, 2x8x64 bfloat16" in text
    assert "### resnet18, `plain`: wall" in text and "### resnet18, `int8@8bit`: wall" in text


def test_training_speed_times_steps_under_bf16_autocast(tmp_path):
    # gpu_check's bf16 step: the step targets hold in fp32 and under bf16 autocast.
    import bench_training_speed

    bench_training_speed.main(["--models", "resnet18", "--batch", "2", "--img-size", "32", "--specs", "int8",
                               "--rounds", "1", "--warmup", "0", "--no-costs", "--autocast", "bf16",
                               "--out-dir", str(tmp_path)])
    text = next(tmp_path.glob("training_speed_b2_img32_bf16autocast_*.md")).read_text()
    assert "autocast: bf16" in text and "| `int8` |" in text


def test_cuda_graphs_bench_reports_each_spec_and_a_failed_capture(monkeypatch):
    # bench_cuda_graphs on a CPU, capture and timing stood in for: its rows and ratios, and a
    # capture that fails recorded in its row rather than ending the run.
    import argparse

    import bench_cuda_graphs
    import torch

    captures = []

    def graphed(step):
        captures.append(step)
        if len(captures) == 2:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return step, 2**20

    monkeypatch.setattr(bench_cuda_graphs, "graphed", graphed)
    monkeypatch.setattr(bench_cuda_graphs, "timed", lambda call, steps: (call(), 0.01)[1])
    args = argparse.Namespace(batch=2, img_size=32, rounds=2, steps=1, autocast="none", seed=0)
    rows = bench_cuda_graphs.bench_model("resnet18", ["int8", "int8@8bit"], args, torch.device("cpu"))
    by_spec = {row["spec"]: row for row in rows}
    assert list(by_spec) == ["plain", "int8", "int8@8bit"]
    assert by_spec["int8"]["note"].startswith("capture failed: RuntimeError: operation not permitted")
    assert by_spec["int8@8bit"]["replay_over_plain_replay"] == 1.0 and by_spec["int8@8bit"]["note"] == ""
    assert by_spec["int8@8bit"]["capture_peak_mib"] == 1.0 and by_spec["int8"]["capture_peak_mib"] != 1.0


def test_host_overhead_times_launches_and_whole_steps_on_a_cpu():
    # The parts bench_host_overhead runs only with --device cuda, run here under Triton's
    # interpreter (tests/conftest.py): one launch bare and through actcomp's launch, the CUDA
    # calls beside it, and a whole converted step less plain's.
    import bench_host_overhead
    import torch

    from actcomp.core.backends import use_backend

    assert bench_host_overhead._asks_for_cuda(["x", "--device", "cuda"])
    assert not bench_host_overhead._asks_for_cuda(["x", "--device", "cpu", "cuda"])
    cpu = torch.device("cpu")
    with use_backend("triton"):
        calls = bench_host_overhead.launch_costs(1, cpu)
        with bench_host_overhead.launches_stubbed():
            rows = bench_host_overhead.whole_model(["8bit"], 1, cpu, whole_steps=True)
    assert [row["spec"] for row in calls] == ["kernel[grid](...)", "triton_runtime.launch", "torch.empty",
                                              "device guard"]
    assert rows[-1]["what"].startswith("step less plain's") and rows[-1]["launches"] > 0


def test_gpu_scripts_small_helpers():
    import bench_gpu_peak
    import gpu_profile
    from torch.autograd import DeviceType

    assert bench_gpu_peak._spec_and_rest("mink0.9+int8@other=int8") == ("mink0.9+int8", {"other": "int8"})
    assert bench_gpu_peak._spec_and_rest("mink0.9+int8@8bit") == ("mink0.9+int8", "8bit")

    class Event:
        def __init__(self, name, device_type):
            self.name, self.device_type = name, device_type

    names = gpu_profile._host_names([Event("CompressedInputFunction", DeviceType.CPU),
                                     Event("_quantize_kernel", DeviceType.CUDA)])
    assert names == {"CompressedInputFunction"}
