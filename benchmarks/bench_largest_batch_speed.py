"""Samples per second at the largest batch that fits the budget: plain, checkpointing, actcomp.

    python benchmarks/bench_largest_batch_speed.py            # ViT-S and resnet50 at 2 threads: ~15 minutes
    python benchmarks/bench_largest_batch_speed.py --models resnet50 --rounds 1 --steps 1   # a check: ~3 minutes

``bench_max_batch.py`` finds, per model and method, the largest batch whose training step peaks
within 4 GiB; its results files (``max_batch_4GiB_<model>_*.csv``) give the batches here. This
script trains each method at its own largest batch, each run in a fresh process
(:func:`actcomp.tools.peak_rss.training_steps`, the search's own probe: the model built from the
same seed, one untimed step, then ``--steps`` timed steps; the peak read from VmHWM, AdamW,
glibc's allocator as a user's process gets it), the methods in rotating
order for ``--rounds`` rounds. Reported: samples per second (batch / median step time), and
per round the ratio to plain's samples per second in the same round, median over rounds: what
a user who fills the budget gets per second of training.

Writes ``benchmarks/results/largest_batch_speed_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path

import torch
from bench_frontier import METHODS
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, quantiles, write_results

from actcomp.tools.peak_rss import training_steps

COLUMNS = ["model", "method", "batch", "samples_per_s", "ratio_vs_plain", "ratio_p25", "ratio_p75", "step_s",
           "peak_mib"]


def largest_batches(results: Path, model: str, budget: str) -> dict[str, int]:
    """Method -> largest batch for ``model``, from bench_max_batch.py's newest results file that has it."""
    for path in sorted(results.glob(f"max_batch_{budget}_*.csv"), key=lambda path: path.stat().st_mtime, reverse=True):
        with path.open() as handle:
            rows = [row for row in csv.DictReader(line for line in handle if not line.startswith("#"))
                    if row["model"] == model]
        if rows:
            return {row["method"]: int(row["batch"]) for row in rows}
    raise SystemExit(f"no {results}/max_batch_{budget}_*.csv has {model}: run bench_max_batch.py --models {model} first")


def run_once(model: str, method: str, batch: int, args) -> dict:
    """One fresh process: the first full-size step untimed, then ``--steps`` timed ones."""
    compress, whole, checkpoint = METHODS[method]
    peak, seconds = training_steps(model, args.spec if compress else None, rest=args.rest if whole else None,
                                   checkpoint=checkpoint, batch=batch, img_size=args.img_size, steps=args.steps + 1,
                                   threads=args.threads)
    return {"step_s": statistics.median(seconds[1:]), "peak": peak}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["vit_small_patch16_224", "resnet50"])
    parser.add_argument("--budget", default="4GiB", help="which bench_max_batch.py results to read")
    parser.add_argument("--methods", nargs="+", default=["plain", "whole", "checkpoint"], choices=list(METHODS))
    parser.add_argument("--spec", default="mink0.9+int8", help="Linear/Conv pipeline (as the search used)")
    parser.add_argument("--rest", default="8bit", help="whole-model policy (as the search used)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run, after one untimed")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--max-batch-dir", default=str(RESULTS_DIR), help="where bench_max_batch.py's results are")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    if "plain" not in args.methods:
        parser.error("--methods needs plain: the ratios are against it")
    load_before, started = load_average(), time.perf_counter()

    rows = []
    for model in args.models:
        batches = largest_batches(Path(args.max_batch_dir), model, args.budget)
        missing = [method for method in args.methods if method not in batches]
        if missing:
            raise SystemExit(f"the max-batch results for {model} have no {', '.join(missing)}")
        runs: dict[str, list[dict]] = {method: [] for method in args.methods}
        for round_index in range(args.rounds):
            shift = round_index % len(args.methods)
            for method in args.methods[shift:] + args.methods[:shift]:
                result = run_once(model, method, batches[method], args)
                runs[method].append(result)
                print(f"{model} {method} batch {batches[method]}: {batches[method] / result['step_s']:.2f} samples/s, "
                      f"peak {result['peak'] / 2**20:.0f} MiB", flush=True)
        plain_rates = [batches["plain"] / run["step_s"] for run in runs["plain"]]
        for method in args.methods:
            rates = [batches[method] / run["step_s"] for run in runs[method]]
            low, median, high = quantiles([rate / base for rate, base in zip(rates, plain_rates)])
            rows.append({"model": model, "method": method, "batch": batches[method],
                         "samples_per_s": statistics.median(rates), "ratio_vs_plain": median, "ratio_p25": low,
                         "ratio_p75": high, "step_s": statistics.median(run["step_s"] for run in runs[method]),
                         "peak_mib": max(run["peak"] for run in runs[method]) / 2**20})

    body = ["Each method at its own largest batch within the budget (from `bench_max_batch.py`); "
            "`x plain`: per round, samples/s over plain's in the same round, median (quartiles) over rounds.",
            "", "| model | method | batch | samples/s | x plain | p25-p75 | step s | peak MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        body.append(f"| {row['model']} | {row['method']} | {row['batch']} | {row['samples_per_s']:.2f} "
                    f"| **{row['ratio_vs_plain']:.2f}x** | {row['ratio_p25']:.2f}-{row['ratio_p75']:.2f} "
                    f"| {row['step_s']:.1f} | {row['peak_mib']:.0f} |")
    settings = {"budget": args.budget, "spec": args.spec, "rest": args.rest, "img_size": args.img_size,
                "rounds": args.rounds, "steps": args.steps}
    device = torch.device("cpu")
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, settings, load_before)
    write_results("largest_batch_speed", device, args.threads, header,
                  f"Samples per second at the largest batch within {args.budget}", body, rows, COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
