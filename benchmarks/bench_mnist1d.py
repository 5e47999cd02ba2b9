"""Test accuracy on MNIST-1D: the dataset's own MLP and CNN trained plain and compressed, same seeds.

    pip install mnist1d                       # the dataset's generator (numpy, scipy, matplotlib)
    python benchmarks/bench_mnist1d.py --budgets 0.0833   # 3 seeds, both nets: ~10 minutes on 2 cores
    python benchmarks/bench_mnist1d.py --steps 300 --seeds 1 --budgets 0.0833   # a check

MNIST-1D (Greydanus, 2020) is generated, not downloaded: ``mnist1d.data.make_dataset`` with the
paper's arguments builds its 4,000 training and 1,000 test signals of 40 samples from ten digit
templates (padding, shear, scale, noise and translation drawn from the dataset's fixed seed, 42),
so every machine trains on the same data. The nets and the training are the paper's: an MLP
(40-100-100-10, ReLU) and a CNN (three stride-2 Conv1d of 25 channels, ReLU, one Linear), Adam at
lr 0.01, batches of 100 drawn from one seeded generator (every method sees the same batches),
6,000 steps; the paper reports about 68% (MLP) and 94% (CNN) test accuracy.

Methods: ``plain``; ``--budgets F ...``: ``actcomp.plan_budget(model, batch, F)`` on the seed's
freshly initialised net and 100 training signals drawn apart from the training stream, applied
as planned; ``--methods`` adds fixed presets. Reported: the test accuracy after training, its
difference from plain's per seed (percentage points), their mean and spread, and each method's
kept bytes for backward as a fraction of plain's (``memory_report`` on the planning batch).
Issue 39's target: >= 12x fewer bytes kept (F = 1/12) within 1 pp of plain's accuracy, 3 seeds.

Writes ``benchmarks/results/mnist1d_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results
from torch import nn
from torch.nn import functional as F

import actcomp

# (label, Linear/Conv spec, rest); None: plain.
METHODS = [("plain", None, None), ('"int8", rest="8bit"', "int8", "8bit"), ('"int4", rest="4bit"', "int4", "4bit")]
COLUMNS = ["net", "method", "seed", "test_accuracy", "vs_plain_pp", "kept_fraction"]
BATCH = 100


def dataset() -> dict[str, torch.Tensor]:
    """MNIST-1D as the paper generates it (its default arguments and seed)."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as error:
        raise SystemExit("this benchmark generates MNIST-1D with its own package: pip install mnist1d") from error
    data = make_dataset(get_dataset_args())
    return {"x": torch.as_tensor(data["x"], dtype=torch.float32), "y": torch.as_tensor(data["y"]).long(),
            "x_test": torch.as_tensor(data["x_test"], dtype=torch.float32),
            "y_test": torch.as_tensor(data["y_test"]).long()}


class MLP(nn.Sequential):
    """The paper's MLP: 40-100-100-10 with ReLU."""

    def __init__(self):
        super().__init__(nn.Linear(40, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))


class CNN(nn.Module):
    """The paper's CNN: three stride-2 Conv1d of 25 channels with ReLU, then one Linear."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv1d(1, 25, 5, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv1d(25, 25, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv1d(25, 25, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(25 * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.unsqueeze(1)).flatten(1))


NETS = {"mlp": MLP, "cnn": CNN}


def net_for(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return NETS[name]().train()


def planning_batch(data: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training signals from a generator of their own (the training stream is untouched)."""
    rows = torch.randint(0, data["x"].shape[0], (BATCH,), generator=torch.Generator().manual_seed(seed + 2000))
    return data["x"][rows], data["y"][rows]


def convert(model: nn.Module, spec, rest) -> nn.Module:
    return model if spec is None else actcomp.to_compressed(model, spec, rest=rest)


def kept_bytes(name: str, spec, rest, seed: int, batch) -> int:
    """Bytes the method keeps for backward on ``batch`` (``memory_report``; ``spec`` None: plain)."""
    from actcomp.tools.user_batch import UserBatch

    return UserBatch(batch[0]).memory(convert(net_for(name, seed), spec, rest)).total_bytes


