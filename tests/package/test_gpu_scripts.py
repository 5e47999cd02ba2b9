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
