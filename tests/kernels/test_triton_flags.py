"""The chain's finite flag as a Triton kernel (kernels/triton_flags.py), run on CPU tensors under
Triton's interpreter: the eager flag's answer, a 0-d bool on the tensor's device, in one kernel
launch after the fill, for every float dtype, size and non-finite value."""

from __future__ import annotations

import pytest
import torch

from actcomp.core import chain
from actcomp.core.backends import use_backend
from actcomp.kernels import triton_runtime

# CPU tensors under Triton's interpreter, and a GPU's tensors where there is one.
DEVICES = [device for device in ("cpu", "cuda") if (torch.cuda.is_available() or device == "cpu")
           and triton_runtime.runs_on(torch.device(device))]
pytestmark = [pytest.mark.skipif(not DEVICES, reason="needs triton: on a GPU, or its interpreter on the CPU"),
              pytest.mark.parametrize("device", DEVICES)]

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("count", [1, 7, 4099])
def test_the_finite_flag_kernel_gives_the_eager_flag(dtype, count, device):
    x = torch.randn(count).to(dtype).to(device)
    x[-1] = torch.finfo(dtype).max  # finite at the dtype's largest: a sum would overflow
    for special in (None, NAN, INF, -INF):
        y = x.clone()
        if special is not None:
            y[count // 2] = special
        triton_runtime.LAUNCHES.clear()
        with use_backend("triton"):
            flag = chain.finite_flag(y)
        assert triton_runtime.LAUNCHES == {"_finite_kernel": 1}
        assert flag.dtype == torch.bool and flag.shape == () and flag.device == y.device
        assert bool(flag) == (special is None) == bool(chain.finite_flag(y))


def test_the_finite_flag_kernel_on_empty_and_strided_tensors(device):
    x = torch.randn(40, 30, device=device)
    x[3, 5] = NAN
    with use_backend("triton"):
        triton_runtime.LAUNCHES.clear()
        assert bool(chain.finite_flag(x[:0]))
        assert not triton_runtime.LAUNCHES  # nothing to check: the fill alone
        assert not bool(chain.finite_flag(x.t())) and triton_runtime.LAUNCHES == {"_finite_kernel": 1}
        assert bool(chain.finite_flag(x[4:, ::3]))  # gaps between its elements: the eager flag
        assert triton_runtime.LAUNCHES == {"_finite_kernel": 1}


def test_under_torch_compile_the_eager_flag_is_traced(device):
    x = torch.randn(300, device=device)
    x[7] = float("inf")
    with use_backend("triton"):
        flag = torch.compile(chain.finite_flag, fullgraph=True, backend="eager")(x)
    assert flag.dtype == torch.bool and not bool(flag)