def train(name: str, spec, rest, seed: int, args: argparse.Namespace, data: dict) -> float:
    """Test accuracy after ``args.steps`` steps of Adam on batches from a seeded generator."""
    model = convert(net_for(name, seed), spec, rest)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(seed + 1000)
    for _ in range(args.steps):
        rows = torch.randint(0, data["x"].shape[0], (BATCH,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(data["x"][rows]), data["y"][rows]).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(data["x_test"]).argmax(1) == data["y_test"]).float().mean().item()
    return 100 * accuracy


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--nets", nargs="+", choices=sorted(NETS), default=["mlp", "cnn"])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--methods", nargs="*", default=[], metavar="LABEL",
                        help=f"fixed presets to run besides plain, of: {'; '.join(label for label, _, _ in METHODS[1:])}")
    parser.add_argument("--budgets", type=float, nargs="*", default=[], help="plan_budget fractions to train")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    unknown = set(args.methods) - {label for label, _, _ in METHODS[1:]}
    if unknown:
        parser.error(f"unknown --methods {sorted(unknown)}; known: {[label for label, _, _ in METHODS[1:]]}")
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    data = dataset()
    rows = []
    methods = [method for method in METHODS if method[0] == "plain" or method[0] in args.methods]
    budget_labels = [f"plan_budget({fraction:.4g})" for fraction in args.budgets]
    for name in args.nets:
        for seed in range(args.seeds):
            batch = planning_batch(data, seed)
            x, y = batch
            planned, plain_bytes, plain = [], kept_bytes(name, None, None, seed, batch), None
            for label, fraction in zip(budget_labels, args.budgets):
                plan = actcomp.plan_budget(net_for(name, seed), x, fraction,
                                           loss_fn=lambda out, y=y: F.cross_entropy(out, y))
                print(f"{name} seed {seed} {label}: {plan.call()} (cosine {plan.cosine:.4f}, {plan.steps} steps)",
                      flush=True)
                planned.append((label, plan.pipeline, plan.rest))
            for label, spec, rest in methods + planned:
                kept = kept_bytes(name, spec, rest, seed, batch) / plain_bytes
                accuracy = train(name, spec, rest, seed, args, data)
                plain = accuracy if spec is None else plain
                rows.append({"net": name, "method": label, "seed": seed, "test_accuracy": accuracy,
                             "vs_plain_pp": accuracy - plain, "kept_fraction": kept})
                print(f"{name} seed {seed} {label}: test accuracy {accuracy:.1f}% ({accuracy - plain:+.1f} pp), "
                      f"kept {kept:.4f} ({1 / kept:.1f}x fewer)", flush=True)
    body = [f"MNIST-1D (4,000 training and 1,000 test signals, generated); {args.steps} steps of Adam at lr "
            f"{args.lr}, batches of {BATCH}. Target: >= 12x fewer bytes kept within 1 pp of plain's accuracy.", "",
            "| net | method | kept (x fewer) | test accuracy % (per seed) | vs plain, pp (per seed) "
            "| mean vs plain, pp (sd) | worst, pp |",
            "|---|---|---:|---|---|---:|---:|"]
    for name in args.nets:
        for label in [label for label, _, _ in methods] + budget_labels:
            mine = [row for row in rows if row["net"] == name and row["method"] == label]
            kept = statistics.mean(row["kept_fraction"] for row in mine)
            accuracies = ", ".join(f"{row['test_accuracy']:.1f}" for row in mine)
            deltas = [row["vs_plain_pp"] for row in mine]
            spread = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
            body.append(f"| {name} | {label} | {kept:.4f} ({1 / kept:.1f}x) | {accuracies} | "
                        f"{', '.join(f'{delta:+.1f}' for delta in deltas)} | **{statistics.mean(deltas):+.2f}** "
                        f"(sd {spread:.2f}) | {min(deltas):+.1f} |")
    device = torch.device("cpu")
    settings = {"nets": args.nets, "steps": args.steps, "seeds": args.seeds, "lr": args.lr, "budgets": args.budgets,
                "methods": args.methods}
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, settings, load_before)
    write_results("mnist1d", device, args.threads, header, "Test accuracy on MNIST-1D", body, rows, COLUMNS,
                  Path(args.out))


if __name__ == "__main__":
    main()
