"""Where the Triton kernels run, and their launches counted.

The Triton kernels (:mod:`~actcomp.kernels.triton_affine`, :mod:`~actcomp.kernels.triton_masks`,
:mod:`~actcomp.kernels.triton_select`) are the CUDA implementations of the codecs. They run on
CUDA tensors, and on CPU tensors under Triton's interpreter: ``TRITON_INTERPRET=1`` set before
``triton`` is first imported, which runs each program instance in turn with numpy. That is how
they are tested on a machine without a GPU (``tests/conftest.py`` sets it there): slowly, so at
small sizes, but the same kernel source and the same codes.

``import actcomp`` never imports triton: the first CUDA tensor a codec sees does (or a CPU one
under the interpreter with ``use_backend("triton")``).

Every launch goes through :func:`launch`, which counts it: the deterministic cost figures
(launches per saved tensor) come from :data:`LAUNCHES`, on any machine.

>>> import torch
>>> runs_on(torch.device("meta"))
False
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

INTERPRETER = "TRITON_INTERPRET"
# Kernel launches by kernel name, since the process started (or the caller cleared it).
LAUNCHES: Counter[str] = Counter()
# Called with each launch's kernel name, each giving a context the launch runs in
# (benchmarks/bench_step_costs.py counts launches per saved tensor, and leaves out the ATen ops
# Triton's interpreter runs inside one).
_observers: list[Callable[[str], contextlib.AbstractContextManager]] = []
_recorders: list[Callable[[Any, tuple, tuple, dict], Any]] = []


@functools.cache
def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``): on CPU tensors.
    Read once (every codec call asks): triton reads it once too, when first imported."""
    return os.environ.get(INTERPRETER, "0") not in ("", "0")


@functools.cache
def available() -> bool:
    """Whether triton imports here (it comes with torch's CUDA wheels for Linux)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``: a CUDA device with triton
    installed, or the CPU under Triton's interpreter."""
    if device.type == "cuda":
        return available()
    return device.type == "cpu" and interpreting() and available()


def cdiv(count: int, block: int) -> int:
    """Blocks of ``block`` that cover ``count``, in plain Python: ``triton.cdiv`` is a jit
    function, whose call from the host cost 5 us (and ran interpreted under the interpreter).

    >>> cdiv(10, 4), next_power_of_2(5), next_power_of_2(1)
    (3, 8, 1)
    """
    return -(-count // block)


def next_power_of_2(value: int) -> int:
    """The smallest power of two at least ``value`` (at least 1), in plain Python."""
    return 1 << max(0, value - 1).bit_length()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)`` on the current stream of the tensors' device, counted.

    ``enable_fp_fusion=False`` always: the references round a product and then a sum, and a
    fused multiply-add would round once and change a code."""
    name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
    LAUNCHES[name] += 1
    for recorder in _recorders:
        recorder(kernel, grid, args, meta)
    with contextlib.ExitStack() as observing:
        for observer in _observers:
            observing.enter_context(observer(name))
        kernel[grid](*args, enable_fp_fusion=False, **meta)


@contextlib.contextmanager
def recording(recorder: Callable[[Any, tuple, tuple, dict], Any]) -> Iterator[None]:
    """Call ``recorder(kernel, grid, args, meta)`` at each launch inside the block (what
    ``tests/kernels/test_triton_compiles.py`` compiles for a GPU)."""
    _recorders.append(recorder)
    try:
        yield
    finally:
        _recorders.remove(recorder)


@contextlib.contextmanager
def observed(observer: Callable[[str], contextlib.AbstractContextManager]) -> Iterator[None]:
    """Run each launch inside the block within ``observer(kernel name)``, a context manager."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def device_guard(tensor: torch.Tensor) -> Any:
    """A context making ``tensor``'s CUDA device the current one (Triton launches on it)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
