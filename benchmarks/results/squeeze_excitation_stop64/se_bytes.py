"""Bytes kept for backward by timm models with squeeze-excitation, plain against whole-model mode
(batch 8 at 224 px, random weights, "mink0.9+int8" on the layers); the normalization and other kinds."""

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
    for rest in ("8bit", "4bit"):
        report = actcomp.memory_report(actcomp.to_compressed(copy.deepcopy(model), "mink0.9+int8", rest=rest), x)
        kinds = {row.kind: row.kept_bytes for row in report.kinds}
        cells.append(f"{rest}: {plain.total_bytes / report.total_bytes:.2f}x (normalization "
                     f"{kinds.get('normalization', 0) / 2**20:.0f} MiB, other {kinds.get('other', 0) / 2**20:.0f} MiB)")
    print(f"| {name} | {plain.total_bytes / 2**20:.0f} MiB | " + " | ".join(cells) + " |", flush=True)
