"""Benchmarks that reach into actcomp's internals run against today's code: a probe that wraps
a renamed function fails only when someone next runs the benchmark (bench_forward_overhead's
unpack probe named a function stop 46 moved, and the benchmark failed until stop 65)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_forward_overhead_probes_count_packs_and_unpacks(tmp_path):
    subprocess.run([sys.executable, "bench_forward_overhead.py", "--models", "gpt2", "--rounds", "1", "--warmup", "0",
                    "--out-dir", str(tmp_path)], cwd=BENCHMARKS, check=True, capture_output=True, timeout=600)
    table = next(tmp_path.glob("forward_overhead_*.md")).read_text()
    row = next(line for line in table.splitlines() if line.startswith("| gpt2 |"))
    # model calls, mode calls, scopes, saved (plain), packed, unpacked: the probes saw the hooks run.
    counts = [int(cell) for cell in row.strip("|").split("|")[1:7]]
    assert all(count > 0 for count in counts) and counts[4] == counts[5], row
