"""Gradient quality of actcomp's presets on a language model with and without the outliers of a trained one.

    python benchmarks/bench_lm_quality.py        # ~3 minutes on 2 cores

A Llama-shaped model from a config (hidden 256, 4 layers, vocabulary 2000, 2 x 256 tokens, the
first token a sink), random, and the same with ``actcomp.tools.llm_outliers.add_outliers``
(4 channels with 40x norm gains, the sink token's embedding 300x on them). For each
configuration, the cosine between the full gradient of one step (every parameter, float64)
and plain's, over ``--seeds`` input batches (min and median). ``loss="plain"`` throughout, so
the loss is the same in both and only the codecs differ; each rest kind is also run alone.

Writes ``benchmarks/results/lm_quality_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.tools.llm_outliers import add_outliers

# (label, Linear/Conv spec, rest[, attention implementation]): the presets, and each kind of
# rest="8bit"/"4bit" alone; SDPA attention unless named.
CONFIGS = [
    ("int8 (Linear inputs)", "int8", None),
    ("int4 (Linear inputs)", "int4", None),
    ("int4:scale=group (Linear inputs, no channel scales)", "int4:scale=group", None),
    ('rest="8bit" (Linear exact)', "mink0", "8bit"),
    ('rest="4bit" (Linear exact)', "mink0", "4bit"),
    ("8bit: activation only", "mink0", {"activation": "int8", "normalization": None, "attention": None}),
    ("8bit: normalization only", "mink0", {"activation": None, "normalization": "int8", "attention": None}),
    ("8bit: attention only", "mink0", {"activation": None, "normalization": None, "attention": "int8"}),
    ("8bit: attention only, groups of 32", "mink0",
     {"activation": None, "normalization": None, "attention": "int8:group=32"}),
    ('"mink0.9+int8", rest="8bit"', "mink0.9+int8", "8bit"),
    # A model written with eager attention (softmax probabilities saved, no log-sum-exp): SDPA's
    # rules do not reach it.
    ('rest="8bit", eager attention', "mink0", "8bit", "eager"),
    ('rest="4bit", eager attention', "mink0", "4bit", "eager"),
    ('rest="4bit" with attention int8, eager attention', "mink0",
     {"activation": "int4:group=64", "normalization": "int4:group=64", "attention": "int8", "fewbit": 4}, "eager"),
    # Where "4bit"'s error on eager attention comes from: each kind alone, and the norms' inputs in
    # smaller groups.
    ("4bit, eager: activation only", "mink0",
     {"activation": "int4:group=64", "normalization": None, "attention": None, "fewbit": 4}, "eager"),
    ("4bit, eager: normalization only", "mink0",
     {"activation": None, "normalization": "int4:group=64", "attention": None}, "eager"),
    ("4bit, eager: attention only", "mink0",
     {"activation": None, "normalization": None, "attention": "int4:group=64"}, "eager"),
    ('rest="4bit" with normalization in groups of 32, eager attention', "mink0",
     {"activation": "int4:group=64", "normalization": "int4:group=32", "attention": "int4:group=64", "fewbit": 4},
     "eager"),
    # Groups of 16 leave a sink token's outlier channels fewer neighbours to flatten.
    ("4bit, eager: normalization only, groups of 16", "mink0",
     {"activation": None, "normalization": "int4:group=16", "attention": None}, "eager"),
    ('rest="4bit" with normalization in groups of 16, eager attention', "mink0",
     {"activation": "int4:group=64", "normalization": "int4:group=16", "attention": "int4:group=64", "fewbit": 4},
     "eager"),
    ('rest="4bit" with normalization in int8, eager attention', "mink0",
     {"activation": "int4:group=64", "normalization": "int8", "attention": "int4:group=64", "fewbit": 4}, "eager"),
]
COLUMNS = ["outliers", "config", "cosine_min", "cosine_median"]


def llama(outliers: bool, attention: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         attn_implementation=attention)
    model = LlamaForCausalLM(config).train()
    if outliers:
        add_outliers(model)
    return model


def gradient(model, ids: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return torch.cat([p.grad.double().reshape(-1) for p in model.parameters() if p.grad is not None])


def reference_batches(model, seeds: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``seeds`` batches of 2 x 256 tokens, the first a sink, each with ``model``'s gradient."""
    batches = []
    for seed in range(seeds):
        ids = torch.randint(1, 2000, (2, 256), generator=torch.Generator().manual_seed(seed))
        ids[:, 0] = 0  # the sink token
        batches.append((ids, gradient(model, ids)))
    return batches


def cosine_table(intro: list[str], labels: list[str], rows: list[dict], digits: int) -> list[str]:
    """``intro`` and a row per configuration label: its min and median cosines without and with
    the outliers (the latter's min in bold)."""
    body = [*intro, "| configuration | random: min | random: median | outliers: min | outliers: median |",
            "|---|---:|---:|---:|---:|"]
    for label in labels:
        clean, outlying = (next(row for row in rows if row["config"] == label and row["outliers"] == flag)
                           for flag in (False, True))
        body.append(f"| {label} | {clean['cosine_min']:.{digits}f} | {clean['cosine_median']:.{digits}f} "
                    f"| **{outlying['cosine_min']:.{digits}f}** | {outlying['cosine_median']:.{digits}f} |")
    return body


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    rows = []
    for outliers in (False, True):
        bases, batches = {}, {}
        for label, spec, rest, *named in CONFIGS:
            attention = named[0] if named else "sdpa"
            if attention not in bases:
                bases[attention] = llama(outliers, attention)
                batches[attention] = reference_batches(bases[attention], args.seeds)
            model = copy.deepcopy(bases[attention])
            actcomp.to_compressed(model, spec, rest=rest, loss="plain")
            cosines = [float(F.cosine_similarity(gradient(model, ids), reference, dim=0))
                       for ids, reference in batches[attention]]
            rows.append({"outliers": outliers, "config": label, "cosine_min": min(cosines),
                         "cosine_median": statistics.median(cosines)})
            print(f"outliers={outliers} {label}: min {min(cosines):.4f}", flush=True)
    body = cosine_table(["Cosine of one step's full gradient (float64) against plain's; min and median over "
                         f"{args.seeds} batches. Targets (issue 24): >= 0.99 for 8-bit presets, >= 0.97 for 4-bit "
                         "ones, with the outliers built in.", ""], [label for label, *_ in CONFIGS], rows, 4)
    device = torch.device("cpu")
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, {"seeds": args.seeds}, load_before)
    write_results("lm_quality", device, args.threads, header,
                  "Gradient quality on a language model, with a trained model's outliers", body, rows, COLUMNS,
                  Path(args.out))


if __name__ == "__main__":
    main()
