"""mesa8's Triton decode (kernels/triton_mesa.py), on CPU tensors under Triton's interpreter and
a GPU's where there is one: the eager decode's values bit for bit, every channel group, dtype
and layout, the finite flag applied in its one launch."""

from __future__ import annotations

import pytest
import torch

import actcomp
from actcomp.core.backends import use_backend
from actcomp.kernels import triton_runtime

# CPU tensors under Triton's interpreter, and a GPU's tensors where there is one.
DEVICES = [device for device in ("cpu", "cuda") if (torch.cuda.is_available() or device == "cpu")
           and triton_runtime.runs_on(torch.device(device))]
pytestmark = [pytest.mark.skipif(not DEVICES, reason="needs triton: on a GPU, or its interpreter on the CPU"),
              pytest.mark.parametrize("device", DEVICES)]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor).reshape(-1).view(torch.uint8)


def round_trip(spec: str, x: torch.Tensor, channel_dim: int | None, backend: str):
    pipeline = actcomp.parse(spec)
    triton_runtime.LAUNCHES.clear()
    with use_backend(backend):
        packed = pipeline.compress(x, channel_dim=channel_dim)
        return packed.tensors, pipeline.decompress(packed), dict(triton_runtime.LAUNCHES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec, shape, channel_dim", [
    ("mesa8", (4099,), None), ("mesa8", (1,), None), ("mesa8:groups=2", (3, 6, 5, 7), 1),
    ("mesa8:groups=3", (5, 9), -1), ("mesa8:groups=4", (8, 3, 5), 0), ("mesa8", (0, 4), -1)])
def test_the_decode_gives_the_reference_values(spec, shape, channel_dim, dtype, device):
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=generator) * 5).to(dtype).to(device)
    # The channel axis of the transposed view: the first and last axes swap places.
    swapped = None if channel_dim is None else {0: x.dim() - 1, x.dim() - 1: 0}.get(channel_dim % x.dim(), channel_dim)
    for case, axis in ((x, channel_dim), (x.transpose(0, -1), swapped)):
        tensors, decoded, launches = round_trip(spec, case, axis, "triton")
        want_tensors, want, _ = round_trip(spec, case, axis, "eager")
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(tensors, want_tensors, strict=True))
        assert decoded.dtype == want.dtype and decoded.shape == want.shape
        assert torch.equal(bits(decoded), bits(want))
        # The finite flag's check and the decode; the encode is the eager one.
        assert launches == ({"_finite_kernel": 1, "_mesa_decode_kernel": 1} if case.numel() else {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_non_finite_tensor_decodes_to_the_reference_nan(dtype, device):
    x = torch.randn(6, 40).to(dtype).to(device)
    x[2, 3] = float("inf")
    _, decoded, _ = round_trip("mesa8:groups=2", x, 1, "triton")
    _, want, _ = round_trip("mesa8:groups=2", x, 1, "eager")
    assert decoded.isnan().all() and torch.equal(bits(decoded), bits(want))
