"""Chunked passes: every stage works on a tensor a slice at a time.

Compressing runs on the forward's critical path and inside the very memory peak the library
exists to lower. A stage that computed on the whole tensor at once would allocate temporaries
of its size (``x.abs()``, an fp32 copy of a bf16 tensor, a bool mask, int64 indices: 10x the
input's bytes for a global ``topk``). Working in chunks bounds them by the chunk instead, and on
CPU a chunk of :data:`CPU_CHUNK` elements stays in cache between the few operations run on it,
so a chunked stage reads the tensor from memory about once.

On CUDA, each operation is a kernel launch, so chunks are larger: at least :data:`CUDA_CHUNK`
elements and at most an eighth of the tensor, so the temporaries stay a small share of it.

Compiled code runs the whole tensor as one chunk: Inductor fuses the operations into kernels
that keep no temporaries.

>>> list(spans(10, 4))
[(0, 4), (4, 8), (8, 10)]
>>> aligned_length(torch.device("cpu"), 10**6, 256, 8) % 256
0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

CPU_CHUNK = 2**18
CUDA_CHUNK = 2**22


def spans(count: int, length: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive slices of ``length`` covering ``range(count)``."""
    if count <= length:
        # Without a loop: compiled code runs a symbolic size as one slice, and a loop over it
        # would make one graph per size.
        if count:
            yield 0, count
        return
    for start in range(0, count, length):
        yield start, min(start + length, count)


def aligned_length(device: torch.device, count: int, *multiples: int, element_size: int = 4) -> int:
    """The chunk length for ``count`` elements on ``device``: a multiple of every one of
    ``multiples`` (group sizes, 8 for bit packing), near the device's chunk size; all of
    ``count`` while ``torch.compile`` traces. A stage that works on float32 copies of a narrower
    input gives its ``element_size``: the chunk shrinks so that the copies weigh what a chunk of
    a float32 input's would, beside a tensor of half the bytes.

    >>> aligned_length(torch.device("cpu"), 10**7, 256, element_size=2) * 2 == aligned_length(torch.device("cpu"), 10**7, 256)
    True
    """
    if torch.compiler.is_compiling():
        return count
    target = CPU_CHUNK if device.type == "cpu" else max(CUDA_CHUNK, count // 8)
    target = target * min(element_size, 4) // 4
    step = math.lcm(*multiples) if multiples else 1
    return max(step, target // step * step)


def map_chunks(flat: torch.Tensor, dtype: torch.dtype, function: Callable[[torch.Tensor], torch.Tensor],
               length: int | None = None) -> torch.Tensor:
    """``function`` applied to ``flat`` (1-D) a chunk at a time, written into one new tensor of
    ``dtype``: the output is written once, and the temporaries are a chunk's."""
    count = flat.numel()
    length = length or aligned_length(flat.device, count)
    out = torch.empty(count, dtype=dtype, device=flat.device)
    for start, stop in spans(count, length):
        out[start:stop] = function(flat[start:stop])
    return out
