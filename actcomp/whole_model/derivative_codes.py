"""Few-bit derivative codes for GELU and SiLU (the Few-bit backward idea, Novikov et al., ICML'22).

GELU's and SiLU's backward read their saved input ``x`` only through the derivative ``f'(x)``.
So split the real line into ``2**bits`` intervals on which ``f'`` varies least (minimax: the
largest ``max f' - min f'`` over the intervals is as small as it can be), keep each ``x`` as
the index of its interval (``bits`` bits), and unpack it to a *representative* point of the
interval, chosen so that ``f'`` there is the middle of ``f'``'s range on the interval. PyTorch's
own backward kernel then reads the representative, so the gradient uses a derivative within
:func:`derivative_error` of the true one (0.08 for 3-bit GELU), at a tenth of the bytes of
fp32 (3 bits instead of 32).

The intervals are computed once per (function, bits) on a float64 grid from the backward
kernels themselves, so they match what the backward computes. On CUDA (and under Triton's
interpreter, asked for) encode and decode are one launch each of
:mod:`~actcomp.kernels.triton_masks`, and on a CPU (float32 or bfloat16) one pass each of
:mod:`~actcomp.kernels.native_cpu`: the same codes bit for bit. (The reference compares each
value once per edge: with it a ``rest="4bit"`` step of ViT-S cost 1.71-1.78x plain's on an Intel
Xeon at 2 threads, with the kernels 1.36-1.38x; ``benchmarks/results/fewbit_native_stop58/``.)

>>> import torch
>>> x = torch.randn(1000)
>>> codec = DerivativeCode("gelu", bits=3)
>>> packed = codec.compress(x)
>>> packed.nbytes, codec.label, round(derivative_error("gelu", "none", 3), 3)
(376, 'fewbit3', 0.08)
>>> d = lambda t: torch.ops.aten.gelu_backward(torch.ones_like(t), t)
>>> bool((d(codec.decompress(packed)) - d(x)).abs().max() <= derivative_error("gelu", "none", 3) + 1e-3)  # + fp32 rounding
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from actcomp.core.backends import register_implementation
from actcomp.core.codec import Compressor, Encoded, Hints, setting
from actcomp.core.registry import register_codec
from actcomp.kernels import native_cpu
from actcomp.kernels.bitpack import unpack_codes
from actcomp.kernels.chunks import spans
from actcomp.kernels.device_constants import device_table
from actcomp.whole_model.exact_codecs import TRITON_FLOATS, pack_chunked, triton_takes

# f' on [-10, 10] decides the intervals; beyond it GELU's and SiLU's derivatives are within
# 5e-4 of their limits (0 and 1), inside every interval's tolerance.
_GRID = torch.linspace(-10, 10, 4001, dtype=torch.float64)
# Elements encoded or decoded at a time (a multiple of 8: chunks pack into whole bytes).
CHUNK = 1 << 20


def _derivative(function: str, approximate: str, x: torch.Tensor) -> torch.Tensor:
    ones = torch.ones_like(x)
    if function == "gelu":
        return torch.ops.aten.gelu_backward(ones, x, approximate=approximate)
    return torch.ops.aten.silu_backward(ones, x)


def _pieces(values: list[float], tolerance: float, most: int | None = None) -> list[int]:
    """Start indices of the fewest runs in which ``max - min <= 2 * tolerance`` (greedy is
    optimal for this: each run is as long as it can be); with ``most``, the first ``most + 1``
    once there are more (the bisection below asks only whether there are at most ``most``).

    Comparisons, not ``min``/``max`` calls, and the early stop: the bisection's 50 scans of 4,001
    values took 55 ms (now 15) in a process's first ``"4bit"`` forward of a GELU or SiLU, half a
    plain step of the budget search's small Llama."""
    width = 2 * tolerance
    starts, low, high = [0], values[0], values[0]
    for index, value in enumerate(values):
        if value < low:
            low = value
        elif value > high:
            high = value
        if high - low > width:
            starts.append(index)
            if most is not None and len(starts) > most:
                return starts
            low = high = value
    return starts


