"""Each codec's round trip, native and compiled, against its eager reference; the price of compiling.

    python benchmarks/bench_fused.py                    # defaults: 5-10 minutes on 2 cores (compiling)
    python benchmarks/bench_fused.py --specs int8 mink0.9+int8 --threads 1

For each spec and shape, the round trip ``decompress(compress(x))`` runs under the eager
backend (the reference), the native one (the default: C kernels where a codec has them), the
compiled one and a plain ``x.clone()`` in interleaved rounds (``actcomp.core.backends``); the
figures are medians of per-round ratios. The native and compiled codes are checked equal to
the eager ones first (a mismatch stops the benchmark). ``compile s`` is
the first compiled round trip of the spec in this process (Inductor's cache directory as the
environment leaves it: cold on a fresh machine, warm on a second run). These results are why
the backend's default is native, and compiled only on request.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from common import (
    RESULTS_DIR,
    add_specs_argument,
    benchmark_parser,
    check_specs,
    header_lines,
    load_average,
    quantiles,
    time_rounds,
    write_results,
)

import actcomp
from actcomp.core.backends import use_backend

DEFAULT_SPECS = ["int8", "int4", "int2", "fp16", "bf16", "fp8", "mink0.9", "smink0.9", "pmink0.9",
                 "channel0.9", "mink0.9+int8", "smink0.9+int8"]
DEFAULT_SHAPES = ["32x64x56x56", "32x197x384"]
COLUMNS = ["shape", "spec", "native_vs_eager", "compiled_vs_eager", "compiled_p25", "compiled_p75", "eager_vs_clone",
           "native_vs_clone", "compiled_vs_clone", "compile_s"]


def round_trip(pipeline: actcomp.Pipeline, x: torch.Tensor, backend: str):
    channel_dim = 1 if x.dim() >= 4 else -1

    def run() -> torch.Tensor:
        with use_backend(backend):
            return pipeline.decompress(pipeline.compress(x, channel_dim=channel_dim))
    return run


def codes(pipeline: actcomp.Pipeline, x: torch.Tensor, backend: str) -> tuple[torch.Tensor, ...]:
    with use_backend(backend):
        packed = pipeline.compress(x, channel_dim=1 if x.dim() >= 4 else -1)
        return (*packed.tensors, pipeline.decompress(packed))


def bench_one(x: torch.Tensor, spec: str, rounds: int, warmup: int) -> dict:
    pipeline = actcomp.parse(spec)
    started = time.perf_counter()
    compiled_codes = codes(pipeline, x, "compiled")
    compile_s = time.perf_counter() - started
    eager_codes = codes(pipeline, x, "eager")
    for backend, other in (("compiled", compiled_codes), ("native", codes(pipeline, x, "native"))):
        if len(other) != len(eager_codes) or not all(torch.equal(a, b) for a, b in zip(other, eager_codes)):
            raise RuntimeError(f"{spec}: {backend} codes differ from the eager ones")
    times = time_rounds({backend: round_trip(pipeline, x, backend) for backend in ("eager", "native", "compiled")}
                        | {"clone": x.clone}, rounds, warmup, x.device)

    def median_of(top: str, bottom: str) -> float:
        return quantiles([a / b for a, b in zip(times[top], times[bottom])])[1]

    p25, median, p75 = quantiles([c / e for c, e in zip(times["compiled"], times["eager"])])
    return {
        "shape": "x".join(map(str, x.shape)), "spec": spec, "native_vs_eager": median_of("native", "eager"),
        "compiled_vs_eager": median, "compiled_p25": p25, "compiled_p75": p75,
        "eager_vs_clone": median_of("eager", "clone"), "native_vs_clone": median_of("native", "clone"),
        "compiled_vs_clone": median_of("compiled", "clone"), "compile_s": compile_s,
    }


def markdown_body(rows: list[dict]) -> list[str]:
    lines = ["`native/eager`, `compiled/eager`: median over interleaved rounds of the native (C kernels, the "
             "default) and compiled round trip's time over the eager reference's (compiled: with the 25th-75th "
             "percentile); `x clone`: each over a `clone()` of the same tensor in the same round; `compile s`: the "
             "spec's first compiled round trip in this process.", "",
             "| shape | spec | native/eager | compiled/eager | p25-p75 | eager x clone | native x clone | "
             "compiled x clone | compile s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['shape']} | `{row['spec']}` | **{row['native_vs_eager']:.2f}** | "
                     f"{row['compiled_vs_eager']:.2f} | {row['compiled_p25']:.2f}-{row['compiled_p75']:.2f} | "
                     f"{row['eager_vs_clone']:.1f} | {row['native_vs_clone']:.1f} | {row['compiled_vs_clone']:.1f} | "
                     f"{row['compile_s']:.1f} |")
    return lines


def main() -> None:
    parser = benchmark_parser(__doc__)
    add_specs_argument(parser, DEFAULT_SPECS)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="fp32 tensor shapes, like 32x197x384")
    parser.add_argument("--rounds", type=int, default=9, help="timed interleaved rounds per spec and shape")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    check_specs(parser, args.specs)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    load_before, started = load_average(), time.perf_counter()
    rows = []
    for shape in args.shapes:
        torch.manual_seed(args.seed)
        x = torch.randn([int(size) for size in shape.split("x")])
        for spec in args.specs:
            row = bench_one(x, spec, args.rounds, args.warmup)
            rows.append(row)
            print(f"{row['shape']:>12} {spec:>14}  native/eager {row['native_vs_eager']:5.2f}  "
                  f"compiled/eager {row['compiled_vs_eager']:5.2f}  "
                  f"eager {row['eager_vs_clone']:5.1f}x clone, native {row['native_vs_clone']:5.1f}x, "
                  f"compiled {row['compiled_vs_clone']:5.1f}x, "
                  f"compile {row['compile_s']:.1f} s", flush=True)
    header = header_lines(device, args.threads, args.seed, time.perf_counter() - started,
                          {"rounds": args.rounds, "warmup": args.warmup}, load_before)
    write_results("fused", device, args.threads, header, "Codecs native and compiled against their eager reference",
                  markdown_body(rows), rows, COLUMNS, args.out_dir)


if __name__ == "__main__":
    main()
