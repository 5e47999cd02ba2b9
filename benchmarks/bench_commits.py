"""Step time of two commits side by side: did a change make whole-model training slower?

    python benchmarks/bench_commits.py --before 9109b39              # against the working tree
    python benchmarks/bench_commits.py --before 9109b39 --after HEAD --models resnet18 --rounds 3

Each commit's ``actcomp/`` is exported (``git archive``) to a temporary directory; every
measurement is a fresh process (``step_probe.py``) importing actcomp from one of them, run
before/after in turn (the order alternating round to round), so the machine's drift hits both
alike. A process times the plain model's step and the converted model's step in interleaved
rounds; the figures reported are medians over processes of

- ``after / before``: the converted step of the new code over the old one's, pair by pair;
- each commit's converted step over the plain step of the same process.

The conversion is ``to_compressed(model, spec, rest=rest)`` for each ``--rest`` (``none``:
Linear/Conv mode), fp32, at ``--threads`` torch threads. ``gpt2`` in ``--models`` is the
GPT-2-shaped model of ``gpt2_shaped.py`` (``--gpt2-batch`` sequences of ``--seq-len`` tokens).

The probes inherit the environment: ``ACTCOMP_NATIVE_MARCH=x86-64-v3`` builds the native
kernels for AVX2 (commits that have it), ``ATEN_CPU_CAPABILITY=avx2`` runs torch's own kernels
as on an AVX2 CPU; both are recorded in the header, with the capability the probes reported and
the range of the 1-minute load average seen as each probe started.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from common import REPO_ROOT, benchmark_parser, header_lines, load_average, quantiles, write_results
from gpt2_shaped import GPT2

from actcomp.tools.probe import run_probe

PROBE = Path(__file__).with_name("step_probe.py")


def export(revision: str, into: Path) -> str:
    """``actcomp/`` of ``revision`` under ``into`` (the working tree's for ``"worktree"``); its short commit."""
    if revision == "worktree":
        return "worktree (" + subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                             text=True, check=True).stdout.strip() + " + changes)"
    archive = subprocess.run(["git", "archive", revision, "actcomp"], cwd=REPO_ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return subprocess.run(["git", "rev-parse", "--short", revision], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def probe(source: Path, model: str, spec: str, rest: str, args) -> dict:
    batch = args.gpt2_batch if model == GPT2 else args.batch
    program = [str(PROBE), "--model", model, "--spec", spec, "--rest", rest, "--batch", str(batch),
               "--img-size", str(args.img_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--threads", str(args.threads)]
    LOADS.append(float(load_average()))
    measured = run_probe(program, what=f"step probe of {model} rest={rest} for {source}", package_root=str(source),
                         timeout=1800)
    if not measured["actcomp_file"].startswith(str(source)):
        raise RuntimeError(f"the probe imported {measured['actcomp_file']}, not the code under {source}")
    CAPABILITIES.add(measured.get("cpu_capability", "not reported"))
    return measured


# The 1-minute load average as each probe starts, and the CPU capabilities the probes reported.
LOADS: list[float] = []
CAPABILITIES: set[str] = set()


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--before", required=True, help="the older revision (a commit, tag or branch)")
    parser.add_argument("--after", default="worktree", help="the newer revision; default: the working tree")
    parser.add_argument("--models", nargs="+", default=["resnet18", "vit_small_patch16_224"], help="timm model names")
    parser.add_argument("--spec", default="mink0.9+int8", help="the Linear/Conv pipeline")
    parser.add_argument("--rest", nargs="+", default=["8bit"], help="rest= values to time ('none': Linear/Conv mode)")
    parser.add_argument("--rounds", type=int, default=4, help="processes per revision and configuration")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process (after one warm-up step)")
    parser.add_argument("--batch", type=int, default=4, help="batch size")
    parser.add_argument("--img-size", type=int, default=224, help="image size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each probe")
    parser.add_argument("--seq-len", type=int, default=64, help=f"tokens per sequence for {GPT2!r}")
    parser.add_argument("--gpt2-batch", type=int, default=4, help=f"batch size for {GPT2!r}")
    parser.add_argument("--name", default="commits", help="results file name (before the torch/device suffix)")
    args = parser.parse_args()
    start, load_before = time.time(), load_average()
    with tempfile.TemporaryDirectory() as before_dir, tempfile.TemporaryDirectory() as after_dir:
        before_commit = export(args.before, Path(before_dir))
        after_source = REPO_ROOT if args.after == "worktree" else Path(after_dir)
        after_commit = export(args.after, Path(after_dir))
        rows = []
        for model in args.models:
            for rest in args.rest:
                before, after = [], []
                for index in range(args.rounds):
                    order = [("before", Path(before_dir)), ("after", after_source)]
                    for name, source in order if index % 2 == 0 else order[::-1]:
                        (before if name == "before" else after).append(probe(source, model, args.spec, rest, args))
                    print(f"{model} rest={rest} round {index + 1}: after/before "
                          f"{after[-1]['step_s'] / before[-1]['step_s']:.3f}", flush=True)
                pairs = [a["step_s"] / b["step_s"] for a, b in zip(after, before)]
                low, median, high = quantiles(pairs)
                # Each commit's step over its own process's plain step, after's over before's pair by
                # pair: steadier than after / before on a loaded machine, as plain and converted
                # steps alternate inside a process while the two processes of a pair see different load.
                normalized = quantiles([(a["step_s"] / a["plain_s"]) / (b["step_s"] / b["plain_s"])
                                        for a, b in zip(after, before)])
                rows.append({
                    "model": model, "rest": rest, "after_over_before": median, "q25": low, "q75": high,
                    "before_vs_plain": statistics.median(b["step_s"] / b["plain_s"] for b in before),
                    "after_vs_plain": statistics.median(a["step_s"] / a["plain_s"] for a in after),
                    "normalized_after_over_before": normalized[1], "normalized_q25": normalized[0],
                    "normalized_q75": normalized[2],
                })
    header = header_lines(torch.device("cpu"), args.threads, 0, time.time() - start,
                          {"before": before_commit, "after": after_commit, "spec": args.spec, "batch": args.batch,
                           "img_size": args.img_size, "gpt2": f"{args.gpt2_batch}x{args.seq_len} tokens",
                           "rounds": args.rounds, "steps": args.steps,
                           "ACTCOMP_NATIVE_MARCH": os.environ.get("ACTCOMP_NATIVE_MARCH", "unset (native)"),
                           "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY", "unset"),
                           "probes' cpu capability": "/".join(sorted(CAPABILITIES)),
                           "load at probe starts": f"{min(LOADS):.2f}-{max(LOADS):.2f}"}, load_before)
    body = ["| model | rest | after / before (median, quartiles) | before: step / plain | after: step / plain | "
            "(after / plain) / (before / plain), pair by pair |",
            "|---|---|---|---|---|---|"]
    body += [f"| {r['model']} | {r['rest']} | **{r['after_over_before']:.3f}** ({r['q25']:.3f}-{r['q75']:.3f}) | "
             f"{r['before_vs_plain']:.2f}x | {r['after_vs_plain']:.2f}x | {r['normalized_after_over_before']:.3f} "
             f"({r['normalized_q25']:.3f}-{r['normalized_q75']:.3f}) |" for r in rows]
    print("\n".join(body))
    write_results(args.name, torch.device("cpu"), args.threads, header, f"Step time: {after_commit} against {before_commit}",
                  body, rows, list(rows[0]), REPO_ROOT / "benchmarks" / "results")


if __name__ == "__main__":
    main()
