"""What ``plan_budget``'s op-kind rungs cost: a step per rung (the search until stop 61) against one
forward packed under every rung's policy with a backward per rung (``_Search.kind_errors``).

    python benchmarks/bench_kind_rungs.py            # ~4 minutes on 2 cores

For each model of ``bench_budget.py`` (its batches: 8 images at 224 px, the Llama-shaped model's
2 x 256 tokens; ``--models`` also takes the 8-layer Llama of 2048 tokens), every rung of
``KIND_SPECS`` of every lossy op kind the model saves is measured both ways on the rows (or
tokens) the search measures errors on, in rounds whose order rotates (``common.time_rounds``),
beside one plain step on the whole batch, the unit. The step per rung is written here as the
search wrote it (a deep copy converted with the rung's ``rest``, its gradients copied to float64,
the squared error in float64); both ways must give the same errors (to 1e-6, relative), or the
benchmark stops.

Writes ``benchmarks/results/kind_rungs_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from bench_budget import DEFAULT_MODELS, build
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, time_rounds, write_results

import actcomp
from actcomp.tools import budget
from actcomp.tools.user_batch import UserBatch, copy_model

COLUMNS = ["model", "errors_on", "rungs", "step_per_rung", "one_forward", "ratio"]


def rungs_of(search: budget._Search) -> list[tuple[str, str]]:
    """Every (kind, spec) the search could want: each lossy kind's rungs that keep fewer bytes."""
    parts, _ = search.parts()
    return [(part.name, option.spec) for part in parts if part.kind == "kind" for option in part.options[1:]]


def step_per_rung(search: budget._Search, model: torch.nn.Module, rungs: list[tuple[str, str]]) -> list[float]:
    """The errors as the search measured them until stop 61: one converted copy and step per rung."""
    errors = []
    for kind, spec in rungs:
        rest = budget._kinds_alone({kind: spec}, search.attention_floors)
        got = search.measured.gradients(actcomp.to_compressed(copy_model(model), "mink0", rest=rest, loss=search.loss))
        errors.append(sum(float((got[name] - grad).square().sum())
                          for name, grad in search.measured_reference.items()) / search.norm)
    return errors


def measured(name: str, rounds: int) -> dict:
    """One model's row: both ways' errors checked equal, then timed in rotating rounds."""
    model, batch = build(name)
    search = budget._Search(model, UserBatch(batch), budget.LAYER_SPECS, budget.KIND_SPECS)
    rungs = rungs_of(search)
    old, new = step_per_rung(search, model, rungs), search.kind_errors(rungs)
    for rung, before, after in zip(rungs, old, new):
        if abs(after - before) > 1e-6 * abs(before):
            raise SystemExit(f"{name} {rung}: the two ways disagree ({before!r} against {after!r})")
    times = time_rounds({"plain": lambda: search.run.gradients(copy_model(model)),
                         "old": lambda: step_per_rung(search, model, rungs),
                         "new": lambda: search.kind_errors(rungs)}, rounds, 1, torch.device("cpu"))
    plain = statistics.median(times["plain"])
    return {"model": name, "errors_on": search.errors_on, "rungs": len(rungs),
            "step_per_rung": statistics.median(times["old"]) / plain,
            "one_forward": statistics.median(times["new"]) / plain,
            "ratio": statistics.median(after / before for before, after in zip(times["old"], times["new"]))}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    rows, body = [], ["Each op-kind rung's error measured a step per rung, then with one forward and a backward per "
                      "rung: seconds for all of a model's rungs over one plain step's on the whole batch (median of "
                      f"{args.rounds} rounds, each round timing the three in turn), and the second over the first "
                      "round by round (median).", "",
                      "| model | errors on | rungs | a step per rung | one forward | ratio |",
                      "|---|---|---:|---:|---:|---:|"]
    for name in args.models:
        row = measured(name, args.rounds)
        rows.append(row)
        body.append(f"| {name} | {row['errors_on']} | {row['rungs']} | {row['step_per_rung']:.2f} | "
                    f"{row['one_forward']:.2f} | {row['ratio']:.2f}x |")
        print(f"{name}: {row['rungs']} rungs on {row['errors_on']}: a step each {row['step_per_rung']:.2f}, one "
              f"forward {row['one_forward']:.2f} plain steps ({row['ratio']:.2f}x)", flush=True)
    elapsed = time.perf_counter() - started
    header = header_lines(torch.device("cpu"), args.threads, 0, elapsed, {"rounds": args.rounds}, load_before)
    write_results("kind_rungs", torch.device("cpu"), args.threads, header,
                  "The budget search's op-kind rungs: a step each against one forward", body, rows, COLUMNS,
                  Path(args.out))


if __name__ == "__main__":
    main()
