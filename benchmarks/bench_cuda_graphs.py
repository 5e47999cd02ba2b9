"""Training steps replayed from CUDA graphs: what a converted step costs once the host is out of it.

    python benchmarks/bench_cuda_graphs.py                       # resnet50 and ViT-S, batch 64, 224 px
    python benchmarks/bench_cuda_graphs.py --models resnet18 --batch 8 --rounds 2   # a check

Stop 52's H200 profile found a converted step's device idle 48-68% of the time, waiting on the
host's Python and Triton's launches (``gpu_profile.py``). A CUDA graph captured from one step
replays its kernels without the host: PyTorch's whole-network recipe (a few steps on a side
stream, then one step, SGD's included, captured with ``torch.cuda.graph``; a batch is copied
into the captured inputs before each replay). ``tests/core/test_cuda_graphs.py`` checks that a
converted step's replay gives an eager step's gradients.

Each model, plain and converted (``SPEC`` or ``SPEC@REST`` as in ``bench_training_speed.py``),
runs eagerly and from its graph, in interleaved rounds of ``--steps`` steps each; reported, as
medians over rounds: each step's time over plain's eager step and over plain's replayed step in
the same round; and the captured step's peak allocation above what was allocated before it (a
replay's step peak: whether the graph keeps actcomp's memory saving). A configuration whose
capture fails says why in its row.

Writes ``benchmarks/results/cuda_graphs_<torch>_cuda_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from bench_training_speed import TOKEN_MODELS, create_workload, step_fn
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp

COLUMNS = ["model", "spec", "eager_over_plain", "replay_over_plain", "replay_over_plain_replay", "replay_over_eager",
           "eager_ms", "replay_ms", "capture_peak_mib", "note"]


def graphed(step) -> tuple[callable, int]:
    """``step`` captured into a CUDA graph after three warm-up steps on a side stream; returns
    the replay (the step's inputs are the tensors it was captured with) and the bytes the capture
    allocated at its peak above what was allocated before it: the step's peak as a replay has it
    (the graph's pool keeps what the captured step allocated, reused within the step as eagerly)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay, torch.cuda.max_memory_allocated() - before


def timed(call, steps: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def bench_model(name: str, specs: list[str], args, device: torch.device) -> list[dict]:
    torch.manual_seed(args.seed)
    plain, inputs, loss = create_workload(name, args, device)
    models = {"plain": plain}
    for spec in specs:
        linear, _, rest = spec.partition("@")
        first_layer = None if name in TOKEN_MODELS else "auto"
        models[spec] = actcomp.to_compressed(copy.deepcopy(plain), linear, rest=rest or None, first_layer=first_layer,
                                             return_freed_memory=False)
    autocast = torch.bfloat16 if args.autocast == "bf16" and name not in TOKEN_MODELS else None
    eager = {label: step_fn(model, inputs, loss, autocast) for label, model in models.items()}
    replays, notes, peaks = {}, {}, {}
    for label, model in models.items():
        try:
            replays[label], peaks[label] = graphed(step_fn(copy.deepcopy(model), inputs, loss, autocast))
        except Exception as error:  # noqa: BLE001 - a failed capture is a result, said in its row
            notes[label] = f"capture failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
    for step in eager.values():
        step()
    times = {(label, how): [] for label in models for how in ("eager", "replay")}
    for _ in range(args.rounds):
        for label in models:
            times[label, "eager"].append(timed(eager[label], args.steps))
            if label in replays:
                times[label, "replay"].append(timed(replays[label], args.steps))
    rows = []
    for label in specs:
        row = {"model": name, "spec": label, "note": notes.get(label, "")}

        def ratio(a, b):
            if not times[a] or not times[b]:
                return float("nan")
            return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

        row["eager_over_plain"] = ratio((label, "eager"), ("plain", "eager"))
        row["replay_over_plain"] = ratio((label, "replay"), ("plain", "eager"))
        row["replay_over_plain_replay"] = ratio((label, "replay"), ("plain", "replay"))
        row["replay_over_eager"] = ratio((label, "replay"), (label, "eager"))
        row["eager_ms"] = statistics.median(times[label, "eager"]) * 1e3
        row["replay_ms"] = statistics.median(times[label, "replay"]) * 1e3 if times[label, "replay"] else float("nan")
        row["capture_peak_mib"] = peaks[label] / 2**20 if label in peaks else float("nan")
        rows.append(row)
    plain_row = {"model": name, "spec": "plain", "note": notes.get("plain", ""), "eager_over_plain": 1.0,
                 "replay_over_plain": statistics.median(r / e for r, e in zip(times["plain", "replay"],
                                                                              times["plain", "eager"], strict=False))
                 if times["plain", "replay"] else float("nan"),
                 "replay_over_plain_replay": 1.0, "eager_ms": statistics.median(times["plain", "eager"]) * 1e3,
                 "replay_ms": statistics.median(times["plain", "replay"]) * 1e3 if times["plain", "replay"]
                 else float("nan"), "capture_peak_mib": peaks["plain"] / 2**20 if "plain" in peaks else float("nan")}
    plain_row["replay_over_eager"] = plain_row["replay_over_plain"]
    return [plain_row, *rows]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_small_patch16_224"])
    parser.add_argument("--specs", nargs="+", default=["int8", "int8@8bit", "mink0.9+int8@8bit"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps a round, each way")
    parser.add_argument("--autocast", choices=["none", "bf16"], default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    load_before, started = load_average(), time.perf_counter()
    rows = [row for name in args.models for row in bench_model(name, args.specs, args, torch.device("cuda"))]
    body = ["`eager`: the step as it runs; `replay`: the same step replayed from a CUDA graph. Ratios are medians "
            "over interleaved rounds of (the row's step time / the reference's in the same round).", "",
            "| model | spec | eager / plain eager | replay / plain eager | replay / plain replay | replay / its eager "
            "| eager ms | replay ms | captured step's peak MiB | note |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    body += [f"| {r['model']} | `{r['spec']}` | {r['eager_over_plain']:.2f}x | {r['replay_over_plain']:.2f}x | "
             f"**{r['replay_over_plain_replay']:.2f}x** | {r['replay_over_eager']:.2f}x | {r['eager_ms']:.1f} | "
             f"{r['replay_ms']:.1f} | {r['capture_peak_mib']:.0f} | {r['note']} |" for r in rows]
    device = torch.device("cuda")
    header = header_lines(device, torch.get_num_threads(), args.seed, time.perf_counter() - started,
                          {"batch": args.batch, "img_size": args.img_size, "rounds": args.rounds, "steps": args.steps,
                           "autocast": args.autocast}, load_before)
    write_results(f"cuda_graphs_b{args.batch}_img{args.img_size}" + ("_bf16autocast" if args.autocast == "bf16" else ""),
                  device, torch.get_num_threads(), header, "Training steps replayed from CUDA graphs", body, rows,
                  COLUMNS, args.out_dir)


if __name__ == "__main__":
    main()
