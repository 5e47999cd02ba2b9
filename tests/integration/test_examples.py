"""The scripts in examples/ run end to end at their --tiny settings, as CI runs them.

Each prints a plain-vs-actcomp table and a verdict, then what its checkpoint round trip found;
these tests read both rows (actcomp keeps several times fewer bytes, and learns: accuracy well
above chance) and require every round trip to report an exact match.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
# "actcomp   315.4 KiB   91.9%   2.76x", with a peak-CUDA column between on CUDA machines.
ROW = re.compile(r"^(plain|actcomp) +([\d.]+) (B|KiB|MiB|GiB) +(?:[\d.]+ \w+ +)?([\d.]+)% +([\d.]+)x$", re.MULTILINE)


def run_example(*arguments: str) -> str:
    """Run ``python *arguments`` in the repository with this tree's actcomp, one thread per
    process (the examples are small; more threads oversubscribe a 2-core machine); its stdout."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, *arguments], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit code {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


def check_table(output: str, min_accuracy: float, min_ratio: float = 3.0) -> None:
    rows = {name: (float(size) * UNITS[unit], float(accuracy) / 100, float(ratio))
            for name, size, unit, accuracy, ratio in ROW.findall(output)}
    assert rows.keys() == {"plain", "actcomp"}, output
    (plain_bytes, _, plain_ratio), (packed_bytes, packed_accuracy, _) = rows["plain"], rows["actcomp"]
    assert plain_ratio == 1.0
    assert packed_bytes * min_ratio < plain_bytes, output
    assert packed_accuracy > min_accuracy, output
    assert re.search(r"^verdict: actcomp keeps [\d.]+x fewer bytes for backward", output, re.MULTILINE), output


def test_hf_trainer():
    output = run_example("examples/hf_trainer.py", "--tiny")
    check_table(output, min_accuracy=0.3)  # 4 classes: chance is 0.25
    assert "weights equal to the uninterrupted run's: True" in output
    assert "from_pretrained: same logits: True" in output


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_lora_trainer(qlora):
    if qlora:
        pytest.importorskip("bitsandbytes")
    output = run_example("examples/lora_trainer.py", "--tiny", *(["--qlora"] if qlora else []))
    # Next-byte accuracy (chance: 1/256). 2.7x fewer bytes at this tiny size: SDPA's query and key
    # stay as they are on a LoRA model, and the embedding's share is large.
    check_table(output, min_accuracy=0.1, min_ratio=2.5)
    found = re.search(r"adapters' gradient cosine to plain's: ([\d.]+), lora_A's alone: ([\d.]+)", output)
    assert float(found.group(1)) >= 0.999 and float(found.group(2)) >= 0.999, output
    assert "adapter weights equal: True" in output


def test_amp_loop():
    output = run_example("examples/amp_loop.py", "--tiny")
    check_table(output, min_accuracy=0.9)
    assert re.search(r"after loading, [\d.]+% when saved: equal: True", output), output
    assert "weights equal to the uninterrupted run's: True" in output


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_distributed(mode):
    output = run_example("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         "examples/distributed.py", "--mode", mode, "--tiny")
    check_table(output, min_accuracy=0.5)
    assert "equal to the trained model's: True" in output


def test_lightning_trainer():
    pytest.importorskip("lightning")
    output = run_example("examples/lightning_trainer.py", "--tiny")
    # 10 classes (chance 0.1). The demo's CNN keeps 25x fewer bytes: its ReLU outputs and MaxPool
    # argmaxes become 1-bit masks and offsets.
    check_table(output, min_accuracy=0.5, min_ratio=20)
    # Lightning calls configure_model for fit and again for test; the guard converts once.
    found = re.search(r"configure_model ran (\d+) times \(fit, test\), converted 1 time\(s\): .*, [1-9]\d* layers", output)
    assert found and int(found.group(1)) >= 2, output
    assert re.search(r"into a plain module \(0 converted layers\): weights equal: True \(\d+ tensors\); "
                     r"into a converted module \([1-9]\d* converted layers\): weights equal: True", output), output


def test_table_doctest(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import compare

    results = doctest.testmod(compare)
    assert results.attempted > 0 and results.failed == 0
