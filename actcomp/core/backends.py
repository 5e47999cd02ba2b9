"""Which implementation of a codec runs: its eager reference, its native CPU kernel, or the
same pair compiled.

Every registered codec's ``encode``/``decode`` in eager PyTorch is its *reference*: always
there, and what the tests compare every other implementation against. :func:`encode` and
:func:`decode` are what the chain calls; they pick one of

- ``"eager"``: the reference, nothing else;
- ``"native"`` (the default): a codec's native CPU kernel where it has one and it takes the
  tensor (:meth:`~actcomp.core.codec.Compressor.native_encode`; today the int8/int4/int2
  quantizers, fp8 and the ReLU masks, and the min-k selection and positions inside the eager
  sparsifiers), built once per
  machine by :mod:`~actcomp.kernels.native_cpu`; the reference elsewhere. Its bytes are the
  reference's, bit for bit; only the time differs (``benchmarks/bench_compressors.py``);
- ``"compiled"``: the pair under ``torch.compile(fullgraph=True)``, compiled once per codec
  class and settings and at most twice per tensor rank (symbolic sizes, settings as constants:
  new sizes do not recompile), compiled code cached by Inductor across processes. The codec
  contract (no value read back to Python, shapes fixed by the input's shape and the settings)
  lets Inductor fuse a chunked loop of eager operations into a few kernels (C++/OpenMP on CPU,
  Triton on CUDA) that give the eager codes. Not the default: on these CPUs the compiled forms
  are slower than the native ones and than eager for most codecs
  (``benchmarks/bench_fused.py``), and compiling costs seconds per codec on first use.

The choice, first match wins: :func:`use_backend` (a context manager, for a block of code),
then the environment variable ``ACTCOMP_COMPILE`` (``0``: eager, nothing built or compiled;
``1``: compiled), then the default, native. A codec that cannot compile (``compiles()`` false:
Rice-coded positions, a stage with runtime state, a draw from torch's generator) runs eagerly
when compiled is asked. A compile that fails (no C++ compiler, an Inductor error) warns once
and that codec runs eagerly from then on; so does one that would recompile past torch's limit,
rather than falling back silently frame by frame; a native build that fails warns once and the
references run.

>>> import torch, actcomp
>>> with use_backend("eager"):
...     packed = actcomp.parse("int8").compress(torch.zeros(4))
>>> active_backend()
'native'
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from actcomp.errors import ActcompError, warn_once
from actcomp.kernels import native_cpu
from actcomp.torch_compat import maybe_mark_dynamic, recompile_limit_raises

BACKENDS = ("eager", "native", "compiled")
DEFAULT = "native"
ENVIRONMENT = "ACTCOMP_COMPILE"
_ENVIRONMENT_VALUES = {"0": "eager", "1": "compiled"}
_chosen: list[str] = []  # the stack of use_backend choices
_compiled: dict[tuple[type, str], Callable[..., Any]] = {}
_failed: set[type] = set()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run codecs with backend ``name`` (``"eager"``, ``"native"`` or ``"compiled"``) inside the block."""
    if name not in BACKENDS:
        raise ActcompError(f"unknown codec backend {name!r}; known: {', '.join(BACKENDS)}")
    _chosen.append(name)
    try:
        yield
    finally:
        _chosen.pop()


def active_backend() -> str:
    """The backend asked for here: :func:`use_backend`, else ``ACTCOMP_COMPILE``, else native."""
    if _chosen:
        return _chosen[-1]
    value = os.environ.get(ENVIRONMENT)
    if value is None or value == "":
        return DEFAULT
    if value not in _ENVIRONMENT_VALUES:
        raise ActcompError(f"{ENVIRONMENT}={value!r} is not valid; use 0 (eager reference codecs) or 1 (compiled "
                           "codecs), or leave it unset (native kernels where a codec has one)")
    return _ENVIRONMENT_VALUES[value]


def encode(codec: Any, x: torch.Tensor, hints: Any, *state: Any) -> Any:
    """``codec.encode(x, hints, *state)`` by the active backend."""
    return _run(codec, "encode", x, hints, *state)


def decode(codec: Any, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
    """``codec.decode(payload, saved, meta)`` by the active backend."""
    return _run(codec, "decode", payload, saved, meta)


def _run(codec: Any, method: str, *args: Any) -> Any:
    eager = getattr(codec, method)
    backend = active_backend()
    if backend == "native" and not torch.compiler.is_compiling():
        result = getattr(codec, f"native_{method}")(*args)
        return eager(*args) if result is None else result
    if backend == "eager":
        # The reference through and through: no native kernel inside the codec either.
        previous = native_cpu.allow(False)
        try:
            return eager(*args)
        finally:
            native_cpu.allow(previous)
    if torch.compiler.is_compiling() or type(codec) in _failed or not codec.compiles():
        return eager(*args)
    compiled = _compiled_method(type(codec), method)
    try:
        # Past torch's recompile limit, dynamo would quietly run the frame eagerly from then on;
        # an error instead, so the fallback below says so once.
        with recompile_limit_raises():
            return compiled(codec, *_with_dynamic_sizes(args))
    except Exception as error:  # noqa: BLE001 - any compile failure falls back to the reference
        if isinstance(error, ActcompError):
            raise
        _failed.add(type(codec))
        warn_once(f"compiling {type(codec).__name__}", f"actcomp: compiling codec {codec.name!r} failed "
                  f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); it runs "
                  f"eagerly from now on ({ENVIRONMENT}=0 skips compiling)")
        return eager(*args)


def _compiled_method(klass: type, method: str) -> Callable[..., Any]:
    """``klass.<method>`` compiled once; the codec is an argument, so its settings are guarded.

    Not ``dynamic=True``: that would make every integer a symbol, the codec's settings too, and
    a symbolic group size leaves Inductor an integer division per element where it would
    vectorize around a literal (an int8 decode ran 20x slower). Instead the tensors' sizes are
    marked dynamic where they are passed (:func:`_with_dynamic_sizes`), the settings stay
    constants, and the integers of a packed layout (the shape) turn dynamic the first time one
    changes (one more graph per method)."""
    key = (klass, method)
    if key not in _compiled:
        _compiled[key] = torch.compile(getattr(klass, method), fullgraph=True, dynamic=None)
    return _compiled[key]


def _with_dynamic_sizes(args: tuple) -> tuple:
    """``args``, every tensor in them (in tuples too) with each size marked dynamic."""
    for value in args:
        for tensor in value if isinstance(value, tuple) else (value,):
            if isinstance(tensor, torch.Tensor):
                for dim in range(tensor.dim()):
                    maybe_mark_dynamic(tensor, dim)
    return args
