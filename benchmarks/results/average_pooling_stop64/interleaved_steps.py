"""Whole-model and Linear/Conv-mode step time over plain's, interleaved in one process (UserBatch.step_time, 4 rounds)."""
import copy
import sys
import warnings

import timm
import torch

import actcomp
from actcomp.tools.user_batch import UserBatch

warnings.simplefilter("ignore")
torch.set_num_threads(2)
batch = int(sys.argv[1])
for name in sys.argv[2:]:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    x = torch.randn(batch, 3, 224, 224)
    run = UserBatch((x,), lambda logits: logits.float().square().mean())
    for rest in ("8bit", None):
        conv = actcomp.to_compressed(copy.deepcopy(model), "mink0.9+int8", rest=rest)
        print(name, batch, rest, f"{run.step_time(model, conv, 4):.2f}x", flush=True)
