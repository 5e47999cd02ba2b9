"""The native CPU kernels against their eager references and a ``clone()``, built for each x86-64 level.

    python benchmarks/bench_native_levels.py                    # native and x86-64-v3: 3-4 minutes on 2 cores
    python benchmarks/bench_native_levels.py --levels native x86-64-v3 x86-64 --codecs int8 --rounds 21

Each level (``ACTCOMP_NATIVE_MARCH``: ``native`` is this CPU's widest vectors, ``x86-64-v3``
AVX2, ``x86-64`` the portable loops) is built and timed in a fresh process at 1 thread, since
the library is built once per process. In that process, one loop per codec, direction, shape and
dtype times the native kernel, the eager reference (``use_backend("eager")``: no kernel inside
the codec either) and ``x.clone()`` alternately, so a noisy machine slows all three alike; the
ratios are medians of per-round ratios. ``level/native`` compares levels across processes
through each one's ratio to its own clone. Results name the CPU, each build's vector width and
the commit: ``benchmarks/results/native_levels_<cpu>_<widest vector>.md`` and ``.csv``.

The reference runs as it would on a CPU of that level: each process sets ATen's own vector
level to match (``ATEN_CPU_CAPABILITY``: ``avx2`` for ``x86-64-v3``, ``default`` below it). Kernels
that :func:`~actcomp.kernels.native_cpu.outruns_reference` turns off at a level are timed all
the same (the table says which run by default): that measurement is the reason they are off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import (
    RESULTS_DIR,
    SOURCE_VERSION,
    benchmark_parser,
    cpu_name,
    header_lines,
    load_average,
    parse_shape,
    ratio_summary,
    time_rounds,
    write_csv,
    write_markdown,
)

import actcomp
from actcomp.core import backends
from actcomp.core.packed import Hints
from actcomp.core.registry import codec_class
from actcomp.kernels import native_cpu
from actcomp.whole_model.exact_codecs import PoolOffsets

# Each codec with a native kernel: the quantizers, fp8, the ReLU mask (LeakyReLU's is the same
# kernel), min-k, whose selection (candidates, radix select, compaction, gather) and
# Elias-Fano positions run natively inside its eager encode and decode, and the saturating
# bfloat16 cast (of float32 only: from bfloat16 it is no cast at all, and is skipped), and a
# 3x3 stride-2 max pool's offsets (of the conv shape's pool: ResNet's stem pool; its input is
# the argmax positions, so its dtype column is the activation's it was pooled from), and the
# 4-bit GELU derivative code (``rest="4bit"``'s GELU input).
CODECS = ["int8", "int4", "int2", "fp8", "relu-mask", "mink0.9", "bf16", "pool-offsets", "fewbit4"]
# A ViT-S/16 token activation and a ResNet-style conv activation.
SHAPES = ["32x197x384", "32x64x56x56"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# ATen's kernels for a CPU of each level; "native": whatever this CPU has.
ATEN_CAPABILITY = {"x86-64": "default", "x86-64-v2": "default", "x86-64-v3": "avx2", "x86-64-v4": "avx512"}
# The codecs with a kernel outruns_reference() governs (the mask decode; the others always run).
GOVERNED = {("relu-mask", "decode")}
COLUMNS = ["level", "vector_bits", "aten_capability", "by_default", "shape", "dtype", "codec", "direction",
           "native_ms", "reference_ms", "clone_ms",
           "native_vs_reference", "native_vs_clone", "vs_native_build"]


def codec_for(name: str):
    """A registered codec by name (``relu-mask``), or the one stage of a spec (``int8``, ``mink0.9``)."""
    if name.endswith("-mask") or name == "pool-offsets":
        return codec_class(name)()
    if name.startswith("fewbit"):
        return codec_class("fewbit")(bits=int(name.removeprefix("fewbit")))
    return actcomp.parse(name).stages[0]


def pooled(x: torch.Tensor) -> tuple[PoolOffsets, torch.Tensor]:
    """A 3x3, stride-2, padding-1 max pool's argmax positions of ``x`` and their codec."""
    _, indices = torch.ops.aten.max_pool2d_with_indices(x, 3, 2, 1)
    return PoolOffsets(kernel=(3, 3), stride=(2, 2), padding=(1, 1), width=x.shape[-1],
                       out_size=tuple(indices.shape[-2:])), indices


