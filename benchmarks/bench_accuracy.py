"""Test accuracy of a small CNN trained on scikit-learn's digits, plain vs compressed activations.

    python benchmarks/bench_accuracy.py                        # defaults: about 2 minutes, 1 thread
    python benchmarks/bench_accuracy.py --specs mink0.8 --seeds 0 --epochs 5

The 8x8 digit images are split once (a fixed, stratified 75/25 split, whatever the seed).
For each seed, the baseline and every spec start from the same weights and see the same
batches in the same order; only the saved activations differ. As ``to_compressed`` does
by default, the first conv (it reads the image) stays plain: the other two convs and the
classifier are converted. Reported: mean and sample standard deviation over seeds of the
final test accuracy, and the difference from the baseline in percentage points, with the
standard deviation of the per-seed (paired) differences.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import RESULTS_DIR, add_specs_argument, benchmark_parser, check_specs, header_lines, load_average, write_results
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import actcomp

BASELINE = "baseline"
DEFAULT_SPECS = ["mink0.8", "pmink0.9", "mink0.9+int8", "random0.8", "channel0.8"]
# The target: min-k variants within this many percentage points of the baseline (mean over seeds).
MINK_SPECS, TARGET_PP = ("mink0.8", "pmink0.9", "mink0.9+int8"), 0.5
SPLIT_SEED, TEST_FRACTION = 0, 0.25

COLUMNS = ["spec", "seeds", "accuracy_mean", "accuracy_std", "diff_pp", "diff_pp_std", "final_loss_mean",
           "per_seed_accuracy", "converted_layers", "train_s"]


def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train images, train labels, test images, test labels; images (N, 1, 8, 8) scaled to [0, 1]."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    labels = torch.tensor(digits.target)
    train_idx, test_idx = train_test_split(torch.arange(len(labels)).numpy(), test_size=TEST_FRACTION,
                                           random_state=SPLIT_SEED, stratify=labels.numpy())
    return images[train_idx], labels[train_idx], images[test_idx], labels[test_idx]


def small_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 10),
    )


def train_and_test(spec: str, seed: int, data: tuple[torch.Tensor, ...], args: argparse.Namespace) -> dict:
    """Final test accuracy and last-epoch mean training loss of one run."""
    train_x, train_y, test_x, test_y = data
    torch.manual_seed(seed)  # same initial weights for the baseline and every spec
    model = small_cnn()
    if spec != BASELINE:
        actcomp.to_compressed(model, spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    order = torch.Generator().manual_seed(seed)  # same batches in the same order for every spec
    model.train()
    for _ in range(args.epochs):
        losses = []
        for batch in torch.randperm(len(train_y), generator=order).split(args.batch):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(train_x[batch]), train_y[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    return {"accuracy": accuracy, "final_loss": statistics.fmean(losses),
            "converted_layers": len(actcomp.compressed_layers(model))}


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    baseline = [run["accuracy"] for run in runs[BASELINE]]
    rows = []
    for spec, spec_runs in runs.items():
        accuracies = [run["accuracy"] for run in spec_runs]
        diffs = [100 * (value - base) for value, base in zip(accuracies, baseline)]
        rows.append({
            "spec": spec, "seeds": len(accuracies),
            "accuracy_mean": 100 * statistics.fmean(accuracies),
            "accuracy_std": 100 * statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
            "diff_pp": statistics.fmean(diffs),
            "diff_pp_std": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            "final_loss_mean": statistics.fmean(run["final_loss"] for run in spec_runs),
            "per_seed_accuracy": " ".join(f"{100 * value:.2f}" for value in accuracies),
            "converted_layers": spec_runs[0]["converted_layers"],
            "train_s": sum(run["train_s"] for run in spec_runs),
        })
    return rows


def markdown_body(rows: list[dict], test_size: int) -> list[str]:
    body = [
        f"Digits (scikit-learn, 8x8), fixed stratified split: {test_size} test images, so one image is "
        f"{100 / test_size:.2f} pp. Accuracy: mean ± sample std over seeds; `diff`: mean of the per-seed "
        "differences from the baseline (same weights at start, same batches), ± their std. "
        "CNN: conv(1→32) ReLU conv(32→64) ReLU maxpool conv(64→64) ReLU linear(1024→10); the first conv stays plain.",
        "",
        "| spec | test accuracy % | diff pp | final train loss | per-seed accuracy % | layers converted |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        body.append(f"| `{row['spec']}` | {row['accuracy_mean']:.2f} ± {row['accuracy_std']:.2f} "
                    f"| {row['diff_pp']:+.2f} ± {row['diff_pp_std']:.2f} | {row['final_loss_mean']:.4f} "
                    f"| {row['per_seed_accuracy']} | {row['converted_layers']} |")
    checked = [row for row in rows if row["spec"] in MINK_SPECS]
    if checked:
        body += ["", f"Target: min-k variants within {TARGET_PP:g} pp of the baseline (mean over seeds)."]
        for row in checked:
            verdict = "met" if row["diff_pp"] >= -TARGET_PP else "NOT met"
            body.append(f"- `{row['spec']}`: {row['diff_pp']:+.2f} pp, {verdict}")
    return body


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__)
    add_specs_argument(parser, DEFAULT_SPECS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (momentum 0.9)")
    # The model is tiny: a second thread only adds synchronisation (on a shared 2-core machine
    # it made each run several times slower), and one thread keeps the runs reproducible.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if min(args.epochs, args.batch, args.threads) < 1 or args.lr <= 0:
        parser.error("--epochs, --batch and --threads must be >= 1, --lr > 0")
    check_specs(parser, args.specs)

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    load_before = load_average()
    started = time.perf_counter()
    data = digits_split()
    runs: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for spec in [BASELINE, *args.specs]:
            run_started = time.perf_counter()
            run = train_and_test(spec, seed, data, args)
            run["train_s"] = time.perf_counter() - run_started
            runs.setdefault(spec, []).append(run)
            print(f"seed {seed} {spec:>14}: test accuracy {100 * run['accuracy']:6.2f}%  "
                  f"final loss {run['final_loss']:.4f}  ({run['train_s']:.1f} s)", flush=True)
    rows = summarise(runs)
    settings = {"seeds": " ".join(map(str, args.seeds)), "epochs": args.epochs, "batch": args.batch,
                "lr": args.lr, "split seed": SPLIT_SEED}
    header = header_lines(device, args.threads, args.seeds[0], time.perf_counter() - started, settings, load_before)
    title = "actcomp test accuracy on digits, plain vs compressed"
    write_results("accuracy_digits", device, args.threads, header, title, markdown_body(rows, len(data[3])), rows,
                  COLUMNS, args.out_dir)


if __name__ == "__main__":
    main()
