"""Plot what ``bench_lm_loss.py`` wrote: each method's step peak against its step time, per run.

    python benchmarks/plot_lm_loss.py        # reads benchmarks/results/**/lm_loss_*.csv, writes lm_loss.png

One panel per results file and (dtype, sequence length): x is the step time over plain's, y the
step's peak memory over plain's (both from the file, both measured side by side there); lower
and to the left is better. Needs matplotlib (the ``[plot]`` extra).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from common import RESULTS_DIR

MARKERS = {"plain": "o", "torch-chunked": "s", "actcomp-loss": "D", "actcomp-8bit": "*", "checkpoint": "^",
           "checkpoint+actcomp-8bit": "P"}


def read(path: Path) -> tuple[str, list[dict]]:
    """The file's device line and its rows."""
    lines = path.read_text().splitlines()
    device = next((line.split("device: ", 1)[1] for line in lines if line.startswith("# device:")), path.stem)
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    return device.split(", threads")[0], rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "lm_loss.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = []
    for path in sorted(args.results.rglob("lm_loss_*.csv")):
        device, rows = read(path)
        for key in dict.fromkeys((row["dtype"], row.get("tokens", "2048")) for row in rows):
            panels.append((f"{device}\n{key[0]}, {key[1]} tokens",
                           [row for row in rows if (row["dtype"], row.get("tokens", "2048")) == key]))
    figure, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.8), squeeze=False)
    for axis, (title, rows) in zip(axes[0], panels):
        for row in rows:
            axis.scatter(float(row["step_ratio"]), 1 / float(row["peak_vs_plain"]), marker=MARKERS.get(row["method"], "x"),
                         s=70, label=row["method"])
        if max(float(row["step_ratio"]) for row in rows) > 3:
            axis.set_xscale("log")
            axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}x"))
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("step time / plain's")
        axis.set_ylim(0, 1.05)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("step peak / plain's")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels), frameon=False)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