def measure(arguments: argparse.Namespace) -> dict:
    """In this process (built for ``$ACTCOMP_NATIVE_MARCH``): per case, the three lists of seconds."""
    torch.set_num_threads(1)
    declined = not native_cpu.outruns_reference()
    native_cpu.outruns_reference = lambda: True  # time the kernels a level turns off, too
    generator = torch.Generator().manual_seed(0)
    cases = []
    for shape_text in arguments.shapes:
        shape = parse_shape(shape_text)
        hints = Hints(channel_dim=1 if len(shape) >= 4 else -1)
        for dtype_name in arguments.dtypes:
            x = (torch.randn(shape, generator=generator) * 3).to(DTYPES[dtype_name])
            for name in arguments.codecs:
                codec, value = codec_for(name), x
                if name == "pool-offsets":
                    if len(shape) != 4:
                        continue
                    codec, value = pooled(x.float())
                if backends.choose(codec, "encode", value, hints) != "native":
                    continue  # no kernel for this dtype: the reference is all there is
                with backends.use_backend("native"):
                    encoded = backends.encode(codec, value, hints)
                with backends.use_backend("eager"):
                    reference = backends.encode(codec, value, hints)
                # Timed on the same bytes: a native kernel that did not run, or gave other codes,
                # would make these figures meaningless.
                for got, expected in zip((encoded.payload, *encoded.saved), (reference.payload, *reference.saved),
                                         strict=True):
                    if not torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)):
                        raise SystemExit(f"{name} {shape_text} {dtype_name}: native codes differ from the reference")

                def run(backend: str, direction: str, codec=codec, value=value, hints=hints, encoded=encoded):
                    with backends.use_backend(backend):
                        if direction == "encode":
                            return backends.encode(codec, value, hints)
                        return backends.decode(codec, encoded.payload, encoded.saved, encoded.meta)

                for direction in ("encode", "decode"):
                    if direction == "decode" and backends.choose(codec, "decode", encoded.payload, encoded.saved,
                                                                 encoded.meta) != "native":
                        continue  # a codec whose decode has no kernel of its own
                    calls = {"native": lambda d=direction: run("native", d),
                             "reference": lambda d=direction: run("eager", d),
                             "clone": value.clone}
                    times = time_rounds(calls, arguments.rounds, arguments.warmup, torch.device("cpu"))
                    cases.append({"shape": shape_text, "dtype": dtype_name, "codec": name, "direction": direction,
                                  **times})
                    print(f"  {native_cpu.march():>9} {shape_text:>12} {dtype_name} {name:>9} {direction}: "
                          f"{statistics.median(times['native']) * 1e3:.2f} ms native, "
                          f"{statistics.median(times['reference']) * 1e3:.2f} ms reference, "
                          f"{statistics.median(times['clone']) * 1e3:.2f} ms clone", file=sys.stderr, flush=True)
    return {"level": native_cpu.march(), "vector_bits": native_cpu.vector_bits(), "declined": declined,
            "aten_capability": torch.backends.cpu.get_cpu_capability(), "cases": cases}


