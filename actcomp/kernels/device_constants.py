"""Small constant tables (a codec's decode values, a codebook's edges) on a tensor's device,
made once per device rather than copied from host memory on every call.

``torch.tensor([...], device="cuda")`` copies from pageable host memory, and that copy waits
for the device: one stall of the launch queue per call. A table here is made on its first use
per (values, dtype, device) and reused; inside ``torch.compile`` it is a graph constant.

>>> table = device_table((0.0, 1.5), torch.float32, torch.device("cpu"))
>>> table, table is device_table((0.0, 1.5), torch.float32, torch.device("cpu"))
(tensor([0.0000, 1.5000]), True)
"""

from __future__ import annotations

import functools

import torch


def device_table(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, made once; never write to it."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    # Keyed by each value's hex form: NaN != NaN would make every call a miss.
    return _made(tuple(float(value).hex() for value in values), dtype, torch.device(device))


@functools.lru_cache(maxsize=1024)  # bounded: codecs' settings, not steps, make new tables
def _made(hex_values: tuple[str, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    values = [float.fromhex(value) for value in hex_values]
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    # One fill per value, not a copy from host memory, which waits for the device: the first
    # use may come inside a step that must not synchronize (the H100 sync check of stop 50).
    return torch.stack([torch.full((), value, dtype=dtype, device=device) for value in values])


def true_divide(values: torch.Tensor, divisor: float) -> torch.Tensor:
    """``values / divisor`` rounded once (IEEE division) on every device, ``values`` float32.

    ATen's CUDA kernel divides by a Python number as a multiplication by its reciprocal, which
    rounds twice: 60000 / 15 came out one float32 step above 4000, and an int4 step one bf16 step
    above the CPU's and the Triton kernel's (the H200 run of stop 44). A divisor on the device
    takes the true division there, as it does on the CPU.

    >>> true_divide(torch.tensor([60000.0]), 15)
    tensor([4000.])
    """
    return values / device_table((divisor,), torch.float32, values.device).view(())
