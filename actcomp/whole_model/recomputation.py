"""What a compiled backward recomputes instead of keeping, under a lossy ``compress_in_graph``.

AOTAutograd's min-cut partitioner decides which forward values the backward keeps and which it
recomputes. By default it never recomputes a value the backward must materialize (one a matrix
product reads: a LayerNorm's output that is the next Linear's input, GELU's output): recomputing
is free only where it fuses into a kernel the backward runs anyway. Under compression that trade
turns. Keeping such a value costs a code of its own, while recomputing it from the norm's or the
activation's input, which the backward keeps anyway (compressed), costs one pointwise kernel. So
under a plan with a lossy codec, :func:`~actcomp.compress_in_graph` lets the partitioner
recompute those values too (a ViT block's saved tensors go from 9 to 6: both norms' outputs and
GELU's output are rebuilt in backward), with one exception this pass marks: a value the graph
compares with a constant (ReLU's output, which the backward tests ``<= 0``) is kept, where the
hooks keep the comparison's exact bits; rebuilt from a lossy code, its mask would flip (resnet18's
one-step gradient cosine fell from 0.99996 to 0.9964 under ``"8bit"`` without this pass, and is
0.99999 with it). Exact plans keep the partitioner's defaults, so their gradients stay the
compiled step's bit for bit.

>>> import torch
>>> from torch import fx
>>> graph = fx.Graph()
>>> relu = graph.call_function(torch.ops.aten.relu.default, (graph.placeholder("x"),))
>>> mask = graph.call_function(torch.ops.aten.le.Scalar, (relu, 0))
>>> KeepComparedValues()(graph)
>>> [node.name for node in graph.nodes if "recompute" in node.meta]
['relu_default']
"""

from __future__ import annotations

import hashlib
import pathlib

import torch
from torch import fx

from actcomp.torch_compat import custom_graph_pass_base, keep_for_backward

# The ordering comparisons with a constant, by name: ReLU's backward (``x <= 0``), a clamp's, a
# threshold's. The compiled hooks keep a tensor read only through one of them as its bits.
SCALAR_COMPARISONS = {
    torch.ops.aten.le.Scalar: "le", torch.ops.aten.lt.Scalar: "lt", torch.ops.aten.ge.Scalar: "ge",
    torch.ops.aten.gt.Scalar: "gt",
}
# What this pass keeps: those, equality with a constant, and ReLU's fused backward.
_KEPT_FOR = frozenset(SCALAR_COMPARISONS) | {
    torch.ops.aten.eq.Scalar, torch.ops.aten.ne.Scalar, torch.ops.aten.threshold_backward.default,
}


class KeepComparedValues(custom_graph_pass_base()):
    """Inductor's joint-graph pass that tells the partitioner to keep, never recompute, every
    value the graph compares with a constant (after running the user's own joint pass,
    ``previous``)."""

    previous = None  # the user's joint_custom_post_pass, if any

    def __call__(self, graph: fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        for node in graph.nodes:
            if node.op == "call_function" and any(user.target in _KEPT_FOR for user in node.users):
                keep_for_backward(node)

    def uuid(self):
        # Compiled graphs cached with another version of this pass must not be reused.
        source = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()
        previous = self.previous.uuid() if self.previous is not None else None
        return ("actcomp keep compared values", source, previous)
