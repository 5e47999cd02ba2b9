"""Bytes kept for backward by timm models with average pooling, plain against whole-model mode.

Run from benchmarks/ (before: with PYTHONPATH at the older tree). Batch 8 at 224 px, random
weights, "mink0.9+int8" on the Linear/Conv inputs; the pooling kind's row and the total.
"""

import copy
import sys
import warnings

import timm
import torch

import actcomp

warnings.simplefilter("ignore")
torch.set_num_threads(2)
for name in sys.argv[1:]:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).train()
    x = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    plain = actcomp.memory_report(model, x)
    cells = []
    for rest in ("exact", "8bit"):
        report = actcomp.memory_report(actcomp.to_compressed(copy.deepcopy(model), "mink0.9+int8", rest=rest), x)
        pooling = next((row.kept_bytes for row in report.kinds if row.kind == "pooling"), 0)
        other = next((row.kept_bytes for row in report.kinds if row.kind == "other"), 0)
        cells.append(f"{rest}: {plain.total_bytes / report.total_bytes:.2f}x (pooling {pooling / 2**20:.0f} MiB, "
                     f"other {other / 2**20:.0f} MiB)")
    print(f"| {name} | {plain.total_bytes / 2**20:.0f} MiB | " + " | ".join(cells) + " |", flush=True)
