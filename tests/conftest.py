import pytest
import torch

import actcomp


@pytest.fixture
def seeded():
    """Start from a fixed global RNG state (random inputs, stochastic rounding)."""
    torch.manual_seed(0)


@pytest.fixture
def single_thread():
    """Run on one intra-op thread: tiny ops on a shared 2-core machine are many times faster,
    and plain and converted models then run the same kernels either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def compress_calls(monkeypatch):
    """Shapes of every tensor any pipeline compresses while the test runs."""
    calls: list[tuple[int, ...]] = []
    original = actcomp.Pipeline.compress

    def counting(self, x, **kwargs):
        calls.append(tuple(x.shape))
        return original(self, x, **kwargs)

    monkeypatch.setattr(actcomp.Pipeline, "compress", counting)
    return calls


@pytest.fixture
def compressing_layers(monkeypatch):
    """A function ``model -> names of its converted layers that kept a compressed input`` while
    the test ran (each converted layer has its own pipeline instance; a layer that reuses the
    copy another layer made of the same input counts too)."""
    compressed_by: set[int] = set()
    original = actcomp.autograd._compress_once

    def recording(pipeline, *args, **kwargs):
        compressed_by.add(id(pipeline))
        return original(pipeline, *args, **kwargs)

    monkeypatch.setattr(actcomp.autograd, "_compress_once", recording)

    def names(model) -> set[str]:
        return {name for name, pipeline in actcomp.compressed_layers(model).items() if id(pipeline) in compressed_by}

    return names
