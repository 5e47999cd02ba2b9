"""Native CPU kernels: the eager codecs' hot loops as one C pass each, built at first use.

On a CPU, an eager codec is a string of ATen operations, each a pass over memory with its own
temporaries: an int8 round trip cost 7x a ``clone()``, the min-k candidate search
(``nonzero`` a chunk at a time) 14x its chunk's clone. The same loops written once in C
(``native_cpu.c``) read the input once and write only their outputs, on every thread
``torch.get_num_threads()`` allows. Each kernel gives its eager reference's bytes bit for bit
(``tests/kernels/test_native_cpu.py`` compares them), so the choice of path changes the time, never
a code.

The library is built the first time a kernel is asked for, by the system C compiler (``$CC``,
else ``cc``, ``gcc`` or ``clang``; about a second), into a cache directory keyed by the source,
the compiler and the CPU (``$ACTCOMP_CACHE_DIR``, else ``~/.cache/actcomp``); the same way
Inductor builds its CPU kernels, so a machine that can ``torch.compile`` can build these. Where
none can be built (no compiler, a failed build), :func:`library` warns once and returns None,
and the codecs run their eager reference. ``ACTCOMP_COMPILE=0`` (:mod:`~actcomp.core.backends`)
runs the eager reference everywhere.

The build targets this CPU (``-march=native``). ``ACTCOMP_NATIVE_MARCH`` names another x86-64
level (:data:`MARCH_LEVELS`: ``x86-64-v3`` is AVX2, ``x86-64-v4`` AVX-512), part of the cache
key, read when the library is first built: how the AVX2 kernels are built and measured on an
AVX-512 machine (``benchmarks/bench_native_levels.py``). A level this CPU cannot run is an
error, not a crash.

>>> import torch
>>> native = library()
>>> x = torch.tensor([1.0, -3.0, 0.5, 2.0])
>>> native is None or positions_and_keys(x, floor=int(x[3:].view(torch.int32)))[0].tolist() == [1, 3]
True
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from actcomp import host_allocator
from actcomp.errors import ActcompError, warn_once
from actcomp.kernels.layouts import is_subclass_tensor
from actcomp.kernels.noise import FINGERPRINT_SAMPLE, _mix_seed_and_size

SOURCE = Path(__file__).with_name("native_cpu.c")
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno")
MARCH_ENVIRONMENT = "ACTCOMP_NATIVE_MARCH"
# The -march targets ACTCOMP_NATIVE_MARCH may name, with the /proc/cpuinfo flags each needs
# (gcc's and clang's x86-64 micro-architecture levels; "native" is whatever this CPU has).
MARCH_LEVELS = {
    "native": (),
    "x86-64": (),
    "x86-64-v2": ("sse4_2", "ssse3", "popcnt", "cx16"),
    "x86-64-v3": ("sse4_2", "ssse3", "popcnt", "cx16", "avx2", "fma", "bmi2", "f16c", "movbe"),
    "x86-64-v4": ("sse4_2", "ssse3", "popcnt", "cx16", "avx2", "fma", "bmi2", "f16c", "movbe", "avx512f",
                  "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
# Positions are int32 (the position forms' own width), so the kernels take tensors below 2**31.
MAX_ELEMENTS = 2**31 - 1
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_KEY_WIDTHS = {4: (torch.int32, "32"), 2: (torch.int16, "16")}
_loaded: list[ctypes.CDLL | None] = []  # empty until the first call: [library] or [None]
_allowed = True
_observers: list[Any] = []


def allow(allowed: bool) -> bool:
    """Let the kernels run (True) or make every caller take its eager reference (False);
    returns the previous choice. :mod:`~actcomp.core.backends` turns them off for ``"eager"``."""
    global _allowed
    previous, _allowed = _allowed, allowed
    return previous


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None where they cannot be built (warned once)
    or are not allowed (:func:`allow`)."""
    if not _allowed:
        return None
    if not _loaded:
        _loaded.append(_load())
    return _loaded[0]


