"""Whole-model mode against the plain model: bytes kept for backward, peak process memory, step time.

    python benchmarks/bench_whole_model.py          # defaults: about 12-15 minutes on 2 idle cores
    python benchmarks/bench_whole_model.py --models resnet18 --skip-rss --rounds 2    # check: 1-2 minutes

On a loaded machine expect double: at load average 5 on 2 cores the bytes part alone took 12
minutes (most of it resnet50), and one timing round of all four models 50 s.

Every configuration compresses the Linear/Conv inputs with ``mink0.9+int8``
(``to_compressed(model, "mink0.9+int8", rest=...)``); they differ in what happens to the rest:

- ``linear``: nothing (Linear/Conv mode, ``rest=None``);
- ``8bit``: ``rest="8bit"``: int8 for norm, attention and smooth-activation tensors, 3-bit
  derivative codes for GELU/SiLU, 1-bit ReLU masks, dropout bits, MaxPool window offsets;
- ``4bit``: ``rest="4bit"``: the same with int4;
- ``exact``: ``rest="exact"``: only the exact codecs (masks, bits, offsets), everything else
  as is. The rest is then bit-exact, but the Linear/Conv inputs still go through the lossy
  ``mink0.9+int8``, so the gradients are *not* those of the plain model: this configuration
  isolates what the exact codecs alone save and cost.

The timm models' layer that reads the image runs plain (``first_layer="auto"``); the GPT-2-shaped
model (:mod:`gpt2_shaped`; token ids go to an embedding) is converted with ``first_layer=None``.

1. **Bytes kept for backward** (``actcomp.memory_report``: one training-mode forward,
   deduplicated by storage, parameters, autocast's weight copies and the model input left
   out), fp32 and under CPU bf16 autocast, batch 8 at 224 px (GPT-2: 8 x 256 tokens). Plain
   and every configuration are identical copies of one seeded model. Ratio = plain bytes /
   configuration bytes. Per op kind (``report.kinds``) for ``8bit``, and the largest storage
   each configuration still keeps as is.
2. **Peak RSS** of training steps at batch 32, fp32, plain vs ``linear`` vs ``8bit``, each in
   a fresh process (:mod:`actcomp.tools.peak_rss`: AdamW, glibc's allocator as a user's process gets it; the
   probe uses torch's default thread count). ~2-4 GiB and 30-90 s per process.
   ``--skip-rss`` skips it.
3. **Step time** (forward + cross-entropy + backward + SGD step), plain vs ``linear``,
   ``8bit``, ``exact``, fp32, on ``--threads`` (default 1) torch threads, timed in
   interleaved rounds (``common.time_rounds``); the ratio is the median over rounds of
   (configuration step / plain step in the same round), with quartiles. Defaults keep it
   short on one thread: batch 4 at 224 px, GPT-2 4 x 64 tokens, 4 rounds after 1 warm-up.

Targets: at ``8bit`` every model keeps >= 6x fewer bytes in fp32 and >= 3.5x under bf16; at
``4bit`` >= 10x and >= 6x; ``8bit``'s peak RSS at batch 32 >= 2x lower than plain.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from common import (
    DTYPES,
    RESULTS_DIR,
    benchmark_parser,
    header_lines,
    load_average,
    precision,
    ratio_summary,
    time_rounds,
    write_results,
)
from gpt2_shaped import GPT2, GPT2Config, GPT2Model, gpt2_tokens
from torch import nn

import actcomp
from actcomp.tools.memory import format_bytes
from actcomp.tools.peak_rss import peak_rss

MAIN_SPEC = "mink0.9+int8"
PLAIN = "plain"
# The rest= argument of each configuration (all use MAIN_SPEC for Linear/Conv inputs).
CONFIGS: dict[str, str | None] = {"linear": None, "8bit": "8bit", "4bit": "4bit", "exact": "exact"}
KIND_CONFIG = "8bit"  # the configuration whose per-op-kind rows are reported
# Minimum plain / kept bytes ratios, by (configuration, dtype).
BYTES_TARGETS = {("8bit", "fp32"): 6.0, ("8bit", "bf16"): 3.5, ("4bit", "fp32"): 10.0, ("4bit", "bf16"): 6.0}
RSS_CONFIGS = [PLAIN, "linear", "8bit"]
RSS_TARGET_CONFIG, RSS_TARGET = "8bit", 2.0
TIME_CONFIGS = [PLAIN, "linear", "8bit", "exact"]

DEFAULT_MODELS = ["resnet18", "resnet50", "vit_small_patch16_224", GPT2]
DEFAULT_RSS_MODELS = ["vit_small_patch16_224", "resnet50"]

# One CSV holds every part; ``part`` says which table a row belongs to.
COLUMNS = [
    "part", "model", "input_shape", "dtype", "config", "rest", "plain_bytes", "kept_bytes", "ratio", "target", "met",
    "plain_bytes_own_accounting", "parameter_copy_bytes", "largest_as_is_bytes", "largest_as_is", "kind", "codecs",
    "steps", "peak_rss_bytes", "ratio_p25", "ratio_p75", "ratio_best", "step_ms", "plain_ms",
]


def build(name: str, batch: int, img_size: int, seq_len: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, str | None]:
    """A randomly initialised model, an input batch, its targets, and ``to_compressed``'s ``first_layer``."""
    if name == GPT2:
        config = GPT2Config()
        tokens = gpt2_tokens(config, batch, seq_len)
        return GPT2Model(config), tokens, gpt2_tokens(config, batch, seq_len), None
    kwargs = {"img_size": img_size} if "vit" in name or "deit" in name else {}
    model = timm.create_model(name, pretrained=False, **kwargs)
    images = torch.randn(batch, 3, img_size, img_size)
    return model, images, torch.randint(0, model.num_classes, (batch,)), "auto"


