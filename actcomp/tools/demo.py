"""``python -m actcomp demo``: a small CNN and a small ViT on scikit-learn's digits.

Every configuration (plain, then each pipeline) starts from the same weights and sees the
same batches; they train in lockstep, one step each in turn, so the step-time ratios are
measured side by side on the same noisy machine. Prints test accuracy, saved activation
bytes (:func:`actcomp.memory_report`) and step time relative to the plain model.

>>> run_demo(epochs=1, specs=["mink0.9"], models=["cnn"])  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from actcomp.convert import compressed_layers, to_compressed
from actcomp.core.pipeline import Pipeline, parse
from actcomp.errors import ActcompError
from actcomp.graph.op_kinds import module_kind
from actcomp.tools.memory import format_bytes, memory_report
from actcomp.tools.plotting import X_LESS_NOTE, pyplot_for
from actcomp.whole_model.policy import RestPolicy


def load_digits_tensors(seed: int = 0):
    """Digits as (N, 1, 8, 8) float tensors in [0, 1], split 80/20 with a fixed seed."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ActcompError("the demo trains on scikit-learn's digits: pip install scikit-learn "
                           "(or pip install 'actcomp[demo]')") from None
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    return images[order[:cut]], labels[order[:cut]], images[order[cut:]], labels[order[cut:]]


