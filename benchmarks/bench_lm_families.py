"""Bytes kept for backward by Llama-, Mistral- and Qwen2-shaped models, plain against the default preset.

    python benchmarks/bench_lm_families.py                  # 2048 tokens, fp32 and bf16, 8bit and 4bit: ~5 minutes
    python benchmarks/bench_lm_families.py --tokens 256 --layers 2   # a check

Each family's causal LM built from a config with the same sizes (hidden 512, intermediate 1408,
8 layers, 8 heads and 4 key-value heads, vocabulary 32,000; Qwen2 with its q/k/v biases), batch
1, the loss computed inside the forward (``labels=``). ``actcomp.memory_report`` (deduplicated by
storage) of the plain model and of ``to_compressed(model, "mink0.9+int8", rest=...)`` for each of
``--rests`` (the loss routed through the chunked cross-entropy), the loss's share apart (bytes
with labels minus without). Targets (issue 24): >= 6x fewer bytes in fp32, >= 4x in bf16; the
rest of the model alone >= 4x (issue 39: in bf16 too).

Writes ``benchmarks/results/lm_families_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp

FAMILIES = ("llama", "mistral", "qwen2")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLUMNS = ["family", "dtype", "rest", "plain_mib", "kept_mib", "kept_vs_plain", "rest_plain_mib", "rest_kept_mib",
           "rest_vs_plain"]


def build(family: str, args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    sizes = {"hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4, "num_hidden_layers": args.layers,
             "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32_000,
             "max_position_embeddings": max(args.tokens, 128)}
    config, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(0)
    return model_class(config(**sizes)).to(dtype).train()


def kept(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    """Bytes kept with labels (the loss computed) and without."""
    return (actcomp.memory_report(model, input_ids=ids, labels=ids).total_bytes,
            actcomp.memory_report(model, input_ids=ids).total_bytes)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rests", nargs="+", default=["8bit", "4bit"], help="whole-model presets to measure")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    ids = torch.randint(0, 32_000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    rows = []
    for family in FAMILIES:
        for dtype_name, dtype in DTYPES.items():
            plain_with, plain_without = kept(build(family, args, dtype), ids)
            for rest in args.rests:
                model = actcomp.to_compressed(build(family, args, dtype), "mink0.9+int8", rest=rest)
                with_labels, without = kept(model, ids)
                rows.append({"family": family, "dtype": dtype_name, "rest": rest, "plain_mib": plain_with / 2**20,
                             "kept_mib": with_labels / 2**20, "kept_vs_plain": plain_with / with_labels,
                             "rest_plain_mib": plain_without / 2**20, "rest_kept_mib": without / 2**20,
                             "rest_vs_plain": plain_without / without})
                print(f"{family} {dtype_name} {rest}: {plain_with / with_labels:.2f}x fewer bytes "
                      f"(the rest alone {plain_without / without:.2f}x)", flush=True)
    body = [f"Hidden {args.hidden}, {args.layers} layers, vocabulary 32,000, batch 1 x {args.tokens} tokens, "
            "loss inside the forward; `\"mink0.9+int8\"` with each `rest`. Targets: >= 6x in fp32, >= 4x in bf16; "
            "the rest of the model (no labels) >= 4x.", "",
            "| family | dtype | rest | plain MiB | kept MiB | x plain | rest: plain MiB | rest: kept MiB | rest x plain |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    body += [f"| {row['family']} | {row['dtype']} | {row['rest']} | {row['plain_mib']:.0f} | {row['kept_mib']:.0f} "
             f"| **{row['kept_vs_plain']:.2f}x** | {row['rest_plain_mib']:.0f} | {row['rest_kept_mib']:.0f} "
             f"| {row['rest_vs_plain']:.2f}x |" for row in rows]
    device = torch.device("cpu")
    settings = {"tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "rests": args.rests}
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, settings, load_before)
    write_results("lm_families", device, args.threads, header,
                  "Bytes kept by Llama-, Mistral- and Qwen2-shaped models", body, rows, COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