def configured(plain: nn.Module, config: str, first_layer: str | None) -> nn.Module:
    """``plain`` itself, or a converted copy of it (same weights)."""
    if config == PLAIN:
        return plain
    return actcomp.to_compressed(copy.deepcopy(plain), MAIN_SPEC, first_layer=first_layer, rest=CONFIGS[config])


def describe(storage: actcomp.tools.memory.SavedStorage) -> str:
    """``"float32 8x384x56x56 by layer1.0.bn1 (normalization)"``."""
    dtype = str(storage.dtype).removeprefix("torch.")
    return f"{dtype} {'x'.join(map(str, storage.shape))} by {storage.savers[0]} ({storage.op_kind})"


class Progress:
    """Prints lines prefixed with the seconds since the benchmark started."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():5.0f} s] {message}", flush=True)


# --- 1. Bytes kept for backward --------------------------------------------------------------

def bytes_rows(name: str, args: argparse.Namespace, say: Progress) -> list[dict]:
    """One row per dtype and configuration, then the per-kind rows of :data:`KIND_CONFIG`."""
    torch.manual_seed(args.seed)
    plain, inputs, _, first_layer = build(name, args.batch, args.img_size, args.seq_len)
    shape = "x".join(map(str, inputs.shape))
    plain_reports = {}
    for dtype in args.dtypes:
        with precision(dtype):
            plain_reports[dtype] = actcomp.memory_report(plain, inputs)
    rows, kind_rows = [], []
    for config, rest in CONFIGS.items():
        model = configured(plain, config, first_layer)
        for dtype in args.dtypes:
            with precision(dtype):
                report = actcomp.memory_report(model, inputs)
            plain_bytes = plain_reports[dtype].total_bytes
            ratio = plain_bytes / report.total_bytes
            target = BYTES_TARGETS.get((config, dtype))
            as_is = report.kept_as_is()
            rows.append({
                "part": "bytes", "model": name, "input_shape": shape, "dtype": dtype, "config": config,
                "rest": rest or "", "plain_bytes": plain_bytes, "kept_bytes": report.total_bytes, "ratio": ratio,
                "target": target or "", "met": "" if target is None else ratio >= target,
                "plain_bytes_own_accounting": report.plain_bytes,
                "parameter_copy_bytes": report.parameter_copy_bytes,
                "largest_as_is_bytes": as_is[0].nbytes if as_is else 0,
                "largest_as_is": describe(as_is[0]) if as_is else "",
            })
            say(f"{name} {dtype} {config:>6}: {plain_bytes / 2**20:7.1f} -> {report.total_bytes / 2**20:6.1f} MiB "
                f"({ratio:5.2f}x){'' if target is None else ' target ' + str(target) + 'x'}")
            if config == KIND_CONFIG:
                kind_rows += [{
                    "part": "kind", "model": name, "input_shape": shape, "dtype": dtype, "config": config,
                    "kind": row.kind, "plain_bytes": row.plain_bytes, "kept_bytes": row.kept_bytes,
                    "ratio": row.plain_bytes / row.kept_bytes if row.kept_bytes else float("inf"),
                    "codecs": ", ".join(row.codecs),
                } for row in report.kinds]
        del model
    return rows + kind_rows


# --- 2. Peak RSS ----------------------------------------------------------------------------

def rss_rows(name: str, args: argparse.Namespace, say: Progress) -> list[dict]:
    rows = []
    for config in RSS_CONFIGS:
        say(f"{name} peak RSS, {config}, batch {args.rss_batch}, {args.rss_steps} step(s), fresh process ...")
        spec = None if config == PLAIN else MAIN_SPEC
        peak = peak_rss(name, spec, rest=CONFIGS.get(config), batch=args.rss_batch, img_size=args.img_size,
                        steps=args.rss_steps)
        rows.append({"part": "rss", "model": name, "input_shape": f"{args.rss_batch}x3x{args.img_size}x{args.img_size}",
                     "dtype": "fp32", "config": config, "rest": CONFIGS.get(config) or "", "steps": args.rss_steps,
                     "peak_rss_bytes": peak})
        say(f"{name} peak RSS, {config}: {peak / 2**20:.0f} MiB")
    plain_peak = rows[0]["peak_rss_bytes"]
    for row in rows:
        row["ratio"] = plain_peak / row["peak_rss_bytes"]
        if row["config"] == RSS_TARGET_CONFIG:
            row["target"], row["met"] = RSS_TARGET, row["ratio"] >= RSS_TARGET
    return rows


# --- 3. Step time ---------------------------------------------------------------------------

def training_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> Callable[[], None]:
    """One forward + cross-entropy + backward + SGD (momentum) step per call."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        # Flattening makes one call fit both: (batch, classes) and GPT-2's (batch, tokens, vocab).
        F.cross_entropy(model(inputs).flatten(0, -2), targets.flatten()).backward()
        optimizer.step()

    return step


