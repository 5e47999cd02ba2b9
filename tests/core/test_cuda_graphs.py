"""On a CUDA device, a converted training step captures into a CUDA graph, and its replays
give the gradients an eager step gives on the same batch. Skipped without CUDA
(``benchmarks/gpu_check.py`` runs it where one is lent).

Why it matters: stop 52's H200 profile found the device idle 48-68% of a converted step waiting
on the host (Python, Triton's launcher); a replayed graph runs the step's kernels without either.
Nothing in the device path reads a value back (``test_cuda_sync.py``), so nothing stops a
capture; what this checks is that the replay recomputes: a batch copied into the captured
inputs after the capture gives that batch's gradients, twice in a row.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import actcomp

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    if "x" in batch:
        return F.cross_entropy(model(batch["x"]), batch["targets"])
    return model(**batch).loss


def _fresh_batch(batch: dict, seed: int) -> dict:
    """A batch of ``batch``'s shapes and dtypes with other values."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    fresh = {}
    for key, value in batch.items():
        if value.is_floating_point():
            fresh[key] = torch.randn(value.shape, generator=generator).to(value)
        else:
            high = int(value.max()) + 1
            fresh[key] = torch.randint(0, high, value.shape, generator=generator).to(value)
    if "labels" in fresh:
        fresh["labels"] = fresh["input_ids"]
    return fresh


def _captured(model: torch.nn.Module, static: dict) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """PyTorch's whole-network recipe: a few steps on a side stream (the kernels compiled, the
    allocator warm), then one step captured; returns the graph and its loss tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            _loss(model, static).backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = _loss(model, static)
        loss.backward()
    return graph, loss


def _cosine(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    a = torch.cat([grad.flatten().double() for grad in first])
    b = torch.cat([grad.flatten().double() for grad in second])
    return float(a @ b / (a.norm() * b.norm()))


@needs_cuda
@pytest.mark.parametrize("rest", ["8bit", "exact"])
@pytest.mark.parametrize("model_id", ["resnet18", "vit_tiny_patch16_224", "llama"])
def test_a_converted_step_replays_from_a_cuda_graph_with_an_eager_steps_gradients(model_id, rest):
    from integration.test_host_reads import MODELS

    entry = MODELS[model_id]
    torch.manual_seed(0)
    model = actcomp.to_compressed(entry.build(), "mink0.9+int8", rest=rest, return_freed_memory=False).cuda()
    eager = copy.deepcopy(model)
    # resnet18's roomy batch: with 2 values a BatchNorm channel, its input gradient is mostly
    # cancellation noise that any change in the order of sums reshuffles (tests/zoo.py).
    static = {key: value.cuda() for key, value in (entry.roomy_batch or entry.batch)().items()}
    graph, captured_loss = _captured(model, static)
    for seed in (1, 2):
        batch = _fresh_batch(static, seed)
        for key, value in batch.items():
            static[key].copy_(value)
        graph.replay()
        eager.zero_grad(set_to_none=True)
        eager_loss = _loss(eager, batch)
        eager_loss.backward()
        torch.cuda.synchronize()
        replayed = [param.grad for param in model.parameters() if param.requires_grad]
        expected = [param.grad for param in eager.parameters() if param.requires_grad]
        assert all(grad is not None and bool(grad.isfinite().all()) for grad in replayed)
        # The same kernels on the same batch: equal up to the order of float sums (cuDNN and
        # cuBLAS may pick other algorithms under capture). A replay of the captured batch
        # would be far off: each seed's batch is drawn afresh.
        torch.testing.assert_close(captured_loss, eager_loss, rtol=1e-4, atol=1e-5)
        assert _cosine(replayed, expected) > 0.9999
