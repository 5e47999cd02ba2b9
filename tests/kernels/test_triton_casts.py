"""The Triton casts (kernels/triton_casts.py), run on CPU tensors under Triton's interpreter
(tests/conftest.py turns it on without a GPU): the eager reference's codes, scales and values
bit for bit, non-finite values included where no finite flag covers them, in the launches each
promises."""

from __future__ import annotations

import pytest
import torch
from models import bits

import actcomp
from actcomp.core import chain
from actcomp.core.backends import use_backend
from actcomp.kernels import triton_runtime

# CPU tensors under Triton's interpreter, and a GPU's tensors where there is one.
DEVICES = [device for device in ("cpu", "cuda") if (torch.cuda.is_available() or device == "cpu")
           and triton_runtime.runs_on(torch.device(device))]
pytestmark = [pytest.mark.skipif(not DEVICES, reason="needs triton: on a GPU, or its interpreter on the CPU"),
              pytest.mark.parametrize("device", DEVICES),
              # numpy, running the kernels, says so where NaN or inf meet a division.
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

NAN, INF = float("nan"), float("inf")


def values(dtype: torch.dtype, count: int = 4099) -> torch.Tensor:
    """Every magnitude fp8 and the casts round differently: fp8's subnormals and ties, beyond
    fp16's and bf16's range, both zeros."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(count, generator=generator) * torch.logspace(-12, 12, count).roll(17)
    x[:6] = torch.tensor([0.0, -0.0, 7e4, -3e38, 3.3e38, 65520.0])
    return x.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype)


def launched(spec: str, x: torch.Tensor, backend: str, flag_non_finite: bool = True):
    """The packed tensors, the decoded tensor and the launches counted in between."""
    codec = actcomp.parse(spec)
    triton_runtime.LAUNCHES.clear()
    with use_backend(backend):
        stages = codec.stages
        packed = chain.pack(stages, codec.spec, x, flag_non_finite=flag_non_finite)
        decoded = chain.unpack(stages, codec.spec, packed)
    return packed.tensors, decoded, dict(triton_runtime.LAUNCHES)


def assert_same(spec: str, x: torch.Tensor, flag_non_finite: bool = True) -> dict[str, int]:
    tensors, decoded, launches = launched(spec, x, "triton", flag_non_finite)
    want_tensors, want, _ = launched(spec, x, "eager", flag_non_finite)
    assert [(t.shape, t.dtype) for t in tensors] == [(t.shape, t.dtype) for t in want_tensors]
    for got, expected in zip(tensors, want_tensors):
        assert torch.equal(bits(got), bits(expected))
    assert decoded.dtype == want.dtype and decoded.shape == want.shape
    assert torch.equal(bits(decoded), bits(want))
    return launches


@pytest.mark.parametrize("spec", ["fp8", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_casts_give_the_reference_bits(spec, dtype, device):
    x = values(dtype).to(device)
    for case in (x, x[:1], x[:7], x[:4096].view(64, 64).t(), x * 1e-30, torch.zeros(5, dtype=dtype, device=device)):
        assert_same(spec, case)


@pytest.mark.parametrize("spec", ["fp8", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_values_give_the_reference_bits_flagged_or_not(spec, dtype, device):
    x = values(dtype, 300).to(device)
    x[[3, 50, 51, 299]] = torch.tensor([NAN, INF, -INF, -NAN], dtype=dtype, device=device)
    for flag_non_finite in (True, False):
        assert_same(spec, x, flag_non_finite)
    x = values(dtype, 300).to(device)
    x[7] = INF  # amax inf: every finite code 0, the inf NaN
    assert_same(spec, x, flag_non_finite=False)


def test_launches_per_encode_and_decode(device):
    x = values(torch.float32).to(device)
    assert assert_same("fp8", x, flag_non_finite=False) == {"_fp8_range_kernel": 1, "_fp8_encode_kernel": 1,
                                                            "_fp8_decode_kernel": 1}
    # The flag without a pass of its own: the encode writes it (max |x| is finite exactly where
    # every value is), the decode applies it.
    assert assert_same("fp8", x) == {"_fp8_range_kernel": 1, "_fp8_encode_kernel": 1, "_fp8_decode_kernel": 1}
    assert assert_same("fp16", x) == {"_cast_kernel": 1}  # the decode is a plain cast, torch's
    assert assert_same("bf16", x.to(torch.bfloat16)[:1000].float()) == {"_cast_kernel": 1}
    assert assert_same("fp16", x.to(torch.bfloat16)) == {"_cast_kernel": 1}  # back to bf16: a plain cast
    assert assert_same("fp16", x.to(torch.float16)) == {}  # nothing to cast


def test_the_empty_tensor_is_encoded_without_a_kernel(device):
    assert assert_same("fp8", torch.zeros(0, 3, device=device)) == {}


def test_fp8s_range_pass_strides_over_blocks_when_partials_run_out(device, monkeypatch):
    from actcomp.kernels import triton_casts

    monkeypatch.setattr(triton_casts, "MAX_PARTIALS", 3)  # each program reduces several blocks
    x = values(torch.float32, 5 * triton_casts.BLOCK + 7).to(device)
    for largest in (5 * triton_casts.BLOCK + 6, 2, triton_casts.BLOCK * 3 + 1):
        y = x.clone()
        y[largest] = 1e13  # in the last block, the first program's, a middle program's second block
        assert_same("fp8", y)
        y[largest] = NAN
        assert_same("fp8", y, flag_non_finite=False)
