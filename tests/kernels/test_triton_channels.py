"""The channel sparsifiers' Triton decode (kernels/triton_channels.py), on CPU tensors under
Triton's interpreter and a GPU's where there is one: the eager decode's bits (the kept values
as they were, NaN's payload too, zeros between), every channel axis and kept count, in one
launch that applies the finite flag."""

from __future__ import annotations

import pytest
import torch

import actcomp
from actcomp.core import chain
from actcomp.core.backends import use_backend
from actcomp.kernels import triton_runtime

# CPU tensors under Triton's interpreter, and a GPU's tensors where there is one.
DEVICES = [device for device in ("cpu", "cuda") if (torch.cuda.is_available() or device == "cpu")
           and triton_runtime.runs_on(torch.device(device))]
pytestmark = [pytest.mark.skipif(not DEVICES, reason="needs triton: on a GPU, or its interpreter on the CPU"),
              pytest.mark.parametrize("device", DEVICES),
              # The encode is torch's: asked for triton, it says so once.
              pytest.mark.filterwarnings("ignore:actcomp. backend 'triton' cannot run"),
              pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor).reshape(-1).view(torch.uint8)


def round_trip(spec: str, x: torch.Tensor, channel_dim: int, backend: str, flag_non_finite: bool = True):
    pipeline = actcomp.parse(spec)
    torch.manual_seed(0)  # rchannel's permutation
    triton_runtime.LAUNCHES.clear()
    with use_backend(backend):
        packed = chain.pack(pipeline.stages, pipeline.spec, x, channel_dim=channel_dim, flag_non_finite=flag_non_finite)
        return packed.tensors, chain.unpack(pipeline.stages, pipeline.spec, packed), dict(triton_runtime.LAUNCHES)


def assert_same(spec: str, x: torch.Tensor, channel_dim: int, flag_non_finite: bool = True) -> dict[str, int]:
    tensors, decoded, launches = round_trip(spec, x, channel_dim, "triton", flag_non_finite)
    want_tensors, want, _ = round_trip(spec, x, channel_dim, "eager", flag_non_finite)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(tensors, want_tensors, strict=True))
    assert decoded.dtype == want.dtype and decoded.shape == want.shape
    assert torch.equal(bits(decoded), bits(want))
    return launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ["channel0.5", "rchannel0.3", "channel0.99", "channel0"])
@pytest.mark.parametrize("shape, channel_dim", [((4, 37, 5), 1), ((3, 300), -1), ((129, 6), 0), ((7,), 0)])
def test_the_decode_gives_the_reference_bits(spec, shape, channel_dim, dtype, device):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=generator).to(dtype).to(device)
    assert assert_same(spec, x, channel_dim, flag_non_finite=False) == {"_channel_decode_kernel": 1}
    assert assert_same(spec, x.transpose(0, -1), channel_dim, flag_non_finite=False) == {"_channel_decode_kernel": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_values_flagged_or_kept_as_they_were(dtype, device):
    x = torch.randn(5, 64).to(dtype).to(device)
    x[:, 10] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1.0], dtype=dtype)
    x[:, 11] = 1e4  # channel 10 and 11 are kept
    for flag_non_finite in (True, False):
        launches = assert_same("channel0.5", x, 1, flag_non_finite)
        assert launches == ({"_finite_kernel": 1, "_channel_decode_kernel": 1} if flag_non_finite
                            else {"_channel_decode_kernel": 1})


def test_in_a_pipeline_the_channel_stage_applies_the_flag(device):
    x = torch.randn(6, 96, device=device)
    assert_same("channel0.5+int8", x, -1)
    x[0, 0] = float("nan")
    # int8's kernel owes no codes for a group holding NaN: the flag decodes everything to NaN.
    _, decoded, launches = round_trip("channel0.5+int8", x, -1, "triton")
    _, want, _ = round_trip("channel0.5+int8", x, -1, "eager")
    assert torch.equal(bits(decoded), bits(want)) and launches["_channel_decode_kernel"] == 1
