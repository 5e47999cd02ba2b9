"""One command for the day a CUDA GPU is lent: the tests on it, the host-sync check, and the
speed and memory benchmarks, every results file named after the device.

    python benchmarks/gpu_check.py                      # results under benchmarks/results/gpu_<device>/
    python benchmarks/gpu_check.py --out-dir "$OUT"     # on the device tool's machine

The device tool brings back at most 8 files, and this writes about 20: there, write them into a
folder and pack it (what stop 44 ran, with ``PYTHONPATH=$PWD ACTCOMP_SOURCE_VERSION=<commit>``)::

    python benchmarks/gpu_check.py --out-dir "$OUT/g"; tar czf "$OUT/g.tgz" -C "$OUT" g && rm -rf "$OUT/g"

A session's device time is 15 minutes, machine start included. Stop 50's call ran in 333 s on
an H100 and left the rest for a second call; the steps it chose (the compiled step, 240 s, the
LoRA example and the language model left for a call of their own)::

    PYTHONPATH=$PWD ACTCOMP_SOURCE_VERSION=<commit> python3 benchmarks/gpu_check.py --out-dir "$OUT/g" \
        --budget 480 --only "tests on cuda" "triton kernels on cuda" "zoo exactness on cuda" \
        "compressor round trips" "host costs" "training steps" "training steps, bf16 autocast" "profile" \
        "cuda graphs" "step peaks"

Stop 52's first call ran those steps (but the host costs, added after) in 273 s on an H200; a
second call ran the compiled step, the LoRA example and the language model (304 s: the language
model ran out of its 120 s; 2,048 tokens alone take about 60 s). The next second call::

    PYTHONPATH=$PWD ACTCOMP_SOURCE_VERSION=<commit> python3 benchmarks/gpu_check.py --out-dir "$OUT/h" \
        --budget 450 --only "compiled step" "compiled step, cuda graphs" "lora example" "language model"

Steps, each a fresh process (with a time limit) whose exit code and output tail go into
``gpu_check.md``:

1. the test files with CUDA cases (compressors and noise on ``cuda``) and ``tests/core/test_cuda_sync.py``,
   which runs every pipeline codec and the chain around them under
   ``torch.cuda.set_sync_debug_mode("error")``, eager and compiled, and whole converted training
   steps (resnet18, ViT-tiny, a tiny Llama, and the issues' resnet50, ViT-S and bf16 Llama at
   small sizes; ``rest="8bit"`` and ``"exact"``) counting no more synchronizations than the plain
   model's step; ``tests/core/test_cuda_graphs.py``: those steps captured into CUDA graphs,
   whose replays give an eager step's gradients;
   ``tests/core/test_dispatch.py`` on CUDA tensors: every implementation (the Triton kernels
   for real) against the reference, bit for bit (these and the zoo run side by side, first);
2. the zoo exactness harness on ``cuda`` (``ACTCOMP_TEST_DEVICE=cuda``, deterministic kernels):
   bit-identical logits and gradients for lossless conversions and ``rest="exact"``, fp32 and
   bf16 autocast, and the lossy presets' gradient floors;
3. ``bench_compressors.py --device cuda``: round trips against ``clone()`` and stored bytes;
4. ``bench_host_overhead.py --device cuda``: the host's µs per layer (fp32 and bf16 autocast), per saved tensor, per
   round trip and per launch, with the Triton launches run and stubbed (where the device's idle
   time goes); ``bench_training_speed.py --device cuda``: training steps against the plain model,
   in fp32 and under bf16 autocast;
5. ``gpu_profile.py``: per kernel, its launches and device time in each codec's round trip and
   in whole converted steps, and the share of a step the device sits idle waiting on the host;
   ``bench_cuda_graphs.py``: the same steps replayed from CUDA graphs (the host out of the step);
6. ``bench_gpu_peak.py``: each method's step peak (``max_memory_allocated``) and the process's reserved
   peak (``max_memory_reserved``), fresh processes;
7. ``bench_compiled.py --device cuda``: ViT-S's compiled step with ``compress_in_graph`` beside the
   compiled plain step and Inductor's fp8 activation pass (time and peak allocated); the first two
   again under ``mode="reduce-overhead"`` (CUDA graphs);
8. ``examples/lora_trainer.py --tiny``: PEFT LoRA through the Trainer, with its CUDA peak column;
9. ``bench_lm_loss.py --device cuda``: the Llama-shaped model in bf16 at 2,048 tokens (3 rounds:
   62 s on stop 52's H200, where 2,048 and 4,096 tokens at 5 rounds ran out of 120 s).

A step that fails or runs out of time does not stop the others; steps stop starting when the
``--budget`` (540 s) is spent, the later ones recorded as skipped. Without CUDA the script says so
and exits 2. ``ACTCOMP_SOURCE_VERSION`` names the commit where the tree has no git.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import cpu_name

ROOT = Path(__file__).resolve().parent.parent
TAIL = 3000  # characters of each step's output kept in the summary


def steps(out_dir: Path) -> list[tuple[str, list[str], dict, int]]:
    """``(name, command, environment added, seconds allowed)`` per step."""
    python, out = sys.executable, str(out_dir)
    pytest = [python, "-m", "pytest", "-q", "-m", "", "-rfxXs", "-p", "no:cacheprovider"]
    return [
        ("tests on cuda", [*pytest, "-n", "4", "tests/core/test_cuda_sync.py", "tests/core/test_cuda_graphs.py",
                           "tests/compressors/test_compressors.py", "tests/kernels/test_noise.py", "-k", "cuda or sync"],
         {}, 120),
        ("triton kernels on cuda", [*pytest, "-n", "4", "tests/core/test_dispatch.py", "tests/kernels/test_triton_casts.py",
                                    "tests/kernels/test_triton_flags.py", "-k", "cuda or triton"], {}, 150),
        ("zoo exactness on cuda", [*pytest, "-n", "8", "tests/integration/test_zoo.py"], {"ACTCOMP_TEST_DEVICE": "cuda"}, 120),
        ("compressor round trips", [python, "benchmarks/bench_compressors.py", "--device", "cuda", "--out-dir", out],
         {}, 45),
        ("host costs", [python, "benchmarks/bench_host_overhead.py", "--device", "cuda", "--rounds", "10",
                        "--out-dir", out], {}, 60),
        ("training steps", [python, "benchmarks/bench_training_speed.py", "--device", "cuda", "--models", "resnet50",
                            "vit_small_patch16_224", "llama_bf16", "--batch", "64", "--specs", "smink0.9+int8",
                            "mink0.9+int8@8bit", "int8", "--rounds", "5", "--no-costs", "--out-dir", out], {}, 75),
        ("training steps, bf16 autocast", [python, "benchmarks/bench_training_speed.py", "--device", "cuda", "--models",
                                           "resnet50", "vit_small_patch16_224", "--batch", "64", "--specs", "int8",
                                           "mink0.9+int8@8bit", "--rounds", "5", "--no-costs", "--autocast", "bf16",
                                           "--out-dir", out], {}, 60),
        ("profile", [python, "benchmarks/gpu_profile.py", "--device", "cuda", "--out-dir", out], {}, 120),
        ("cuda graphs", [python, "benchmarks/bench_cuda_graphs.py", "--out-dir", out], {}, 90),
        ("step peaks", [python, "benchmarks/bench_gpu_peak.py", "--out-dir", out], {}, 90),
        # The H200 run of stop 44 compiled plain and the fp8 pass in about 100 s and ran out of
        # its 150 s inside compress_in_graph's compile.
        ("compiled step", [python, "benchmarks/bench_compiled.py", "--device", "cuda", "--batch", "64",
                           "--img-size", "224", "--rounds", "1", "--configs", "plain", "fp8-pass", "actcomp-8bit",
                           "--out-dir", out], {}, 240),
        ("compiled step, cuda graphs", [python, "benchmarks/bench_compiled.py", "--device", "cuda", "--batch", "64",
                                        "--img-size", "224", "--rounds", "1", "--configs", "plain", "actcomp-8bit",
                                        "--mode", "reduce-overhead", "--out-dir", out], {}, 150),
        ("lora example", [python, "examples/lora_trainer.py", "--tiny"], {}, 90),
        ("language model", [python, "benchmarks/bench_lm_loss.py", "--device", "cuda", "--dtypes", "bf16",
                            "--tokens", "2048", "--rounds", "3", "--out", out], {}, 90),
    ]


# The test steps time nothing: they run side by side (the GPU has room, the machine 16 cores),
# before any timed step starts.
TOGETHER = ("tests on cuda", "triton kernels on cuda", "zoo exactness on cuda")
# A step is not started with less of the budget left than this.
MIN_STEP_SECONDS = 20


def run_steps(chosen: list[tuple[str, list[str], dict, int]],
              budget: float) -> list[tuple[str, str, float, str, list[str]]]:
    """Run ``chosen`` steps (those of :data:`TOGETHER` at once, then the rest one by one), each
    within its time limit and what is left of ``budget`` seconds (a step with under
    :data:`MIN_STEP_SECONDS` left is skipped): ``(name, verdict, seconds, output, command)`` per step, in order."""
    done = []
    deadline = time.perf_counter() + budget

    def finish(name, command, process, started, seconds):
        try:
            stdout, stderr = process.communicate(timeout=max(1.0, seconds - (time.perf_counter() - started)))
            verdict = "passed" if process.returncode == 0 else f"FAILED (exit {process.returncode})"
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            verdict = f"TIMED OUT after {seconds} s"
        elapsed = time.perf_counter() - started
        print(f"gpu_check: {name}: {verdict} in {elapsed:.0f} s", flush=True)
        done.append((name, verdict, elapsed, (stdout or "") + (stderr or ""), command))

    def start(command, environment):
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **environment})

    together = [(step, time.perf_counter(), start(step[1], step[2])) for step in chosen if step[0] in TOGETHER]
    for (name, command, _, seconds), started, process in together:
        finish(name, command, process, started, seconds)
    for name, command, environment, seconds in chosen:
        if name in TOGETHER:
            continue
        left = deadline - time.perf_counter()
        if left < MIN_STEP_SECONDS:
            print(f"gpu_check: {name}: skipped ({left:.0f} s of the budget left)", flush=True)
            done.append((name, f"SKIPPED ({left:.0f} s of the --budget left)", 0.0, "", command))
            continue
        finish(name, command, start(command, environment), time.perf_counter(), int(min(seconds, left)))
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where results go (default: benchmarks/results/gpu_<device>/)")
    parser.add_argument("--only", nargs="+", default=None, metavar="STEP", help="run only the steps named")
    parser.add_argument("--budget", type=float, default=540,
                        help="seconds for all steps: the device tool's calls end at 600 (default 540)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing run", file=sys.stderr)
        sys.exit(2)
    device = torch.cuda.get_device_name(0)
    slug = "".join(ch if ch.isalnum() else "_" for ch in device).strip("_").lower()
    out_dir = args.out_dir or ROOT / "benchmarks" / "results" / f"gpu_{slug}"
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = os.environ.get("ACTCOMP_SOURCE_VERSION") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    lines = [f"# GPU check on {device}", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- torch: {torch.__version__}, CUDA: {torch.version.cuda}, actcomp: git {commit}",
             f"- host CPU: {cpu_name()}, {os.cpu_count()} cores (the host's Python and launches set a converted step)",
             "- command: `python benchmarks/gpu_check.py`", ""]
    chosen = [step for step in steps(out_dir) if not args.only or step[0] in args.only]
    for name, verdict, elapsed, output, command in run_steps(chosen, args.budget):
        (out_dir / f"{name.replace(' ', '_')}.log").write_text(output)
        lines += [f"## {name}: {verdict}, {elapsed:.0f} s", "", f"`{' '.join(command[1:])}`", "", "```",
                  output[-TAIL:].rstrip(), "```", ""]
    summary = out_dir / "gpu_check.md"
    summary.write_text("\n".join(lines) + "\n")
    print(f"gpu_check: wrote {summary}")


if __name__ == "__main__":
    main()
