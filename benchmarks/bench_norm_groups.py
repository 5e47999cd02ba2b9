"""What smaller quantization groups on the norms' inputs cost under ``rest="4bit"``, model by model.

    python benchmarks/bench_norm_groups.py        # ~1 minute on 2 cores

A language model with eager attention and a trained model's outliers keeps its 4-bit gradient
above the 0.97 floor only with its norms' inputs in groups of 16 (``bench_lm_quality.py``: 0.983
against 0.968 in groups of 64): a sink token's outlier channels set the range of every group they
share. This measures the bytes that costs, on models with and without such tokens: resnet50 and ViT-S (batch 8,
224 px) and the Llama-shaped model of ``bench_lm_quality.py`` (2 x 256 tokens, eager attention,
outliers built in), each under ``"mink0.9+int8"`` with every norm's input in groups of 64 (the
``"4bit"`` preset before stop 57), with the preset (since stop 57: LayerNorm and RMSNorm inputs in
groups of 16, ``token_norms``, BatchNorm's in 64) and with every norm's in groups of 16
(``actcomp.memory_report``, bytes kept for backward).

Writes ``benchmarks/results/norm_groups_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from bench_lm_quality import llama
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp

GROUPS_OF_64 = {"activation": "int4:group=64", "normalization": "int4:group=64", "attention": "int4:group=64",
                "fewbit": 4}
GROUPS_OF_16 = {**GROUPS_OF_64, "normalization": "int4:group=16"}
VARIANTS = (("groups64", GROUPS_OF_64), ("preset", "4bit"), ("groups16", GROUPS_OF_16))
COLUMNS = ["model", "plain_mib", "groups64_mib", "preset_mib", "groups16_mib", "groups64_x", "preset_x", "groups16_x",
           "preset_more_pct", "groups16_more_pct"]


def models(batch: int) -> dict[str, tuple[torch.nn.Module, tuple, dict]]:
    import timm

    built = {}
    for name in ("resnet50", "vit_small_patch16_224"):
        torch.manual_seed(0)
        built[name] = (timm.create_model(name, pretrained=False), (torch.randn(batch, 3, 224, 224),), {})
    ids = torch.randint(1, 2000, (2, 256), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0  # the sink token
    built["llama (outliers, eager attention)"] = (llama(outliers=True, attention="eager"), (),
                                                  {"input_ids": ids, "labels": ids})
    return built


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batch", type=int, default=8, help="images per batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    rows = []
    for name, (model, inputs, kwargs) in models(args.batch).items():
        plain = actcomp.memory_report(model, *inputs, **kwargs).total_bytes
        kept = {}
        for label, rest in VARIANTS:
            converted = actcomp.to_compressed(copy.deepcopy(model), "mink0.9+int8", rest=rest)
            kept[label] = actcomp.memory_report(converted, *inputs, **kwargs).total_bytes
        row = {"model": name, "plain_mib": plain / 2**20}
        for label, _ in VARIANTS:
            row[f"{label}_mib"], row[f"{label}_x"] = kept[label] / 2**20, plain / kept[label]
        for label in ("preset", "groups16"):
            row[f"{label}_more_pct"] = 100 * (kept[label] / kept["groups64"] - 1)
        rows.append(row)
        print(f"{name}: {row['groups64_x']:.2f}x, preset {row['preset_x']:.2f}x, all 16 {row['groups16_x']:.2f}x",
              flush=True)
    body = ['Bytes kept for backward: plain, and `"mink0.9+int8"` with `rest="4bit"`\'s mapping with every norm\'s '
            "input in groups of 64 (the preset before stop 57), with the preset (LayerNorm/RMSNorm inputs in groups of "
            "16, BatchNorm's in 64), and with every norm's input in groups of 16.", "",
            "| model | plain | norms in groups of 64 | `\"4bit\"` | every norm in groups of 16 |",
            "|---|---:|---:|---:|---:|"]
    body += [f"| {r['model']} | {r['plain_mib']:.1f} MiB | {r['groups64_mib']:.1f} MiB ({r['groups64_x']:.2f}x fewer) | "
             f"{r['preset_mib']:.1f} MiB ({r['preset_x']:.2f}x, +{r['preset_more_pct']:.1f}%) | "
             f"{r['groups16_mib']:.1f} MiB ({r['groups16_x']:.2f}x, +{r['groups16_more_pct']:.1f}%) |" for r in rows]
    device = torch.device("cpu")
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, {"batch": args.batch}, load_before)
    write_results("norm_groups", device, args.threads, header, "Norms' inputs in groups of 16 under rest=\"4bit\": the bytes",
                  body, rows, COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
