"""What smaller quantization groups on the norms' inputs cost under ``rest="4bit"``, model by model.

    python benchmarks/bench_norm_groups.py        # ~1 minute on 2 cores

A language model with eager attention and a trained model's outliers keeps its 4-bit gradient
above the 0.97 floor only with its norms' inputs in groups of 16 (``bench_lm_quality.py``: 0.983
against the preset's 0.968): a sink token's outlier channels set the range of every group they
share. This measures the bytes that costs where no sink token lives: resnet50 and ViT-S (batch 8,
224 px) and the Llama-shaped model of ``bench_lm_quality.py`` (2 x 256 tokens, eager attention,
outliers built in), each under ``"mink0.9+int8"`` with the ``"4bit"`` preset and with the same
preset's norms in groups of 16 (``actcomp.memory_report``, bytes kept for backward).

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

GROUPS_OF_16 = {"activation": "int4:group=64", "normalization": "int4:group=16", "attention": "int4:group=64",
                "fewbit": 4}
COLUMNS = ["model", "plain_mib", "preset_mib", "groups16_mib", "preset_x", "groups16_x", "more_bytes_pct"]


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
        for label, rest in (("preset", "4bit"), ("groups16", GROUPS_OF_16)):
            converted = actcomp.to_compressed(copy.deepcopy(model), "mink0.9+int8", rest=rest)
            kept[label] = actcomp.memory_report(converted, *inputs, **kwargs).total_bytes
        rows.append({"model": name, "plain_mib": plain / 2**20, "preset_mib": kept["preset"] / 2**20,
                     "groups16_mib": kept["groups16"] / 2**20, "preset_x": plain / kept["preset"],
                     "groups16_x": plain / kept["groups16"],
                     "more_bytes_pct": 100 * (kept["groups16"] / kept["preset"] - 1)})
        print(f"{name}: {rows[-1]['preset_x']:.2f}x -> {rows[-1]['groups16_x']:.2f}x", flush=True)
    body = ['Bytes kept for backward: plain, `"mink0.9+int8", rest="4bit"`, and the same with the norms\' inputs in '
            "groups of 16 (`rest=" + repr(GROUPS_OF_16).replace("'", '"') + "`).", "",
            "| model | plain | `\"4bit\"` | norms in groups of 16 | more bytes |", "|---|---:|---:|---:|---:|"]
    body += [f"| {r['model']} | {r['plain_mib']:.1f} MiB | {r['preset_mib']:.1f} MiB ({r['preset_x']:.2f}x fewer) | "
             f"{r['groups16_mib']:.1f} MiB ({r['groups16_x']:.2f}x) | +{r['more_bytes_pct']:.1f}% |" for r in rows]
    device = torch.device("cpu")
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, {"batch": args.batch}, load_before)
    write_results("norm_groups", device, args.threads, header, "Norms' inputs in groups of 16 under rest=\"4bit\": the bytes",
                  body, rows, COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