def run_level(level: str, arguments: argparse.Namespace) -> dict:
    """:func:`measure` in a fresh process whose kernels are built for ``level``."""
    command = [sys.executable, __file__, "--worker", "--rounds", str(arguments.rounds), "--warmup",
               str(arguments.warmup), "--codecs", *arguments.codecs, "--shapes", *arguments.shapes, "--dtypes",
               *arguments.dtypes]
    # The worker imports the actcomp this process imported, wherever it was found.
    source_root = str(Path(actcomp.__file__).resolve().parent.parent)
    search_path = os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, native_cpu.MARCH_ENVIRONMENT: level, "PYTHONPATH": search_path}
    environment.pop("ATEN_CPU_CAPABILITY", None)
    if level in ATEN_CAPABILITY:
        environment["ATEN_CPU_CAPABILITY"] = ATEN_CAPABILITY[level]
    result = subprocess.run(command, env=environment, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(result.stdout)


def widest_vector() -> str:
    """This CPU's widest vectors by its flags: ``avx512``, ``avx2`` or ``sse``."""
    flags = set(native_cpu._cpu_flags().split())
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"


def cpu_description() -> str:
    """lscpu's model name with its family and model numbers (a virtual machine's name may not say
    which generation it is), and the widest vectors."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    family = f", family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields else ""
    return f"{cpu_name()}{family}, widest vectors {widest_vector()}"


def summarize(levels: list[dict]) -> list[dict]:
    """One row per level and case: medians, and the median per-round ratios."""
    native_vs_clone = {}
    rows = []
    for level in levels:
        for case in level["cases"]:
            key = (case["shape"], case["dtype"], case["codec"], case["direction"])
            versus_clone = ratio_summary(case["native"], case["clone"])["ratio"]
            if level["level"] == "native":
                native_vs_clone[key] = versus_clone
            by_default = "reference" if level["declined"] and (case["codec"], case["direction"]) in GOVERNED \
                else "kernel"
            rows.append({"level": level["level"], "vector_bits": level["vector_bits"],
                         "aten_capability": level["aten_capability"], "by_default": by_default,
                         "shape": case["shape"],
                         "dtype": case["dtype"], "codec": case["codec"], "direction": case["direction"],
                         "native_ms": statistics.median(case["native"]) * 1e3,
                         "reference_ms": statistics.median(case["reference"]) * 1e3,
                         "clone_ms": statistics.median(case["clone"]) * 1e3,
                         "native_vs_reference": ratio_summary(case["native"], case["reference"])["ratio"],
                         "native_vs_clone": versus_clone, "key": key})
    for row in rows:
        base = native_vs_clone.get(row.pop("key"))
        row["vs_native_build"] = row["native_vs_clone"] / base if base else float("nan")
    return rows


def markdown_body(rows: list[dict], levels: list[dict]) -> list[str]:
    widths = "; ".join(f"`{level['level']}`: {level['vector_bits'] or 'portable loops'}"
                       + (" bits" if level["vector_bits"] else "")
                       + f", reference on ATen's {level['aten_capability']} kernels" for level in levels)
    body = [f"Vector width of each build's hand-vectorized path: {widths}.", "",
            "`runs`: what runs by default at that level (`reference` where "
            "`native_cpu.outruns_reference()` turns the kernel off; it is timed anyway).", "",
            "Kernel time over the eager reference's (below 1: the kernel is faster) and over a "
            "`clone()`'s, medians of per-round ratios in one process per build; `vs native build`: this "
            "build's clone ratio over the `native` build's (its time relative to the widest build).", "",
            "| level | runs | shape | dtype | codec | direction | native ms | reference ms | clone ms | "
            "native / reference | native / clone | vs native build |",
            "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        body.append(f"| `{row['level']}` | {row['by_default']} | {row['shape']} | {row['dtype']} | `{row['codec']}` | "
                    f"{row['direction']} | "
                    f"{row['native_ms']:.2f} | {row['reference_ms']:.2f} | {row['clone_ms']:.2f} | "
                    f"{row['native_vs_reference']:.2f}x | {row['native_vs_clone']:.2f}x | "
                    f"{row['vs_native_build']:.2f}x |")
    slowest = {}
    for row in rows:  # of the kernels that run by default
        if row["by_default"] == "kernel":
            slowest[row["level"]] = max(slowest.get(row["level"], 0.0), row["native_vs_reference"])
    widest = {}
    for row in rows:
        widest[row["level"]] = max(widest.get(row["level"], 0.0), row["vs_native_build"])
    body += ["", "Worst case per build: " + "; ".join(
        f"`{level}`'s kernels that run by default at most {slowest[level]:.2f}x the reference's time; all its "
        f"kernels at most {widest[level]:.2f}x the native build's" for level in slowest) + "."]
    return body


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--levels", nargs="+", default=["native", "x86-64-v3"], choices=list(native_cpu.MARCH_LEVELS),
                        help="builds to time, each in its own process (the first is the baseline if not native)")
    parser.add_argument("--codecs", nargs="+", default=CODECS, help="codecs with native kernels")
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per case")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(measure(arguments)))
        return
    if "native" not in arguments.levels:
        arguments.levels.insert(0, "native")
    load_before, started = load_average(), time.perf_counter()
    levels = [run_level(level, arguments) for level in arguments.levels]
    rows = summarize(levels)
    header = header_lines(torch.device("cpu"), 1, 0, time.perf_counter() - started,
                          {"rounds": arguments.rounds, "warmup": arguments.warmup,
                           "levels": " ".join(arguments.levels)}, load_before)
    header[3] = f"device: cpu ({cpu_description()}), threads: 1"
    body = markdown_body(rows, levels)
    print("\n".join(body))
    stem = "native_levels_" + re.sub(r"[^a-z0-9]+", "_", cpu_name().split(",")[0].lower()).strip("_") \
        + f"_{widest_vector()}"
    arguments.out_dir.mkdir(parents=True, exist_ok=True)
    write_markdown(arguments.out_dir / f"{stem}.md", f"Native kernels per x86-64 level (git {SOURCE_VERSION})",
                   header, body)
    write_csv(arguments.out_dir / f"{stem}.csv", header, rows, COLUMNS)
    print(f"wrote {arguments.out_dir / stem}.md and .csv")


if __name__ == "__main__":
    main()
