"""Linear/Conv mode: exact forward and input gradient, the layer's input compressed for the weight
gradient. :mod:`.ops` holds each layer kind's math, :mod:`.function` the one autograd Function,
:mod:`.compressed_layer` the compressed twin of each layer (its class swapped in by
:mod:`actcomp.graph.module_surgery`), :mod:`.own_forward` layers with a forward of their own.

>>> import torch, actcomp
>>> actcomp.to_compressed(torch.nn.Linear(4, 2), "int8")
CompressedLinear(in_features=4, out_features=2, bias=True, compress='int8')
"""

# Pickles made by actcomp 0.1.0 name this function by this module.
from actcomp.layers.compressed_layer import _rebuild_compressed  # noqa: F401
