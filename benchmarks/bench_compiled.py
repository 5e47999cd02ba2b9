"""A ``torch.compile`` d training step with compression inside the compiled graphs, beside the
compiled plain step and Inductor's own fp8 activation pass.

    python benchmarks/bench_compiled.py                      # ViT-S, batch 16, 128 px, 2 threads
    python benchmarks/bench_compiled.py --rounds 5 --configs plain actcomp-8bit

Every measurement is a fresh process (``compiled_probe.py``); the configurations run in turn, the
order rotating round to round, and each round's ratios are taken against that round's plain
step. Each configuration runs twice a round: once with ``MALLOC_MMAP_THRESHOLD_=65536`` (RSS
follows live memory) for the peak and the first call, then with the allocator as users have it
for the step time (the threshold makes every freed block of over 64 KiB go back to the system,
so each new one costs page faults: it took ViT-S's compress_in_graph step from 1.15x to 1.4x
plain's, its extern codec calls allocating where Inductor's generated code reuses buffers).
Reported: the median over rounds of the step time over plain (and under the threshold), the
step's peak RSS above what it starts from (parameters and optimizer state, no gradients) and
plain's peak over it; on a CPU two measures the allocator does not move, since the RSS peak counts
only the pages the step touches beyond those resident before it, and glibc's heap holds 6-11 MiB
free from the compile and the earlier steps, different in each process (one configuration's peak
moved by up to 3 MiB between processes): the RSS peak from a start with that free heap handed back
(``malloc_trim``), and the peak of the step's live tensors (the profiler's allocation events);
and the first call's time (the compile): cold in the first round (Inductor's
and Triton's caches in a fresh directory), with the caches warm in the last.

- ``plain``: ``torch.compile(model)``;
- ``fp8-pass``: Inductor's ``activation_quantization_aten_pass`` (saved fp32 activations of at
  least 1 MiB as scaled fp8 e5m2);
- ``actcomp-8bit`` / ``actcomp-4bit`` / ``actcomp-exact``: ``actcomp.compress_in_graph("int8",
  rest="8bit")``, ``("int4", rest="4bit")``, ``(None, rest="exact")`` around the forward;
- ``converted-8bit``: ``torch.compile(actcomp.to_compressed(model, "int8", rest="8bit"))``, as users
  write it (the model's forward compiles under compress_in_graph's hooks with its rest policy).

``--mode reduce-overhead`` compiles every configuration so (CUDA graphs on CUDA: stop 52's H200 ran
``compress_in_graph`` at 1.33x the compiled plain step, where the eager converted steps waited on
the host for half their time; this says how much of that the host's launches are).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import REPO_ROOT, benchmark_parser, header_lines, load_average, write_results

from actcomp.tools.probe import run_probe

PROBE = Path(__file__).with_name("compiled_probe.py")
CONFIGS = ["plain", "fp8-pass", "actcomp-8bit", "actcomp-4bit", "actcomp-exact", "converted-8bit"]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="vit_small_patch16_224", help="timm model name")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per configuration")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process (after two warm-up steps)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--img-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda (peak allocated, step synchronized)")
    parser.add_argument("--mode", default="default", choices=["default", "reduce-overhead"],
                        help="torch.compile's mode for every configuration (reduce-overhead: CUDA graphs, "
                             "which leave the host's launches out of a CUDA step)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    configs = ["plain"] + [name for name in args.configs if name != "plain"]
    start, load_before = time.time(), load_average()
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for index in range(args.rounds):
        order = configs[index % len(configs):] + configs[:index % len(configs)]
        for name in order:
            program = [str(PROBE), "--model", args.model, "--config", name, "--batch", str(args.batch),
                       "--img-size", str(args.img_size), "--steps", str(args.steps), "--threads", str(args.threads),
                       "--device", args.device, "--mode", args.mode]
            with tempfile.TemporaryDirectory() as fresh:
                # The first round compiles truly cold: Inductor's and Triton's caches in a fresh
                # directory (the default one holds what earlier runs compiled, of plain's graphs too).
                cold = {"TORCHINDUCTOR_CACHE_DIR": fresh, "TRITON_CACHE_DIR": os.path.join(fresh, "triton")} \
                    if index == 0 else {}
                peak = run_probe(program, what=f"compiled step probe ({name})", package_root=str(REPO_ROOT),
                                 env={"MALLOC_MMAP_THRESHOLD_": "65536", **cold}, timeout=1800)
            # On CUDA the host allocator does not hold the activations: one process.
            timed = peak if args.device != "cpu" else run_probe(
                program, what=f"compiled step probe ({name})", package_root=str(REPO_ROOT),
                env={"MALLOC_MMAP_THRESHOLD_": None}, timeout=1800)
            runs[name].append({**peak, "threshold_step_s": peak["step_s"], "step_s": timed["step_s"]})
            print(f"round {index + 1} {name}: {timed['step_s']:.3f} s ({peak['step_s']:.3f} s under the threshold), "
                  f"{peak['peak_bytes'] / 2**20:.0f} MiB", flush=True)
    rows = []
    for name in configs:
        ratios = [run["step_s"] / plain["step_s"] for run, plain in zip(runs[name], runs["plain"])]
        peak = statistics.median(run["peak_bytes"] for run in runs[name])
        live = statistics.median(run["live_peak_bytes"] for run in runs[name])
        trimmed = statistics.median(run["trimmed_peak_bytes"] for run in runs[name])
        threshold = [run["threshold_step_s"] / plain["threshold_step_s"] for run, plain in zip(runs[name], runs["plain"])]
        rows.append({"config": name, "step_over_plain": statistics.median(ratios),
                     "threshold_step_over_plain": statistics.median(threshold), "peak_mib": peak / 2**20,
                     "trimmed_peak_mib": trimmed / 2**20, "live_peak_mib": live / 2**20,
                     "plain_peak_over_peak": statistics.median(runs["plain"][0]["peak_bytes"] / run["peak_bytes"]
                                                               for run in runs[name]),
                     "first_call_s": runs[name][0]["compile_s"], "warm_first_call_s": runs[name][-1]["compile_s"]})
    header = header_lines(torch.device(args.device), args.threads, 0, time.time() - start,
                          {"model": args.model, "batch": args.batch, "img_size": args.img_size, "rounds": args.rounds,
                           "steps": args.steps, "mode": args.mode}, load_before)
    body = ["| configuration | step / compiled plain | the same, 64 KiB mmap threshold | step peak above start "
            "| plain peak / peak | the same, free heap trimmed first | live tensors' peak | first call, cold "
            "| first call, warm cache |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    body += [f"| `{r['config']}` | **{r['step_over_plain']:.2f}x** | {r['threshold_step_over_plain']:.2f}x | "
             f"{r['peak_mib']:.0f} MiB | "
             f"{r['plain_peak_over_peak']:.2f}x | {r['trimmed_peak_mib']:.0f} MiB | {r['live_peak_mib']:.1f} MiB | "
             f"{r['first_call_s']:.0f} s | {r['warm_first_call_s']:.0f} s |" for r in rows]
    print("\n".join(body))
    write_results("compiled" if args.mode == "default" else f"compiled_{args.mode.replace('-', '_')}",
                  torch.device(args.device), args.threads, header,
                  f"Compiled training step of {args.model}: compression inside the graph", body, rows, list(rows[0]),
                  args.out_dir)


if __name__ == "__main__":
    main()
