"""Step time of checkpointing with whole-model mode inside it, against each alone, under one
allocator: is the combination's time checkpointing's plus actcomp's own?

    python benchmarks/bench_checkpoint_steps.py                     # ViT-S and resnet50, batch 8 (~8 minutes)
    python benchmarks/bench_checkpoint_steps.py --models resnet18 --batch 4 --rounds 2

One process per model: timm's model four ways (plain; per-block checkpointing,
``set_grad_checkpointing()``, non-reentrant; ``to_compressed(model, SPEC, rest=REST)``; both),
AdamW, timed in interleaved rounds after a warm-up step each. :func:`actcomp.host_allocator.return_freed_memory`
is set before any of them, so all four pay the same page faults: as users run them (fresh
processes, ``bench_user_peak.py``) checkpointing alone runs under glibc's defaults and the
converted runs under the 1 MiB mmap threshold, whose faults the recomputation pays a second time.
Reported: each way's median step over plain's, and the combination against checkpointing's
ratio plus whole-model's extra (``ckpt + (whole - 1)``).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import timm
import torch
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.host_allocator import return_freed_memory

WAYS = {"plain": (False, False), "checkpointing": (True, False), "whole": (False, True), "both": (True, True)}


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One timed training step, in seconds."""
    start = time.perf_counter()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["vit_small_patch16_224", "resnet50"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--spec", default="mink0.9+int8")
    parser.add_argument("--rest", default="8bit")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    allocator = return_freed_memory()
    rows = []
    for name in args.models:
        runs = {}
        for way, (checkpointing, whole) in WAYS.items():
            torch.manual_seed(0)
            model = timm.create_model(name, pretrained=False, num_classes=10)
            if checkpointing:
                model.set_grad_checkpointing(True)
            if whole:
                model = actcomp.to_compressed(model, args.spec, rest=args.rest)
            runs[way] = (model.train(), torch.optim.AdamW(model.parameters(), lr=1e-4))
        x = torch.randn(args.batch, 3, args.img_size, args.img_size)
        y = torch.randint(0, 10, (args.batch,))

        for way in WAYS:
            step(*runs[way], x, y)
        ratios = {way: [] for way in WAYS}
        for index in range(args.rounds):
            order = list(WAYS)[index % 4:] + list(WAYS)[:index % 4]
            seconds = {way: step(*runs[way], x, y) for way in order}
            for way in WAYS:
                ratios[way].append(seconds[way] / seconds["plain"])
        median = {way: statistics.median(values) for way, values in ratios.items()}
        additive = median["checkpointing"] + median["whole"] - 1
        rows.append({"model": name, **{f"{way}_ratio": median[way] for way in WAYS}, "additive": additive})
        print(f"{name}: " + ", ".join(f"{way} {median[way]:.2f}x" for way in WAYS) + f"; additive {additive:.2f}x", flush=True)
    device = torch.device("cpu")
    settings = {"spec": args.spec, "rest": args.rest, "batch": args.batch, "img_size": args.img_size,
                "rounds": args.rounds, "allocator": f"return_freed_memory(): {allocator}", "optimizer": "AdamW"}
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, settings, load_before)
    body = ["Median over rounds of each way's step over plain's in the same round (one process, one allocator "
            "setting for all). `checkpointing + whole's extra` = checkpointing's ratio + whole's - 1.", "",
            "| model | checkpointing | whole | both | checkpointing + whole's extra |", "|---|---:|---:|---:|---:|"]
    body += [f"| {row['model']} | {row['checkpointing_ratio']:.2f}x | {row['whole_ratio']:.2f}x | "
             f"**{row['both_ratio']:.2f}x** | {row['additive']:.2f}x |" for row in rows]
    columns = ["model", "plain_ratio", "checkpointing_ratio", "whole_ratio", "both_ratio", "additive"]
    write_results("checkpoint_steps", device, args.threads, header,
                  "Checkpointing with whole-model mode inside it: step times under one allocator", body, rows, columns,
                  Path(args.out))


if __name__ == "__main__":
    main()
