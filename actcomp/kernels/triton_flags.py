"""The chain's finite flag as one Triton kernel: whether every element of a tensor is finite.

The eager flag (:func:`actcomp.core.chain.finite_flag`) is ``torch.aminmax`` and two
``isfinite`` and an ``&``: four launches on CUDA. Here the flag is a 0-d bool filled with True
(one launch), and one kernel whose programs each check a block and, where the block holds NaN
or an infinity, store False into it. Every program that stores, stores the same byte, so the
stores need no atomics and their order does not matter; the flag stays a bool, which every
consumer of the eager one reads (``torch.where``, the decode kernels' ``finite_ptr``).

>>> import torch
>>> takes(torch.zeros(3, dtype=torch.float64))
True
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actcomp.kernels.triton_runtime import cdiv, device_guard, launch

# Elements a program checks.
BLOCK = 4096
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def takes(x: torch.Tensor) -> bool:
    """Whether :func:`finite_flag` checks ``x``: a float32/bfloat16/float16/float64 tensor
    whose elements are laid out without gaps (contiguous in some order of its axes)."""
    return x.dtype in _DTYPES and _dense(x) is not None


def _dense(x: torch.Tensor) -> torch.Tensor | None:
    """``x``'s axes permuted so that the view is contiguous (the same memory, every element
    once), or None where its elements leave gaps or overlap."""
    if x.is_contiguous():
        return x
    order = sorted(range(x.dim()), key=lambda axis: (x.stride(axis), x.shape[axis]), reverse=True)
    permuted = x.permute(order)
    return permuted if permuted.is_contiguous() else None


@triton.jit
def _finite_kernel(x_ptr, flag_ptr, count, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(x_ptr + index, mask=index < count, other=0.0)
    if x_ptr.dtype.element_ty != tl.float64:
        values = values.to(tl.float32)  # exact; the interpreter has no half-precision arithmetic
    # NaN fails every comparison, so a value is finite exactly when its magnitude is below inf.
    infinite = (tl.abs(values) < float("inf")) == 0
    if tl.max(infinite.to(tl.int32), axis=0) > 0:
        tl.store(flag_ptr, 0)


def finite_flag(x: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``x``'s device: whether every element of ``x`` (see :func:`takes`) is
    finite. Two launches (the fill, the check), never read back."""
    flag = torch.ones((), dtype=torch.bool, device=x.device)
    dense = _dense(x)
    count = dense.numel()
    if count:
        with device_guard(x):
            launch(_finite_kernel, (cdiv(count, BLOCK),), dense, flag.view(torch.uint8), count, BLOCK=BLOCK)
    return flag
