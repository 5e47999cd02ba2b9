"""Give freed activation buffers back to the operating system, so a saving shows in the process.

A converted model frees each layer's full input as soon as it is compressed, and each decompressed
copy right after its backward. glibc's malloc keeps such blocks for reuse: past its first freed
mapped block its mmap threshold rises to that block's size (up to 32 MiB), every later buffer
below it comes from the heap, and freed heap is returned only from the top. The process then
holds the pages a plain run would have needed anyway: ViT-S at batch 32 (224 px, AdamW, 2
threads) peaked at 2565 MiB under ``"mink0.9+int8", rest="8bit"`` against plain's 3420 MiB, 1.33x
lower (the trap ActNN's users reported as "memory not actually saved").

:func:`return_freed_memory` fixes glibc's threshold at 1 MiB with ``mallopt``: every buffer of
1 MiB and up is mapped on its own and unmapped when freed, and resident memory follows live
memory (the same ViT-S: 1590 MiB, 2.15x lower than plain as a user runs it;
``benchmarks/results/user_peak_torch2.14.1_cpu_t2.md``). :func:`~actcomp.to_compressed`
asks for it on every conversion that changes something (:func:`request`), and it is set when
actcomp first compresses a tensor outside a compiled graph (:func:`apply_request`): a converted
model that only runs compiled keeps the allocator as a plain compiled model has it, since there
Inductor plans the buffers and the threshold's page faults were the step's largest cost (ViT-S,
batch 16, 128 px, 2 threads: 1.41x the compiled plain step under the threshold, 1.04-1.09x
without; stop 59). ``to_compressed(..., return_freed_memory=False)``
or ``ACTCOMP_RETURN_FREED_MEMORY=0`` in the environment leave the allocator alone. The setting is
the process's (glibc has one malloc), it stays until the process ends, and it is inherited by
processes forked later (DataLoader workers). Its price is a page fault per fresh page of a large
buffer: ``benchmarks/bench_user_peak.py`` states it beside the peaks.

The buffers actcomp's own CPU kernels write whole (a decoded activation, in backward) are
allocated by :func:`empty_for_writing`: where this process maps large buffers one by one and the
kernel offers transparent huge pages on request (``madvise`` in
``/sys/kernel/mm/transparent_hugepage/enabled``), the buffer's 2 MiB-aligned interior is advised
to huge pages before anything touches it, so it faults in once per 2 MiB instead of once per
4 KiB page; and in backward a buffer it handed out before that nothing holds any more is handed
out again (the last one of 4 MiB and up, up to four smaller ones), until the backward ends. A
fresh 4.8 MB buffer filled 17.7x slower than a reused one, 4.8x when advised (AMD EPYC Zen 4
virtual machine, 1 thread: ``benchmarks/bench_page_faults.py``,
``benchmarks/results/page_faults_torch2.14.1_cpu_t1.md``). Reusing the large ones too took the
native kernels of a ViT-S batch-4 step at 2 threads from 122 to 55-77 ms (a 4.8 MB decode into a
fresh advised buffer 1.6-4.7 ms, into a reused one 0.2-0.5 ms: ``benchmarks/bench_native_calls.py``,
``benchmarks/results/native_calls_stop46/``). Buffers torch allocates itself (the
model's own activations and gradients) are glibc's and keep 4 KiB pages.

Left alone: a process whose ``MALLOC_MMAP_THRESHOLD_`` is set (the user chose), and every C
library but glibc (musl, macOS, Windows): there ``mallopt`` does not exist or means something
else, and the allocator decides (not measured there).

>>> from actcomp.host_allocator import return_freed_memory
>>> return_freed_memory() in {"set", "already set", "left to MALLOC_MMAP_THRESHOLD_", "not glibc", "refused"}
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import threading
from pathlib import Path

import torch

from actcomp.errors import ActcompError
from actcomp.torch_compat import at_backward_end, in_backward_pass, storage_shared

# Buffers from this size up are mapped one by one. In a one-off probe (not kept in benchmarks/),
# 64 KiB, 256 KiB and 1 MiB gave ViT-S's batch-32 step the same peak (1580 MiB), 4 MiB 45 MiB
# more; the larger the threshold, the fewer small mappings a step pays for.
MMAP_THRESHOLD = 1 << 20
SWITCH = "ACTCOMP_RETURN_FREED_MEMORY"
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_MADV_HUGEPAGE = 14  # Linux's asm-generic/mman-common.h
_HUGE_PAGE = 2 << 20
# Below this a buffer's aligned interior holds at most one huge page: not worth a system call.
ADVISE_FROM = 4 << 20
_threshold_set: int | None = None  # what this process's mallopt call set, if any
_requested = False  # a conversion asked for the threshold, which the next eager compression sets


def request() -> None:
    """Ask for :func:`return_freed_memory`, made when actcomp next compresses a tensor eagerly
    (:func:`apply_request`), not now: a model that is only ever compiled never needs it.

    >>> request(); apply_request() in {"set", "already set", "left to MALLOC_MMAP_THRESHOLD_", "not glibc", "refused",
    ...                                 "disabled by ACTCOMP_RETURN_FREED_MEMORY=0"}
    True
    """
    global _requested
    _requested = True


def apply_request() -> str | None:
    """:func:`return_freed_memory`'s answer where a conversion asked for it and it has not run
    since (called by every eager compression, so one check of a flag), else None."""
    global _requested
    if not _requested:
        return None
    _requested = False
    return return_freed_memory()


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> str:
    """Make glibc map every buffer of ``threshold`` bytes and up on its own, so freeing it returns
    its pages; says what happened: ``"set"``, ``"already set"``, ``"disabled by
    ACTCOMP_RETURN_FREED_MEMORY=0"``, ``"left to MALLOC_MMAP_THRESHOLD_"``, ``"not glibc"`` or
    ``"refused"`` (mallopt returned 0: glibc caps the threshold, at a size its version decides).

    >>> return_freed_memory() != ""
    True
    """
    global _threshold_set
    # mallopt takes a C int: a larger value would wrap to another threshold, 0 included.
    if not 0 < int(threshold) < 2**31:
        raise ActcompError(f"return_freed_memory: threshold={threshold} bytes is not in 1 .. 2**31 - 1")
    if os.environ.get(SWITCH, "1").strip().lower() in {"0", "false", "no", "off"}:
        return f"disabled by {SWITCH}=0"
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return "left to MALLOC_MMAP_THRESHOLD_"
    if _threshold_set == threshold:
        return "already set"
    libc = _glibc()
    if libc is None:
        return "not glibc"
    if not libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)):
        return "refused"
    _threshold_set = threshold
    return "set"


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def empty_for_writing(count: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(count, dtype=dtype)`` on the CPU, for a kernel to write whole (a decoded
    activation). Where this process maps large buffers on their own (:func:`return_freed_memory`
    set the threshold), so that a fresh buffer faults in page by page, in backward it hands out
    again a buffer it handed out before, of the same size, that nothing references any more:

    - of :data:`ADVISE_FROM` bytes and up, the one it handed out last (so at most one such
      buffer sits idle: a ViT-S MLP input's decode, reused by the GELU input's and the next
      block's); a fresh one has its 2 MiB-aligned interior advised to transparent huge pages
      where the kernel offers them on request;
    - a smaller one: at most :data:`REUSED_BUFFERS` are remembered (at most 16 MiB idle).

    Nothing is kept past the backward that asked: the engine's end-of-backward callback forgets
    them (:func:`~actcomp.torch_compat.at_backward_end`), before the optimizer step and the next
    forward. Outside a backward every buffer is fresh. The values are undefined, as ``empty``'s.

    >>> empty_for_writing(10, torch.float32).shape
    torch.Size([10])
    """
    global _large
    nbytes = _own_mapping(count, dtype)
    if nbytes is None:
        return torch.empty(count, dtype=dtype)
    if not in_backward_pass():
        if _reused or _large is not None:
            _forget()  # a backward whose end could not be told (at_backward_end said no)
        return _fresh(nbytes).view(dtype)
    with _reused_lock:
        if nbytes >= ADVISE_FROM:
            if _large is None or _large.numel() != nbytes or storage_shared(_large):
                _large = _fresh(nbytes)
                _forget_at_backward_end()
            return _large.view(dtype)
        for index, buffer in enumerate(_reused):
            if buffer.numel() == nbytes and not storage_shared(buffer):
                _reused.append(_reused.pop(index))  # the most recently used last
                return buffer.view(dtype)
        buffer = _fresh(nbytes)
        _reused.append(buffer)
        if len(_reused) > REUSED_BUFFERS:
            _reused.pop(0)  # whoever still holds it keeps it alive; it is just not reused
        _forget_at_backward_end()
        return buffer.view(dtype)


