"""plan_budget at 0.2 on timm's vit_tiny_patch16_224 with and without attention dropout (8 images, 224 px)."""

import warnings

import timm
import torch

import actcomp

warnings.simplefilter("ignore")
torch.set_num_threads(2)
for drop in (0.0, 0.1):
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, attn_drop_rate=drop)
    x = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    plan = actcomp.plan_budget(model, x, 0.2)
    kinds = [(part.name, part.spec) for part in plan.parts if part.kind == "kind"]
    print(f"attn_drop {drop}: kept {plan.kept_fraction:.3f} cosine {plan.cosine:.4f} "
          f"smallest {plan.smallest_bytes / plan.plain_bytes:.3f}", kinds)