def time_rows(name: str, args: argparse.Namespace, say: Progress) -> list[dict]:
    torch.manual_seed(args.seed)
    plain, inputs, targets, first_layer = build(name, args.time_batch, args.img_size, args.time_seq_len)
    steps = {config: training_step(configured(plain, config, first_layer), inputs, targets) for config in TIME_CONFIGS}

    def progress(index: int, seconds: dict[str, float]) -> None:
        say(f"{name} round {index + 1}/{args.rounds}: " + "  ".join(f"{c} {s:.2f}s" for c, s in seconds.items()))

    times = time_rounds(steps, args.rounds, args.warmup, torch.device("cpu"), progress)
    plain_ms = ratio_summary(times[PLAIN], times[PLAIN])["median_s"] * 1e3
    rows = []
    for config in TIME_CONFIGS:
        summary = ratio_summary(times[config], times[PLAIN])
        rows.append({"part": "time", "model": name, "input_shape": "x".join(map(str, inputs.shape)), "dtype": "fp32",
                     "config": config, "rest": CONFIGS.get(config) or "", "ratio": summary["ratio"],
                     "ratio_p25": summary["ratio_p25"], "ratio_p75": summary["ratio_p75"],
                     "ratio_best": summary["ratio_best"], "step_ms": summary["median_s"] * 1e3, "plain_ms": plain_ms})
    say(f"{name} step time vs plain: " + ", ".join(f"{r['config']} {r['ratio']:.2f}x" for r in rows[1:]))
    return rows


# --- Results --------------------------------------------------------------------------------

def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def verdict(row: dict) -> str:
    if row.get("target", "") == "":
        return ""
    return f">= {row['target']:g}x: {'met' if row['met'] else 'NOT met'}"