class SmallCNN(nn.Sequential):
    def __init__(self, classes: int = 10):
        super().__init__(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes),
        )


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class SmallViT(nn.Module):
    def __init__(self, classes: int = 10, dim: int = 64, depth: int = 3, heads: int = 4, patch: int = 2):
        super().__init__()
        self.patch_embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (8 // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


_MODELS = {"cnn": (SmallCNN, 3e-3), "vit": (SmallViT, 3e-3)}


def run_demo(epochs: int = 8, specs=("mink0.9+int8",), models=("cnn", "vit"), seed: int = 0, batch: int = 64,
             threads: int = 1, plot: str | None = None, rest="8bit") -> list[dict]:
    """Train, print the comparison table and the verdict, return the table's rows.

    Configurations: plain, then each spec in Linear/Conv mode, then each spec in whole-model
    mode with ``rest`` (``None``: no whole-model rows). In each row ``memory_reduction`` is
    plain / compressed saved bytes (higher is better) and ``step_time_vs_plain`` is compressed /
    plain step time (lower is better).

    One thread by default: these models are tiny, and more threads only add contention.

    >>> rows = run_demo(epochs=1, specs=["int8"], models=["cnn"], rest=None)  # doctest: +SKIP
    >>> [row["pipeline"] for row in rows]  # doctest: +SKIP
    ['plain', 'int8']
    """
    demo_started = time.perf_counter()
    configurations = _configurations([parse(spec) for spec in specs], rest)
    tqdm = _tqdm()
    # Said before the data and the models are built, so something shows at once.
    print(f"actcomp demo: {' and '.join(models)} on scikit-learn's digits, {epochs} epoch{'s' * (epochs != 1)}, "
          f"{len(configurations)} runs in lockstep: {', '.join(label for label, _, _ in configurations)}", flush=True)
    torch.set_num_threads(threads)
    plt = pyplot_for(plot) if plot else None
    train_x, train_y, test_x, test_y = load_digits_tensors(seed)
    labels = [label for label, _, _ in configurations]
    rows, curves = [], {}
    for model_name in models:
        # A short bar: no rate, a two-number loss, so an 80-column terminal keeps room for the bar.
        progress = tqdm(total=epochs * -(-len(train_y) // batch), desc=model_name, unit="step", leave=False,
                        dynamic_ncols=True, disable=None,
                        bar_format="{desc} {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}<{remaining}{postfix}]")
        with progress:
            nets, losses, times = _train_in_lockstep(model_name, configurations, train_x, train_y, epochs=epochs,
                                                     batch=batch, seed=seed, progress=progress)
        rows += _rows(model_name, labels, nets, times, train_x[:batch], test_x, test_y)
        curves[model_name] = dict(zip(labels, losses))
    _print_table(rows, batch)
    print(verdict(rows))
    if plt is not None:
        _plot(plt, curves, plot)
    # Timings depend on the thread count, so the line quoted with them names it.
    used = torch.get_num_threads()
    print(f"total wall time {time.perf_counter() - demo_started:.0f} s on {used} torch thread{'s' * (used != 1)}")
    return rows


def _configurations(pipelines: list[Pipeline], rest) -> list[tuple[str, Pipeline | None, RestPolicy | None]]:
    """(label, pipeline, whole-model policy): plain, each pipeline alone, then each with ``rest``.

    >>> [label for label, _, _ in _configurations([parse("int8")], "8bit")]
    ['plain', 'int8', 'int8 rest=8bit']
    """
    policy = None if rest is None else RestPolicy.parse(rest)
    configurations = [("plain", None, None)] + [(p.spec, p, None) for p in pipelines]
    if policy is not None:
        configurations += [(f"{p.spec} rest={policy}", p, policy) for p in pipelines]
    return configurations


def _train_in_lockstep(model_name: str, configurations: list, train_x: torch.Tensor, train_y: torch.Tensor, *,
                       epochs: int, batch: int, seed: int, progress) -> tuple[list[nn.Module], list, list]:
    """One net per configuration, all from the same weights, trained on the same batches one step
    each in turn (so the machine's drift hits all alike); the nets, their losses and step times."""
    factory, lr = _MODELS[model_name]
    torch.manual_seed(seed)
    base = factory()
    nets = [copy.deepcopy(base) if pipeline is None else to_compressed(copy.deepcopy(base), pipeline, rest=mode)
            for _, pipeline, mode in configurations]
    optimizers = [torch.optim.AdamW(net.parameters(), lr=lr) for net in nets]
    losses: list[list[float]] = [[] for _ in nets]
    times: list[list[float]] = [[] for _ in nets]
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = -(-len(train_y) // batch)
    for epoch in range(epochs):
        order = torch.randperm(len(train_y), generator=generator)
        for start in range(0, len(order), batch):
            index = order[start:start + batch]
            for net, optimizer, net_losses, net_times in zip(nets, optimizers, losses, times):
                tick = time.perf_counter()
                loss = F.cross_entropy(net(train_x[index]), train_y[index])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                net_times.append(time.perf_counter() - tick)
                net_losses.append(loss.item())
            progress.update()
        plain_loss, last_loss = (statistics.fmean(run[-steps_per_epoch:]) for run in (losses[0], losses[-1]))
        progress.set_postfix_str(f"loss {plain_loss:.2f}/{last_loss:.2f}")
        if progress.disable:
            # No terminal to draw a bar on (a log, a pipe): a line per epoch instead.
            print(f"{model_name} epoch {epoch + 1}/{epochs}: loss {plain_loss:.3f} plain, {last_loss:.3f} "
                  f"{configurations[-1][0]}", flush=True)
    return nets, losses, times


def _rows(model_name: str, labels: list[str], nets: list[nn.Module], times: list[list[float]], sample: torch.Tensor,
          test_x: torch.Tensor, test_y: torch.Tensor) -> list[dict]:
    """One table row per trained net: test accuracy, saved bytes, and step time against the plain net's."""
    plain_bytes = memory_report(nets[0], sample).total_bytes
    rows = []
    for label, net, step_times in zip(labels, nets, times):
        net.eval()
        with torch.no_grad():
            accuracy = (net(test_x).argmax(1) == test_y).float().mean().item()
        report = memory_report(net, sample)
        ratios = [t / base_t for t, base_t in zip(step_times, times[0])]
        rows.append({"model": model_name, "pipeline": label, "accuracy": accuracy,
                     "saved_bytes": report.total_bytes, "memory_reduction": plain_bytes / report.total_bytes,
                     "step_time_vs_plain": statistics.median(ratios), "layers_freeing_nothing": len(report.not_freed),
                     "inputs_also_kept_by": inputs_also_kept_by(net, report),
                     "layers_compressed": len(compressed_layers(net))})
    return rows


def _tqdm():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ActcompError("the demo shows its progress with tqdm: pip install tqdm (or pip install 'actcomp[demo]')") from None
    return tqdm


def verdict(rows: list[dict]) -> str:
    """One line on the last configuration (whole-model mode when it ran): memory saved, accuracy
    kept, time paid, per model.

    >>> verdict([{"model": "cnn", "pipeline": "plain", "accuracy": 0.95, "memory_reduction": 1.0, "step_time_vs_plain": 1.0},
    ...          {"model": "cnn", "pipeline": "int8", "accuracy": 0.96, "memory_reduction": 3.9, "step_time_vs_plain": 1.3}])
    'verdict for int8: cnn keeps 3.9x less for backward, accuracy +1.0 pp, 1.3x step time'
    """
    label = rows[-1]["pipeline"]
    plain = {row["model"]: row["accuracy"] for row in rows if row["pipeline"] == "plain"}
    per_model = "; ".join(
        f"{row['model']} keeps {row['memory_reduction']:.1f}x less for backward, accuracy "
        f"{100 * (row['accuracy'] - plain[row['model']]):+.1f} pp, {row['step_time_vs_plain']:.1f}x step time"
        for row in rows if row["pipeline"] == label)
    return f"verdict for {label}: {per_model}"


def _print_table(rows: list[dict], batch: int) -> None:
    print(f"\nmemory: {X_LESS_NOTE}; step time = compressed / plain, lower is better")
    width = max(16, *(len(row["pipeline"]) for row in rows))
    print(f"{'model':<6} {'pipeline':<{width}} {'test acc':>8} {f'saved (batch {batch})':>18} {'x less':>9} {'step time':>10}")
    for row in rows:
        print(f"{row['model']:<6} {row['pipeline']:<{width}} {row['accuracy']:>8.1%} {format_bytes(row['saved_bytes']):>18} "
              f"{row['memory_reduction']:>8.2f}x {row['step_time_vs_plain']:>9.2f}x")
    print("saved = bytes autograd keeps for backward, deduplicated by storage; step time = median over steps, "
          "interleaved with the plain model's")
    # The same layers free nothing whatever the pipeline: one note per model.
    notes = {(row["model"], row["layers_freeing_nothing"], row["layers_compressed"], row["inputs_also_kept_by"])
             for row in rows}
    for model_name, lost, total, kept_by in sorted(notes):
        if lost:
            print(f"note: {model_name}: {lost} of {total} converted layers free nothing: their input is also kept by "
                  f"{kept_by}; see 'Shared tensors' in docs/guide/whole-model.md")


def inputs_also_kept_by(net: nn.Module, report) -> str:
    """What else keeps the inputs of the converted layers that free nothing, by module class
    (and, for a block of no kind of its own, the kind of op in it); '' when there are none.

    >>> net = to_compressed(SmallCNN(), "mink0.9")
    >>> inputs_also_kept_by(net, memory_report(net, torch.randn(2, 1, 8, 8)))
    'ReLU'
    """
    modules = {name or "(model)": module for name, module in net.named_modules()}
    found = {}
    for item in report.not_freed:
        for saver in item.kept_by:
            module = modules[saver]
            name = getattr(type(module), "actcomp_base", type(module)).__name__
            if next(module.children(), None) is not None and module_kind(module) is None:
                # A block running functional ops (a ViT block's attention): the op kind says which.
                kinds = sorted({s.op_kind for s in report.storages if saver in s.savers and s.nbytes == item.input_bytes})
                name = f"the {' or '.join(kinds)} in {name}" if kinds else name
            found[name] = None
    return ", ".join(found)


def _plot(plt, curves: dict, path: str) -> None:
    figure, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    for ax, (model_name, by_label) in zip(axes[0], curves.items()):
        for label, losses in by_label.items():
            window = 20
            smooth = [statistics.fmean(losses[max(0, i - window):i + 1]) for i in range(len(losses))]
            ax.plot(smooth, label=label)
        ax.set_title(f"{model_name} on digits")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (moving average)")
        ax.set_yscale("log")
        ax.legend()
    figure.tight_layout()
    figure.savefig(path)
    print(f"loss curves saved to {path}")
