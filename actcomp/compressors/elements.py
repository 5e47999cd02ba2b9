"""Element sparsifiers (DropIT §3.3): keep some elements exactly, drop the rest to zero.

Every stage here keeps at most ``k = n - floor(drop_rate * n)`` elements (see
:func:`~actcomp.kernels.thresholds.kept_count`): ``mink``, ``pmink`` and ``random`` exactly
``k``, ``smink`` ``k`` within sampling error. The kept values are handed on as a flat payload of
``k`` slots in ascending position order (slots left over hold zeros), so every shape follows
from the input's shape and the settings; the positions are stored in the static form of
fewest bytes, a bitmask or Elias-Fano (:mod:`actcomp.kernels.positions`), or, with the setting
``rice=1``, Rice-coded (smaller, but a size that depends on the data: eager only).
Encoding reads nothing back to Python, so it runs under ``torch.compile(fullgraph=True)``.

All of them select a chunk at a time (:mod:`~actcomp.kernels.chunks`): a bool mask per slice
of the tensor, the kept values and positions written from it while the slice is in cache. The
min-k stages first find their threshold without sorting (:mod:`~actcomp.kernels.thresholds`).
On CUDA, ``mink``, ``smink``, ``dropit`` and ``random`` run as Triton kernels instead
(:mod:`~actcomp.kernels.triton_select`: a radix select and two passes, the same codes,
the chain's finite flag written and applied in those launches).

Bytes and round-trip time of each form, the static ones beside ``rice=1``, are measured by
``python benchmarks/bench_compressors.py`` (its results file, and the README's table): on
(32, 197, 384) fp32 with ``+int8``, 4.2% of the dense bytes static, 4.0% with ``rice=1``,
whose round trip is now the slower one (it runs the same slot pass before coding). At rate 0.5
both store a bitmask's size (Rice with r = 0 spends one bit per element too).

>>> import torch
>>> x = torch.tensor([[0.1, -3.0], [2.0, 0.2]])
>>> MinK(0.5).decompress(MinK(0.5).compress(x))
tensor([[ 0., -3.],
        [ 2.,  0.]])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from actcomp.core import backends
from actcomp.core.backends import register_implementation
from actcomp.core.codec import Compressor, Encoded, Hints, setting
from actcomp.core.registry import register_compressor
from actcomp.kernels import eager_cpu, native_cpu
from actcomp.kernels.chunks import aligned_length, spans
from actcomp.kernels.eager_select import exact_kept_positions, sampled_kept_positions, worth_it
from actcomp.kernels.positions import (
    Bitmask,
    Dense,
    EliasFano,
    Indices,
    PositionForm,
    Selector,
    encode_kept,
    encode_positions,
    expand_kept,
    index_chunk_length,
    rice_form,
    static_form,
)
from actcomp.kernels.thresholds import (
    RANDOM_KEY_BITS,
    SAMPLE,
    Threshold,
    ThresholdSelector,
    exact_threshold,
    kept_count,
    magnitude_keys,
    random_keys,
    sample_step,
    sampled_rank,
    sampled_threshold,
    select_threshold,
)


@dataclass(frozen=True)
class _ElementSparsifier(Compressor):
    """Shared chunked encode/decode: subclasses only choose which elements of a slice to keep."""

    kind = "sparsifier"
    takes_rate = True
    drop_rate: float = 0.9

    def kept_count(self, count: int) -> int:
        return kept_count(count, self.drop_rate)

    def compiles(self) -> bool:
        return not getattr(self, "rice", 0) and super().compiles()

    def selector(self, flat: torch.Tensor, kept: int) -> Selector:
        """What to keep in each slice of ``flat``, ``kept`` overall."""
        raise NotImplementedError

    def chunk_length(self, device: torch.device, count: int) -> int:
        """Elements per slice: a multiple of 8, for the bitmask."""
        return index_chunk_length(device, count)

    def position_form(self, count: int, kept: int, length: int) -> PositionForm:
        rice = getattr(self, "rice", 0)
        return rice_form(count, kept, length) if rice else static_form(count, kept)

    def kept_positions(self, flat: torch.Tensor, kept: int) -> torch.Tensor | None:
        """The CPU selection (:mod:`~actcomp.kernels.eager_select`, run by the CPU implementation
        below): the ascending positions the selector would keep (``flat.numel()`` in an empty
        slot), or None to take the static path. A stage without one always takes the static path."""
        return None

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        count = flat.numel()
        kept = self.kept_count(count)
        length = self.chunk_length(flat.device, count)
        form = self.position_form(count, kept, length)
        select = self.selector(flat, kept) if kept < count else None
        return Encoded(*encode_kept(flat, select, kept, form, length))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: PositionForm) -> torch.Tensor:
        return meta.scatter(payload, saved)


def _cpu_form(codec: _ElementSparsifier, x: torch.Tensor) -> Bitmask | EliasFano | Indices | None:
    """The position form the CPU selection writes for ``x``, None where it does not run: off a CPU
    (or under :func:`~actcomp.kernels.eager_cpu.static_path_only`), for a stage without its own
    selection or encode, a form written otherwise (dense, Rice), or candidates too large beside
    the input (:func:`~actcomp.kernels.eager_select.worth_it`)."""
    if not eager_cpu.applies(x) or type(codec).encode is not _ElementSparsifier.encode \
            or type(codec).kept_positions is _ElementSparsifier.kept_positions:
        return None
    count = x.numel()
    kept = codec.kept_count(count)
    form = codec.position_form(count, kept, codec.chunk_length(x.device, count))
    if isinstance(form, (Bitmask, EliasFano, Indices)) and worth_it(count, kept, x.element_size()):
        return form
    if _keeps_densely(codec, x, form):
        return form
    return None


def _keeps_densely(codec: _ElementSparsifier, x: torch.Tensor, form: PositionForm) -> bool:
    """Whether exact min-k keeps too many for candidates (more than about 15% of fp32, 10% of
    16-bit elements) and the native kernels take ``x``: a radix select over the data's own keys,
    then one kernel writes the bits and the kept values (Bitmask positions, over about 25% kept),
    or the kept positions for the Elias-Fano writer (between the two, where those positions stay
    within the temporaries' budget)."""
    if type(codec) is not MinK or not native_cpu.selects(x):
        return False
    if _sample_is_whole(x.numel()) and isinstance(form, (EliasFano, Indices)):
        return True  # positions of fewer than 131,072 values: under 512 KiB, whatever the share kept
    if isinstance(form, EliasFano):
        # The int32 positions are a temporary: within 0.35x the input's bytes, as candidates are
        # (bf16 up to 17.5% kept; the static path past it, up to the bitmask's 25%).
        return codec.kept_count(x.numel()) * 4 <= 0.35 * x.numel() * x.element_size()
    return isinstance(form, Bitmask)


def _sample_is_whole(count: int) -> bool:
    """Whether exact min-k's sample of ``count`` elements is all of them (fewer than 2
    :data:`~actcomp.kernels.thresholds.SAMPLE`): its candidates would then repeat the select over
    the same keys, so one select over the data and one pass writing the kept positions do it
    (a small layer's 34 x 384 input: 4 native calls, keys and candidates made, 174 us, against
    2 calls and none made)."""
    return sample_step(count, SAMPLE, round_up=True) == 1


def _selects_over_data(codec: _ElementSparsifier, flat: torch.Tensor, kept: int) -> bool:
    """Whether :func:`_cpu_encode` selects over ``flat``'s data with the native kernels rather
    than over candidates: where candidates would keep too many (:func:`_keeps_densely` took it),
    or where exact min-k's sample is all of ``flat`` (:func:`_sample_is_whole`)."""
    return not worth_it(flat.numel(), kept, flat.element_size()) or (
        type(codec) is MinK and native_cpu.selects(flat) and _sample_is_whole(flat.numel()))


def _cpu_encode(codec: _ElementSparsifier, x: torch.Tensor, hints: Hints) -> Encoded:
    """The static path's codes from the CPU selection: candidates found with ``nonzero``, the
    positions written by the native kernels where they are built."""
    flat = x.reshape(-1)
    form = _cpu_form(codec, x)  # not None: this implementation's encodes() said so
    kept = codec.kept_count(flat.numel())
    if _selects_over_data(codec, flat, kept):
        flat = flat.contiguous()
        key, ties = native_cpu.select_data(flat, kept)
        if isinstance(form, Bitmask):
            values, bits = native_cpu.bitmask_keep(flat, key, ties, kept)
            return Encoded(values, (bits,), form)
        return Encoded(*encode_positions(flat, native_cpu.kept_positions(flat, key, ties, kept), form))
    positions = codec.kept_positions(flat, kept)
    if positions is None:  # the sample missed (about once in 30,000 tensors): the static path
        return codec.encode(x, hints)
    return Encoded(*encode_positions(flat, positions, form))


# The CPU implementation of the element sparsifiers: the candidate search and Elias-Fano's
# scatter read data-sized results back, which costs a CPU nothing (eager_cpu).
register_implementation(
    _ElementSparsifier, "native", encode=_cpu_encode,
    encodes=lambda codec, x, hints: _cpu_form(codec, x) is not None,
    decode=lambda codec, payload, saved, meta: meta.scatter_on_cpu(payload, saved),
    decodes=lambda codec, payload, saved, meta: isinstance(meta, (EliasFano, Bitmask)) and eager_cpu.applies(payload)
    and type(codec).decode is _ElementSparsifier.decode)


def threshold_selector(threshold: Threshold) -> Selector:
    """Keeps ``|x|`` above ``threshold`` and its first ``ties`` equal elements, in position order."""
    select = ThresholdSelector(threshold)
    return lambda part, start: select(magnitude_keys(part))


@register_compressor
@dataclass(frozen=True)
class MinK(_ElementSparsifier):
    """Exact global min-k: drops the ``drop_rate`` fraction of smallest |x|.

    Of the elements tied at the threshold, the first ones in memory order are kept, so the
    count is exact and the choice deterministic. ``rice=1`` stores the positions Rice-coded
    (eager only: under torch.compile it raises).
    """

    name = "mink"
    rice: int = setting(0, minimum=0, below=2)

    def selector(self, flat: torch.Tensor, kept: int) -> Selector:
        return threshold_selector(exact_threshold(flat, kept))

    def kept_positions(self, flat: torch.Tensor, kept: int) -> torch.Tensor | None:
        return exact_kept_positions(flat, kept)


@register_compressor
@dataclass(frozen=True)
class SampledMinK(_ElementSparsifier):
    """Sampled min-k: the threshold is a quantile of an evenly spaced sample of ``sample`` |x|
    (65,536 by default), raised by 4 of its standard deviations, and one compare-and-pack pass
    keeps what lies above it, in ``k`` slots.

    The sample quantile's standard deviation is ``sqrt(p (1 - p) / sample)``, 0.0012 at
    ``p = 0.1`` and the default sample: the kept fraction is ``1 - drop_rate`` less about 4 of
    those (0.005), within 0.01 of its target, and more than ``k`` lie above the threshold only
    about once in 30,000 tensors (then the last ones in position order are dropped). Elements
    tied at the threshold fill what is left of the ``k`` slots in position order; when more than
    ``drop_rate`` of the values are zero, only the non-zero ones are kept. Slots left over hold
    zeros. Tensors of at most ``sample`` elements are read whole, and select exactly as
    ``mink`` does. ``rice=1`` stores the positions Rice-coded (eager only).
    """

    name = "smink"
    sample: int = setting(SAMPLE, minimum=64)
    rice: int = setting(0, minimum=0, below=2)

    def selector(self, flat: torch.Tensor, kept: int) -> Selector:
        if flat.numel() <= self.sample:
            return threshold_selector(exact_threshold(flat, kept))
        return threshold_selector(sampled_threshold(flat, kept, self.sample))

    def kept_positions(self, flat: torch.Tensor, kept: int) -> torch.Tensor | None:
        if flat.numel() <= self.sample:
            return exact_kept_positions(flat, kept)
        return sampled_kept_positions(flat, kept, self.sample)


def _triton_encode(codec: MinK | SampledMinK | DropITReference, x: torch.Tensor, hints: Hints,
                   finite: torch.Tensor | None = None) -> Encoded:
    """:meth:`_ElementSparsifier.encode` of ``mink``, ``smink`` and ``dropit`` by
    :mod:`~actcomp.kernels.triton_select`: a radix select (of ``smink``'s sample where it samples),
    then a count and a write pass, which write ``finite`` (the chain's flag) where given."""
    from actcomp.kernels import triton_select

    flat = x.reshape(-1).contiguous()
    count = flat.numel()
    kept = codec.kept_count(count)
    form = codec.position_form(count, kept, codec.chunk_length(flat.device, count))
    if isinstance(form, Dense):
        return Encoded(flat, (), form) if finite is None else _dense_flagged(flat, form, finite)
    sampled = None
    if isinstance(codec, SampledMinK) and count > codec.sample:
        step = sample_step(count, codec.sample)
        sampled = (step, sampled_rank(count, kept, -(-count // step)))
    low_bits = form.low_bits if isinstance(form, EliasFano) else None
    values, saved = triton_select.encode(flat, kept, low_bits, sampled, indices=isinstance(form, Indices),
                                         finite=finite)
    return Encoded(values, saved, form)


def _dense_flagged(flat: torch.Tensor, form: Dense, finite: torch.Tensor) -> Encoded:
    """A stage that keeps everything (a tensor too small to drop from) with the chain's flag
    written into ``finite``: the chain's own reduction, copied."""
    from actcomp.core.chain import finite_flag

    finite.copy_(finite_flag(flat))
    return Encoded(flat, (), form)


def _triton_decode(codec: MinK | SampledMinK | DropITReference, payload: torch.Tensor,
                   saved: tuple[torch.Tensor, ...], meta: Dense | Bitmask | EliasFano | Indices,
                   finite: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`_ElementSparsifier.decode`: two launches (NaN everywhere where ``finite`` is given
    and false, in the same launches)."""
    from actcomp.kernels import triton_select

    if isinstance(meta, Dense):
        return payload if finite is None else backends.nan_unless_finite(payload, finite)
    if isinstance(meta, Indices):
        return triton_select.decode_indices(payload, saved[0], meta.count, finite)
    low_bits = meta.low_bits if isinstance(meta, EliasFano) else None
    return triton_select.decode(payload, saved, meta.count, low_bits, finite)


def _triton_takes(codec: _ElementSparsifier, device: torch.device, dtype: torch.dtype,
                  count: int) -> bool:
    if getattr(codec, "rice", 0) or not backends.triton_runs_on(device):
        return False
    from actcomp.kernels import triton_select

    return triton_select.takes(dtype, count)


@register_compressor
@dataclass(frozen=True)
class ParallelMinK(_ElementSparsifier):
    """Exact min-k inside consecutive blocks of ``block`` elements (DropIT's parallel min-k).

    Each full block keeps ``block - floor(drop_rate * block)`` elements; a last partial block
    of ``r`` elements keeps ``r - floor(drop_rate * r)``. One batched ``topk`` over the rows
    of a slice is much faster than a global one. ``rice=1`` stores the positions Rice-coded
    (eager only).
    """

    name = "pmink"
    block: int = setting(2**14, minimum=1)
    rice: int = setting(0, minimum=0, below=2)

    def chunk_length(self, device: torch.device, count: int) -> int:
        # Whole blocks and whole bytes of a bitmask (not aligned_length(..., block, 8): its lcm
        # does not take the symbolic ints torch.compile makes of the settings).
        step = self.block if self.block % 8 == 0 else 8 * self.block
        return step * max(1, index_chunk_length(device, count) // step)

    def selector(self, flat: torch.Tensor, kept: int) -> Selector:
        block, row_kept = self.block, super().kept_count(self.block)

        def select(part: torch.Tensor, start: int) -> torch.Tensor:
            count = part.numel()
            full = count // block * block
            mask = torch.zeros(count, dtype=torch.bool, device=part.device)
            if full:
                rows = part[:full].view(-1, block).abs()
                index = torch.topk(rows, row_kept, dim=1, sorted=False).indices
                mask[:full].view(-1, block).scatter_(1, index, True)
            if full < count:  # the tensor's last, partial block
                tail = part[full:].abs()
                mask[full:].scatter_(0, torch.topk(tail, super(ParallelMinK, self).kept_count(tail.numel())).indices, True)
            return mask

        return select

    def kept_count(self, count: int) -> int:
        # Not divmod: it does not take the symbolic counts of torch.compile.
        return count // self.block * super().kept_count(self.block) + super().kept_count(count % self.block)

    def kept_positions(self, flat: torch.Tensor, kept: int) -> torch.Tensor:
        """The eager CPU path: the positions the static selector's own ``topk`` keeps (so ties
        go as they go there), sorted and offset, written straight to an int32 buffer of
        ``kept``; blocks in chunks of about the values' chunk, not one or two at a time, and no
        mask, rank or scatter pass over the tensor."""
        block, row_kept = self.block, super().kept_count(self.block)
        count = flat.numel()
        full = count // block * block
        positions = torch.empty(kept, dtype=torch.int32, device=flat.device)
        filled = 0
        length = block * max(1, aligned_length(flat.device, count) // block)
        for start, stop in spans(full, length):
            rows = flat[start:stop].view(-1, block).abs()
            index = torch.topk(rows, row_kept, dim=1, sorted=False).indices.sort(dim=1).values
            index += torch.arange(start, stop, block, device=flat.device).unsqueeze(1)
            positions[filled:filled + index.numel()] = index.view(-1)
            filled += index.numel()
        if full < count:  # the tensor's last, partial block, as the static selector takes it
            tail = flat[full:].abs()
            index = torch.topk(tail, super().kept_count(tail.numel())).indices.sort().values + full
            positions[filled:filled + index.numel()] = index
        return positions


@register_compressor
@dataclass(frozen=True)
class RandomDrop(_ElementSparsifier):
    """Drops a uniformly random ``drop_rate`` share of the elements: keeps exactly ``k``.

    The kept ones are those with the ``k`` largest keys of a counter-based hash of (seed,
    position) (:func:`~actcomp.kernels.thresholds.random_keys`; ties by position), the seed
    drawn from torch's global generator, so ``torch.manual_seed`` reproduces runs. Only the seed
    (one int64) is kept beside the values: decoding recomputes the keys and their threshold.
    """

    name = "random"
    draws_global_random = True

    def encode(self, x: torch.Tensor, hints: Hints) -> Encoded:
        flat = x.reshape(-1)
        count = flat.numel()
        kept = self.kept_count(count)
        if kept == count:
            return Encoded(flat, (), static_form(count, kept))
        seed = torch.randint(0, 2**31, (1,), device=flat.device)
        kept_mask = self._kept_mask(seed, count, kept)
        values, _, _ = encode_kept(flat, lambda part, start: kept_mask(start, start + part.numel()), kept)
        return Encoded(values, (seed,), Seeded(count, kept))

    @staticmethod
    def _kept_mask(seed: torch.Tensor, count: int, kept: int) -> Callable[[int, int], torch.Tensor]:
        """``(start, stop) ->`` which of those positions are kept, chunk after chunk."""
        def keys_of(start: int, stop: int) -> torch.Tensor:
            return random_keys(seed, start, stop)

        select = ThresholdSelector(select_threshold(keys_of, count, kept, RANDOM_KEY_BITS, seed.device))
        return lambda start, stop: select(keys_of(start, stop))

    def decode(self, payload: torch.Tensor, saved: tuple[torch.Tensor, ...], meta: Seeded | Dense) -> torch.Tensor:
        if isinstance(meta, Dense):
            return payload
        kept_mask = self._kept_mask(saved[0], meta.count, meta.kept)
        chunks = spans(meta.count, index_chunk_length(payload.device, meta.count))
        return expand_kept(payload, meta.count, ((start, stop, kept_mask(start, stop)) for start, stop in chunks))


@dataclass(frozen=True)
class Seeded:
    """``random``'s metadata: ``kept`` of ``count`` kept, their positions recomputed from the seed."""

    count: int
    kept: int


@register_compressor
@dataclass(frozen=True)
class DropITReference(_ElementSparsifier):
    """DropIT's released storage format, for comparison: global min-k, the kept values in the
    input dtype and their int32 indices (ascending). Costs 8 bytes per kept fp32 value.
    """

    name = "dropit"

    def position_form(self, count: int, kept: int, length: int) -> PositionForm:
        return static_form(count, kept) if kept >= count else Indices(count, kept)

    def selector(self, flat: torch.Tensor, kept: int) -> Selector:
        return threshold_selector(exact_threshold(flat, kept))

    def kept_positions(self, flat: torch.Tensor, kept: int) -> torch.Tensor | None:
        return exact_kept_positions(flat, kept)


for _klass in (MinK, SampledMinK, DropITReference):
    # CUDA float32, bfloat16 and float16 (CPU under Triton's interpreter), the static forms and indices.
    register_implementation(
        _klass, "triton", encode=_triton_encode,
        encodes=lambda codec, x, hints: _triton_takes(codec, x.device, x.dtype, x.numel()),
        decode=_triton_decode, applies_finite_flag=True, writes_finite_flag=True,
        decodes=lambda codec, payload, saved, meta: isinstance(meta, (Dense, Bitmask, EliasFano, Indices))
        and _triton_takes(codec, payload.device, payload.dtype, meta.count))


def _triton_random_encode(codec: RandomDrop, x: torch.Tensor, hints: Hints,
                          finite: torch.Tensor | None = None) -> Encoded:
    """:meth:`RandomDrop.encode` by :mod:`~actcomp.kernels.triton_select`: the keys hashed in
    registers, a histogram pass over them, a count and a write pass (which write ``finite``)."""
    from actcomp.kernels import triton_select

    flat = x.reshape(-1).contiguous()
    count = flat.numel()
    kept = codec.kept_count(count)
    if kept == count:
        form = static_form(count, kept)
        return Encoded(flat, (), form) if finite is None else _dense_flagged(flat, form, finite)
    seed = torch.randint(0, 2**31, (1,), device=flat.device)
    return Encoded(triton_select.encode_random(flat, kept, seed, finite), (seed,), Seeded(count, kept))


def _triton_random_decode(codec: RandomDrop, payload: torch.Tensor, saved: tuple[torch.Tensor, ...],
                          meta: Seeded | Dense, finite: torch.Tensor | None = None) -> torch.Tensor:
    from actcomp.kernels import triton_select

    if isinstance(meta, Dense):
        return payload if finite is None else backends.nan_unless_finite(payload, finite)
    return triton_select.decode_random(payload, saved[0], meta.count, finite)


# The same kernels for random: its encode and decode are its own, so its own entry.
register_implementation(
    RandomDrop, "triton", encode=_triton_random_encode,
    encodes=lambda codec, x, hints: _triton_takes(codec, x.device, x.dtype, x.numel()),
    decode=_triton_random_decode, applies_finite_flag=True, writes_finite_flag=True,
    decodes=lambda codec, payload, saved, meta: _triton_takes(codec, payload.device, payload.dtype, meta.count))
