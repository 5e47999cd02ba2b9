"""What whole-model mode keeps of one saved tensor, in both engines (the eager saved-tensor hooks
of :mod:`~actcomp.whole_model.session` and the compiled ones of
:mod:`~actcomp.whole_model.in_graph`): each form holds frozen values and tensors only and gives
the backward its tensor back with ``unpack()``.

- :class:`AsIs`: the tensor itself (checked for in-place changes when unpacked);
- :class:`Compressed`: a codec's packed form and the codec that decodes it;
- :class:`Recomputed`: a gated MLP's ``act(gate)``, rebuilt from the gate's compressed form;
- :class:`Sided`: lossy values with the exact bits of the one comparison the backward makes.

>>> import torch
>>> from actcomp.core.pipeline import parse
>>> kept = Compressed(parse("int8"), parse("int8").compress(torch.ones(4, 64)))
>>> kept.unpack().shape, torch.equal(kept.unpack(), torch.ones(4, 64))
(torch.Size([4, 64]), True)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from actcomp.core.codec import Compressor
from actcomp.core.pipeline import Packed, Pipeline
from actcomp.errors import ActcompError
from actcomp.torch_compat import version_of


class AsIs:
    """A saved tensor kept as it is; unpacking checks it was not modified in place since."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        # Detached: a tensor autograd saves is often its op's own output, whose grad_fn holds
        # this object; holding the tensor itself would close a reference cycle through C++ that
        # the garbage collector cannot see, leaking the whole graph of a forward that never runs
        # backward. The detached alias shares the storage and the version counter, and autograd
        # re-attaches the grad_fn when it unpacks.
        self.tensor, self.version = tensor.detach(), version_of(tensor)

    def unpack(self) -> torch.Tensor:
        if version_of(self.tensor) != self.version:
            raise ActcompError(
                f"a tensor of shape {tuple(self.tensor.shape)} saved for backward was modified by an in-place "
                f"operation after it was saved (version {self.version}, now {version_of(self.tensor)}); plain PyTorch "
                "raises here too: make the in-place op out of place"
            )
        return self.tensor


class Compressed(NamedTuple):
    """A saved tensor in packed form and the codec that decodes it: frozen values only, so it
    holds no closure and could be pickled or handed to compiled code."""

    codec: Compressor | Pipeline
    packed: Packed

    def unpack(self) -> torch.Tensor:
        """The stand-in (or, for lossy codecs, the approximation) the backward reads."""
        return self.codec.decompress(self.packed)


class Recomputed(NamedTuple):
    """A gated MLP's ``act(gate)``, saved by the gate product, rebuilt in backward from the
    compressed form of ``gate`` that the activation saved already, instead of a second code of
    its own: a third of what a SwiGLU/GeGLU block keeps. ``act(decoded gate)`` errs as the
    decoded gate does (SiLU's and GELU's slopes stay within [-0.1, 1.1]), no more than a code of
    ``act(gate)`` would."""

    source: Compressed
    op: str  # "silu" or "gelu"
    approximate: str  # GELU's

    def unpack(self) -> torch.Tensor:
        gate = self.source.unpack()
        return F.silu(gate) if self.op == "silu" else F.gelu(gate, approximate=self.approximate)
