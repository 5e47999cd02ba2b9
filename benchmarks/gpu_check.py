"""One command for the day a CUDA GPU is lent: the tests on it, the host-sync check, and the
speed and memory benchmarks, every results file named after the device.

    python benchmarks/gpu_check.py                      # results under benchmarks/results/gpu_<device>/
    python benchmarks/gpu_check.py --out-dir "$OUT"     # on the device tool's machine

Steps, each a fresh process whose exit code and output tail go into ``gpu_check.md``:

1. the test files with CUDA cases (compressors and noise on ``cuda``) and ``tests/test_cuda_sync.py``,
   which runs every pipeline codec under ``torch.cuda.set_sync_debug_mode("error")``, eager and
   compiled (the chain's known host read, its non-finite sum, is a strict expected failure);
2. ``bench_compressors.py --device cuda``: round trips against ``clone()`` and stored bytes;
3. ``bench_training_speed.py --device cuda``: training steps against the plain model.

A step that fails does not stop the others. Without CUDA the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TAIL = 3000  # characters of each step's output kept in the summary


def steps(out_dir: Path) -> list[tuple[str, list[str]]]:
    python = sys.executable
    return [
        ("tests on cuda", [python, "-m", "pytest", "-q", "-m", "", "-rxXs", "tests/test_cuda_sync.py",
                           "tests/test_compressors.py", "tests/test_noise.py", "-k", "cuda or sync"]),
        ("compressor round trips", [python, "benchmarks/bench_compressors.py", "--device", "cuda",
                                    "--out-dir", str(out_dir)]),
        ("training steps", [python, "benchmarks/bench_training_speed.py", "--device", "cuda",
                            "--out-dir", str(out_dir)]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where results go (default: benchmarks/results/gpu_<device>/)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing run", file=sys.stderr)
        sys.exit(2)
    device = torch.cuda.get_device_name(0)
    slug = "".join(ch if ch.isalnum() else "_" for ch in device).strip("_").lower()
    out_dir = args.out_dir or ROOT / "benchmarks" / "results" / f"gpu_{slug}"
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    lines = [f"# GPU check on {device}", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- torch: {torch.__version__}, CUDA: {torch.version.cuda}, actcomp: git {commit}",
             "- command: `python benchmarks/gpu_check.py`", ""]
    for name, command in steps(out_dir):
        started = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        elapsed = time.perf_counter() - started
        verdict = "passed" if result.returncode == 0 else f"FAILED (exit {result.returncode})"
        print(f"gpu_check: {name}: {verdict} in {elapsed:.0f} s", flush=True)
        output = (result.stdout + result.stderr)[-TAIL:]
        lines += [f"## {name}: {verdict}, {elapsed:.0f} s", "", f"`{' '.join(command[1:])}`", "", "```",
                  output.rstrip(), "```", ""]
    summary = out_dir / "gpu_check.md"
    summary.write_text("\n".join(lines) + "\n")
    print(f"gpu_check: wrote {summary}")


if __name__ == "__main__":
    main()
