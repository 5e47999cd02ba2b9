"""Peak GPU memory of a training step: plain, per-block checkpointing and actcomp, fresh processes.

    python benchmarks/bench_gpu_peak.py                                 # resnet50 and ViT-S, batch 64
    python benchmarks/bench_gpu_peak.py --models resnet18 --batch 8     # a check

Each (model, method) runs in a process of its own on ``cuda``: the model built as
``bench_training_speed.py`` builds it, one step (gradients and SGD momentum allocated, the
steady state), then one measured step. Reported: ``torch.cuda.max_memory_allocated`` above
``memory_allocated`` at the measured step's start (what the step itself adds: the activations
kept for backward and the temporaries), the process's allocated peak, and its reserved peak
(``torch.cuda.max_memory_reserved``: what the caching allocator holds from the driver, what an
out-of-memory error and nvidia-smi see) with the reserved bytes it held beyond the allocated peak
(blocks split or cached that no tensor used: packed codes of odd sizes must not raise it above
plain's). The ratio against plain is given for both the step's allocated peak and the process's
reserved peak. Probes run a few at a
time: the allocator's counters are per process, so neighbours do not move them. Step times are
``bench_training_speed.py --device cuda``'s (interleaved in one process).

Methods: ``plain``; ``checkpoint`` (timm's ``set_grad_checkpointing()``, per block,
non-reentrant); ``SPEC@REST`` (``to_compressed(model, SPEC, rest=REST)``) and ``SPEC`` (Linear/Conv
mode); ``checkpoint+SPEC@REST`` (both). A ``REST`` of ``KIND=SPEC`` pairs (``other=int8``) is a
``rest`` mapping, which overrides the ``"8bit"`` preset for the kinds it names:
``checkpoint+mink0.9+int8@other=int8`` codes checkpoint's stored block inputs (kind ``other``) too.

Writes ``benchmarks/results/gpu_peak_<torch>_cuda_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from bench_training_speed import create_workload, step_fn
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.tools.probe import run_probe

DEFAULT_METHODS = ["plain", "checkpoint", "smink0.9+int8", "mink0.9+int8@8bit", "checkpoint+mink0.9+int8@8bit",
                   "checkpoint+mink0.9+int8@other=int8"]
COLUMNS = ["model", "batch", "img_size", "method", "step_peak_mib", "peak_vs_plain", "process_peak_mib",
           "reserved_peak_mib", "reserved_vs_plain", "reserved_slack_mib"]


def build(name: str, method: str, args: argparse.Namespace):
    """``step``: one training step of ``name`` converted as ``method`` says, on cuda."""
    torch.manual_seed(args.seed)
    model, inputs, loss = create_workload(name, args, torch.device("cuda"))
    if method.startswith("checkpoint"):
        model.set_grad_checkpointing(True)
        method = method.removeprefix("checkpoint").removeprefix("+") or "plain"
    if method != "plain":
        model = actcomp.to_compressed(copy.deepcopy(model), *_spec_and_rest(method))
    return step_fn(model, inputs, loss)


def _spec_and_rest(method: str) -> tuple[str, str | dict | None]:
    """``to_compressed``'s spec and ``rest`` from a method's ``SPEC@REST``.

    >>> _spec_and_rest("mink0.9+int8@other=int8,norm=int4")
    ('mink0.9+int8', {'other': 'int8', 'norm': 'int4'})
    >>> _spec_and_rest("int8")
    ('int8', None)
    """
    spec, _, rest = method.partition("@")
    if "=" in rest:
        return spec, dict(pair.split("=", 1) for pair in rest.split(","))
    return spec, rest or None


def probe(settings: dict) -> None:
    """One method's step peak, in this (fresh) process."""
    args = argparse.Namespace(**settings)
    step = build(args.model, args.method, args)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    # reset_peak_memory_stats sets the reserved peak to what is reserved now, which holds the first
    # step's cached blocks: max_memory_reserved is the process's reserved peak either way.
    print(json.dumps({"step_peak": torch.cuda.max_memory_allocated() - start,
                      "process_peak": torch.cuda.max_memory_allocated(),
                      "reserved_peak": torch.cuda.max_memory_reserved()}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        probe(json.loads(sys.argv[2]))
        return
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_small_patch16_224"])
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=4, help="probes at a time")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    if "plain" not in args.methods:
        parser.error("--methods needs plain: the ratios are against it")
    load_before, started = load_average(), time.perf_counter()
    jobs = [(name, method) for name in args.models for method in args.methods]

    def measure(job):
        name, method = job
        settings = {"model": name, "method": method, "batch": args.batch, "img_size": args.img_size, "seed": args.seed}
        result = run_probe([__file__, "--probe", json.dumps(settings)], what=f"{name} {method}")
        print(f"{name} {method}: step +{result['step_peak'] / 2**20:.0f} MiB", flush=True)
        return result

    with ThreadPoolExecutor(args.parallel) as pool:
        peaks = dict(zip(jobs, pool.map(measure, jobs)))
    rows = [{"model": name, "batch": args.batch, "img_size": args.img_size, "method": method,
             "step_peak_mib": peaks[name, method]["step_peak"] / 2**20,
             "peak_vs_plain": peaks[name, "plain"]["step_peak"] / peaks[name, method]["step_peak"],
             "process_peak_mib": peaks[name, method]["process_peak"] / 2**20,
             "reserved_peak_mib": peaks[name, method]["reserved_peak"] / 2**20,
             "reserved_vs_plain": peaks[name, "plain"]["reserved_peak"] / peaks[name, method]["reserved_peak"],
             "reserved_slack_mib": (peaks[name, method]["reserved_peak"] - peaks[name, method]["process_peak"]) / 2**20}
            for name, method in jobs]
    body = ["`step peak`: `torch.cuda.max_memory_allocated()` above `memory_allocated()` at the measured "
            "step's start, each method in a fresh process; `x plain`: plain's over the method's; "
            "`allocated` and `reserved`: the process's `max_memory_allocated()` and `max_memory_reserved()` "
            "(weights, gradients, momentum included; reserved is what an out-of-memory error and nvidia-smi see); "
            "`slack`: reserved beyond the allocated peak (the caching allocator's fragmentation).", "",
            "| model | method | step peak MiB | x plain | allocated MiB | reserved MiB | reserved x plain | slack MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    body += [f"| {row['model']} | {row['method']} | +{row['step_peak_mib']:.0f} | **{row['peak_vs_plain']:.2f}x** "
             f"| {row['process_peak_mib']:.0f} | {row['reserved_peak_mib']:.0f} | {row['reserved_vs_plain']:.2f}x "
             f"| {row['reserved_slack_mib']:.0f} |" for row in rows]
    device = torch.device("cuda")
    header = header_lines(device, torch.get_num_threads(), args.seed, time.perf_counter() - started,
                          {"batch": args.batch, "img_size": args.img_size}, load_before)
    write_results("gpu_peak", device, torch.get_num_threads(), header, "Peak GPU memory of a training step", body,
                  rows, COLUMNS, args.out_dir)


if __name__ == "__main__":
    main()