def quantizes(device: torch.device, dtype: torch.dtype, count: int, bits: int) -> bool:
    """Whether :func:`quantize` and :func:`dequantize` take ``count`` values of ``dtype`` on
    ``device`` at ``bits`` bits: CPU float32 or bfloat16, 1 to 2**31 - 1 values, 8, 4 or 2
    bits, and the kernels built."""
    return bits in (2, 4, 8) and casts(device, dtype, count)


def quantize(flat: torch.Tensor, bits: int, group: int, seed: torch.Tensor, codes: torch.Tensor, offset: torch.Tensor,
             scale: torch.Tensor, base: int = 0, finite: torch.Tensor | None = None) -> None:
    """:func:`~actcomp.kernels.quantize.quantize_affine` of contiguous ``flat`` into ``codes``
    (packed), ``offset`` and ``scale``, with :class:`~actcomp.kernels.noise.RoundingNoise`'s
    noise of ``seed`` (:func:`~actcomp.kernels.noise.noise_seed`, read by the kernel: no sync).
    ``flat`` is the slice from element ``base`` of a larger tensor (a multiple of ``group``
    and 8) and draws that slice's noise. ``finite`` (a 0-d bool), where given, is set to whether
    every value of ``flat`` is finite, from the groups' ranges the pass computes anyway."""
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(f"the noise seed must be one int64 value, got {seed.dtype} of shape {tuple(seed.shape)}")
    _call(f"actcomp_quantize_{_DTYPES[flat.dtype]}", (flat, codes, offset, scale),
          _pointer(flat), ctypes.c_int64(flat.numel()), ctypes.c_int64(group), ctypes.c_int(bits),
          _pointer(seed), ctypes.c_int64(base), _pointer(codes), _pointer(offset), _pointer(scale),
          _threads(), _flag_pointer(finite))


def quantize_seeded(flat: torch.Tensor, bits: int, group: int, codes: torch.Tensor, offset: torch.Tensor,
                    scale: torch.Tensor, finite: torch.Tensor | None = None) -> None:
    """:func:`quantize` of all of contiguous ``flat`` with the noise of :func:`noise_seed`
    ``(flat)``, in one call: the same codes as the two calls (the seed is computed in the
    kernel), a few microseconds less on a small tensor."""
    _call(f"actcomp_quantize_seeded_{_DTYPES[flat.dtype]}", (flat, codes, offset, scale),
          _pointer(flat), ctypes.c_int64(flat.numel()), ctypes.c_int64(group), ctypes.c_int(bits),
          *_seed_arguments(flat.numel()), _pointer(codes), _pointer(offset), _pointer(scale), _threads(),
          _flag_pointer(finite))


def _flag_pointer(finite: torch.Tensor | None) -> ctypes.c_void_p | None:
    """The chain's finite flag for a quantize kernel to write: one bool, or None for none."""
    if finite is None:
        return None
    if finite.dtype != torch.bool or finite.numel() != 1:
        raise ValueError(f"the finite flag must be one bool, got {finite.dtype} of shape {tuple(finite.shape)}")
    return _pointer(finite)


