"""The longest sequence a Llama-shaped model trains on in a memory budget: plain against actcomp.

    python benchmarks/bench_lm_longest.py                  # fp32, 4 GiB, 2 threads: ~20 minutes
    python benchmarks/bench_lm_longest.py --methods plain --budget 2GiB --layers 2   # a check

The model, batch and methods of ``bench_lm_loss.py`` (hidden 512, 8 layers, vocabulary 32,000,
AdamW, batch 1). Each probe is a fresh process running two training steps at one sequence
length (``bench_lm_loss.py --probe``), its peak read from VmHWM (glibc as it comes unless ``--allocator tuned``).
The search doubles the length from ``--start`` until a step passes the budget (or the length
passes ``--max-tokens``: then the result is "at least" the last length that fit), then bisects
until the longest length that fits and the shortest that does not are within ``--tolerance``
(lengths in multiples of 256). Every probe is listed in the results file.

Writes ``benchmarks/results/lm_longest_<budget>_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from bench_lm_loss import DTYPES, METHODS, add_model_arguments, step_peaks
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

from actcomp.tools.memory import parse_bytes

STEP = 256
COLUMNS = ["dtype", "method", "longest_tokens", "its_peak_mib", "shortest_over", "x_plain", "probes"]


def longest(args, dtype: str, method: str, budget: int) -> tuple[int, int, int | None, list]:
    probes = []

    def fits(tokens: int) -> bool:
        value = step_peaks(args, dtype, method, tokens)["peak"]
        probes.append((tokens, value))
        print(f"  {dtype} {method} {tokens} tokens: {value / 2**20:.0f} MiB{'' if value <= budget else ' (over)'}",
              flush=True)
        return value <= budget

    low, high = 0, args.start
    while fits(high):
        low, high = high, high * 2
        if high > args.max_tokens:  # attention's time grows with the square of the length
            return low, dict(probes)[low], None, probes
    if low == 0:
        raise SystemExit(f"{method}: even {args.start} tokens pass the budget")
    while high - low > max(STEP, args.tolerance * low):
        middle = (low + high) // 2 // STEP * STEP
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, dict(probes)[low], high, probes


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--methods", nargs="+", default=["plain", "actcomp-8bit"], choices=METHODS)
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--budget", default="4GiB")
    parser.add_argument("--start", type=int, default=2048)
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=16_384,
                        help="stop doubling past this length (a step at 32k tokens takes minutes here)")
    add_model_arguments(parser)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    budget = parse_bytes(args.budget)
    load_before, started = load_average(), time.perf_counter()
    rows = []
    for method in args.methods:
        tokens, its_peak, over, probes = longest(args, args.dtype, method, budget)
        rows.append({"dtype": args.dtype, "method": method, "longest_tokens": tokens, "its_peak_mib": its_peak / 2**20,
                     "shortest_over": over, "probes": " ".join(f"{t}:{p / 2**20:.0f}" for t, p in probes)})
    plain = next((row["longest_tokens"] for row in rows if row["method"] == "plain"), None)
    for row in rows:
        row["x_plain"] = row["longest_tokens"] / plain if plain else float("nan")
    body = [f"Llama-shaped: hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocabulary}, batch 1, "
            f"AdamW, {args.dtype}. The longest sequence (a multiple of {STEP}) whose training step peaks within "
            f"{args.budget} of process memory (VmHWM, fresh process per probe).", "",
            "| method | longest sequence | its peak | x plain's | shortest over |", "|---|---:|---:|---:|---:|"]
    for row in rows:
        at_least = "≥ " if row["shortest_over"] is None else ""
        body.append(f"| {row['method']} | **{at_least}{row['longest_tokens']}** | {row['its_peak_mib']:.0f} MiB "
                    f"| {at_least}{row['x_plain']:.2f}x | {row['shortest_over'] or 'not searched'} |")
    body += ["", "Probes (tokens:peak MiB, in order):", ""] + [f"- {row['method']}: {row['probes']}" for row in rows]
    device = torch.device("cpu")
    settings = {"budget": args.budget, "dtype": args.dtype, "tolerance": args.tolerance}
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, settings, load_before)
    write_results(f"lm_longest_{args.budget}", device, args.threads, header,
                  f"The longest sequence in {args.budget}: plain against actcomp", body, rows, COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
