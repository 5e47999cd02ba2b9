"""On the device path actcomp reads nothing back to the host: whole training steps of resnet18,
ViT-tiny and a tiny Llama, converted with ``rest="8bit"``, ``"4bit"`` and ``"exact"`` and run
on the reference codecs (``use_backend("eager")``, the oracle of every device kernel), call no
op that reads a value back (``aten._local_scalar_dense``, behind ``.item()``, ``bool()`` and
``int()`` of a tensor; ``nonzero``; ``bincount``; ...) more often than the plain model does.

A read on a GPU drains the launch queue: at a few hundred saved tensors a step, one read each
made the first GPU run 16-41x plain's step. On a CPU the same reads cost nothing, so the CPU
implementations may take them (named as CPU shortcuts, :mod:`actcomp.kernels.eager_cpu`); this
test runs on CPU tensors with those shortcuts off, which is what a GPU runs.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from models import HostReads
from zoo import ZOO

import actcomp
from actcomp.core.backends import use_backend

MODELS = {entry.id: entry for entry in ZOO if entry.id in ("resnet18", "vit_tiny_patch16_224", "llama")}


def training_step(model: torch.nn.Module, batch: dict) -> None:
    """Forward, loss (a causal LM's own, which actcomp computes chunk by chunk), backward."""
    torch.manual_seed(1)
    if "x" in batch:
        loss = F.cross_entropy(model(batch["x"]), batch["targets"])
    else:
        loss = model(**batch).loss
    loss.backward()


def host_reads_of_a_step(model: torch.nn.Module, batch: dict) -> collections.Counter[str]:
    model.train()
    training_step(model, batch)  # the first step sets things up (lazy modules, caches)
    with HostReads() as reads:
        training_step(model, batch)
    return reads.counts


def test_the_counter_sees_the_reads_it_is_meant_to_catch():
    x = torch.tensor([0.0, 2.0, 0.0])
    with HostReads() as reads:
        bool(x.sum() > 0), x.nonzero(), torch.bincount(x.long()), x[x > 0]
    assert reads.counts["_local_scalar_dense"] == 1 and reads.counts["nonzero"] >= 1
    assert reads.counts["bincount"] == 1


@pytest.mark.parametrize("rest", ["8bit", "4bit", "exact"])
@pytest.mark.parametrize("model_id", sorted(MODELS))
def test_a_converted_training_step_reads_nothing_back_on_the_reference_path(model_id, rest):
    entry = MODELS[model_id]
    torch.manual_seed(0)
    plain = entry.build()
    converted = actcomp.to_compressed(copy.deepcopy(plain), "mink0.9+int8", rest=rest, return_freed_memory=False)
    batch = entry.batch()

    plain_reads = host_reads_of_a_step(plain, batch)
    with use_backend("eager"):
        converted_reads = host_reads_of_a_step(converted, batch)

    assert converted_reads == plain_reads, f"actcomp adds host reads: {dict(converted_reads - plain_reads)}"