def empty_for_copying(count: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(count, dtype=dtype)`` on the CPU, for a tensor's values copied dense before a
    codec reads them (a slice of a wider tensor: attention's query, key and value of one qkv
    projection, 36 a ViT-S step; a BatchNorm input in rows per channel). Where this process maps
    large buffers on their own, a buffer below :data:`ADVISE_FROM` is handed out again, the last
    one, when it is of this size and nothing references it any more (a codec that kept its input,
    as a cast to the input's own dtype does, keeps it referenced, and the next copy gets a fresh
    one): a 1.2 MB copy into a fresh buffer took 370 µs of page faults, into a reused one 27 µs
    (AMD EPYC Zen 4, 2 threads). A larger one is fresh each time: kept, it would sit idle through
    the forward between copies (a resnet50 BatchNorm input at batch 32 is 102 MB; idle decode
    buffers of every size once raised ViT-S's batch-32 peak by 45 MiB, stop 45). The buffer is
    forgotten when the forward that asked ends (:func:`forget_copy_buffer`). The values are
    undefined.

    >>> empty_for_copying(10, torch.float32).shape
    torch.Size([10])
    """
    global _copy_buffer
    nbytes = _own_mapping(count, dtype)
    if nbytes is None or nbytes >= ADVISE_FROM:
        return torch.empty(count, dtype=dtype)
    with _reused_lock:
        if _copy_buffer is None or _copy_buffer.numel() != nbytes or storage_shared(_copy_buffer):
            _copy_buffer = torch.empty(nbytes, dtype=torch.uint8)
        return _copy_buffer.view(dtype)


def _own_mapping(count: int, dtype: torch.dtype) -> int | None:
    """The bytes of a buffer of ``count`` ``dtype`` values where this process maps it on its own
    (the threshold set, the buffer at least its size): the buffers worth reusing; else None."""
    nbytes = count * dtype.itemsize
    return None if _threshold_set is None or nbytes < _threshold_set else nbytes


def forget_copy_buffer() -> None:
    """Let go of :func:`empty_for_copying`'s buffer (at a forward's end: idle through the
    backward, it would add its size to the step's peak)."""
    global _copy_buffer
    with _reused_lock:
        _copy_buffer = None


# How many decode buffers below ADVISE_FROM a backward remembers for reuse: consecutive layers
# of a network decode tensors of the same few sizes, each freed once its backward op has run.
REUSED_BUFFERS = 4
_reused: list[torch.Tensor] = []
# The last decode buffer of ADVISE_FROM bytes and up. One only: measured on ViT-S at batch 32,
# remembering four of every size raised the step's peak by 45 MiB (stop 45).
_large: torch.Tensor | None = None
_forget_queued = False
# The last buffer empty_for_copying handed out, until the forward that asked ends.
_copy_buffer: torch.Tensor | None = None
_reused_lock = threading.Lock()  # backwards may run in several threads


def _forget_at_backward_end() -> None:
    """Have the running backward forget the remembered buffers when it ends (once a backward;
    call with the lock held)."""
    global _forget_queued
    if not _forget_queued:
        _forget_queued = at_backward_end(_forget)


def _forget() -> None:
    global _large, _forget_queued
    with _reused_lock:
        _reused.clear()
        _large, _forget_queued = None, False


def _fresh(nbytes: int) -> torch.Tensor:
    """A new uint8 buffer of ``nbytes`` (at least the threshold: a mapping of its own), its
    aligned interior advised to huge pages where that helps."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= ADVISE_FROM and _huge_pages_on_request():
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        stop = (out.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if stop > start:
            # Advice, not a promise: where the kernel has no huge page free it maps 4 KiB pages
            # as before, so the result is not checked.
            _glibc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), ctypes.c_int(_MADV_HUGEPAGE))
    return out


@functools.cache
def _huge_pages_on_request() -> bool:
    """Whether Linux's transparent huge pages are on for regions that ask (``madvise``; under
    ``always`` they need no asking, under ``never`` asking does nothing)."""
    try:
        return "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
