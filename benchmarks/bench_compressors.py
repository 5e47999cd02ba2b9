"""Round-trip time and stored size of actcomp pipelines, relative to a plain ``clone()``.

    python benchmarks/bench_compressors.py                      # defaults: 1-2 minutes on 2 cores
    python benchmarks/bench_compressors.py --specs pmink0.9+int8 --shapes 32x197x384

For each shape and spec, one loop times ``decompress(compress(x))`` and ``x.clone()``
alternately, so a noisy machine slows both members of a pair alike; the reported ratio is
the median of the per-pair ratios, with the ratio of the fastest runs as a cross-check (on a
shared machine delays only ever add time). Stored bytes are
``packed.nbytes`` over the dense bytes of ``x``. Results go to a markdown table and a CSV
whose names record the torch version, device and thread count.

Channel stages need the channel axis: 1 for 4-D (N, C, H, W) conv activations, -1 for
3-D (N, L, C) linear activations, as the compressed layers will pass it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    RESULTS_DIR,
    add_specs_argument,
    benchmark_parser,
    check_specs,
    header_lines,
    load_average,
    parse_shape,
    quantiles,
    synchronize,
    write_results,
)

import actcomp
from actcomp.core.registry import codec_class, list_codecs

DEFAULT_SPECS = [
    "mink0.9", "smink0.9", "pmink0.9", "random0.9", "channel0.9", "rchannel0.9", "dropit0.9",
    "int8", "int4", "int2", "mesa8", "fp16", "bf16", "fp8",
    "smink0.9+int8", "pmink0.9+int8", "mink0.9+int8",
    # Rice-coded positions (eager only), against the static forms above.
    "mink0.9:rice=1+int8", "smink0.9:rice=1+int8",
    # Whole-model mode's one-bit mask of a ReLU's output (a codec, not a spec).
    "codec:relu-mask",
]
# A ResNet-style conv activation and a ViT-S/16 token activation, both fp32.
DEFAULT_SHAPES = ["32x64x56x56", "32x197x384"]
# The targets (issue 23): round trip at most this many clones.
TARGETS = {"int8": 2.0, "codec:relu-mask": 1.5, "smink0.9+int8": 4.0, "mink0.9+int8": 8.0, "pmink0.9+int8": 8.0}
CODEC_PREFIX = "codec:"


def stage_for(spec: str):
    """The pipeline of a spec, or the codec ``codec:<name>`` names (as whole-model mode uses it)."""
    if spec.startswith(CODEC_PREFIX):
        return codec_class(spec[len(CODEC_PREFIX):])()
    return actcomp.parse(spec)

COLUMNS = ["shape", "spec", "ratio_vs_clone", "ratio_p25", "ratio_p75", "ratio_best", "roundtrip_ms",
           "clone_ms", "clone_fastest_ms", "stored_fraction", "rel_error"]


def channel_dim_for(shape: tuple[int, ...]) -> int:
    """Conv activations (4-D and up) carry channels on dim 1; linear ones on the last dim."""
    return 1 if len(shape) >= 4 else -1


def time_interleaved(first: Callable[[], object], second: Callable[[], object], repeats: int,
                     warmup: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Seconds per call of ``first`` and ``second``, measured in alternating pairs."""
    for _ in range(warmup):
        first()
        second()
    times: tuple[list[float], list[float]] = ([], [])
    # Strictly first, second, first, second: each always runs right after the other, so
    # neither ever finds the caches warmed by a run of its own.
    for _ in range(repeats):
        for which, call in enumerate((first, second)):
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            times[which].append(time.perf_counter() - start)
    return times


def bench_one(x: torch.Tensor, spec: str, repeats: int, warmup: int) -> dict:
    pipeline = stage_for(spec)
    channel_dim = channel_dim_for(tuple(x.shape))
    if spec.startswith(CODEC_PREFIX):
        x = torch.relu(x)  # what a ReLU saves: its output

    def round_trip() -> torch.Tensor:
        return pipeline.decompress(pipeline.compress(x, channel_dim=channel_dim))

    packed = pipeline.compress(x, channel_dim=channel_dim)
    restored = pipeline.decompress(packed)
    if restored.shape != x.shape or restored.dtype != x.dtype:
        raise RuntimeError(f"{spec}: round trip gave {restored.dtype} {tuple(restored.shape)}")
    stored_fraction = packed.nbytes / (x.numel() * x.element_size())
    if spec.startswith(CODEC_PREFIX):
        # A mask decodes to the ReLU's derivative, exactly: its error is against that.
        x_compared = (x > 0).to(x.dtype)
    else:
        x_compared = x
    rel_error = float((restored.double() - x_compared.double()).norm() / x_compared.double().norm())
    del packed, restored

    trip_times, clone_times = time_interleaved(round_trip, x.clone, repeats, warmup, x.device)
    ratios = [trip / clone for trip, clone in zip(trip_times, clone_times)]
    ratio_p25, ratio_median, ratio_p75 = quantiles(ratios)
    return {
        "shape": "x".join(map(str, x.shape)),
        "spec": spec,
        "ratio_vs_clone": ratio_median,
        "ratio_p25": ratio_p25,
        "ratio_p75": ratio_p75,
        # Delays on a shared machine only ever add time, so the fastest runs are a cross-check.
        "ratio_best": min(trip_times) / min(clone_times),
        "roundtrip_ms": statistics.median(trip_times) * 1e3,
        "clone_ms": statistics.median(clone_times) * 1e3,
        "clone_fastest_ms": min(clone_times) * 1e3,
        "stored_fraction": stored_fraction,
        "rel_error": rel_error,
    }


