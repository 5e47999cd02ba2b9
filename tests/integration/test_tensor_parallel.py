"""Tensor parallelism: a model parallelized with ``parallelize_module`` (DTensor weights, and
DTensor activations where a style hands its layer one) converts and trains.

Local-tensor activations (the default ``use_local_output=True`` of ColwiseParallel) compress as
any others; a layer whose input is itself a DTensor (RowwiseParallel's sharded input) keeps it
as it is, after one warning: the codecs read a plain tensor's memory (a native kernel given a
DTensor read freed memory before this was guarded). One process, a one-rank gloo mesh: the
code path is the same on more ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import actcomp

pytestmark = pytest.mark.usefixtures("single_thread")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


@pytest.fixture
def mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(x).sum().backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:.*(DTensor|redistribute).*:UserWarning")
def test_a_tensor_parallel_model_converts_and_keeps_dtensor_inputs_as_they_are(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plain = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    model = actcomp.to_compressed(copy.deepcopy(plain), "int8", rest="8bit")
    x = torch.randn(4, 8, 32)

    with pytest.warns(UserWarning, match=r"layer 'down' \(Linear\) reads a DTensor; .* kept as they are"):
        got = gradients(model, x)
    expected = gradients(plain, x)
    # down's input (a DTensor) is kept exactly: its weight gradient is plain's, bit for bit.
    assert torch.equal(got["down.weight"], expected["down.weight"])
    # up's input is a plain tensor, compressed in int8 like any other.
    assert F.cosine_similarity(got["up.weight"].flatten(), expected["up.weight"].flatten(), dim=0) > 0.999
    report = actcomp.memory_report(model, x)
    assert "int8" in {storage.codec for storage in report.storages}


def test_a_parameter_read_as_a_layers_input_is_still_compressed(compress_calls):
    # Parameters are plain tensors to the codecs; only true subclasses (DTensor) are kept as is.
    layer = actcomp.to_compressed(nn.Sequential(nn.Linear(8, 4)), "int8", first_layer=None)
    table = nn.Parameter(torch.randn(3, 8))
    layer(table).sum().backward()
    assert compress_calls == [(3, 8)]