_CODEBOOKS: dict[tuple[str, str, int], tuple[list[float], list[float], float]] = {}


def _codebook(function: str, approximate: str, bits: int) -> tuple[list[float], list[float], float]:
    """Interval boundaries, representatives and the largest derivative error, computed once.

    A plain dict, filled when a codec is built (eagerly): compiled code then reads constants."""
    key = (function, approximate, bits)
    if key not in _CODEBOOKS:
        _CODEBOOKS[key] = _compute_codebook(function, approximate, bits)
    return _CODEBOOKS[key]


def _compute_codebook(function: str, approximate: str, bits: int) -> tuple[list[float], list[float], float]:
    derivative = _derivative(function, approximate, _GRID)
    values = derivative.tolist()
    low, high = 0.0, max(values) - min(values)
    for _ in range(50):  # bisect the smallest tolerance that needs at most 2**bits runs
        middle = (low + high) / 2
        low, high = (low, middle) if len(_pieces(values, middle, 2**bits)) <= 2**bits else (middle, high)
    starts = _pieces(values, high) + [len(values)]
    boundaries, representatives = [], []
    for start, end in zip(starts, starts[1:]):
        run = derivative[start:end]
        target = (run.max() + run.min()) / 2
        representatives.append(_GRID[start + int((run - target).abs().argmin())].item())
        if end < len(values):
            boundaries.append(((_GRID[end - 1] + _GRID[end]) / 2).item())
    # The error between grid points counts too: measure it on a grid 50 times finer.
    fine = torch.linspace(-10, 10, 200001, dtype=torch.float64)
    interval = torch.bucketize(fine, torch.tensor(boundaries, dtype=torch.float64))
    chosen = torch.tensor(representatives, dtype=torch.float64)[interval]
    error = (_derivative(function, approximate, fine) - _derivative(function, approximate, chosen)).abs().max().item()
    # The largest errors sit at the boundaries, approached from either side (a value just past
    # a boundary reads the next interval's representative); no grid point reaches those limits.
    edges = _derivative(function, approximate, torch.tensor(boundaries, dtype=torch.float64))
    sides = _derivative(function, approximate, torch.tensor(representatives, dtype=torch.float64))
    limits = torch.maximum((edges - sides[:-1]).abs(), (edges - sides[1:]).abs())
    return boundaries, representatives, max(error, limits.max().item())


def derivative_error(function: str, approximate: str, bits: int) -> float:
    """The largest gap between ``f'(x)`` and the derivative the backward reads from the code, in
    exact arithmetic; rounding interval ends and representatives to the input's dtype adds up to
    about 1e-4 in fp32 and 2e-3 in bf16 (its derivative kernel rounds too)."""
    return _codebook(function, approximate, bits)[2]


