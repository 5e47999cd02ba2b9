"""What coding the block inputs checkpoint stores does to an image model's gradient, beside
whole-model mode inside the checkpointed blocks (resnet50, ViT-S; random weights, 10 classes).

    python benchmarks/bench_checkpoint_inputs_images.py      # ~3 minutes on 2 cores

Per-block checkpointing (timm's ``set_grad_checkpointing()``) converted with
``"mink0.9+int8"`` and ``rest="8bit"``, then the same with ``rest={"other": "bf16"}`` and
``{"other": "int8"}`` (the stored inputs in bf16, in int8). Each prints one step's gradient cosine
against plain's without checkpointing (float64, batch 8 at 224 px, two batches). Min-k at random
weights bends the gradient far already (its cosine is low here); what the table shows is how much
the stored inputs' code moves it from there. Prints a markdown table.
"""

from __future__ import annotations

import time

import torch
from common import header_lines, load_average

import actcomp
from actcomp.tools.user_batch import UserBatch, copy_model, gradient_cosine

RUNS = [('rest="8bit"', "8bit"), ('rest={"other": "bf16"}', {"other": "bf16"}),
        ('rest={"other": "int8"}', {"other": "int8"})]


def main() -> None:
    import timm

    torch.set_num_threads(2)
    load_before, started, table = load_average(), time.perf_counter(), []
    table.append("\n| model | batch | " + " | ".join(label for label, _ in RUNS) + " |\n|---|---:|" + "---:|" * len(RUNS))
    for name in ["resnet50", "vit_small_patch16_224"]:
        torch.manual_seed(0)
        base = timm.create_model(name, num_classes=10)
        checkpointed = copy_model(base)
        checkpointed.set_grad_checkpointing()
        for seed in range(2):
            inputs = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(seed))
            run = UserBatch((inputs,), None, seed)
            reference = run.gradients(copy_model(base))
            cosines = [gradient_cosine(run.gradients(actcomp.to_compressed(copy_model(checkpointed), "mink0.9+int8",
                                                                           rest=rest)), reference)
                       for _, rest in RUNS]
            table.append(f"| {name} | {seed} | " + " | ".join(f"{cosine:.5f}" for cosine in cosines) + " |")
            print(table[-1], flush=True)
    header = header_lines(torch.device("cpu"), 2, 0, time.perf_counter() - started,
                          {"batch": 8, "img_size": 224, "batches": 2}, load_before)
    print("\n# Checkpointed image models: the stored inputs' code and the gradient\n")
    print("\n".join(f"- {line}" for line in header))
    print("\n".join(table))


if __name__ == "__main__":
    main()
