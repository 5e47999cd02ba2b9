"""What whole-model mode keeps of one saved tensor, in both engines (the eager saved-tensor hooks
of :mod:`~actcomp.whole_model.session` and the compiled ones of
:mod:`~actcomp.whole_model.in_graph`): each form holds frozen values and tensors only and gives
the backward its tensor back with ``unpack()``.

- :class:`AsIs`: the tensor itself (checked for in-place changes when unpacked);
- :class:`Compressed`: a codec's packed form and the codec that decodes it;
- :class:`Recomputed`: a gated MLP's ``act(gate)``, rebuilt from the gate's compressed form;
- :class:`Rescaled`: an RMSNorm's ``x * rstd``, rebuilt from ``x``'s compressed form;
- :class:`Sided`: lossy values with the exact bits of the one comparison the backward makes
  (the compiled engine's: eager mode sees the two ops that save them apart).

>>> import torch
>>> from actcomp.core.pipeline import parse
>>> kept = Compressed(parse("int8"), parse("int8").compress(torch.ones(4, 64)))
>>> kept.unpack().shape, torch.equal(kept.unpack(), torch.ones(4, 64))
(torch.Size([4, 64]), True)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
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

    # What the compiled engine hands from its pack hook to its unpack hook: the tensors, and a
    # template of everything else (constants a compiled graph cannot carry) named by ``key``.
    def packed_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.packed.tensors

    def template(self) -> Compressed:
        """This form less its tensors. Under dynamic shapes the element count a codec's
        metadata holds (a mask's) is an expression of the forward's symbols (``256*s77``) that
        the unpack hook's trace cannot name: it is kept as :data:`ELEMENT_COUNT` and worked
        out again from the shape handed to :meth:`refill`."""
        layout = self.packed.layout
        count = math.prod(layout.shape)
        if isinstance(count, torch.SymInt):
            layout = replace(layout, stages=_substituted(layout.stages, lambda value: ELEMENT_COUNT if (
                isinstance(value, torch.SymInt) and str(value) == str(count)) else value))
        return Compressed(self.codec, Packed((None,) * len(self.packed.tensors), layout))

    def key(self) -> str:
        return f"{self.codec!r} {self.packed.layout!r}"

    def refill(self, tensors: Iterator[torch.Tensor], shape: tuple | None = None) -> Compressed:
        """This template's form with the next of ``tensors`` in it, and ``shape`` (the shape as
        the unpack hook's trace has it, handed over beside the tensors) where given."""
        layout = self.packed.layout
        if shape is not None:
            count = math.prod(shape)
            layout = replace(layout, shape=torch.Size(shape), stages=_substituted(
                layout.stages, lambda value: count if value is ELEMENT_COUNT else value))
        return Compressed(self.codec, Packed(tuple(next(tensors) for _ in self.packed.tensors), layout))


class _ElementCount:
    """Stands in a template for the element count of the form's shape (see ``template``)."""

    def __repr__(self) -> str:
        return "ELEMENT_COUNT"


ELEMENT_COUNT = _ElementCount()


def _substituted(value, swap):
    """``value`` (nested tuples) with each leaf passed through ``swap``."""
    if type(value) is tuple:
        return tuple(_substituted(item, swap) for item in value)
    return swap(value)




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


class Rescaled(NamedTuple):
    """A norm written out in elementwise ops (HF's RMSNorm: ``w * (x * rstd).to(dtype)``) saves
    its input ``x`` (for ``pow``) and the normalized ``x * rstd`` (for the gain's product): two
    codes of one tensor's values. The second is rebuilt in backward from the first's code and
    the per-row statistic kept as it is, halving what the norm keeps; it errs as the decoded
    ``x`` does, times ``rstd``, where a code of its own would add an error of its own."""

    source: Compressed
    statistic: torch.Tensor  # rstd, one value a row, broadcast over the row
    dtype: torch.dtype  # the product's, or its cast's

    def unpack(self) -> torch.Tensor:
        return torch.mul(self.source.unpack(), self.statistic).to(self.dtype)


class Sided(NamedTuple):
    """A tensor the backward reads both through one comparison with a constant and otherwise (a
    ReLU output that is also the next Linear's input): ``values`` in a lossy code, ``mask`` a
    :class:`~actcomp.whole_model.exact_codecs.ComparisonMask` 's exact bits, and the decoded values
    moved, where they crossed the threshold, back to the side the bits say. The comparison then
    gives the original's result bit for bit; the values err as their code does."""

    values: Compressed
    mask: Compressed

    def unpack(self) -> torch.Tensor:
        values = self.values.unpack()
        comparison = self.mask.codec
        held = comparison.predicate(self.mask.unpack())  # the stand-ins compare as the original did
        return on_side(values, held, comparison.comparison, comparison.threshold)

    def packed_tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.values.packed_tensors(), *self.mask.packed_tensors())

    def template(self) -> Sided:
        return Sided(self.values.template(), self.mask.template())

    def key(self) -> str:
        return f"sided [{self.values.key()}] [{self.mask.key()}]"

    def refill(self, tensors: Iterator[torch.Tensor], shape: tuple | None = None) -> Sided:
        return Sided(self.values.refill(tensors, shape), self.mask.refill(tensors, shape))


def on_side(values: torch.Tensor, held: torch.Tensor, comparison: str, threshold: float) -> torch.Tensor:
    """``values`` moved, where needed, just past ``threshold`` to the side where
    ``comparison(x, threshold)`` gave ``held`` for the original. Python numbers only: this runs
    inlined in compiled backward graphs, where a tensor constant made while the hook is traced
    does not survive.

    >>> on_side(torch.tensor([0.5, -0.5]), torch.tensor([True, True]), "le", 0.0)
    tensor([ 0.0000, -0.5000])
    """
    info = torch.finfo(values.dtype)
    step = max(abs(threshold) * info.eps, info.smallest_normal)  # at least one step of the dtype
    below, above = threshold - step, threshold + step
    if comparison in ("le", "lt"):
        return torch.where(held, values.clamp(max=threshold if comparison == "le" else below),
                           values.clamp(min=above if comparison == "le" else threshold))
    return torch.where(held, values.clamp(min=threshold if comparison == "ge" else above),
                       values.clamp(max=below if comparison == "ge" else threshold))
