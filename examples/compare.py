"""How the examples measure a training run and print plain vs actcomp.

>>> with Measured() as measured:
...     total = sum(range(1000))
>>> measured.seconds > 0
True
>>> plain = Run("plain", 4 << 20, 0.962, 2.0)
>>> print_comparison(plain, Run("actcomp", 1 << 20, 0.958, 2.6))
run      kept for backward  test acc  step time
plain              4.0 MiB    96.2%      1.00x
actcomp            1.0 MiB    95.8%      1.30x
verdict: actcomp keeps 4.0x fewer bytes for backward, accuracy -0.4 pp, steps 1.30x as long
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from actcomp.tools.memory import format_bytes


class Measured:
    """Wall time of a ``with`` block (``seconds``) and, on CUDA, the peak memory allocated during
    it above what was allocated when it began (``peak_cuda``; None without CUDA), so tensors
    left from an earlier run do not count."""

    seconds: float
    peak_cuda: int | None = None

    def __enter__(self) -> Measured:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exception) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.peak_cuda = torch.cuda.max_memory_allocated() - self.base
        self.seconds = time.perf_counter() - self.start


@dataclass(frozen=True)
class Run:
    """One training run's results: ``kept_bytes`` is what autograd keeps for backward for one
    batch (:func:`actcomp.memory_report`), ``seconds`` the training time, ``peak_cuda`` as
    :class:`Measured` gives it."""

    name: str
    kept_bytes: int
    accuracy: float
    seconds: float
    peak_cuda: int | None = None


def print_comparison(plain: Run, compressed: Run) -> None:
    """Print both runs (step time relative to ``plain``: both take the same steps) and a verdict."""
    cuda = plain.peak_cuda is not None
    print(f"{'run':<8} {'kept for backward':>17}" + (f" {'peak CUDA':>10}" if cuda else "") + "  test acc  step time")
    for run in (plain, compressed):
        peak = f" {format_bytes(run.peak_cuda):>10}" if cuda else ""
        print(f"{run.name:<8} {format_bytes(run.kept_bytes):>17}{peak}  {run.accuracy:>7.1%}  "
              f"{run.seconds / plain.seconds:>8.2f}x")
    peak = f" ({plain.peak_cuda / compressed.peak_cuda:.2f}x lower CUDA peak)" if cuda else ""
    print(f"verdict: actcomp keeps {plain.kept_bytes / compressed.kept_bytes:.1f}x fewer bytes for backward{peak}, "
          f"accuracy {100 * (compressed.accuracy - plain.accuracy):+.1f} pp, "
          f"steps {compressed.seconds / plain.seconds:.2f}x as long")