def markdown_body(rows: list[dict], args: argparse.Namespace) -> list[str]:
    part = {name: [row for row in rows if row["part"] == name] for name in ("bytes", "kind", "rss", "time")}
    body = [
        f"Every configuration compresses Linear/Conv inputs with `{MAIN_SPEC}`; `rest` is what "
        "`to_compressed(..., rest=)` does with every other saved tensor (`linear`: nothing; `exact`: only the exact "
        f"codecs, but with lossy `{MAIN_SPEC}` Linear/Conv inputs, so its gradients are not the plain model's). "
        "The timm models' image-reading layer runs plain; the GPT-2-shaped model (4 blocks of GPT-2 small, tied "
        "50257-token head) is converted with `first_layer=None`.",
    ]
    if part["bytes"]:
        body += ["", "## Bytes kept for backward", "",
                 "`actcomp.memory_report` after one training-mode forward: deduplicated by storage; parameters, "
                 "autocast's weight copies and the model input left out. Ratio = plain model's bytes / configuration's "
                 "bytes (two reports on identical copies of one seeded model). bf16 = CPU autocast.", "",
                 "| model | input | dtype | config | plain MiB | kept MiB | ratio | target |",
                 "|---|---|---|---|---:|---:|---:|---|"]
        for row in part["bytes"]:
            body.append(f"| {row['model']} | {row['input_shape']} | {row['dtype']} | {row['config']} "
                        f"| {mib(row['plain_bytes'])} | {mib(row['kept_bytes'])} | {row['ratio']:.2f} | {verdict(row)} |")
        mismatched = [row for row in part["bytes"]
                      if abs(row["plain_bytes_own_accounting"] - row["plain_bytes"]) > 0.01 * row["plain_bytes"]]
        body += ["", "Cross-check: each converted model's report also estimates what plain PyTorch would keep "
                     "(`report.plain_bytes`); "
                 + ("it agrees with the plain model's own report within 1% everywhere." if not mismatched else
                    "it differs from the plain model's report by over 1% for: " + "; ".join(
                        f"{r['model']} {r['dtype']} {r['config']} ({mib(r['plain_bytes_own_accounting'])} vs "
                        f"{mib(r['plain_bytes'])} MiB)" for r in mismatched) + ".")]
        body += ["", "### Largest storage each configuration keeps as is", "",
                 "| model | dtype | config | size | share of kept | storage (dtype, shape, first saver, op kind) |",
                 "|---|---|---|---:|---:|---|"]
        for row in part["bytes"]:
            if row["config"] != "linear" and row["largest_as_is"]:
                body.append(f"| {row['model']} | {row['dtype']} | {row['config']} | {format_bytes(row['largest_as_is_bytes'])} "
                            f"| {row['largest_as_is_bytes'] / row['kept_bytes']:.0%} | {row['largest_as_is']} |")
    if part["kind"]:
        body += ["", f"## Per op kind, `{KIND_CONFIG}`", "",
                 "Plain: what PyTorch alone keeps for that kind (a storage saved by two kinds counts for the first "
                 "saver); kept: the compressed forms (a tensor saved by several ops gets one per saver). Both come "
                 "from the converted model's report: where the cross-check above flags a bf16 mismatch, `linear`'s "
                 "plain figure is the one off (it counts the layers' fp32 inputs, where plain autocast keeps "
                 "their bf16 copies).", "",
                 "| model | dtype | op kind | plain MiB | kept MiB | ratio | kept as |", "|---|---|---|---:|---:|---:|---|"]
        for row in part["kind"]:
            ratio = f"{row['ratio']:.1f}" if row["kept_bytes"] else "-"
            body.append(f"| {row['model']} | {row['dtype']} | {row['kind']} | {mib(row['plain_bytes'])} "
                        f"| {mib(row['kept_bytes'])} | {ratio} | {row['codecs']} |")
    if part["rss"]:
        body += ["", "## Peak process memory (RSS) of training steps", "",
                 f"VmHWM of a fresh process running {args.rss_steps} AdamW step(s) at batch {args.rss_batch}, "
                 f"{args.img_size} px, fp32 (`actcomp.tools.peak_rss`: glibc's allocator as a user's process gets it; "
                 "parameters, libraries and the backward's temporaries included).", "",
                 "| model | config | peak MiB | plain / config | target |", "|---|---|---:|---:|---|"]
        for row in part["rss"]:
            body.append(f"| {row['model']} | {row['config']} | {row['peak_rss_bytes'] / 2**20:.0f} "
                        f"| {row['ratio']:.2f} | {verdict(row)} |")
    if part["time"]:
        body += ["", "## Step time", "",
                 f"Forward + cross-entropy + backward + SGD (momentum) step, fp32, {args.threads} torch thread(s), "
                 f"{args.rounds} interleaved rounds after {args.warmup} warm-up. `x plain`: median over rounds of "
                 "(configuration step / plain step in the same round), with the 25th-75th percentile range; `best`: "
                 "fastest step / fastest plain step.", "",
                 "| model | input | config | x plain | p25-p75 | best | step ms |", "|---|---|---|---:|---:|---:|---:|"]
        for row in part["time"]:
            body.append(f"| {row['model']} | {row['input_shape']} | {row['config']} | {row['ratio']:.2f} "
                        f"| {row['ratio_p25']:.2f}-{row['ratio_p75']:.2f} | {row['ratio_best']:.2f} "
                        f"| {row['step_ms']:.0f} |")
    return body


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, metavar="NAME",
                        help=f"timm model names, or {GPT2!r} for the GPT-2-shaped model (bytes and step time)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                        help="for the bytes: fp32, and/or bf16 = torch.autocast('cpu', dtype=torch.bfloat16)")
    parser.add_argument("--batch", type=int, default=8, help="batch for the bytes")
    parser.add_argument("--img-size", type=int, default=224, help="image side, every part (ViTs are built for it)")
    parser.add_argument("--seq-len", type=int, default=256, help=f"tokens per sequence for {GPT2!r}'s bytes")
    parser.add_argument("--skip-rss", action="store_true", help="skip the peak-RSS part")
    parser.add_argument("--rss-models", nargs="+", default=DEFAULT_RSS_MODELS, metavar="NAME",
                        help="timm models for the peak-RSS part")
    parser.add_argument("--rss-batch", type=int, default=32)
    parser.add_argument("--rss-steps", type=int, default=2,
                        help="training steps per peak-RSS process (from the 2nd, the forward runs with gradients alive)")
    parser.add_argument("--skip-time", action="store_true", help="skip the step-time part")
    parser.add_argument("--time-batch", type=int, default=4, help="batch for the step time")
    parser.add_argument("--time-seq-len", type=int, default=64, help=f"tokens per sequence for {GPT2!r}'s step time")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (each steps every configuration once)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the step time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    sizes = (args.batch, args.img_size, args.seq_len, args.rss_batch, args.rss_steps, args.time_batch,
             args.time_seq_len, args.rounds, args.threads)
    if min(sizes) < 1 or args.warmup < 0:
        parser.error("sizes, steps, --rounds and --threads must be >= 1, --warmup >= 0")
    if max(args.seq_len, args.time_seq_len) > GPT2Config.max_positions:
        parser.error(f"--seq-len and --time-seq-len must be at most {GPT2Config.max_positions}")
    unknown = [name for name in args.models if name != GPT2 and not timm.is_model(name)]
    unknown += [name for name in args.rss_models if not args.skip_rss and not timm.is_model(name)]
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)}; use timm names (or {GPT2!r} in --models)")

    device = torch.device("cpu")  # bf16 autocast, the peak-RSS probe and the timing here are CPU's
    load_before = load_average()
    bytes_threads = torch.get_num_threads()
    say = Progress()
    rows = []
    for name in args.models:
        rows += bytes_rows(name, args, say)
    if not args.skip_rss:
        for name in args.rss_models:
            rows += rss_rows(name, args, say)
    if not args.skip_time:
        torch.set_num_threads(args.threads)
        for name in args.models:
            rows += time_rows(name, args, say)
        torch.set_num_threads(bytes_threads)
    settings = {
        "main spec": MAIN_SPEC,
        "bytes": f"batch {args.batch}, {args.img_size} px, {GPT2} {args.seq_len} tokens, {bytes_threads} threads",
        "peak RSS": "skipped" if args.skip_rss else f"batch {args.rss_batch}, {args.rss_steps} step(s)",
        "step time": "skipped" if args.skip_time else
        f"batch {args.time_batch}, {GPT2} {args.time_seq_len} tokens, {args.rounds} rounds, {args.warmup} warm-up",
    }
    header = header_lines(device, args.threads, args.seed, say.elapsed(), settings, load_before)
    # The step-time threads are in the name: the bytes do not depend on threads.
    write_results("whole_model", device, args.threads, header, "actcomp whole-model mode vs the plain model",
                  markdown_body(rows, args), rows, COLUMNS, args.out_dir)


if __name__ == "__main__":
    main()
