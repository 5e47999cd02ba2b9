"""actcomp.check on squeeze-excitation models: the whole gradient and the normalization kind alone."""
import sys
import warnings

import timm
import torch

import actcomp

warnings.simplefilter("ignore")
torch.set_num_threads(2)
for name in sys.argv[1:]:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    x = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    for rest in ("8bit", "4bit"):
        c = actcomp.check(model, x, "int8", rest=rest, rounds=1)
        kinds = {row.name: row.cosine for row in c.kinds}
        alone = kinds.get("normalization", float("nan"))
        print(f"{name} {rest}: whole {c.cosine:.5f}, normalization alone {alone:.5f}", flush=True)
