"""Helpers shared by the benchmark scripts: command line, results files and their header,
device naming and load, synchronisation, interleaved timing and percentiles.

The scripts import it as ``common`` (run as ``python benchmarks/<script>.py``, this folder
is on ``sys.path``).

>>> stem = results_stem("memory", torch.device("cpu"), threads=2)
>>> stem.startswith("memory_torch") and stem.endswith("_cpu_t2")
True
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

import actcomp

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# The --dtypes choices: fp32, and bf16 = torch.autocast("cpu", dtype=torch.bfloat16).
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def parse_shape(text: str) -> tuple[int, ...]:
    """A ``--shapes`` argument, ``32x197x384``, as a tuple of positive sizes.

    >>> parse_shape("32x197x384")
    (32, 197, 384)
    """
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not like 32x197x384") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} needs positive sizes")
    return shape


def benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc`` (the script's docstring) whose
    ``--help`` shows every default."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_specs_argument(parser: argparse.ArgumentParser, default: list[str]) -> None:
    """``--specs SPEC [SPEC ...]``; check the values with :func:`check_specs` once parsed."""
    parser.add_argument("--specs", nargs="+", default=default, metavar="SPEC",
                        help=f"pipeline specs; registered stages: {', '.join(actcomp.list_compressors())}")


def check_specs(parser: argparse.ArgumentParser, specs: list[str]) -> None:
    """Parse every spec, exiting through ``parser.error`` (status 2) at the first invalid one.

    >>> check_specs(argparse.ArgumentParser(), ["mink0.9", "pmink0.9+int8"])
    """
    for spec in specs:
        try:
            actcomp.parse(spec)
        except actcomp.ActcompError as error:
            parser.error(str(error))


def precision(dtype_name: str) -> contextlib.AbstractContextManager:
    """A :data:`DTYPES` name as a context: fp32, nothing; bf16, CPU autocast."""
    dtype = DTYPES[dtype_name]
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def cpu_name() -> str:
    """platform.processor() where it names the CPU, else lscpu's model name; plus the L3 size,
    since whether a tensor fits in L3 decides how fast the clone baseline is."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    fields = {key.strip().lower(): value.strip() for key, value in fields.items()}
    name = platform.processor()
    if not name or name in ("x86_64", "aarch64", "arm", "i386"):
        name = fields.get("model name") or name or platform.machine() or "unknown"
    if "l3 cache" in fields:
        name += f", L3 {fields['l3 cache'].split(' (')[0]}"
    return name


def device_name(device: torch.device) -> str:
    """The device's name; for a GPU, the host CPU's too: a step the host's Python and launches
    set (stop 52's H200 profile) runs as fast as that CPU."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}; host: {cpu_name()}"
    return cpu_name()


def load_average() -> str:
    """1-minute load average: other work on the machine slows every timed call."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """25th, 50th and 75th percentiles.

    >>> quantiles([1.0, 2.0, 3.0])
    (1.5, 2.0, 2.5)
    >>> quantiles([4.0])
    (4.0, 4.0, 4.0)
    """
    if len(values) == 1:
        return values[0], values[0], values[0]
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, median, high


def results_stem(benchmark: str, device: torch.device, threads: int) -> str:
    """``"speed_torch2.14.1_cpu_t2"``: the file name records torch version, device and threads."""
    version = torch.__version__.split("+")[0]
    return f"{benchmark}_torch{version}_{device.type}_t{threads}"


def source_version() -> str:
    """The checkout's commit, flagged when ``actcomp/`` has uncommitted changes: the version
    number alone does not say which code produced a results file. ``ACTCOMP_SOURCE_VERSION``
    names it where the checkout has no git (a copy of the tree sent to a GPU machine)."""
    if os.environ.get("ACTCOMP_SOURCE_VERSION"):
        return os.environ["ACTCOMP_SOURCE_VERSION"]
    def git(*arguments: str) -> str:
        result = subprocess.run(["git", *arguments], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        return result.stdout.strip()

    try:
        commit, changes = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "actcomp")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit or "unknown") + (" + uncommitted changes in actcomp/" if changes else "")


# Taken at import, next to ``import actcomp``: a commit made while a long benchmark runs
# must not be credited with results from the code loaded before it.
SOURCE_VERSION = source_version()


def header_lines(device: torch.device, threads: int, seed: int, elapsed_s: float,
                 settings: Mapping[str, object], load_before: str) -> list[str]:
    """Command line, date, versions, device, seed, the benchmark's own settings, wall time and
    the load average before (``load_before``, from :func:`load_average`) and after the run."""
    command = "python " + " ".join(shlex.quote(arg) for arg in sys.argv)
    details = ", ".join(f"{key}: {value}" for key, value in settings.items())
    return [
        f"command: `{command}`",
        f"date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"torch: {torch.__version__}, actcomp: {actcomp.__version__} (git {SOURCE_VERSION}), "
        f"python: {platform.python_version()}",
        f"device: {device.type} ({device_name(device)}), threads: {threads}",
        f"seed: {seed}, {details}, wall time: {elapsed_s:.0f} s, "
        f"1-min load average before/after: {load_before}/{load_average()}",
    ]


def write_markdown(path: Path, title: str, header: list[str], body: list[str]) -> None:
    """``# title``, the header as a bullet list, then ``body`` lines."""
    lines = [f"# {title}", "", *(f"- {line}" for line in header), "", *body]
    path.write_text("\n".join(lines) + "\n")


def write_csv(path: Path, header: list[str], rows: list[dict], columns: list[str]) -> None:
    """The header as ``#`` comment lines, then one row per dict (floats to 6 significant digits)."""
    with path.open("w", newline="") as handle:
        for line in header:
            handle.write(f"# {line}\n")
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: f"{value:.6g}" if isinstance(value, float) else value for key, value in row.items()})


def write_results(benchmark: str, device: torch.device, threads: int, header: list[str], title: str,
                  body: list[str], rows: list[dict], columns: list[str], out_dir: Path) -> None:
    """Write ``<stem>.md`` and ``<stem>.csv`` under ``out_dir`` and say where."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = results_stem(benchmark, device, threads)
    write_markdown(out_dir / f"{stem}.md", title, header, body)
    write_csv(out_dir / f"{stem}.csv", header, rows, columns)
    print(f"wrote {out_dir / stem}.md and .csv")


def time_rounds(calls: Mapping[str, Callable[[], object]], rounds: int, warmup: int, device: torch.device,
                progress: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, list[float]]:
    """Seconds per call of every entry of ``calls``, each timed once per round.

    A noisy machine then slows every member of a round alike, so per-round ratios are far
    steadier than ratios of separate averages. The starting member rotates from round to
    round, so none always runs right after the same neighbour. ``warmup`` untimed rounds go
    first; ``progress(round, seconds_by_name)`` is called after each timed round.
    """
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        this_round = {}
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            start = time.perf_counter()
            calls[name]()
            synchronize(device)
            this_round[name] = time.perf_counter() - start
            times[name].append(this_round[name])
        if progress is not None:
            progress(index, this_round)
    return times


def ratio_summary(times: list[float], baseline: list[float]) -> dict[str, float]:
    """Median and quartiles of the per-round ratios ``times / baseline``, and fastest / fastest."""
    ratios = [value / base for value, base in zip(times, baseline)]
    low, median, high = quantiles(ratios)
    # Delays on a shared machine only ever add time, so the fastest runs are a cross-check.
    return {"ratio": median, "ratio_p25": low, "ratio_p75": high, "ratio_best": min(times) / min(baseline),
            "median_s": statistics.median(times)}
