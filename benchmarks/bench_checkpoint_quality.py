"""Gradient quality of whole-model mode inside checkpointed blocks, and of coding the block
inputs checkpoint stores, on a language model with and without a trained model's outliers.

    python benchmarks/bench_checkpoint_quality.py        # ~2 minutes on 2 cores

The Llama-shaped model of ``bench_lm_quality.py`` (hidden 256, 4 layers, 2 x 256 tokens, the
first token a sink), random and with ``actcomp.tools.llm_outliers.add_outliers`` (4 channels
with 40x norm gains, the sink's embedding 300x on them: the residual stream checkpoint stores is
where those outliers live). Each configuration runs HF's ``gradient_checkpointing_enable()``
(non-reentrant) and is compared with plain's gradient without checkpointing (float64 cosine of
one step's full gradient, min and median over ``--seeds`` batches; ``loss="plain"``):

- ``checkpointing``: plain checkpointing (1.0 up to float rounding: the reference's check);
- ``rest="8bit"``, with and without checkpointing: what the recomputation's codes cost;
- ``rest={"other": "int8"}``: the ``"8bit"`` preset plus the stored block inputs in int8;
- ``rest={"other": "fp8"}``: the same in fp8 (e4m3, a scale per tensor);
- ``rest={"other": "bf16"}``: the same in bf16 (half the bytes, a float32's rounding to 8 bits of
  mantissa: the mildest code of them).

Writes ``benchmarks/results/checkpoint_quality_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_lm_quality import cosine_table, gradient, llama, reference_batches
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp

# (label, rest or None for plain, checkpointing?)
CONFIGS = [
    ("checkpointing", None, True),
    ('rest="8bit", no checkpointing', "8bit", False),
    ('rest="8bit", checkpointing', "8bit", True),
    ('rest={"other": "int8"}, checkpointing (stored inputs int8)', {"other": "int8"}, True),
    ('rest={"other": "bf16"}, checkpointing (stored inputs bf16)', {"other": "bf16"}, True),
    ('rest={"other": "fp8"}, checkpointing (stored inputs fp8)', {"other": "fp8"}, True),
]
COLUMNS = ["outliers", "config", "cosine_min", "cosine_median"]


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
        base = llama(outliers)
        batches = reference_batches(base, args.seeds)
        for label, rest, checkpointing in CONFIGS:
            model = copy.deepcopy(base)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if rest is not None:
                actcomp.to_compressed(model, "mink0", rest=rest, loss="plain")
            cosines = [float(F.cosine_similarity(gradient(model, ids), reference, dim=0)) for ids, reference in batches]
            rows.append({"outliers": outliers, "config": label, "cosine_min": min(cosines),
                         "cosine_median": statistics.median(cosines)})
            print(f"outliers={outliers} {label}: min {min(cosines):.5f}", flush=True)
    body = cosine_table(["Cosine of one step's full gradient (float64) against plain's without checkpointing; "
                         f"min and median over {args.seeds} batches.", ""], [label for label, *_ in CONFIGS], rows, 5)
    device = torch.device("cpu")
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, {"seeds": args.seeds}, load_before)
    write_results("checkpoint_quality", device, args.threads, header,
                  "Gradient quality inside checkpointed blocks, with a trained model's outliers", body, rows, COLUMNS,
                  Path(args.out))


if __name__ == "__main__":
    main()
