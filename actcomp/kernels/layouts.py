"""The memory behind a tensor: one key per storage, shared by all its views, and its layout.

>>> import torch
>>> x = torch.randn(4, 4)
>>> storage_key(x[1:]) == storage_key(x), storage_key(x.clone()) == storage_key(x)
(True, False)
>>> storage_key(torch.empty(3, device="meta")) is None
True

A tensor rebuilt from a compressed copy gets the layout of the one it replaces, because
backward kernels pick their algorithm (and so their summation order) from strides:

>>> tokens = torch.randn(2, 17, 8)[:, 1:].transpose(1, 2).reshape(2, 8, 4, 4)  # not dense
>>> core = unbroadcast(tokens)
>>> rebuilt = with_layout_of(core.contiguous(), tokens)
>>> rebuilt.stride(), rebuilt.is_contiguous(memory_format=torch.channels_last)
((128, 1, 32, 8), True)
"""

from __future__ import annotations

import torch


def is_subclass_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a tensor subclass (a DTensor, a FakeTensor) rather than a plain
    tensor or parameter: it has no memory of its own at ``data_ptr()``.

    >>> is_subclass_tensor(torch.ones(2)), is_subclass_tensor(torch.nn.Parameter(torch.ones(2)))
    (False, False)
    """
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a DTensor's local shard (FSDP2 and tensor
    parallel parameters), any other tensor itself. A DTensor has no storage of its own."""
    if not is_subclass_tensor(tensor):
        return tensor  # every saved tensor asks: no import statement on the common path
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
    decide how a layout is read). A view where only size-1 axes' strides differ (the same
    elements at the same places), else a copy."""
    if stride is None or x.stride() == stride:
        return x
    if all(size == 1 or have == want for size, have, want in zip(x.shape, x.stride(), stride)):
        return x.as_strided(x.shape, stride)
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)


def memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The axis order, outermost first, in which non-contiguous ``x`` lies in memory; None when
    ``x`` is contiguous. Read in this order, a dense ``x`` is flat without a copy, and a
    tensor with gaps (a slice of a wider one) needs one copy that closes them; either way, the
    flat values rebuilt in this order have ``dense_strides_like(x)`` with no second copy.

    >>> memory_order(torch.randn(2, 3, 4).transpose(0, 2)), memory_order(torch.randn(2, 3))
    ((2, 1, 0), None)
    """
    if x.is_contiguous():
        return None
    # As dense_strides_like orders axes: of two with equal strides the later one is inner.
    return tuple(sorted(range(x.dim()), key=lambda axis: (x.stride(axis), -axis), reverse=True))


def unbroadcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each broadcast axis (stride 0) cut to size 1: the values it holds, once each.
    ``unbroadcast(x).expand(x.shape)`` is ``x`` again, strides included.

    >>> unbroadcast(torch.randn(3, 1).expand(3, 5)).shape
    torch.Size([3, 1])
    """
    strides = x.stride()
    if 0 not in strides:
        return x  # the common case, without the indexing's view (a few µs a layer, per step)
    return x[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in strides)]


def dense_strides_like(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor shaped like ``x`` whose axes lie in memory in the order of
    ``x``'s: ``x``'s own when it is dense, else the same order with the gaps closed (a slice of
    a channels_last tensor stays channels_last).

    >>> dense_strides_like(torch.randn(5, 8)[:, ::2].t())
    (1, 4)
    """
    stride = dense_strides(x)
    if stride is not None:
        return stride
    dense, step = [0] * x.dim(), 1
    # Innermost axis first; of two axes with equal strides the later one counts as inner.
    for axis in sorted(range(x.dim()), key=lambda axis: (x.stride(axis), -axis)):
        dense[axis] = step
        step *= x.shape[axis]
    return tuple(dense)


def with_layout_of(core: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``core`` (values of ``unbroadcast(like)``, any layout) laid out as ``like``: dense in
    ``like``'s axis order, broadcast where ``like`` is. ``like`` may be a meta tensor."""
    core_like = unbroadcast(like)
    out = restride(core, dense_strides_like(core_like))
    return out if core_like is like else out.expand(like.shape)


def empty_with_layout_of(like: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor laid out as :func:`with_layout_of` lays out ``like``, for kernels
    that read an input's shape and layout but not its values."""
    core = unbroadcast(like)
    return torch.empty_strided(core.shape, dense_strides_like(core), dtype=dtype, device=device).expand(like.shape)