def _seed_arguments(count: int) -> tuple[ctypes.c_int64, ctypes.c_uint32]:
    """What the kernels hash ``count`` values' noise seed from: the fingerprint's stride and the
    torch seed mixed with the count (:func:`~actcomp.kernels.noise.noise_seed`'s)."""
    return ctypes.c_int64(max(1, count // FINGERPRINT_SAMPLE)), ctypes.c_uint32(_mix_seed_and_size(count))


def noise_seed(flat: torch.Tensor) -> torch.Tensor:
    """:func:`~actcomp.kernels.noise.noise_seed` of contiguous 1-D ``flat`` (float32 or bfloat16,
    as :func:`quantizes` takes), in one call.

    >>> from actcomp.kernels import noise
    >>> x = torch.randn(5000)
    >>> library() is None or bool(noise_seed(x) == noise.noise_seed(x))
    True
    """
    seed = torch.empty((), dtype=torch.int64)
    _call("actcomp_noise_seed", (flat,), _pointer(flat), ctypes.c_int64(flat.numel()), ctypes.c_int(flat.element_size()),
          *_seed_arguments(flat.numel()), _pointer(seed))
    return seed


def dequantize(codes: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor, bits: int, group: int,
               out: torch.Tensor) -> None:
    """:func:`~actcomp.kernels.quantize.dequantize_affine` into contiguous ``out`` (its dtype
    as :func:`quantizes` allows)."""
    _call(f"actcomp_dequantize_{_DTYPES[out.dtype]}", (codes, offset, scale, out),
          _pointer(codes), _pointer(offset), _pointer(scale), ctypes.c_int64(out.numel()), ctypes.c_int64(group),
          ctypes.c_int(bits), _pointer(out), _threads())


def vector_bits() -> int:
    """The vector width, in bits, of the kernels' hand-vectorized path in this build: 512 (AVX-512),
    256 (AVX2 with FMA), 0 for the portable loops or no build.

    >>> vector_bits() in (0, 256, 512)
    True
    """
    native = library()
    return 0 if native is None else int(native.actcomp_vector_bits())


def outruns_reference() -> bool:
    """Whether :func:`mask_unpack` runs here: only in a build with a hand-vectorized path
    (:func:`vector_bits`: AVX2 or AVX-512).

    A measured decision (``benchmarks/bench_native_levels.py``, Zen 4, 1 thread, the reference
    on ATen's kernels for the level): built for x86-64 or x86-64-v2, the mask decode's portable
    loop took 2.1-2.5x the reference's time; every other kernel's round trip still took at most
    0.6x the reference's there (the fp32 int8 decode alone took 1.0-1.2x, and the fp32 fp8
    encode 1.0-1.2x, while their encodes, and decodes, took under half the reference's).

    >>> outruns_reference() == (vector_bits() > 0)
    True
    """
    return vector_bits() > 0


def casts(device: torch.device, dtype: torch.dtype, count: int) -> bool:
    """Whether the fp8 kernels and :func:`mask_pack` take ``count`` values of ``dtype`` on
    ``device``: CPU float32 or bfloat16, 1 to 2**31 - 1 values, and the kernels built."""
    return device.type == "cpu" and dtype in _DTYPES and 0 < count <= MAX_ELEMENTS and library() is not None


def fp8_amax(flat: torch.Tensor) -> torch.Tensor:
    """``max(-flat.min(), flat.max())`` as a float32 scalar tensor (0 for no values)."""
    amax = torch.zeros((), dtype=torch.float32)
    _call(f"actcomp_fp8_range_{_DTYPES[flat.dtype]}", (flat,), _pointer(flat), ctypes.c_int64(flat.numel()),
          _pointer(amax), _threads())
    return amax


def fp8_encode(flat: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(flat / scale).clamp(-448, 448)`` cast to float8_e4m3fn, as torch rounds."""
    codes = torch.empty(flat.numel(), dtype=torch.uint8)
    _call(f"actcomp_fp8_encode_{_DTYPES[flat.dtype]}", (flat, codes), _pointer(flat), ctypes.c_int64(flat.numel()),
          _pointer(scale), _pointer(codes), _threads())
    return codes.view(torch.float8_e4m3fn)


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` saturated to ``dtype``'s range, in ``dtype``."""
    out = host_allocator.empty_for_writing(codes.numel(), dtype)
    _call(f"actcomp_fp8_decode_{_DTYPES[dtype]}", (codes, out), _pointer(codes), ctypes.c_int64(codes.numel()),
          _pointer(scale), _pointer(out), _threads())
    return out


MASK_MODES = {"not_at_most_zero": 0, "above_zero": 1}


def mask_pack(flat: torch.Tensor, mode: str) -> torch.Tensor:
    """A bit per element of contiguous ``flat`` (float32 or bfloat16, :func:`casts`), set where
    ``mode`` holds (``"not_at_most_zero"``: ``not (x <= 0)``, NaN included; ``"above_zero"``:
    ``x > 0``), eight to a byte, little end first."""
    bits = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8)
    _call(f"actcomp_mask_pack_{_DTYPES[flat.dtype]}", (flat, bits), _pointer(flat), ctypes.c_int64(flat.numel()),
          ctypes.c_int(MASK_MODES[mode]), _pointer(bits), _threads())
    return bits


def unpacks_mask(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`mask_unpack` writes ``dtype`` on ``device``: 2- or 4-byte elements on a CPU,
    and the kernels built with a hand-vectorized path (:func:`outruns_reference`)."""
    return device.type == "cpu" and dtype.itemsize in _KEY_WIDTHS and library() is not None and outruns_reference()


def mask_unpack(bits: torch.Tensor, count: int, standins: torch.Tensor) -> torch.Tensor:
    """``count`` elements of ``standins``' dtype: ``standins[1]`` where the bit is set,
    ``standins[0]`` where not, bit for bit."""
    out = host_allocator.empty_for_writing(count, standins.dtype)
    width = _KEY_WIDTHS[standins.element_size()][1]
    _call(f"actcomp_mask_unpack_{width}", (bits, out), _pointer(bits), ctypes.c_int64(count), _pointer(standins),
          _pointer(out), _threads())
    return out


def interval_pack(flat: torch.Tensor, edges: torch.Tensor, bits: int) -> torch.Tensor:
    """The number of float32 ``edges`` below each element of contiguous ``flat`` (float32 or
    bfloat16, :func:`casts`; NaN: 0), ``bits`` (1 to 8) to an element, as
    :func:`~actcomp.kernels.bitpack.pack_codes` packs them (one little-endian bit stream)."""
    if not (1 <= bits <= 8 and edges.numel() < 1 << bits):
        raise ValueError(f"interval codes take 1 to 8 bits and fewer than 2**bits edges; got {bits} bits, "
                         f"{edges.numel()} edges")
    packed = torch.empty(-(-flat.numel() * bits // 8), dtype=torch.uint8)
    edges = edges.to(torch.float32).contiguous()
    _call(f"actcomp_interval_pack_{_DTYPES[flat.dtype]}", (flat, edges, packed), _pointer(flat),
          ctypes.c_int64(flat.numel()), _pointer(edges), ctypes.c_int(edges.numel()), ctypes.c_int(bits),
          _pointer(packed), _threads())
    return packed


def interval_unpack(packed: torch.Tensor, count: int, bits: int, table: torch.Tensor) -> torch.Tensor:
    """``count`` elements of ``table``'s dtype: ``table[code]`` for each code :func:`interval_pack`
    wrote, bit for bit."""
    out = host_allocator.empty_for_writing(count, table.dtype)
    table = table.contiguous()
    width = _KEY_WIDTHS[table.element_size()][1]
    _call(f"actcomp_interval_unpack_{width}", (packed, table, out), _pointer(packed), ctypes.c_int64(count),
          ctypes.c_int(bits), _pointer(table), _pointer(out), _threads())
    return out


def saturate_bf16(flat: torch.Tensor) -> torch.Tensor:
    """Contiguous float32 ``flat`` cast to bfloat16 with finite values clamped into its range,
    as :func:`~actcomp.compressors.casts.saturating_cast` casts (NaN as torch casts it here)."""
    out = torch.empty(flat.numel(), dtype=torch.bfloat16)
    _call("actcomp_saturate_bf16", (flat, out), _pointer(flat), ctypes.c_int64(flat.numel()),
          ctypes.c_int(_torch_bf16_nan()), _pointer(out), _threads())
    return out


@functools.cache
def _torch_bf16_nan() -> int:
    # Read from torch once: ATen's vectorized cast writes 0xFFFF for every NaN, its scalar one
    # 0x7FC0, and which one runs depends on ATEN_CPU_CAPABILITY.
    return int(torch.full((64,), float("nan")).bfloat16().view(torch.int16)[0]) & 0xFFFF


def takes_pool_indices(device: torch.device, dtype: torch.dtype, count: int) -> bool:
    """Whether :func:`pool_encode` takes ``count`` argmax positions of ``dtype``: int64 on a
    CPU, 1 to 2**31 - 1 of them, and the kernels built."""
    return device.type == "cpu" and dtype == torch.int64 and 0 < count <= MAX_ELEMENTS and library() is not None


def pool_encode(indices: torch.Tensor, bits: int, geometry: tuple[int, ...]) -> torch.Tensor:
    """PoolOffsets' packed codes of contiguous int64 ``indices``. ``geometry``: the kernel's
    columns, stride, padding and dilation (two each), the input plane's width, the output
    plane's rows and columns."""
    per_byte = 8 // bits
    packed = torch.empty(-(-indices.numel() // per_byte), dtype=torch.uint8)
    _call("actcomp_pool_encode", (indices, packed), _pointer(indices), ctypes.c_int64(indices.numel()),
          (ctypes.c_int64 * len(geometry))(*geometry), ctypes.c_int(bits), _pointer(packed), _threads())
    return packed


def pool_decode(packed: torch.Tensor, count: int, bits: int, geometry: tuple[int, ...]) -> torch.Tensor:
    """The int64 argmax positions :func:`pool_encode` packed."""
    indices = host_allocator.empty_for_writing(count, torch.int64)
    _call("actcomp_pool_decode", (packed, indices), _pointer(packed), ctypes.c_int64(count),
          (ctypes.c_int64 * len(geometry))(*geometry),
          ctypes.c_int(bits), _pointer(indices), _threads())
    return indices


def selects(flat: torch.Tensor) -> bool:
    """Whether :func:`positions_and_keys` takes ``flat``: a CPU tensor of 2- or 4-byte floats
    below 2**31 elements, and the kernels built."""
    return (flat.device.type == "cpu" and flat.is_floating_point() and flat.element_size() in _KEY_WIDTHS
            and flat.numel() <= MAX_ELEMENTS and library() is not None)


def positions_and_keys(flat: torch.Tensor, floor: int | torch.Tensor,
                       capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ascending int32 positions and the magnitude keys
    (:func:`~actcomp.kernels.thresholds.magnitude_keys`) of contiguous ``flat``'s elements whose
    key is at least the key ``floor``. ``capacity``: the room allocated first (None: none, the
    kernel counts first); when more turn up, the kernel says how many and runs again into
    tensors of that size, so no temporary is larger than needed."""
    key_dtype, width = _KEY_WIDTHS[flat.element_size()]
    room = 0 if capacity is None else min(capacity, flat.numel())  # 0: count, then write
    while True:
        positions = torch.empty(room, dtype=torch.int32)
        keys = torch.empty(room, dtype=key_dtype)
        found = _call(f"actcomp_candidates_{width}", (flat, positions, keys),
                      _pointer(flat), ctypes.c_int64(flat.numel()), ctypes.c_int64(int(floor)), _pointer(positions),
                      _pointer(keys), ctypes.c_int64(room), _threads(), data_sized=True)
        if found < 0:
            raise MemoryError("actcomp's native candidate search could not allocate its block counts")
        if found <= room:
            return positions[:found], keys[:found]
        room = found


def takes_keys(keys: torch.Tensor) -> bool:
    """Whether :func:`select` takes ``keys``: contiguous 2- or 4-byte integers on a CPU, and the
    kernels built."""
    return (keys.device.type == "cpu" and not keys.is_floating_point() and keys.element_size() in _KEY_WIDTHS
            and keys.is_contiguous() and library() is not None)


def compacts(positions: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether :func:`compact` takes these candidates: contiguous int32 positions and keys
    :func:`takes_keys` takes."""
    return positions.device.type == "cpu" and positions.dtype == torch.int32 and positions.is_contiguous() \
        and takes_keys(keys)


def compact(positions: torch.Tensor, keys: torch.Tensor, key: int, ties: int) -> torch.Tensor:
    """The positions of the candidates (:func:`positions_and_keys`' outputs, contiguous) whose
    key is above ``key``, and of the first ``ties`` equal to it, moved to the front of
    ``positions`` in order; returns that front, a view."""
    width = _KEY_WIDTHS[keys.element_size()][1]
    kept = _call(f"actcomp_compact_{width}", (positions, keys),
                 _pointer(positions), _pointer(keys), ctypes.c_int64(keys.numel()), ctypes.c_int64(key),
                 ctypes.c_int64(ties), data_sized=True)
    return positions[:kept]


def select(keys: torch.Tensor, kept: int) -> tuple[int, int]:
    """``(key, ties)`` of :func:`~actcomp.kernels.thresholds.select_threshold` over contiguous
    ``keys`` (:func:`positions_and_keys`' or a sample's, 1 to ``keys.numel()`` kept): the
    ``kept``-th largest key, and how many equal to it are kept."""
    key_dtype, width = _KEY_WIDTHS[keys.element_size()]
    ties = ctypes.c_int64(0)
    key = _call(f"actcomp_select_{width}", (keys,), _pointer(keys), ctypes.c_int64(keys.numel()), ctypes.c_int64(kept),
                ctypes.c_int(8 * keys.element_size() - 1), ctypes.byref(ties))
    if key < 0:
        raise MemoryError("actcomp's native radix select could not allocate its histogram")
    return key, ties.value


def select_data(flat: torch.Tensor, kept: int) -> tuple[int, int]:
    """:func:`select` over the magnitude keys of contiguous ``flat`` itself (a tensor
    :func:`selects` takes), without making them: :func:`~actcomp.kernels.thresholds.exact_threshold`'s
    ``(key, ties)``, for a min-k that keeps too many for candidates."""
    width = _KEY_WIDTHS[flat.element_size()][1]
    ties = ctypes.c_int64(0)
    key = _call(f"actcomp_select_data_{width}", (flat,), _pointer(flat), ctypes.c_int64(flat.numel()),
                ctypes.c_int64(kept), ctypes.c_int(8 * flat.element_size() - 1), _threads(), ctypes.byref(ties))
    if key < 0:
        raise MemoryError("actcomp's native radix select could not allocate its histograms")
    return key, ties.value


def bitmask_keep(flat: torch.Tensor, key: int, ties: int, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``kept`` values of contiguous ``flat`` whose magnitude key is above ``key``, with the
    first ``ties`` equal to it, in position order, and the bit per element that says which
    (:class:`~actcomp.kernels.positions.Bitmask`'s): ``encode_kept``'s outputs under that threshold."""
    width = _KEY_WIDTHS[flat.element_size()][1]
    values = torch.empty(kept, dtype=flat.dtype)
    bits = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8)
    written = _call(f"actcomp_bitmask_keep_{width}", (flat, bits, values), _pointer(flat),
                    ctypes.c_int64(flat.numel()), ctypes.c_int64(key), ctypes.c_int64(ties), _pointer(bits),
                    _pointer(values), _threads(), data_sized=True)
    if written < 0:
        raise MemoryError("actcomp's native bitmask encode could not allocate its block counts")
    if written != kept:
        raise ActcompError(f"native bitmask encode kept {written} values where the threshold keeps {kept}")
    return values, bits


def kept_positions(flat: torch.Tensor, key: int, ties: int, kept: int) -> torch.Tensor:
    """The ascending int32 positions of the elements :func:`bitmask_keep` keeps, for the forms
    that store positions."""
    width = _KEY_WIDTHS[flat.element_size()][1]
    positions = torch.empty(kept, dtype=torch.int32)
    written = _call(f"actcomp_kept_positions_{width}", (flat, positions), _pointer(flat),
                    ctypes.c_int64(flat.numel()), ctypes.c_int64(key), ctypes.c_int64(ties), _pointer(positions),
                    _threads(), data_sized=True)
    if written < 0:
        raise MemoryError("actcomp's native position search could not allocate its block counts")
    if written != kept:
        raise ActcompError(f"native position search kept {written} where the threshold keeps {kept}")
    return positions


def bitmask_expand(bits: torch.Tensor, values: torch.Tensor, count: int) -> torch.Tensor:
    """:meth:`Bitmask.scatter <actcomp.kernels.positions.Bitmask.scatter>`: ``count`` zeros with
    the contiguous ``values`` at the set bits of ``bits``, in order."""
    width = _KEY_WIDTHS[values.element_size()][1]
    out = torch.empty(count, dtype=values.dtype)
    if not values.numel():
        return out.zero_()
    if _call(f"actcomp_bitmask_expand_{width}", (bits, values, out), _pointer(bits), _pointer(values),
             ctypes.c_int64(values.numel()), ctypes.c_int64(count), _pointer(out), _threads()) < 0:
        raise MemoryError("actcomp's native bitmask scatter could not allocate its block counts")
    return out


def gather(flat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The values of contiguous ``flat`` at int32 ``positions``, bit for bit, and +0.0 where a
    position is ``flat.numel()`` (an empty slot)."""
    out = torch.empty(positions.numel(), dtype=flat.dtype)
    width = _KEY_WIDTHS[flat.element_size()][1]
    _call(f"actcomp_gather_{width}", (flat, positions, out), _pointer(flat), ctypes.c_int64(flat.numel()),
          _pointer(positions), ctypes.c_int64(positions.numel()), _pointer(out), _threads())
    return out


def codes_positions(positions: torch.Tensor) -> bool:
    """Whether :func:`elias_fano_encode` takes ``positions``: int32 on a CPU, and the kernels built."""
    return positions.device.type == "cpu" and positions.dtype == torch.int32 and library() is not None


def elias_fano_encode(positions: torch.Tensor, low_bits: int, high: torch.Tensor, low: torch.Tensor) -> None:
    """:meth:`EliasFano.from_positions <actcomp.kernels.positions.EliasFano.from_positions>`:
    sets the bits of contiguous ``positions`` (ascending, int32) in the zeroed streams ``high``
    and ``low``."""
    _call("actcomp_ef_encode", (positions, high, low),
          _pointer(positions), ctypes.c_int64(positions.numel()), ctypes.c_int(low_bits), _pointer(high), _pointer(low))


def scatters(values: torch.Tensor) -> bool:
    """Whether :func:`elias_fano_scatter` takes ``values``: 2- or 4-byte elements on a CPU."""
    return values.device.type == "cpu" and values.element_size() in _KEY_WIDTHS and library() is not None


def elias_fano_scatter(values: torch.Tensor, high: torch.Tensor, low: torch.Tensor, low_bits: int,
                       count: int) -> torch.Tensor:
    """:meth:`EliasFano.scatter <actcomp.kernels.positions.EliasFano.scatter>`: ``count`` zeros
    with each slot's value at its position, from contiguous ``values``, ``high`` and ``low``."""
    out = host_allocator.empty_for_writing(count, values.dtype)
    width = _KEY_WIDTHS[values.element_size()][1]
    status = _call(f"actcomp_ef_scatter_{width}", (values, high, low, out),
                   _pointer(values), ctypes.c_int64(values.numel()), _pointer(high), ctypes.c_int64(high.numel()),
                   _pointer(low), ctypes.c_int64(low.numel()), ctypes.c_int(low_bits), ctypes.c_int64(count),
                   _pointer(out), _threads())
    if status < 0:
        raise MemoryError("actcomp's native Elias-Fano scatter could not allocate its slot counts")
    return out


@contextlib.contextmanager
def observed(observer: Any) -> Iterator[None]:
    """Inside the block, every kernel call runs inside ``observer.kernel(name, tensors,
    data_sized)`` (a context manager): what :func:`~actcomp.tools.codec_cost.codec_cost` counts
    and times, as it does the ATen operations the kernels replace. ``tensors``: those the call
    reads and writes; ``data_sized``: whether its result's size depends on the data, as ``nonzero``'s."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def _call(name: str, tensors: tuple[torch.Tensor, ...], *args: Any, data_sized: bool = False) -> Any:
    function = getattr(library(), name)
    if not _observers:
        return function(*args)
    with contextlib.ExitStack() as stack:
        for observer in _observers:
            stack.enter_context(observer.kernel(name, tensors, data_sized))
        return function(*args)


def _threads() -> ctypes.c_int:
    return ctypes.c_int(torch.get_num_threads())


def _pointer(tensor: torch.Tensor) -> ctypes.c_void_p:
    # The kernels index flat memory: a strided view would be read as the wrong elements.
    if is_subclass_tensor(tensor):
        raise ValueError(f"actcomp's native kernels take plain tensors, got a {type(tensor).__name__}")
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"actcomp's native kernels take contiguous CPU tensors, got strides {tensor.stride()} "
                         f"on {tensor.device}")
    return ctypes.c_void_p(tensor.data_ptr())


def _load() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        warn_once("native kernels", "actcomp: no C compiler found ($CC, cc, gcc or clang); the codecs run their "
                  "eager reference, which is slower on CPU")
        return None
    try:
        path = _built(compiler)
        native = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or str(error)
        warn_once("native kernels", f"actcomp: building the native CPU kernels failed ({detail.strip()[:300]}); "
                  "the codecs run their eager reference")
        return None
    _declare(native)
    return native


def march() -> str:
    """The ``-march`` the kernels are built for: ``$ACTCOMP_NATIVE_MARCH``, else ``"native"``.

    >>> march() in MARCH_LEVELS
    True
    """
    level = os.environ.get(MARCH_ENVIRONMENT) or "native"
    if level not in MARCH_LEVELS:
        raise ActcompError(f"unknown {MARCH_ENVIRONMENT}={level!r}; valid: {', '.join(MARCH_LEVELS)}")
    if level != "native" and platform.machine() not in ("x86_64", "AMD64"):
        raise ActcompError(f"{MARCH_ENVIRONMENT}={level!r} is an x86-64 level, and this CPU is "
                           f"{platform.machine()}; valid here: native")
    flags = set(_cpu_flags().split())
    missing = [flag for flag in MARCH_LEVELS[level] if flag not in flags]
    if missing:
        raise ActcompError(f"{MARCH_ENVIRONMENT}={level!r} needs CPU features this CPU lacks "
                           f"({', '.join(missing)}); it would stop at the first such instruction; valid here: "
                           f"{', '.join(name for name, need in MARCH_LEVELS.items() if flags.issuperset(need))}")
    return level


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _built(compiler: str) -> Path:
    """The shared library for this source, compiler and CPU, built once per cache directory."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    flags = (f"-march={march()}", *FLAGS)
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, *flags, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    directory = Path(os.environ.get("ACTCOMP_CACHE_DIR") or Path.home() / ".cache" / "actcomp")
    path = directory / f"native_cpu-{key}.so"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: processes building at once (test workers)
        # never load a half-written file.
        handle, temporary = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(handle)
        try:
            subprocess.run([compiler, *flags, str(SOURCE), "-o", temporary], capture_output=True, text=True, check=True)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
    return path


def _cpu_flags() -> str:
    """The CPU's feature flags: a library built with -march=native runs only where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _declare(native: ctypes.CDLL) -> None:
    native.actcomp_vector_bits.restype = ctypes.c_int
    for name in ("actcomp_candidates_32", "actcomp_candidates_16", "actcomp_ef_scatter_16", "actcomp_ef_scatter_32",
                 "actcomp_compact_32", "actcomp_compact_16", "actcomp_select_32", "actcomp_select_16",
                 "actcomp_select_data_32", "actcomp_select_data_16", "actcomp_bitmask_keep_32",
                 "actcomp_bitmask_keep_16", "actcomp_bitmask_expand_16", "actcomp_bitmask_expand_32",
                 "actcomp_kept_positions_32", "actcomp_kept_positions_16"):
        getattr(native, name).restype = ctypes.c_int64
    for name in ("actcomp_noise_seed",
                 "actcomp_quantize_f32", "actcomp_quantize_bf16", "actcomp_dequantize_f32", "actcomp_dequantize_bf16",
                 "actcomp_quantize_seeded_f32", "actcomp_quantize_seeded_bf16",
                 "actcomp_ef_encode", "actcomp_gather_16", "actcomp_gather_32", "actcomp_fp8_range_f32",
                 "actcomp_fp8_range_bf16", "actcomp_fp8_encode_f32", "actcomp_fp8_encode_bf16", "actcomp_fp8_decode_f32",
                 "actcomp_fp8_decode_bf16", "actcomp_mask_pack_f32", "actcomp_mask_pack_bf16",
                 "actcomp_mask_unpack_16", "actcomp_mask_unpack_32", "actcomp_saturate_bf16",
                 "actcomp_pool_encode", "actcomp_pool_decode", "actcomp_interval_pack_f32",
                 "actcomp_interval_pack_bf16", "actcomp_interval_unpack_16", "actcomp_interval_unpack_32"):
        getattr(native, name).restype = None
