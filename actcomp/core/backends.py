"""Which implementation of a codec's encode or decode runs: its eager reference, a kernel it
registered for the tensor's device, or the reference compiled. The one place that chooses.

Every codec method has implementations by name:

- ``"eager"``: the reference, the class's own ``encode``/``decode`` in eager PyTorch. Always
  there, the oracle every test compares the others with; run as the reference
  (:func:`reference`), it reads nothing back to the host (every CPU-only shortcut off).
- ``"native"``: a CPU kernel the codec registered (:func:`register_implementation`): today
  the int8/int4/int2 quantizers, fp8 and the ReLU masks (C kernels built once per machine by
  :mod:`~actcomp.kernels.native_cpu`), and the element sparsifiers' CPU selection (candidate
  search with ``nonzero``, :mod:`~actcomp.kernels.eager_select`, and Elias-Fano's CPU scatter).
- ``"triton"`` (also called ``"cuda"``): the CUDA kernels, written in Triton
  (:mod:`~actcomp.kernels.triton_runtime` and the ``triton_*`` modules beside it): preferred on
  CUDA tensors; on CPU tensors only when asked (``use_backend("triton")``) and Triton's
  interpreter is on (``TRITON_INTERPRET=1``), which is how they are tested without a GPU. A
  codec without one runs its reference, after one warning where it was asked for.
- ``"compiled"``: the reference under ``torch.compile(fullgraph=True)``, compiled once per
  codec class and settings and at most twice per tensor rank (symbolic sizes, settings as
  constants), for codecs whose ``compiles()`` says so; the others run eagerly.
- the shape-only implementation, :func:`encoded_shapes`: the reference on meta tensors, what
  every output's shape and dtype will be (a codec's contract: shapes follow from the input's
  shape and the settings). Under ``torch.compile`` the reference itself is traced.

Each kernel comes with a capability predicate (device, dtype, size, whether the C kernels were
built). The choice, in the manner of Liger Kernel's ``backends/dispatch.py``, first match wins:
a ``backend=`` argument to :func:`encode`/:func:`decode`, then :func:`use_backend` (a context
manager), then the environment variable ``ACTCOMP_COMPILE`` (``0``: eager; ``1``: compiled),
then preference: the first of :data:`KERNELS` (triton, native) whose predicate takes the
tensors, else the reference, silently. A backend that was asked for and cannot take a tensor
leaves it to the reference with one warning a process (:func:`actcomp.errors.warn_once`); a
compile that fails warns once and that codec runs eagerly from then on. While Dynamo traces
(``torch.compile``), the reference runs: a kernel is an opaque call Dynamo would break the
graph at.

Why a Python registry and not ``torch.library`` custom ops (``benchmarks/bench_dispatch.py``,
``benchmarks/results/dispatch_overhead.md``: AMD EPYC, 1 thread, a loaded 2-core machine):
around a kernel that does nothing, a custom op with ``register_fake`` and a CPU kernel cost
10.3 us a call, a plain Python call 1.3 us, and this module's choice (the look-up and the
capability predicate, which an op would need too) 4.6 us; for a whole int8 encode the
differences drown in the machine's noise (106/119/116 us direct/registry/op on (4, 256),
1627/1661/1751 us on (32, 197, 384)). Under ``torch.compile`` neither breaks the graph (the
registry hands Dynamo the reference), and over sizes 1000, 1500 and 4096 the op made 2 graphs
where the traced reference made 3: the reference's remainder branch guards on the size
dividing by the group, a matter of the reference's formulation, not of the dispatch. And an
op's outputs are a fixed list of tensors, while a codec's encode returns Python metadata (a
position form, a shape) beside a tuple whose length depends on the settings (int4's channel
exponents), and ``rice=1``'s positions have a size that depends on the data: every codec would
need a second, tensor-only signature. The output count and shapes do follow from the input's
shape and the settings for every built-in codec but ``rice=1`` (``tests/core/test_dispatch.py``
checks :func:`encoded_shapes` against the reference), so an op per codec stays possible where
a graph needs one.

>>> import torch, actcomp
>>> with use_backend("eager"):
...     packed = actcomp.parse("int8").compress(torch.zeros(4))
>>> active_backend(), choose(actcomp.parse("int8").stages[0], "encode", torch.zeros(4), None)
('native', 'native')
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from actcomp.errors import ActcompError, warn_once
from actcomp.kernels import eager_cpu, native_cpu, triton_runtime
from actcomp.kernels.layouts import is_subclass_tensor
from actcomp.torch_compat import maybe_mark_dynamic, recompile_limit_raises

# The names a caller may ask for. "eager" is every codec's reference; "native" and "triton" name
# kernels a codec registers (register_implementation); "compiled" is the reference compiled.
BACKENDS = ("eager", "native", "triton", "compiled")
# Other names for a backend: the CUDA slot is filled with Triton kernels.
ALIASES = {"cuda": "triton"}
# Kernels a codec may register, the most preferred first: with nothing asked for, the first one
# that takes the tensors runs, else the reference.
KERNELS = ("triton", "native")
DEFAULT = "native"
ENVIRONMENT = "ACTCOMP_COMPILE"
_ENVIRONMENT_VALUES = {"0": "eager", "1": "compiled"}
_chosen: list[str] = []  # the stack of use_backend choices
_compiled: dict[tuple[type, str], Callable[..., Any]] = {}
_failed: set[type] = set()


@dataclass(frozen=True)
class Implementation:
    """One kernel of one codec method: ``function(codec, *args)`` gives the reference's result
    bit for bit wherever ``takes(codec, *args)`` (its capability predicate: device, dtype, size,
    the kernels built) says yes.

    >>> kernel = Implementation("native", lambda codec, x, hints: x, lambda codec, x, hints: x.is_cpu)
    >>> kernel.takes(None, torch.zeros(2), None)
    True
    """

    name: str
    function: Callable[..., Any]
    takes: Callable[..., bool]
    # A decode that takes ``finite=`` (the chain's 0-d finite flag) and writes NaN everywhere
    # where it is false, in its own pass over the output; an encode that takes ``finite=`` (an
    # uninitialized 0-d bool) and writes the flag as it reads the input, with no launch of its own.
    applies_finite_flag: bool = False


# (codec class, "encode" or "decode", kernel name) -> its implementation.
_REGISTRY: dict[tuple[type, str, str], Implementation] = {}
# (codec class, method) -> the implementations it inherits or registers, the preferred first.
_RESOLVED: dict[tuple[type, str], tuple[Implementation, ...]] = {}


def register_implementation(klass: type, name: str, *, encode: Callable[..., Any] | None = None,
                            encodes: Callable[..., bool] | None = None, decode: Callable[..., Any] | None = None,
                            decodes: Callable[..., bool] | None = None, applies_finite_flag: bool = False,
                            writes_finite_flag: bool = False) -> None:
    """Register ``klass``'s ``name`` kernels (``"native"``: CPU; ``"triton"``: CUDA), each with
    its capability predicate: ``encode(codec, x, hints)`` where ``encodes(codec, x, hints)``,
    ``decode(codec, payload, saved, meta)`` where ``decodes(...)``. Subclasses inherit them (a
    subclass may register its own); a predicate that asks ``type(codec).encode`` keeps a kernel
    off a subclass that encodes otherwise. ``applies_finite_flag``: the decode takes ``finite=``
    and makes the output NaN itself where the flag is false (no pass of its own over the output).
    ``writes_finite_flag``: the encode takes ``finite=`` (an uninitialized 0-d bool on the
    tensor's device) and writes whether every input value is finite (no reduction of its own).

    >>> from actcomp.compressors.casts import Fp16
    >>> register_implementation(Fp16, "triton", encode=lambda codec, x, hints: codec.encode(x, hints),
    ...                         encodes=lambda codec, x, hints: x.is_cuda)
    >>> sorted(implementations(Fp16, "encode")); unregister_implementation(Fp16, "triton")
    ['eager', 'triton']
    """
    flag_methods = {"decode"} if applies_finite_flag else set()
    if writes_finite_flag:
        flag_methods.add("encode")
    if name not in KERNELS:
        raise ActcompError(f"unknown kernel name {name!r} for {klass.__name__}; known: {', '.join(KERNELS)} "
                           "(the eager reference is the class's own encode/decode)")
    for method, function, takes in (("encode", encode, encodes), ("decode", decode, decodes)):
        if function is not None and takes is None:
            raise ActcompError(f"the {name} {method} of {klass.__name__} needs a capability predicate "
                               f"({method}s=...): which tensors it takes")
        if function is not None:
            _REGISTRY[(klass, method, name)] = Implementation(name, function, takes, method in flag_methods)
    _RESOLVED.clear()


# (codec class, "encode" or "decode") -> its graph op: what a traced graph calls.
_GRAPH_OPS: dict[tuple[type, str], Callable[..., Any]] = {}


def register_graph_op(klass: type, *, encode: Callable[..., Any], decode: Callable[..., Any]) -> None:
    """What ``klass``'s encode and decode put in a graph being traced (``torch.compile``,
    ``compress_in_graph``): ``encode(codec, x, hints, *, flagged=False)`` (with ``flagged``:
    ``(encoded, the chain's finite flag)``) and ``decode(codec, payload, saved, meta, finite=None)``
    (NaN everywhere where ``finite`` is given and false): for example a ``torch.library`` custom
    op whose implementations are the codec's own (the kernel the eager path would choose), so a
    compiled graph gives the eager codes and holds one extern call where the traced reference
    would be a few dozen generated loops to compile (the quantizers' encode), or pointwise ops
    Inductor fuses into the kernel that reads their result (the quantizers' decode). Subclasses
    inherit it.
    ``use_backend("eager")`` and ``"compiled"`` trace the reference instead."""
    _GRAPH_OPS[(klass, "encode")] = encode
    _GRAPH_OPS[(klass, "decode")] = decode


def _graph_op(klass: type, method: str) -> Callable[..., Any] | None:
    for base in klass.__mro__:
        if (base, method) in _GRAPH_OPS:
            return _GRAPH_OPS[(base, method)]
    return None


def unregister_implementation(klass: type, name: str) -> None:
    """Forget ``klass``'s own ``name`` kernels (those it inherits stay)."""
    for method in ("encode", "decode"):
        _REGISTRY.pop((klass, method, name), None)
    _RESOLVED.clear()


def implementations(klass: type, method: str) -> dict[str, Implementation | None]:
    """Every implementation ``klass.<method>`` has, by name: ``"eager"`` (the reference, always;
    None: it is the method itself) and each registered kernel, own or inherited.

    >>> from actcomp.compressors.affine import Int4
    >>> sorted(implementations(Int4, "decode"))
    ['eager', 'native', 'triton']
    """
    return {"eager": None, **{kernel.name: kernel for kernel in _resolved(klass, method)}}


def _resolved(klass: type, method: str) -> tuple[Implementation, ...]:
    key = (klass, method)
    if key not in _RESOLVED:
        found = {}
        for name in KERNELS:
            # The nearest class in the MRO that registered this name decides (None: not here).
            for base in klass.__mro__:
                if (base, method, name) in _REGISTRY:
                    found[name] = _REGISTRY[(base, method, name)]
                    break
        _RESOLVED[key] = tuple(found.values())
    return _RESOLVED[key]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run codecs with backend ``name`` inside the block: ``"eager"`` (the reference),
    ``"native"`` (CPU kernels), ``"triton"`` (alias ``"cuda"``: CUDA kernels; none registered
    yet) or ``"compiled"``. A kernel asked for that cannot take a tensor leaves it to the
    reference, with one warning a process."""
    _chosen.append(_known(name, f"unknown codec backend {name!r}"))
    try:
        yield
    finally:
        _chosen.pop()


def _known(name: str, problem: str) -> str:
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ActcompError(f"{problem}; known: {', '.join(BACKENDS)} (and {', '.join(ALIASES)}, another name for "
                           f"{', '.join(ALIASES.values())})")
    return name


def active_backend() -> str:
    """The backend asked for here: :func:`use_backend`, else ``ACTCOMP_COMPILE``, else native."""
    return _asked() or DEFAULT


def _asked(backend: str | None = None) -> str | None:
    """The backend asked for: the argument, else :func:`use_backend`, else the environment; None
    when none is (then the preferred kernel that takes the tensors runs, silently)."""
    if backend is not None:
        return _known(backend, f"unknown codec backend {backend!r}")
    if _chosen:
        return _chosen[-1]
    value = os.environ.get(ENVIRONMENT)
    if value is None or value == "":
        return None
    if value not in _ENVIRONMENT_VALUES:
        raise ActcompError(f"{ENVIRONMENT}={value!r} is not valid; use 0 (eager reference codecs) or 1 (compiled "
                           "codecs), or leave it unset (native kernels where a codec has one)")
    return _ENVIRONMENT_VALUES[value]


def takes_cpu_shortcut(tensor: torch.Tensor) -> bool:
    """Whether code around the codecs may read ``tensor``'s values back (a CPU tensor outside
    ``torch.compile``, :mod:`~actcomp.kernels.eager_cpu`), which the reference and the Triton
    kernels never do."""
    # The Triton kernels on a CPU (the interpreter) stand for a GPU: no shortcut either.
    return active_backend() not in ("eager", "triton") and eager_cpu.applies(tensor) and not torch.compiler.is_compiling()


def encode(codec: Any, x: torch.Tensor, hints: Any, *state: Any, backend: str | None = None) -> Any:
    """``codec.encode(x, hints, *state)`` by the implementation :func:`choose` picks."""
    return _run(codec, "encode", (x, hints, *state), backend)


def encode_flagged(codec: Any, x: torch.Tensor, hints: Any, finite_flag: Callable[[torch.Tensor], torch.Tensor], *,
                   backend: str | None = None) -> tuple[Any, torch.Tensor]:
    """``(codec.encode(x, hints), flag)``: the encoding and a 0-d bool, whether every value of
    ``x`` is finite; written by the kernel as it encodes where it can (``writes_finite_flag``),
    else ``finite_flag(x)``, one reduction more."""
    if tracing(x):
        op = _graph_op(type(codec), "encode")
        if op is not None and _asked(backend) not in ("eager", "compiled"):
            return op(codec, x, hints, flagged=True)  # one extern call writes both
        flag = finite_flag(x)
        return _run(codec, "encode", (x, hints), backend), flag
    name, function = _chosen_implementation(codec, "encode", (x, hints), _asked(backend))
    if _applies_finite_flag(codec, "encode", name):
        flag = torch.empty((), dtype=torch.bool, device=x.device)
        return function(x, hints, finite=flag), flag
    # The flag first, then the encode chosen above (not chosen a second time).
    flag = finite_flag(x)
    return function(x, hints), flag


def decode(codec: Any, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any, *,
           backend: str | None = None, finite: torch.Tensor | None = None) -> torch.Tensor:
    """``codec.decode(payload, saved, meta)`` by the implementation :func:`choose` picks; where
    ``finite`` (a 0-d bool, the chain's finite flag) is given and false, NaN everywhere: in the
    kernel's own pass where it applies the flag, else in one more."""
    if finite is None:
        return _run(codec, "decode", (payload, saved, meta), backend)
    if not tracing(payload):
        name, function = _chosen_implementation(codec, "decode", (payload, saved, meta), _asked(backend))
        if _applies_finite_flag(codec, "decode", name):
            return function(payload, saved, meta, finite=finite)
        return nan_unless_finite(function(payload, saved, meta), finite)
    op = _graph_op(type(codec), "decode")
    if op is not None and _asked(backend) not in ("eager", "compiled"):
        return op(codec, payload, saved, meta, finite=finite)  # the graph op applies it
    return nan_unless_finite(_run(codec, "decode", (payload, saved, meta), backend), finite)


def _applies_finite_flag(codec: Any, method: str, name: str) -> bool:
    """Whether ``codec``'s implementation ``name`` of ``method`` writes (encode) or applies
    (decode) the chain's finite flag itself."""
    return any(kernel.name == name and kernel.applies_finite_flag for kernel in _resolved(type(codec), method))


def nan_unless_finite(payload: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``payload``, or NaN in its shape where ``finite`` (a 0-d bool) is false.

    >>> nan_unless_finite(torch.ones(2), torch.tensor(False))
    tensor([nan, nan])
    """
    if takes_cpu_shortcut(payload):
        # On a CPU outside compile the flag is a read of host memory: skip the pass when finite.
        return payload if bool(finite) else torch.full_like(payload, math.nan)
    return torch.where(finite, payload, math.nan)


def tracing(tensor: torch.Tensor) -> bool:
    """Whether a graph is being traced through ``tensor`` (Dynamo, or AOTAutograd tracing the
    saved-tensor hooks into the graph with fake or functional tensors): then the reference runs,
    since a kernel would be an opaque call, or would run on a tensor with no memory (the H100 run
    of ``compress_in_graph``: "Cannot access data pointer of Tensor")."""
    return torch.compiler.is_compiling() or is_subclass_tensor(tensor)


def triton_runs_on(device: torch.device) -> bool:
    """Whether a codec's Triton kernel may run on ``device``: CUDA with triton installed, or a
    CPU under Triton's interpreter when ``use_backend("triton")`` asks for it (unasked, a CPU
    tensor goes to the native kernels even where the interpreter is on)."""
    if device.type == "cuda":
        return triton_runtime.runs_on(device)
    return _asked() == "triton" and triton_runtime.runs_on(device)


def choose(codec: Any, method: str, *args: Any, backend: str | None = None) -> str:
    """The name of the implementation that runs ``codec.<method>(*args)``: ``"eager"``,
    ``"compiled"`` or a kernel's name.

    >>> import actcomp
    >>> int8, x = actcomp.parse("int8").stages[0], torch.zeros(4, dtype=torch.float64)
    >>> choose(int8, "encode", x, None), choose(int8, "encode", x, None, backend="eager")
    ('eager', 'eager')
    """
    return _chosen_implementation(codec, method, args, _asked(backend))[0]


def reference(codec: Any, method: str, *args: Any) -> Any:
    """``codec.<method>(*args)`` as the reference: every CPU-only shortcut off (the native
    kernels, the candidate searches of :mod:`~actcomp.kernels.eager_cpu`), so nothing is read
    back to the host and every shape follows from the input's and the settings."""
    previous = native_cpu.allow(False)
    try:
        with eager_cpu.static_path_only():
            return getattr(codec, method)(*args)
    finally:
        native_cpu.allow(previous)


def encoded_shapes(codec: Any, x: torch.Tensor, hints: Any) -> Any:
    """The shape-only implementation: ``codec.encode``'s outputs as tensors on the meta device
    (shapes and dtypes, no data), and its metadata, from ``x``'s shape and dtype and the settings.

    >>> import actcomp
    >>> payload, saved, meta = encoded_shapes(actcomp.parse("int8").stages[0], torch.zeros(1000), None)
    >>> payload.shape, [(s.shape, s.dtype) for s in saved]
    (torch.Size([1000]), [(torch.Size([4]), torch.float32), (torch.Size([4]), torch.bfloat16)])
    """
    return reference(codec, "encode", torch.empty_like(x, device="meta"), hints)


def _chosen_implementation(codec: Any, method: str, args: tuple, asked: str | None) -> tuple[str, Callable[..., Any]]:
    if asked == "eager":
        return "eager", functools.partial(reference, codec, method)
    if asked == "compiled":
        if type(codec) in _failed or not codec.compiles():
            return "eager", getattr(codec, method)
        return "compiled", functools.partial(_run_compiled, codec, method)
    for kernel in _resolved(type(codec), method):
        if (asked is None or kernel.name == asked) and kernel.takes(codec, *args):
            return kernel.name, functools.partial(kernel.function, codec)
    if asked is not None:
        _warn_fallback(asked, codec, method, args[0])
        return "eager", functools.partial(reference, codec, method)
    return "eager", getattr(codec, method)


def _run(codec: Any, method: str, args: tuple, backend: str | None) -> Any:
    if tracing(args[0]):
        # A graph being traced gets the codec's graph op where it registered one (the kernels
        # behind a torch.library op: one extern call in the graph), else the reference traced:
        # a kernel is an opaque call Dynamo would break the graph at, and the reference reads
        # nothing back, so every shape in the graph is symbolic.
        op = _graph_op(type(codec), method)
        if op is not None and _asked(backend) not in ("eager", "compiled"):
            return op(codec, *args)
        return getattr(codec, method)(*args)
    return _chosen_implementation(codec, method, args, _asked(backend))[1](*args)


def _warn_fallback(asked: str, codec: Any, method: str, tensor: torch.Tensor) -> None:
    has = [kernel.name for kernel in _resolved(type(codec), method)]
    why = "takes no such tensor" if asked in has else "is not registered for it"
    warn_once(("backend fallback", asked), f"actcomp: backend {asked!r} cannot run {codec.name!r} {method} on a "
              f"{tensor.dtype} tensor of {tuple(tensor.shape)} on {tensor.device} (its {asked} kernel {why}); the eager "
              f"reference runs wherever it cannot (said once a process; kernels here: {', '.join(has) or 'none'})")


def _run_compiled(codec: Any, method: str, *args: Any) -> Any:
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
        return getattr(codec, method)(*args)
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

