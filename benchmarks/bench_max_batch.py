"""Largest batch in a memory budget: plain, per-block checkpointing and actcomp, fresh processes.

    python benchmarks/bench_max_batch.py --models resnet50   # 4 GiB, 1 thread: 26 minutes (ViT-S: 49) beside another process
    python benchmarks/bench_max_batch.py --models resnet18 --img-size 64 --budget 1GiB   # check: ~3 minutes

For each timm model (224 px, fp32, 10 classes, AdamW), :func:`actcomp.tools.max_batch.largest_batch` finds
the largest batch whose training step peaks at most ``--budget`` (VmHWM of a fresh process per
probe, AdamW, glibc's allocator as a user's process gets it; a step at batch 2 first, so the measured step starts with
its gradients allocated, as every step after the first does): an affine first guess from
batches 16 and 32 (smaller ones overrate the slope: the process itself dominates their peak), a
doubling walk, then bisection until the largest batch that fits and the smallest that does not
are within 3%. Configurations as in ``bench_frontier.py``: by default
``plain``, ``whole`` (``to_compressed(model, SPEC, rest=REST)``) and ``checkpoint`` (timm's
per-block, non-reentrant); ``linear`` and ``checkpoint+whole`` on request. Every probe is
listed in the results file.

Writes ``benchmarks/results/max_batch_<budget>_<models>_<torch>_cpu_t<threads>.{md,csv}``; run one
process per model (``--models resnet50``) to search them in parallel.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from bench_frontier import METHODS
from common import RESULTS_DIR, benchmark_parser, check_specs, header_lines, load_average, write_results

from actcomp.tools.max_batch import largest_batch
from actcomp.tools.memory import format_bytes, parse_bytes


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["vit_small_patch16_224", "resnet50"])
    parser.add_argument("--budget", default="4GiB")
    parser.add_argument("--spec", default="mink0.9+int8", help="Linear/Conv pipeline")
    parser.add_argument("--rest", default="8bit", help="whole-model policy")
    parser.add_argument("--methods", nargs="+", default=["plain", "whole", "checkpoint"],
                        choices=list(METHODS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1, help="full-size steps per probe, after one at batch 1")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    check_specs(parser, [args.spec])
    budget = parse_bytes(args.budget)
    load_before, started = load_average(), time.perf_counter()

    rows = []
    for model_name in args.models:
        for method in args.methods:
            compress, whole, checkpoint = METHODS[method]
            began = time.perf_counter()
            search = largest_batch(model_name, args.spec if compress else None, rest=args.rest if whole else None,
                                   checkpoint=checkpoint, budget=budget, img_size=args.img_size, steps=args.steps,
                                   threads=args.threads,
                                   progress=lambda batch, peak, fits, model_name=model_name, method=method: print(
                                       f"  {model_name} {method} batch {batch}: {format_bytes(peak)}"
                                       f"{'' if fits else ' (over)'}", flush=True))
            rows.append({"model": model_name, "method": method, "batch": search.batch, "peak_mib": search.peak / 2**20,
                         "smallest_over": search.smallest_over, "probes": " ".join(
                             f"{batch}:{peak / 2**20:.0f}" for batch, peak in search.probes),
                         "search_s": time.perf_counter() - began})
            print(f"{model_name} {method}: batch {search.batch} ({format_bytes(search.peak)})", flush=True)

    device = torch.device("cpu")
    settings = {"budget": f"{args.budget} ({budget} bytes)", "spec": args.spec, "rest": args.rest,
                "img_size": args.img_size, "steps per probe": args.steps}
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, settings, load_before)
    body = ["| model | method | largest batch | its peak | x plain's batch | smallest batch over | search |",
            "|---|---|---|---|---|---|---|"]
    for row in rows:
        plain = next(r["batch"] for r in rows if r["model"] == row["model"] and r["method"] == "plain") \
            if "plain" in args.methods else None
        ratio = f"{row['batch'] / plain:.2f}x" if plain else "-"
        body.append(f"| {row['model']} | {row['method']} | {row['batch']} | {row['peak_mib']:.0f} MiB | {ratio} | "
                    f"{row['smallest_over']} | {row['search_s'] / 60:.1f} min |")
    body += ["", "Probes (batch:peak MiB, in order):", ""]
    body += [f"- {row['model']} {row['method']}: {row['probes']}" for row in rows]
    columns = ["model", "method", "batch", "peak_mib", "smallest_over", "probes", "search_s"]
    # One file per model set, so models can be searched in parallel processes.
    models = "_".join(name.split("_")[0] for name in args.models)
    write_results(f"max_batch_{args.budget.replace(' ', '')}_{models}", device, args.threads, header,
                  f"Largest batch whose training step peaks under {args.budget}", body, rows, columns,
                  Path(args.out))


if __name__ == "__main__":
    main()
