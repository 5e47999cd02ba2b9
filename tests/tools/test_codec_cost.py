"""actcomp.tools.codec_cost counts what the codecs do in a step, and only that."""

import torch
from torch import nn

import actcomp
from actcomp.tools.codec_cost import codec_cost


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))


def test_counts_each_compressed_input_once_and_the_bytes_it_frees():
    model = actcomp.to_compressed(_mlp(), "int8", first_layer=None)

    # A new batch each step: one compressed copy of a tensor is reused while the tensor lives.
    cost = codec_cost(lambda: model(torch.randn(32, 64)).sum().backward())

    inputs = [torch.randn(32, 64), torch.randn(32, 128), torch.randn(32, 128)]
    packed = [actcomp.parse("int8").compress(t) for t in inputs]
    assert (cost.packs, cost.unpacks) == (3, 3)
    assert cost.bytes_freed == sum(t.numel() * 4 - p.nbytes for t, p in zip(inputs, packed))
    assert cost.aten_ops > 0 and cost.bytes_moved > cost.bytes_freed
    assert cost.python_us_per_tensor > 0


def test_host_syncs_are_told_apart_inside_and_outside_the_codecs():
    model = actcomp.to_compressed(_mlp(), "int8", first_layer=None)

    def step():
        loss = model(torch.randn(32, 64)).sum()
        float(loss.detach())  # the step's own read, outside any codec
        loss.backward()

    cost = codec_cost(step)

    # Inside: eager's one check for NaN and inf per packed tensor.
    assert cost.host_syncs_in_codecs == cost.packs == 3
    assert cost.host_syncs == cost.host_syncs_in_codecs + 1


def test_a_plain_model_costs_nothing():
    model = _mlp()
    x = torch.randn(32, 64)

    cost = codec_cost(lambda: model(x).sum().backward())

    assert (cost.packs, cost.aten_ops, cost.bytes_moved, cost.host_syncs) == (0, 0, 0, 0)


def test_native_kernels_are_counted_as_operations_with_their_bytes():
    from actcomp.core.backends import use_backend
    from actcomp.kernels import native_cpu

    if native_cpu.library() is None:
        import pytest
        pytest.skip("no C compiler to build the native kernels")
    model = actcomp.to_compressed(_mlp(), "mink0.9+int8", first_layer=None)
    x = torch.randn(4096, 64)
    costs = {}
    for backend in ("eager", "native"):
        with use_backend(backend):
            costs[backend] = codec_cost(lambda: model(x).sum().backward())
    eager, native = costs["eager"], costs["native"]
    assert native.bytes_freed == eager.bytes_freed and native.packs == eager.packs > 0
    # Fewer operations and bytes than the eager chain, but not nothing: each kernel call is one
    # operation charged the tensors it reads and writes; reading the inputs alone moves more
    # bytes than compressing them frees.
    assert 0 < native.aten_ops < eager.aten_ops and native.bytes_freed < native.bytes_moved < eager.bytes_moved
    # The candidate search and its compaction return data-sized results, as nonzero does.
    assert native.host_syncs_in_codecs >= 2 * native.packs
