"""Whole-model mode: every tensor autograd saves, compressed by the kind of op saving it.

>>> import torch, actcomp
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
>>> print(actcomp.to_compressed(model, "int8", rest="exact").actcomp_rest)
exact
"""

# Pickles made by actcomp 0.1.0 name these by this module.
from actcomp.whole_model.compressed_model import (  # noqa: F401
    RestPolicy,
    _enter_submodule,
    _leave_submodule,
    _rebuild_compressed_model,
)
