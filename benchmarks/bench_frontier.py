"""Memory-time frontier: peak process memory and step time of plain, checkpointing and actcomp.

    python benchmarks/bench_frontier.py --threads 1   # the README's run: 41 minutes, another process on the other core
    python benchmarks/bench_frontier.py --models resnet18 --batches 4 8 --rounds 2   # check: ~2 minutes

For each timm model (224 px, fp32, 10 classes, SGD) and batch size, five ways to train:

- ``plain``: plain PyTorch;
- ``checkpoint``: timm's per-block activation checkpointing (``model.set_grad_checkpointing()``,
  non-reentrant ``torch.utils.checkpoint``: each block's forward runs again in backward);
- ``linear``: ``to_compressed(model, SPEC)``, Linear/Conv inputs only;
- ``whole``: ``to_compressed(model, SPEC, rest=REST)``, every saved tensor;
- ``checkpoint+whole``: both: checkpointed blocks store nothing, whole-model mode compresses
  what lies outside them (the stem, the head) and checkpoint's stored block inputs stay as they are.

1. **Peak memory**: VmHWM of ``--steps`` training steps, each configuration in a fresh process
   (:func:`actcomp.tools.peak_rss.peak_rss`: AdamW, glibc's allocator as a user's process gets it), on ``--threads`` threads.
2. **Step time**: every configuration of one model and batch lives in one process, is built from
   the same seeded weights and trains on the same batch; one step of each per round, in rotating
   order (``common.time_rounds``); the ratio is the median over rounds of (configuration step /
   plain step in the same round), with quartiles.

Writes ``benchmarks/results/frontier_<torch>_cpu_t<threads>.{md,csv,png}``; the PNG plots peak
memory against step time, one point per configuration and batch.
"""

from __future__ import annotations

import time
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from common import (
    RESULTS_DIR,
    benchmark_parser,
    check_specs,
    header_lines,
    load_average,
    ratio_summary,
    results_stem,
    time_rounds,
    write_results,
)

import actcomp
from actcomp.tools.memory import format_bytes
from actcomp.tools.peak_rss import peak_rss
from actcomp.tools.plotting import pyplot_for

# name -> (compress Linear/Conv?, rest?, checkpoint?)
METHODS = {
    "plain": (False, False, False),
    "checkpoint": (False, False, True),
    "linear": (True, False, False),
    "whole": (True, True, False),
    "checkpoint+whole": (True, True, True),
}


def build(model_name: str, method: str, spec: str, rest: str) -> torch.nn.Module:
    compress, whole, checkpoint = METHODS[method]
    torch.manual_seed(0)
    model = timm.create_model(model_name, pretrained=False, num_classes=10)
    if checkpoint:
        timm.layers.set_reentrant_ckpt(False)
        model.set_grad_checkpointing(True)
    if compress:
        actcomp.to_compressed(model, spec, rest=rest if whole else None)
    return model.train()


def training_step(model: torch.nn.Module, optimizer, images: torch.Tensor, labels: torch.Tensor):
    def step():
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["vit_small_patch16_224", "resnet50"])
    parser.add_argument("--batches", nargs="+", type=int, default=[16, 32])
    parser.add_argument("--spec", default="mink0.9+int8", help="Linear/Conv pipeline")
    parser.add_argument("--rest", default="8bit", help="whole-model policy")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="training steps per peak-memory probe")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    check_specs(parser, [args.spec])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_path = out / f"{results_stem('frontier', torch.device('cpu'), args.threads)}.png"
    try:
        # Checked before the hours of measuring, not after.
        plt = None if args.skip_time else pyplot_for(str(plot_path), where="the frontier plot")
    except actcomp.ActcompError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()

    rows = []
    for model_name in args.models:
        for batch in args.batches:
            peaks = {}
            for method in args.methods:
                compress, whole, checkpoint = METHODS[method]
                peaks[method] = peak_rss(model_name, args.spec if compress else None, rest=args.rest if whole else None,
                                         checkpoint=checkpoint, batch=batch, img_size=args.img_size, steps=args.steps,
                                         threads=args.threads)
                print(f"{model_name} batch {batch} {method}: peak {format_bytes(peaks[method])}", flush=True)
            summaries = {method: {} for method in args.methods}
            if not args.skip_time:
                models = {method: build(model_name, method, args.spec, args.rest) for method in args.methods}
                images = torch.randn(batch, 3, args.img_size, args.img_size, generator=torch.Generator().manual_seed(1))
                labels = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(2))
                steps = {method: training_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), images, labels)
                         for method, model in models.items()}
                times = time_rounds(steps, args.rounds, args.warmup, torch.device("cpu"),
                                    lambda index, seconds: print(f"  round {index}: " + ", ".join(
                                        f"{name} {value:.2f} s" for name, value in seconds.items()), flush=True))
                summaries = {method: ratio_summary(times[method], times["plain"]) for method in args.methods}
                del models, steps
            for method in args.methods:
                rows.append({"model": model_name, "batch": batch, "method": method, "peak_mib": peaks[method] / 2**20,
                             "peak_x_less": peaks["plain"] / peaks[method], **summaries[method]})

    elapsed = time.perf_counter() - started
    device = torch.device("cpu")
    settings = {"spec": args.spec, "rest": args.rest, "batches": args.batches, "img_size": args.img_size,
                "peak steps": args.steps, "rounds": args.rounds, "warmup": args.warmup}
    header = header_lines(device, args.threads, 0, elapsed, settings, load_before)
    body = ["| model | batch | method | peak RSS | x less than plain | step time vs plain (p25-p75) |",
            "|---|---|---|---|---|---|"]
    for row in rows:
        timing = (f"{row['ratio']:.2f}x ({row['ratio_p25']:.2f}-{row['ratio_p75']:.2f})" if "ratio" in row else "-")
        body.append(f"| {row['model']} | {row['batch']} | {row['method']} | {row['peak_mib']:.0f} MiB | "
                    f"{row['peak_x_less']:.2f}x | {timing} |")
    columns = ["model", "batch", "method", "peak_mib", "peak_x_less", "ratio", "ratio_p25", "ratio_p75", "ratio_best",
               "median_s"]
    write_results("frontier", device, args.threads, header, "Peak memory vs step time: plain, checkpointing, actcomp",
                  body, rows, columns, out)
    if plt is not None:
        plot(plt, rows, plot_path, args)


def plot(plt, rows: list[dict], path, args) -> None:
    models = list(dict.fromkeys(row["model"] for row in rows))
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    markers = dict(zip(METHODS, "osD^v"))
    for axis, model_name in zip(axes[0], models):
        for batch, color in zip(args.batches, ["tab:blue", "tab:orange", "tab:green", "tab:red"]):
            points = [row for row in rows if row["model"] == model_name and row["batch"] == batch]
            for row in points:
                axis.scatter(row["ratio"], row["peak_mib"] / 1024, marker=markers[row["method"]], color=color, s=60,
                             label=f"batch {batch}" if row["method"] == "plain" else None)
                axis.annotate(row["method"], (row["ratio"], row["peak_mib"] / 1024), textcoords="offset points",
                              xytext=(5, 4), fontsize=8)
        axis.set_xlabel("step time vs plain (lower is faster)")
        axis.set_ylabel("peak process memory (GiB)")
        axis.set_title(f"{model_name}, 224 px, fp32, {args.threads} CPU threads")
        axis.grid(alpha=0.3)
        axis.legend(loc="upper right")
    figure.suptitle(f"actcomp {args.spec!r} rest={args.rest!r} vs plain and per-block checkpointing")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
