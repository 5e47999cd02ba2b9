"""The channel sparsifiers' decode as one Triton kernel: every value of the full tensor written
once, the kept channels' from the payload, the dropped ones' zero.

The eager decode is three launches on CUDA (the zeros, the ids widened to int64, the
``index_copy_``). Here each value finds its channel among the kept ids, which the encode
sorted, by a binary search in registers. Values are copied as their bits (an integer of their
size), so every value, NaN's payload too, comes back as it was kept.

>>> import torch
>>> takes(torch.bfloat16, 10), takes(torch.float64, 10)
(True, False)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from actcomp.kernels.triton_runtime import cdiv, device_guard, launch

BLOCK = 2048
# The integer each dtype's values are copied as, and the bits of the NaN ``torch.where(finite,
# values, nan)`` writes in that dtype.
_BITS = {torch.float32: (torch.int32, 0x7FC00000), torch.bfloat16: (torch.int16, 0x7FC0),
         torch.float16: (torch.int16, 0x7E00)}


def takes(dtype: torch.dtype, count: int) -> bool:
    """Whether :func:`scatter` writes ``count`` values of ``dtype``: float32, bfloat16 or
    float16, fewer than 2**31."""
    return dtype in _BITS and count < 2**31 - BLOCK


@triton.jit
def _channel_decode_kernel(payload_ptr, ids_ptr, finite_ptr, out_ptr, count, inner, channels, kept, nan_bits,
                           BLOCK: tl.constexpr, STEPS: tl.constexpr, FLAGGED: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = index < count
    within = index % inner
    channel = (index // inner) % channels
    outer = index // (inner * channels)
    # The first kept position whose id is not below the channel (ids ascend).
    low = tl.zeros_like(index)
    high = tl.zeros_like(index) + kept
    for _ in tl.static_range(STEPS):
        searching = low < high
        middle = (low + high) // 2
        below = tl.load(ids_ptr + middle, mask=valid & searching, other=0).to(tl.int32) < channel
        low = tl.where(searching & below, middle + 1, low)
        high = tl.where(searching & (below == 0), middle, high)
    found = valid & (low < kept)
    found = found & (tl.load(ids_ptr + low, mask=found, other=-1).to(tl.int32) == channel)
    values = tl.load(payload_ptr + (outer * kept + low) * inner + within, mask=found, other=0)
    if FLAGGED:
        values = tl.where(tl.load(finite_ptr).to(tl.int32) != 0, values, nan_bits).to(values.dtype)
    tl.store(out_ptr + index, values, mask=valid)


def scatter(payload: torch.Tensor, ids: torch.Tensor, dim: int, channels: int,
            finite: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous ``payload``'s channels along ``dim`` put back at the sorted ``ids`` of a tensor
    with ``channels`` there, zeros between; all NaN where ``finite`` (a 0-d bool) is false.
    One launch."""
    shape = list(payload.shape)
    shape[dim] = channels
    out = torch.empty(shape, dtype=payload.dtype, device=payload.device)
    count = out.numel()
    if count:
        integer, nan_bits = _BITS[payload.dtype]
        kept = ids.numel()
        with device_guard(payload):
            launch(_channel_decode_kernel, (cdiv(count, BLOCK),), payload.view(integer), ids,
                   ids if finite is None else finite, out.view(integer), count, math.prod(shape[dim + 1:]), channels,
                   kept, nan_bits, BLOCK=BLOCK, STEPS=max(1, kept.bit_length()), FLAGGED=finite is not None)
    return out
