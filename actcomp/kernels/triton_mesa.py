"""mesa8's decode as one Triton kernel: ``code * scale + low`` of each value's channel group,
rounded to the tensor's dtype, the finite flag's NaN applied on the way.

The eager decode is four launches a chunk on CUDA (the float copy, the product, the sum, the
copy into the output). The encode stays eager: the chain runs a stateful stage's encode
itself, with its running range, and dispatches only the decode.

>>> import torch
>>> takes(torch.bfloat16, 10), takes(torch.float64, 10)
(True, False)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actcomp.kernels.triton_affine import rounded_to
from actcomp.kernels.triton_casts import nan_unless
from actcomp.kernels.triton_runtime import cdiv, device_guard, launch

BLOCK = 2048


def takes(dtype: torch.dtype, count: int) -> bool:
    """Whether :func:`dequantize` writes ``count`` values of ``dtype``: float32, bfloat16 or
    float16, fewer than 2**31."""
    return dtype in (torch.float32, torch.bfloat16, torch.float16) and count < 2**31 - BLOCK


@triton.jit
def _mesa_decode_kernel(codes_ptr, low_ptr, scale_ptr, finite_ptr, out_ptr, count, span, groups,
                       BLOCK: tl.constexpr, FLAGGED: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    group = (index // span) % groups
    code = tl.load(codes_ptr + index, mask=valid, other=0).to(tl.float32)
    scale = tl.load(scale_ptr + group, mask=valid, other=0.0)
    low = tl.load(low_ptr + group, mask=valid, other=0.0)
    # A product, then a sum: the launch turns off their fusion, as the eager decode never fuses.
    values = rounded_to(code * scale + low, out_ptr.dtype.element_ty)
    if FLAGGED:
        values = nan_unless(values, tl.load(finite_ptr).to(tl.int32) != 0)
    tl.store(out_ptr + index, values, mask=valid)


def dequantize(codes: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, span: int, dtype: torch.dtype,
               finite: torch.Tensor | None = None) -> torch.Tensor:
    """The values of contiguous 1-D uint8 ``codes`` as a 1-D tensor of ``dtype``: group
    ``(i // span) % len(low)`` of float32 ``low`` and ``scale`` decodes value ``i``; all NaN
    where ``finite`` (a 0-d bool) is false. One launch."""
    out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    if codes.numel():
        with device_guard(codes):
            launch(_mesa_decode_kernel, (cdiv(codes.numel(), BLOCK),), codes, low, scale,
                   low if finite is None else finite, out, codes.numel(), span, low.numel(), BLOCK=BLOCK,
                   FLAGGED=finite is not None)
    return out
