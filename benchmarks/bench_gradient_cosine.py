"""Gradient direction under the lossy whole-model presets, over the zoo exactness harness.

    python benchmarks/bench_gradient_cosine.py   # every zoo model and policy: ~1 minute, 1 thread

For every model of ``tests/zoo.py`` (13 timm families, BERT, GPT-2, Llama and T5 from small
configs, and ``CLASS_TOKEN_VIT``, a ViT-tiny whose class token's LayerNorm row has std 1e-6;
a BatchNorm model on its ``roomy_batch``, which gives every BatchNorm channel at least
64 values), one training step in fp32 with a lossless layer spec (``mink0``) and each ``rest``
policy: the cosine between the flattened parameter gradient and plain PyTorch's, and the lowest
cosine of a single parameter's gradient (with that parameter's name). ``tests/integration/test_zoo.py``
holds the floors (``"8bit"`` >= 0.99, ``"4bit"`` >= 0.97); this writes the numbers behind them
and the alternatives they were chosen against.

Writes ``benchmarks/results/gradient_cosine_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from zoo import CLASS_TOKEN_VIT, ZOO, gradient_cosine, preset_gradients  # noqa: E402  (the harness's models, not a package)

# The zoo, and the ViT whose class-token row the norm groups are for.
MODELS = [*ZOO, CLASS_TOKEN_VIT]

POLICIES = {
    "8bit": "8bit",
    "4bit": "4bit",
    "8bit+fewbit3": {"fewbit": 3},
    "int4": "int4",
}


def measure(entry, policy) -> dict:
    grads, ref = preset_gradients(entry, policy)
    names = [name for name, grad in ref.items() if grad is not None and grad.norm() > 0]
    worst = min((gradient_cosine({n: grads[n]}, {n: ref[n]}), n) for n in names)
    return {"cosine": gradient_cosine(grads, ref), "worst_parameter_cosine": worst[0], "worst_parameter": worst[1]}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=[entry.id for entry in MODELS], help="zoo ids")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default=str(RESULTS_DIR), help="results folder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    load_before, start = load_average(), time.perf_counter()

    rows = []
    for entry in MODELS:
        if entry.id not in args.models:
            continue
        for name in args.policies:
            row = {"model": entry.id, "policy": name, **measure(entry, POLICIES[name])}
            rows.append(row)
            print(f"{entry.id:30s} {name:14s} {row['cosine']:.5f}  worst {row['worst_parameter_cosine']:.4f}"
                  f" ({row['worst_parameter']})", flush=True)

    table = ["| model | " + " | ".join(args.policies) + " |", "|---|" + "---:|" * len(args.policies)]
    for model in dict.fromkeys(row["model"] for row in rows):
        cells = [f"{row['cosine']:.4f}" for name in args.policies for row in rows
                 if row["model"] == model and row["policy"] == name]
        table.append(f"| {model} | " + " | ".join(cells) + " |")
    lowest = ["", "Lowest per policy: " + ", ".join(
        f"{name} {min(row['cosine'] for row in rows if row['policy'] == name):.4f}" for name in args.policies),
        "", "Lowest single-parameter cosine (one parameter's gradient alone). Gradients that vanish in exact "
        "arithmetic sit at the bottom, since rounding leaves a residue of its own: BERT's key bias (softmax "
        "ignores it), a BatchNorm weight whose incoming gradient is constant over its channel (LeViT; "
        "norm 3e-7 plain, 3e-4 with 8bit).", ""]
    lowest += [f"- {row['model']} {row['policy']}: {row['worst_parameter_cosine']:.4f} ({row['worst_parameter']})"
               for row in rows]
    settings = {"policies": " ".join(args.policies), "layer spec": "mink0"}
    header = header_lines(torch.device("cpu"), args.threads, 0, time.perf_counter() - start, settings, load_before)
    write_results("gradient_cosine", torch.device("cpu"), args.threads, header,
                  "Gradient cosine vs plain PyTorch, one fp32 step, whole-model presets", table + lowest, rows,
                  ["model", "policy", "cosine", "worst_parameter_cosine", "worst_parameter"], Path(args.out))


if __name__ == "__main__":
    main()
