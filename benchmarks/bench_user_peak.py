"""The memory a user gets: peak RSS and step time of a training step as a user's own script runs it.

    python benchmarks/bench_user_peak.py                    # the README's rows: ViT-S and resnet50, batch 32 (~35 min)
    python benchmarks/bench_user_peak.py --models resnet18 --batch 8 --img-size 64 --rounds 1   # check: ~1 minute

Every run is a fresh process (:func:`actcomp.tools.peak_rss.training_steps`): a timm model at
224 px, fp32, 10 classes, AdamW (the Quickstart's), ``--threads`` torch threads, ``--steps``
steps; its peak is VmHWM, its step time the median of the steps after the first, and with 6 steps
or more also the median of the last half (the *settled* time). Plain's process can get faster as
it ages: glibc's mmap threshold rises with each large block it frees, and after two or three steps
its activations may come from the heap without page faults (resnet50 at batch 32 on an Intel Xeon:
steps 2-3 9.2-9.8 s, steps 4-10 4.9-7.5 s), where a converted model's stays where it is (its
buffers are mapped one by one, :mod:`actcomp.host_allocator`). A short process's ratio then
flatters the conversion; the settled one is what a long training run pays. The ways to run:

- ``plain``: plain PyTorch, glibc's allocator as it comes (what a user's process does);
- ``plain, tuned allocator``: the same with ``MALLOC_MMAP_THRESHOLD_=65536``, the setting the
  benchmarks measured under before stop 40 (plain's peak drops too: part of every saving was it);
- ``whole``: ``to_compressed(model, SPEC, rest=REST)``, as it comes: the conversion makes freed
  buffers of 1 MiB and up go back to the OS (:mod:`actcomp.host_allocator`);
- ``whole, remedy off``: the same with ``ACTCOMP_RETURN_FREED_MEMORY=0`` (the remedy's effect,
  and its price in step time);
- ``whole, huge pages``: ``whole`` in a process started with
  ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc asks for transparent huge pages for the blocks
  it maps: a fault per 2 MiB instead of per 4 KiB page, which is most of the remedy's price);
- ``checkpoint``: timm's per-block checkpointing (non-reentrant), allocator as it comes;
- ``checkpoint+whole``: both (since stop 48 whole-model mode also compresses what each block's
  recomputation saves in backward);
- ``checkpoint+whole, inputs int8``: both, with the block inputs checkpoint stores coded too
  (``rest={"other": "int8"}``, the ``"8bit"`` preset otherwise; ``--rest 8bit`` only);
- ``checkpoint+whole, inputs bf16``: the same in bf16 (``rest={"other": "bf16"}``), the mildest
  code of the stored inputs;
- ``whole, int8 batch norms``: ``whole`` with ``rest={"batch_norms_16bit": None}``, the
  ``"8bit"`` preset before stop 57, which kept a bf16 BatchNorm input in int8 (``--amp bf16``).

``--amp bf16`` runs every step under CPU bf16 autocast.

The runs of one model go in rounds, their order rotating from round to round; a run's step-time
ratio is its median step over plain's in the same round, and the table gives the median of
those ratios over rounds with the quartiles. Peaks are the median over rounds (they move by a
few MiB). Writes ``benchmarks/results/user_peak_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from common import RESULTS_DIR, benchmark_parser, check_specs, header_lines, load_average, quantiles, write_results

from actcomp.tools.peak_rss import training_steps

# name -> (compress?, checkpoint?, allocator setting of actcomp.tools.peak_rss, rest in place of --rest)
# Processes of this many steps or more also report the settled step time (the last half's).
SETTLED_FROM = 6
RUNS = {
    "plain": (False, False, "as-user", None),
    "plain, tuned allocator": (False, False, "tuned", None),
    "whole": (True, False, "as-user", None),
    "whole, remedy off": (True, False, "untouched", None),
    "whole, huge pages": (True, False, "hugetlb", None),
    "checkpoint": (False, True, "as-user", None),
    "checkpoint+whole": (True, True, "as-user", None),
    # A rest mapping overrides the "8bit" preset: checkpoint's stored block inputs are kind "other".
    "checkpoint+whole, inputs int8": (True, True, "as-user", {"other": "int8"}),
    "checkpoint+whole, inputs bf16": (True, True, "as-user", {"other": "bf16"}),
    # Under --amp bf16: the "8bit" preset before stop 57, BatchNorm's bf16 inputs in int8.
    "whole, int8 batch norms": (True, False, "as-user", {"batch_norms_16bit": None}),
}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["vit_small_patch16_224", "resnet50"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--spec", default="mink0.9+int8", help="Linear/Conv pipeline")
    parser.add_argument("--rest", default="8bit", help="whole-model policy")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN",
                        help=f"which runs, of: {'; '.join(RUNS)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="training steps per process (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--amp", choices=["bf16"], default=None, help="CPU autocast dtype for every step")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    check_specs(parser, [args.spec])
    if "plain" not in args.runs:
        parser.error("--runs must include plain: every ratio is against it")
    if args.rest != "8bit" and any(RUNS[run][3] is not None for run in args.runs):
        parser.error("the runs that code checkpoint's stored inputs extend the '8bit' preset: give --rest 8bit")
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is not timed")
    load_before, started = load_average(), time.perf_counter()

    rows = []
    for model in args.models:
        peaks = {run: [] for run in args.runs}
        ratios = {run: [] for run in args.runs}
        settled_ratios = {run: [] for run in args.runs}
        for index in range(args.rounds):
            shift = index % len(args.runs)
            seconds, settled = {}, {}
            for run in args.runs[shift:] + args.runs[:shift]:
                compress, checkpoint, allocator, rest = RUNS[run]
                peak, step_seconds = training_steps(
                    model, args.spec if compress else None, rest=(rest or args.rest) if compress else None,
                    checkpoint=checkpoint, allocator=allocator, batch=args.batch, img_size=args.img_size,
                    steps=args.steps, threads=args.threads, amp=args.amp)
                peaks[run].append(peak)
                seconds[run] = statistics.median(step_seconds[1:])
                settled[run] = statistics.median(step_seconds[len(step_seconds) // 2:])
                print(f"{model} round {index} {run}: peak {peak / 2**20:.0f} MiB, step {seconds[run]:.2f} s, "
                      f"settled {settled[run]:.2f} s, each {[round(value, 2) for value in step_seconds]}", flush=True)
            for run in args.runs:
                ratios[run].append(seconds[run] / seconds["plain"])
                settled_ratios[run].append(settled[run] / settled["plain"])
        plain_peak = statistics.median(peaks["plain"])
        for run in args.runs:
            low, median, high = quantiles(ratios[run])
            peak = statistics.median(peaks[run])
            row = {"model": model, "run": run, "peak_mib": peak / 2**20, "x_lower": plain_peak / peak,
                   "time_ratio": median, "time_p25": low, "time_p75": high}
            if args.steps >= SETTLED_FROM:
                row["settled_p25"], row["settled_ratio"], row["settled_p75"] = quantiles(settled_ratios[run])
            rows.append(row)

    elapsed = time.perf_counter() - started
    device = torch.device("cpu")
    settings = {"spec": args.spec, "rest": args.rest, "batch": args.batch, "img_size": args.img_size,
                "steps": args.steps, "rounds": args.rounds, "optimizer": "AdamW", "amp": args.amp}
    header = header_lines(device, args.threads, 0, elapsed, settings, load_before)
    settled_too = args.steps >= SETTLED_FROM
    body = ["Peaks are VmHWM of fresh processes (median over rounds); x lower is against plain as a user runs it. "
            "Step time: median over rounds of the run's median step over plain's in the same round (quartiles)"
            + ("; settled: the same over the last half of each process's steps." if settled_too else "."), "",
            "| model | run | peak RSS | x lower than plain | step time vs plain (p25-p75) |"
            + (" settled (p25-p75) |" if settled_too else ""), "|---|---|---:|---:|---:|" + ("---:|" if settled_too else "")]
    for row in rows:
        line = (f"| {row['model']} | {row['run']} | {row['peak_mib']:.0f} MiB | {row['x_lower']:.2f}x | "
                f"{row['time_ratio']:.2f}x ({row['time_p25']:.2f}-{row['time_p75']:.2f}) |")
        if settled_too:
            line += f" {row['settled_ratio']:.2f}x ({row['settled_p25']:.2f}-{row['settled_p75']:.2f}) |"
        body.append(line)
    columns = ["model", "run", "peak_mib", "x_lower", "time_ratio", "time_p25", "time_p75"]
    columns += ["settled_ratio", "settled_p25", "settled_p75"] if settled_too else []
    write_results("user_peak", device, args.threads, header, "The memory a user gets: peak RSS as a user's script runs",
                  body, rows, columns, Path(args.out))


if __name__ == "__main__":
    main()
