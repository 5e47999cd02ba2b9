"""The memory behind a tensor: one key per storage, shared by all its views, and its layout.

>>> import torch
>>> x = torch.randn(4, 4)
>>> storage_key(x[1:]) == storage_key(x), storage_key(x.clone()) == storage_key(x)
(True, False)
>>> storage_key(torch.empty(3, device="meta")) is None
True
"""

from __future__ import annotations

import torch


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a DTensor's local shard (FSDP2 and tensor
    parallel parameters), any other tensor itself. A DTensor has no storage of its own."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            return tensor.to_local()
    return tensor


def storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    """``(device, address)`` of the storage ``tensor`` lives in, or None when it holds no bytes:
    empty, freed by resizing to zero (FSDP2 does that to its all-gathered parameters), or with no
    storage to point at (meta tensors, wrapper subclasses)."""
    local = local_part(tensor)
    if local.is_meta:
        return None
    try:
        storage = local.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None  # a wrapper subclass with no storage of its own (e.g. functorch's)
    if storage.nbytes() == 0:
        return None
    return str(local.device), storage.data_ptr()


def dense_strides(x: torch.Tensor) -> tuple[int, ...] | None:
    """``x``'s strides if it is dense and non-overlapping in some dimension order, else None."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return None
        expected *= size
    return x.stride()


def restride(x: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """``x`` laid out with the strides of the tensor it was rebuilt from (``dense_strides`` of
    it), so backward picks the same kernels (channels_last, and size-1 dims whose strides
    decide how a layout is read)."""
    if stride is None or x.stride() == stride:
        return x
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)
