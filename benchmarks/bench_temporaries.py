"""Extra peak memory of compressing and decompressing one large tensor, per pipeline.

    python benchmarks/bench_temporaries.py                          # 2**27 elements: 3-4 minutes
    python benchmarks/bench_temporaries.py --count 16777216 --dtypes float32

Each dtype runs in a fresh process (:func:`actcomp.tools.temporaries.extra_peak`) that resets its peak
resident memory before every call and reads it after: the extra peak is that peak minus the
memory before the call and the bytes of what the call returns, as a fraction of the input's
bytes. Target (issue 9): at most 0.5 for every built-in pipeline. The tensor is conv-shaped,
(N, 64, 32, 32), so channel stages have their channel axis.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from common import RESULTS_DIR, add_specs_argument, benchmark_parser, check_specs, header_lines, load_average, write_results

import actcomp
from actcomp.core.registry import compressor_class
from actcomp.tools.temporaries import extra_peak

DEFAULT_SPECS = [f"{name}0.9" if compressor_class(name).takes_rate else name for name in actcomp.list_compressors()] + [
    "smink0.9+int8", "pmink0.9+int8", "mink0.9+int8", "random0.9+int4", "channel0.9+int8", "mink0.9+fp8",
]
BUDGET = 0.5
COLUMNS = ["dtype", "spec", "input_bytes", "packed_bytes", "compress_extra", "decompress_extra", "round_trip_ok"]


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__)
    add_specs_argument(parser, DEFAULT_SPECS)
    parser.add_argument("--count", type=int, default=2**27, help="elements (a multiple of 65536)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    check_specs(parser, args.specs)
    if args.count % 65536:
        parser.error("--count must be a multiple of 65536")

    load_before, started = load_average(), time.perf_counter()
    rows = []
    for dtype in args.dtypes:
        for row in extra_peak(args.specs, count=args.count, dtype=dtype, threads=args.threads):
            rows.append({"dtype": dtype, **row})
            print(f"{dtype:>9} {row['spec']:>16}  compress +{row['compress_extra']:.3f}x  "
                  f"decompress +{row['decompress_extra']:.3f}x  of {row['input_bytes'] / 2**20:.0f} MiB", flush=True)

    worst = max(max(row["compress_extra"], row["decompress_extra"]) for row in rows)
    body = [
        "Extra peak resident memory while compressing / decompressing one tensor of "
        f"{args.count:,} elements, as a fraction of its bytes (beyond the input and the result). "
        f"Target: <= {BUDGET} for every pipeline.",
        "",
        "| dtype | spec | compress | decompress | stored |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        body.append(f"| {row['dtype']} | `{row['spec']}` | {row['compress_extra']:+.3f}x | {row['decompress_extra']:+.3f}x "
                    f"| {row['packed_bytes'] / row['input_bytes']:.1%} |")
    verdict = "met" if worst <= BUDGET else "NOT met"
    body += ["", f"Worst: {worst:.3f}x of the input: target {verdict}."]
    settings = {"count": args.count}
    header = header_lines(torch.device("cpu"), args.threads, 0, time.perf_counter() - started, settings, load_before)
    write_results("temporaries", torch.device("cpu"), args.threads, header, "actcomp extra peak memory of compression",
                  body, rows, COLUMNS, Path(args.out_dir))


if __name__ == "__main__":
    main()