def markdown_body(rows: list[dict]) -> list[str]:
    lines = [
        "`x/clone`: median over interleaved pairs of (compress + decompress time) / (clone time), "
        "with the 25th-75th percentile range; `best`: fastest round trip / fastest clone. "
        "`stored`: packed bytes / dense bytes. "
        "`rel. error`: ||decompress(compress(x)) - x|| / ||x|| for x ~ N(0, 1). "
        "Channel stages use channel_dim = 1 for 4-D shapes and -1 for 3-D shapes. "
        "`codec:relu-mask` packs relu(x), as whole-model mode packs a ReLU's output, and decodes the "
        "derivative: its error is against (x > 0).",
    ]
    for shape in dict.fromkeys(row["shape"] for row in rows):
        shape_rows = [row for row in rows if row["shape"] == shape]
        clone_median = statistics.median(row["clone_ms"] for row in shape_rows)
        clone_fastest = min(row["clone_fastest_ms"] for row in shape_rows)
        lines += ["", f"## {shape} fp32 (clone: median {clone_median:.2f} ms, fastest {clone_fastest:.2f} ms)", ""]
        lines += ["| spec | x/clone | p25-p75 | best | round trip ms | clone ms | stored | rel. error |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in shape_rows:
            lines.append(
                f"| `{row['spec']}` | {row['ratio_vs_clone']:.1f} | {row['ratio_p25']:.1f}-{row['ratio_p75']:.1f} "
                f"| {row['ratio_best']:.1f} | {row['roundtrip_ms']:.2f} | {row['clone_ms']:.2f} "
                f"| {row['stored_fraction']:.1%} | {row['rel_error']:.3g} |"
            )
    for spec, ratio in TARGETS.items():
        target = [row for row in rows if row["spec"] == spec]
        if target:
            lines += ["", f"Target: `{spec}` round trip <= {ratio:g}x a clone."]
            for row in target:
                verdict = "met" if row["ratio_vs_clone"] <= ratio else "NOT met"
                lines.append(f"- {row['shape']}: {row['ratio_vs_clone']:.1f}x, {verdict}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__)
    add_specs_argument(parser, DEFAULT_SPECS)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None, metavar="NxCx...",
                        help=f"fp32 tensor shapes (default: {' '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--repeats", type=int, default=15, help="timed (round trip, clone) pairs per spec")
    parser.add_argument("--warmup", type=int, default=3, help="untimed pairs before timing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.shapes is None:
        args.shapes = [parse_shape(text) for text in DEFAULT_SHAPES]
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1, --warmup >= 0")
    check_specs(parser, [spec for spec in args.specs if not spec.startswith(CODEC_PREFIX)])
    for spec in args.specs:
        if spec.startswith(CODEC_PREFIX) and spec[len(CODEC_PREFIX):] not in list_codecs():
            parser.error(f"unknown codec {spec!r}; known: {', '.join(list_codecs())}")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    load_before = load_average()
    started = time.perf_counter()
    rows = []
    for shape in args.shapes:
        torch.manual_seed(args.seed)
        x = torch.randn(shape, device=device)
        for spec in args.specs:
            torch.manual_seed(args.seed)
            row = bench_one(x, spec, args.repeats, args.warmup)
            rows.append(row)
            print(f"{row['shape']:>14} {spec:>16}  {row['ratio_vs_clone']:7.1f}x clone  "
                  f"{row['roundtrip_ms']:8.2f} ms  stored {row['stored_fraction']:6.1%}", flush=True)
        del x

    settings = {"repeats": args.repeats, "warmup": args.warmup}
    header = header_lines(device, args.threads, args.seed, time.perf_counter() - started, settings, load_before)
    write_results("compressors", device, args.threads, header, "actcomp compressor round trip vs `clone()`",
                  markdown_body(rows), rows, COLUMNS, args.out_dir)


if __name__ == "__main__":
    main()
