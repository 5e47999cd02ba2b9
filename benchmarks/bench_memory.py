"""Activation bytes autograd keeps for backward, plain vs compressed, for timm models and a GPT-2-shaped model.

    python benchmarks/bench_memory.py                          # defaults: a few minutes on 2 cores
    python benchmarks/bench_memory.py --models resnet18 gpt2 --dtypes bf16 --batch 4

Bytes come from ``actcomp.memory_report`` (one training-mode forward, saved tensors
deduplicated by storage, parameters and the model's input left out), in fp32 and under CPU
bf16 autocast. Two views per model and spec:

- **total**: every saved byte, plain vs compressed. This is what training really gets back.
- **compressed layers**: only what the converted layers save. Plain, that is their inputs
  (deduplicated: a ResNet block input read by both ``conv1`` and ``downsample`` counts once,
  though each compressed layer keeps its own packed copy); compressed, their packed copies.
  Ratios are against those inputs stored densely in bf16, deduplicated and "each layer
  alone" (a shared input counted once per layer: the storage format's own ratio), and
  against DropIT's format (``dropit0.9``: global top-k, values in the input dtype + int32
  indices).

A converted layer "frees nothing" when another op keeps its input anyway (a conv after a
ReLU: ReLU keeps its output): its packed copy is then an extra cost (``report.not_freed``).
As ``to_compressed`` does by default, the timm models' first layer (the one that reads the
image) runs plain and is left out of the per-layer columns; the GPT-2 model has no layer that reads its raw input (token ids go to
an embedding), so all its layers are converted.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import Counter
from pathlib import Path

import timm
import torch
from common import (
    DTYPES,
    RESULTS_DIR,
    add_specs_argument,
    benchmark_parser,
    check_specs,
    header_lines,
    load_average,
    precision,
    write_results,
)
from gpt2_shaped import GPT2, GPT2Config, GPT2Model, gpt2_tokens
from torch import nn

import actcomp

DEFAULT_MODELS = ["resnet18", "resnet50", "vit_small_patch16_224", "deit_tiny_patch16_224", GPT2]
DEFAULT_SPECS = ["mink0.9", "pmink0.9", "mink0.9+int8", "int8", "dropit0.9"]
REFERENCE_SPEC = "dropit0.9"
# The issue's targets for the compressed layers' input bytes.
TARGET_SPEC, TARGET_VS_BF16, TARGET_VS_REFERENCE = "mink0.9+int8", 8.0, 3.5

COLUMNS = [
    "model", "dtype", "spec", "input_shape", "plain_total_bytes", "compressed_total_bytes", "total_ratio",
    "parameter_copy_bytes", "converted_layers", "layers_plain_bytes", "layers_bf16_dense_bytes",
    "layers_compressed_bytes", "layers_ratio_vs_bf16", "layers_bf16_each_bytes", "layers_ratio_vs_bf16_each",
    "layers_ratio_vs_reference", "not_freed_layers", "not_freed_input_bytes",
]


def model_and_input(name: str, args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, str | None]:
    """The model, one input batch, and the ``first_layer`` argument for ``to_compressed``."""
    if name == GPT2:
        config = GPT2Config()
        tokens = gpt2_tokens(config, args.batch, args.seq_len)  # drawn before the weights, as before
        return GPT2Model(config), tokens, None
    kwargs = {"img_size": args.img_size} if args.img_size and ("vit" in name or "deit" in name) else {}
    model = timm.create_model(name, pretrained=False, **kwargs)
    size = args.img_size or model.pretrained_cfg["input_size"][-1]
    return model, torch.randn(args.batch, 3, size, size), "auto"


def layer_bytes(report: actcomp.MemoryReport, layers: dict[str, nn.Module]) -> tuple[int, int]:
    """Bytes of the storages that any of ``layers`` saves (deduplicated), and their dense bf16 size.

    Under autocast a layer also saves its bf16 copy of the weight: a parameter copy, not an
    activation, left out here as in ``report.total_bytes``.
    """
    nbytes = bf16_bytes = 0
    for storage in report.storages:
        if storage.kind != "activation" or not any(name in layers for name in storage.savers):
            continue
        nbytes += storage.nbytes
        bf16_bytes += storage.nbytes // storage.dtype.itemsize * 2
    return nbytes, bf16_bytes


def not_freed_summary(report: actcomp.MemoryReport, model: nn.Module) -> str:
    """``"Conv2d input also kept by ReLU x14"``-style counts of the layers that free nothing."""
    modules = dict(model.named_modules())
    counts = Counter(
        (actcomp_type(modules[item.layer]), ", ".join(sorted({actcomp_type(modules[n]) for n in item.kept_by})))
        for item in report.not_freed
    )
    return "; ".join(f"{layer} input also kept by {keepers} x{count}" for (layer, keepers), count in counts.items())


def actcomp_type(module: nn.Module) -> str:
    return getattr(type(module), "actcomp_base", type(module)).__name__


def bench_model(name: str, args: argparse.Namespace) -> tuple[list[dict], dict[tuple[str, str], str]]:
    """Rows for every dtype and spec, and per (model, dtype) which converted layers free nothing."""
    torch.manual_seed(args.seed)
    plain, batch, first_layer = model_and_input(name, args)
    compressed = {
        spec: actcomp.to_compressed(copy.deepcopy(plain), spec, first_layer=first_layer) for spec in args.specs
    }
    # Layers that read the model input are converted but run plain (first_layer="auto"): they
    # compress nothing, so the per-layer columns leave them out.
    reads_input = set(actcomp.memory_report(next(iter(compressed.values())), batch).plain_on_input)
    converted_names = [n for n in actcomp.compressed_layers(next(iter(compressed.values()))) if n not in reads_input]
    rows, not_freed_notes = [], {}
    for dtype_name in args.dtypes:
        with precision(dtype_name):
            plain_report = actcomp.memory_report(plain, batch)
        plain_modules = dict(plain.named_modules())
        layers_plain, layers_bf16 = layer_bytes(plain_report, {n: plain_modules[n] for n in converted_names})
        layers_bf16_each = sum(layer_bytes(plain_report, {n: plain_modules[n]})[1] for n in converted_names)
        spec_rows = []
        for spec, model in compressed.items():
            with precision(dtype_name):
                report = actcomp.memory_report(model, batch)
            modules = dict(model.named_modules())
            layers_compressed, _ = layer_bytes(report, {n: modules[n] for n in converted_names})
            spec_rows.append({
                "model": name, "dtype": dtype_name, "spec": spec, "input_shape": "x".join(map(str, batch.shape)),
                "plain_total_bytes": plain_report.total_bytes, "compressed_total_bytes": report.total_bytes,
                "total_ratio": plain_report.total_bytes / report.total_bytes,
                "parameter_copy_bytes": plain_report.parameter_copy_bytes,
                "converted_layers": len(converted_names), "layers_plain_bytes": layers_plain,
                "layers_bf16_dense_bytes": layers_bf16, "layers_compressed_bytes": layers_compressed,
                "layers_ratio_vs_bf16": layers_bf16 / layers_compressed,
                "layers_bf16_each_bytes": layers_bf16_each,
                "layers_ratio_vs_bf16_each": layers_bf16_each / layers_compressed,
                "not_freed_layers": len(report.not_freed),
                "not_freed_input_bytes": sum(item.input_bytes for item in report.not_freed),
            })
            # Which layers free nothing depends on the graph, not on the spec: note it once.
            not_freed_notes.setdefault((name, dtype_name), not_freed_summary(report, model))
            print(f"{name:>22} {dtype_name} {spec:>14}  total {spec_rows[-1]['total_ratio']:5.2f}x  "
                  f"layers {spec_rows[-1]['layers_ratio_vs_bf16']:5.2f}x vs bf16  "
                  f"not freed {len(report.not_freed)}/{len(converted_names)}", flush=True)
        reference = next((row for row in spec_rows if row["spec"] == REFERENCE_SPEC), None)
        for row in spec_rows:
            row["layers_ratio_vs_reference"] = (
                reference["layers_compressed_bytes"] / row["layers_compressed_bytes"] if reference else float("nan"))
        rows += spec_rows
    return rows, not_freed_notes


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def markdown_body(rows: list[dict], not_freed_notes: dict[tuple[str, str], str]) -> list[str]:
    body = [
        "Bytes autograd keeps after one training-mode forward (`actcomp.memory_report`: deduplicated by "
        "storage; parameters, their autocast bf16 copies (`parameter copies MiB`) and the model input left out). "
        "`total`: all saved bytes; `layers`: only what the converted layers save (plain: their inputs, "
        "compressed: their packed copies). `vs bf16`: the converted layers' inputs stored densely in bf16 "
        "(deduplicated) / their packed bytes; `each`: the same with a shared input counted once per layer "
        "that reads it (each layer keeps its own packed copy), i.e. the storage format's own ratio; "
        f"`vs {REFERENCE_SPEC}`: `{REFERENCE_SPEC}`'s packed bytes (DropIT's format) "
        "/ this spec's. `not freed`: converted layers whose input another op keeps anyway.",
    ]
    for model in dict.fromkeys(row["model"] for row in rows):
        model_rows = [row for row in rows if row["model"] == model]
        first = model_rows[0]
        copies = ", ".join(
            f"{row['dtype']} {mib(row['parameter_copy_bytes'])}" for row in model_rows if row["spec"] == first["spec"])
        body += ["", f"## {model}, input {first['input_shape']}, {first['converted_layers']} layers converted", "",
                 f"Parameter copies MiB (left out of the totals): {copies}.", ""]
        body += [f"| dtype | spec | total plain MiB | total compressed MiB | total ratio | layers plain MiB "
                 f"| layers compressed MiB | layers vs bf16 | each | layers vs `{REFERENCE_SPEC}` | not freed |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in model_rows:
            body.append(
                f"| {row['dtype']} | `{row['spec']}` | {mib(row['plain_total_bytes'])} "
                f"| {mib(row['compressed_total_bytes'])} | {row['total_ratio']:.2f} | {mib(row['layers_plain_bytes'])} "
                f"| {mib(row['layers_compressed_bytes'])} "
                f"| {row['layers_ratio_vs_bf16']:.2f} | {row['layers_ratio_vs_bf16_each']:.2f} "
                f"| {row['layers_ratio_vs_reference']:.2f} "
                f"| {row['not_freed_layers']}/{row['converted_layers']} |")
        dtypes = dict.fromkeys(row["dtype"] for row in model_rows)
        notes = {dtype: not_freed_notes.get((model, dtype)) for dtype in dtypes}
        for note in dict.fromkeys(notes.values()):
            if note:
                dtypes = ", ".join(dtype for dtype, other in notes.items() if other == note)
                body += ["", f"Layers that free nothing ({dtypes}): {note}."]
    body += ["", f"Targets: `{TARGET_SPEC}` cuts the converted layers' input bytes >= {TARGET_VS_BF16:g}x vs bf16 "
                 f"and >= {TARGET_VS_REFERENCE:g}x vs `{REFERENCE_SPEC}`.", ""]
    body += [f"| model | dtype | vs bf16 (dedup.) | met | vs bf16 (each layer) | met | vs `{REFERENCE_SPEC}` | met |",
             "|---|---|---:|---|---:|---|---:|---|"]
    for row in rows:
        if row["spec"] == TARGET_SPEC:
            cells = [(row[key], target) for key, target in (("layers_ratio_vs_bf16", TARGET_VS_BF16),
                     ("layers_ratio_vs_bf16_each", TARGET_VS_BF16), ("layers_ratio_vs_reference", TARGET_VS_REFERENCE))]
            verdicts = " | ".join(f"{value:.2f} | {'yes' if value >= target else 'NO'}" for value, target in cells)
            body.append(f"| {row['model']} | {row['dtype']} | {verdicts} |")
    return body


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, metavar="NAME",
                        help=f"timm model names, or {GPT2!r} for the built-in GPT-2-shaped model")
    add_specs_argument(parser, DEFAULT_SPECS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                        help="fp32, and/or bf16 = torch.autocast('cpu', dtype=torch.bfloat16)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=None, help="image side (default: each model's native size)")
    parser.add_argument("--seq-len", type=int, default=256, help=f"tokens per sequence for {GPT2!r}")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if min(args.batch, args.seq_len, args.threads) < 1 or (args.img_size is not None and args.img_size < 1):
        parser.error("--batch, --img-size, --seq-len and --threads must be >= 1")
    if not 1 <= args.seq_len <= GPT2Config.max_positions:
        parser.error(f"--seq-len must be at most {GPT2Config.max_positions}")
    check_specs(parser, args.specs)
    unknown = [name for name in args.models if name != GPT2 and not timm.is_model(name)]
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)}; use timm names or {GPT2!r}")

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")  # memory_report accounts any device, but bf16 autocast here is CPU's
    load_before = load_average()
    started = time.perf_counter()
    rows, notes = [], {}
    for name in args.models:
        model_rows, model_notes = bench_model(name, args)
        rows += model_rows
        notes.update(model_notes)
    settings = {"batch": args.batch, "img size": args.img_size or "native", f"{GPT2} seq len": args.seq_len}
    header = header_lines(device, args.threads, args.seed, time.perf_counter() - started, settings, load_before)
    write_results("memory", device, args.threads, header, "actcomp saved activation bytes, plain vs compressed",
                  markdown_body(rows, notes), rows, COLUMNS, args.out_dir)


if __name__ == "__main__":
    main()