@register_codec
@dataclass(frozen=True)
class DerivativeCode(Compressor):
    """``x`` (the input GELU or SiLU saved) as ``bits``-bit interval indices, ``ceil(n * bits
    / 8) + 1`` bytes (the last, the chain's finite flag); ``function`` is ``"gelu"`` (``approximate`` ``"none"`` or ``"tanh"``) or
    ``"silu"``, plus the chain's finite flag: a NaN or inf has no interval, so a tensor holding
    one decodes to NaN everywhere (:mod:`actcomp.core.chain`) and its gradient is NaN, as
    overflow should be (chosen by the op alone: nothing is read to choose).

    Works in chunks of :data:`CHUNK` elements, so its temporaries stay a few chunks in size
    whatever the tensor's (whole-tensor interval indices alone would be 1 byte per element).
    """

    name = "fewbit"
    kind = "derivative"
    function: Literal["gelu", "silu"] = "gelu"
    approximate: Literal["none", "tanh"] = "none"
    bits: int = setting(3, minimum=1, below=9)

    def __post_init__(self) -> None:
        super().__post_init__()
        _codebook(self.function, self.approximate, self.bits)

    @property
    def label(self) -> str:
        return f"fewbit{self.bits}"

    def representatives(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The point each interval decodes to, in ``dtype``."""
        return device_table(tuple(_codebook(self.function, self.approximate, self.bits)[1]), dtype, device)

    def edges(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The intervals' edges as ``dtype`` rounds them, as a comparison with a Python number would."""
        return device_table(tuple(_codebook(self.function, self.approximate, self.bits)[0]), dtype, device)

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        edges = self.edges(x.dtype, x.device)
        flat = x.reshape(-1)
        packed = pack_chunked(flat, self.bits, lambda part: _interval(part, edges), CHUNK)
        return Encoded(packed, (), (flat.numel(), x.dtype))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
        count, dtype = meta
        values = self.representatives(dtype, payload.device)
        out = torch.empty(count, dtype=dtype, device=payload.device)
        for start, stop in spans(count, CHUNK):
            codes = unpack_codes(payload[start * self.bits // 8:], self.bits, stop - start)
            out[start:stop] = torch.index_select(values, 0, codes.int())
        return out


def _interval(part: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """``torch.bucketize(part, edges)`` as uint8: the number of edges below each value. One
    comparison per edge (7 for 3 bits) is ten times faster on CPU than bucketize's search."""
    codes = (part > edges[0]).to(torch.uint8)
    for index in range(1, edges.numel()):
        codes += part > edges[index]
    return codes


def _triton_encode(codec: DerivativeCode, x: torch.Tensor, hints: Hints) -> Encoded:
    """:meth:`DerivativeCode.encode` in one launch of :mod:`~actcomp.kernels.triton_masks`: a
    binary search among the edges, padded with +inf (above every value) to ``2**bits - 1``."""
    from actcomp.kernels import triton_masks

    boundaries, _, _ = _codebook(codec.function, codec.approximate, codec.bits)
    padding = (math.inf,) * (2**codec.bits - 1 - len(boundaries))
    edges = device_table(tuple(boundaries) + padding, x.dtype, x.device)
    flat = x.reshape(-1).contiguous()
    return Encoded(triton_masks.encode_codes(flat, "interval", codec.bits, edges), (), (flat.numel(), x.dtype))


def _triton_decode(codec: DerivativeCode, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any,
                   finite: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`DerivativeCode.decode` in one launch, NaN everywhere where ``finite`` is false."""
    from actcomp.kernels import triton_masks

    count, dtype = meta
    return triton_masks.decode_table(payload.contiguous(), codec.representatives(dtype, payload.device), codec.bits,
                                     count, finite)


def _cpu_encode(codec: DerivativeCode, x: torch.Tensor, hints: Hints) -> Encoded:
    """:meth:`DerivativeCode.encode` in one pass of :mod:`~actcomp.kernels.native_cpu`."""
    flat = x.reshape(-1).contiguous()
    return Encoded(native_cpu.interval_pack(flat, codec.edges(x.dtype, x.device), codec.bits), (),
                   (flat.numel(), x.dtype))


def _cpu_decode(codec: DerivativeCode, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Any) -> torch.Tensor:
    count, dtype = meta
    return native_cpu.interval_unpack(payload.contiguous(), count, codec.bits, codec.representatives(dtype, payload.device))


# Every width the codec takes (1 to 8 bits), only where encode (decode) is DerivativeCode's own;
# the decode where the mask decode runs (a build with hand-vectorized loops).
register_implementation(
    DerivativeCode, "native", encode=_cpu_encode,
    encodes=lambda codec, x, hints: type(codec).encode is DerivativeCode.encode
    and native_cpu.casts(x.device, x.dtype, x.numel()),
    decode=_cpu_decode,
    decodes=lambda codec, payload, saved, meta: type(codec).decode is DerivativeCode.decode and meta[0] > 0
    and native_cpu.unpacks_mask(payload.device, meta[1]))


register_implementation(
    DerivativeCode, "triton", encode=_triton_encode,
    encodes=lambda codec, x, hints: triton_takes(x.device, x.dtype, x.numel(), TRITON_FLOATS),
    decode=_triton_decode, applies_finite_flag=True,
    decodes=lambda codec, payload, saved, meta: triton_takes(payload.device, meta[1], meta[0], TRITON_FLOATS))
