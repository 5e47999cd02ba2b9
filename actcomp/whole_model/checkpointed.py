"""Whole-model compression inside activation checkpointing: what a checkpointed block saves when
its backward recomputes it is kept in the codecs the forward would have chosen.

Per-block checkpointing (``torch.utils.checkpoint``, timm's ``set_grad_checkpointing()``, HF's
``gradient_checkpointing_enable()``) keeps each block's inputs and recomputes the block in
backward; torch then holds every tensor the recomputed block saves whole until the block's
backward has read it, so the step's peak is the stored inputs plus one whole block. Under
whole-model mode the recomputed block keeps them as a whole-model forward would (the same op
table, policy and codecs, a session of :mod:`~actcomp.whole_model.session` whose scopes are the
recomputed block's), so the block costs what a compressed forward of it costs:

- **non-reentrant** checkpoint (timm's and torch's default): a block whose forward runs inside a
  whole-model forward is marked when it starts (:func:`forward_session` names that forward's
  session), and its recomputation packs through a session of the same policy
  (:func:`~actcomp.torch_compat.compress_checkpoint_recomputation`);
- **reentrant** checkpoint recomputes the block with autograd recording, inside backward:
  the block's own forward pre-hook starts a whole-model forward there, as for a submodule called
  from outside the model (:mod:`~actcomp.whole_model.compressed_model`).

Recomputation gives the forward's values (checkpoint restores the RNG state), and the codecs'
rounding noise is a function of the values and their positions, so the recomputed codes are the
ones a forward without checkpointing would have kept; under ``rest="exact"`` gradients equal
plain checkpointing's bit for bit. What checkpoint stores of the block's inputs is the
``"other"`` kind's (a custom autograd Function saves them): kept as they are unless
``rest={"other": ...}`` says otherwise.

>>> import torch, actcomp
>>> block = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
>>> class Net(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.block = block
...     def forward(self, x):
...         return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
>>> net = actcomp.to_compressed(Net(), "int8", rest="8bit")
>>> net(torch.randn(4, 8, requires_grad=True)).sum().backward()
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch

from actcomp.graph.saved_tensors import tracking_scopes
from actcomp.torch_compat import compress_checkpoint_recomputation
from actcomp.whole_model.policy import RestPolicy
from actcomp.whole_model.session import _Session, _Sessions, open_session


class _Forward(threading.local):
    session: _Session | _Sessions | None = None


_FORWARD = _Forward()


@contextlib.contextmanager
def forward_session(session: _Session | _Sessions) -> Iterator[None]:
    """Name ``session`` as this thread's running whole-model forward while the block runs, so
    that checkpointed blocks inside it compress what their recomputation saves."""
    _install()
    outer, _FORWARD.session = _FORWARD.session, session
    try:
        yield
    finally:
        _FORWARD.session = outer


@functools.cache
def _install() -> bool:
    """Checkpoint's recomputation hooks, replaced once for the process (not at every forward)."""
    return compress_checkpoint_recomputation(_captured, _recomputing)


def _captured() -> tuple[RestPolicy, frozenset] | None:
    """What a checkpointed block starting now takes to its recomputation: the running forward's
    policy and the tensors it keeps as they are (buffers, the caller's data), or None."""
    session = _FORWARD.session
    return None if session is None else (session.policy, frozenset(session.excluded))


@contextlib.contextmanager
def _recomputing(captured: tuple[RestPolicy, frozenset], inputs: list[torch.Tensor]) -> Iterator[tuple]:
    """A session of the forward's policy around one block's recomputation, with its scopes; the
    block's inputs are kept as they are (checkpoint holds them until the block's backward ends:
    a code of one would only add bytes)."""
    policy, excluded = captured
    session = open_session(policy, inputs, excluded)
    try:
        with tracking_scopes():
            yield session.pack, session.unpack
    finally:
        session.close()
