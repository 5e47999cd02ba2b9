"""The native CPU kernels give their eager references' bytes bit for bit, at any thread count,
run where they are asked for, and fall back to the references with one warning where they
cannot be built."""

from __future__ import annotations

import platform
import subprocess
import warnings

import pytest
import torch

import actcomp
from actcomp import errors
from actcomp.compressors.affine import GroupQuant
from actcomp.compressors.casts import Fp8
from actcomp.core import backends
from actcomp.core.backends import use_backend
from actcomp.core.chain import pack, unpack
from actcomp.core.registry import codec_class
from actcomp.kernels import eager_select, native_cpu
from actcomp.kernels.thresholds import magnitude_keys
from actcomp.whole_model.exact_codecs import PoolOffsets

needs_native = pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler to build the native kernels")


def values(count: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian values with what breaks quantizers built in: huge outliers of both signs, a
    constant run, zeros of both signs."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, generator=generator) * 3
    if count > 40:
        x[3], x[17], x[30:40] = 1e30, -3e38, 0.25
        x[-1] = 3e38
        x[5], x[6] = 0.0, -0.0
    return x.to(dtype)


def both_ways(spec, x: torch.Tensor) -> tuple[tuple, tuple]:
    """(tensors, decoded) under the eager reference and under the native backend, of a spec
    string or a codec."""
    stage = actcomp.parse(spec) if isinstance(spec, str) else spec
    results = []
    for backend in ("eager", "native"):
        with use_backend(backend):
            packed = stage.compress(x)
            results.append((packed.tensors, stage.decompress(packed)))
    return results[0], results[1]


def assert_same(reference: tuple, native: tuple) -> None:
    flag = reference[0][0] if reference[0] else None
    if flag is not None and flag.dtype == torch.bool and flag.dim() == 0 and not flag:
        # A tensor holding NaN or inf decodes to NaN whatever its codes (the chain's flag).
        assert not native[0][0] and native[1].isnan().all() and reference[1].isnan().all()
        return
    for expected, got in zip(reference[0], native[0], strict=True):
        assert expected.dtype == got.dtype and expected.shape == got.shape
        # Bit patterns, so that -0.0 and 0.0 differ and NaN equals NaN.
        assert torch.equal(expected.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8))
    assert torch.equal(reference[1].reshape(-1).view(torch.uint8), native[1].reshape(-1).view(torch.uint8))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "int8:group=64", "int4:group=100", "int2:group=7",
                                  "int8:group=1", "int4:group=3", "fp8"])
@pytest.mark.parametrize("count", [1, 5, 999, 4096, 300_001])
def test_quantizers_give_the_reference_bytes(spec, dtype, count):
    assert_same(*both_ways(spec, values(count, dtype, seed=count)))


def same_up_to_nan_payload(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """Equal bit patterns, except that any NaN matches any NaN (ATen's casts and reductions
    pick NaN payloads by code path)."""
    both_nan = expected.isnan() & got.isnan() if expected.is_floating_point() else torch.zeros_like(expected, dtype=torch.bool)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[expected.element_size()]
    return expected.shape == got.shape and bool(((expected.view(width) == got.view(width)) | both_nan).all())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["int8", "int4", "int2:group=7", "fp8"])
@pytest.mark.parametrize("special", ["nan", "inf", "-inf", "all"])
def test_non_finite_values_not_set_aside_give_the_reference_values(spec, dtype, special):
    # The compiled graphs pack without setting NaN and inf aside; a group holding one decodes
    # to NaN or saturates, and native and eager must agree on which.
    x = values(4099, torch.float32, seed=3)
    for at in (20, 700, 1500, 4098):
        x[at] = float({"all": ("nan", "inf", "-inf", "nan")[at % 4]}.get(special, special))
    x = x.to(dtype)
    stage = actcomp.parse(spec)
    results = []
    for backend in ("eager", "native"):
        with use_backend(backend):
            packed = pack(stage.stages, stage.spec, x, flag_non_finite=False)
            results.append((packed.tensors, unpack(stage.stages, stage.spec, packed)))
    (reference, reference_decoded), (native, native_decoded) = results
    for expected, got in zip(reference, native, strict=True):
        assert same_up_to_nan_payload(expected.reshape(-1), got.reshape(-1))
    assert same_up_to_nan_payload(reference_decoded, native_decoded)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [7, 256])
@pytest.mark.parametrize("special", [None, "nan", "inf", "-inf"])
@pytest.mark.parametrize("at", [0, 1500, 300_000])
def test_the_quantize_kernel_writes_the_chains_finite_flag(dtype, group, special, at):
    # The flag comes from the groups' ranges the pass computes anyway; it must be what the
    # chain's own reduction says, wherever the one non-finite value sits (a thread's last task too).
    from actcomp.core.chain import finite_flag
    from actcomp.kernels.bitpack import packed_size
    from actcomp.kernels.noise import noise_seed

    x = values(300_001, torch.float32, seed=at).to(dtype)
    if special is not None:
        x[at] = float(special)
    groups = -(-x.numel() // group)
    finite = torch.tensor(not finite_flag(x))  # the opposite of the answer: the kernel must write it
    native_cpu.quantize(x, 8, group, noise_seed(x), torch.empty(packed_size(x.numel(), 8), dtype=torch.uint8),
                        torch.empty(groups, dtype=dtype), torch.empty(groups, dtype=torch.bfloat16), finite=finite)
    assert bool(finite) == bool(finite_flag(x)) == (special is None)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_bytes_do_not_depend_on_the_thread_count(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = values(1009 * 991, torch.float32)
        for spec in ("int8", "int4:group=100", "mink0.9+int8", "smink0.8+int2"):
            assert_same(*both_ways(spec, x.view(1009, 991)))
    finally:
        torch.set_num_threads(previous)


@needs_native
@pytest.mark.parametrize("spec, klass", [("int8", GroupQuant), ("int2", GroupQuant), ("fp8", Fp8)])
def test_the_native_codec_runs_and_the_eager_one_does_not(spec, klass, monkeypatch):
    calls = []
    for method in ("encode", "decode"):
        original = getattr(klass, method)
        monkeypatch.setattr(klass, method, lambda self, *args, _o=original, _m=method: calls.append(_m) or _o(self, *args))
    stage = actcomp.parse(spec)
    x = torch.randn(4000)
    stage.decompress(stage.compress(x))
    assert calls == []
    with use_backend("eager"):
        stage.decompress(stage.compress(x))
    assert calls == ["encode", "decode"]
    # What the kernels do not take runs the reference: float16 values, an empty tensor.
    for other in (x.half(), torch.zeros(0)):
        calls.clear()
        stage.decompress(stage.compress(other))
        assert calls == ["encode", "decode"]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group", [(8, 256), (4, 64), (2, 32)])
@pytest.mark.parametrize("count", [1, 1000, 13_056, 300_001])
def test_the_seeded_quantize_is_the_seed_then_the_quantize(dtype, bits, group, count):
    """One call computing the noise seed in the kernel: the codes, offsets, scales and finite
    flag of noise_seed then quantize, byte for byte (NaN and infinities included)."""
    x = values(count, torch.float32, seed=count).to(dtype)
    if count > 1000:
        x[500] = float("nan")
    groups = -(-count // group)
    outputs = []
    for seeded in (False, True):
        codes = torch.zeros(-(-count * bits // 8), dtype=torch.uint8)
        offset, scale = torch.zeros(groups, dtype=dtype), torch.zeros(groups, dtype=torch.bfloat16)
        finite = torch.empty((), dtype=torch.bool)
        if seeded:
            native_cpu.quantize_seeded(x, bits, group, codes, offset, scale, finite=finite)
        else:
            native_cpu.quantize(x, bits, group, native_cpu.noise_seed(x), codes, offset, scale, finite=finite)
        outputs.append((codes, offset.view(torch.int16), scale.view(torch.int16), finite))
    for expected, got in zip(*outputs, strict=True):
        assert torch.equal(expected, got)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("capacity", [None, 0, 10, 10**9])
def test_candidates_are_the_reference_positions_and_keys(dtype, capacity):
    x = values(200_003, dtype)
    floor = magnitude_keys(torch.tensor([2.5], dtype=dtype))[0]
    positions, keys = native_cpu.positions_and_keys(x, floor, capacity)
    expected = (magnitude_keys(x) >= floor).nonzero().view(-1)
    assert positions.dtype == torch.int32 and torch.equal(positions.long(), expected)
    assert torch.equal(keys, magnitude_keys(x)[expected])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["mink0.9", "smink0.9", "mink0.99+int8", "smink0.9+int4"])
def test_sparsifiers_with_native_kernels_give_the_reference_bytes(spec, dtype, monkeypatch):
    native_calls = set()
    for name in ("positions_and_keys", "select", "compact", "gather", "elias_fano_encode", "elias_fano_scatter"):
        kernel = getattr(native_cpu, name)
        monkeypatch.setattr(native_cpu, name, lambda *a, _k=kernel, _n=name, **k: native_calls.add(_n) or _k(*a, **k))
    # Values on a coarse grid: thousands of ties at every magnitude, the threshold's too.
    x = (values(65536 * 5 + 3, torch.float32).clamp(-1e38, 1e38) * 2).round().div(2).to(dtype)
    assert_same(*both_ways(spec, x))
    assert native_calls == {"positions_and_keys", "select", "compact", "gather", "elias_fano_encode",
                            "elias_fano_scatter"}


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ["mink0.5", "mink0.3", "mink0.7+int8", "mink0.01", "mink0.8", "mink0.83+int4", "mink0.8+bf16"])
@pytest.mark.parametrize("kind", ["ties", "special"])
def test_dense_min_k_gives_the_reference_bytes(spec, dtype, kind, threads, monkeypatch):
    """Min-k keeping more than candidates can hold: a radix select over the data itself, then
    the bits and values in one kernel and the scatter in another (Bitmask positions), or the kept
    positions for the Elias-Fano writer (between candidates and a bitmask); the reference's bytes."""
    native_calls = set()
    for name in ("select_data", "bitmask_keep", "bitmask_expand", "kept_positions", "elias_fano_encode"):
        kernel = getattr(native_cpu, name)
        monkeypatch.setattr(native_cpu, name, lambda *a, _k=kernel, _n=name, **k: native_calls.add(_n) or _k(*a, **k))
    torch.set_num_threads(threads)
    try:
        if kind == "ties":  # thousands of ties at every magnitude, the threshold's too, across blocks
            x = (values(65536 * 5 + 3, torch.float32).clamp(-1e38, 1e38) * 2).round().div(2).to(dtype)
        else:  # NaN and infinities (the largest keys), zeros of both signs
            x = values(65536 * 3 + 11, torch.float32, seed=1).to(dtype)
            x[100:200], x[70_000], x[70_001], x[130_000:130_004] = float("nan"), float("inf"), -float("inf"), -0.0
        assert_same(*both_ways(spec, x))
    finally:
        torch.set_num_threads(2)
    from actcomp.kernels.positions import Bitmask
    stage = actcomp.parse(spec).stages[0]
    kept = stage.kept_count(x.numel())
    form = stage.position_form(x.numel(), kept, 1)
    if isinstance(form, Bitmask):
        assert native_calls == {"select_data", "bitmask_keep", "bitmask_expand"}
    elif kept * 4 <= 0.35 * x.numel() * x.element_size():  # the positions within the temporaries' budget
        assert native_calls == {"select_data", "kept_positions", "elias_fano_encode"}
    else:  # 16-bit elements at 20% kept: the static path, which the comparison covers all the same
        assert not native_calls & {"select_data", "kept_positions"}


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 9, 65536 + 9])
def test_the_bitmask_scatter_never_writes_past_the_elements_or_reads_past_the_values(dtype, count):
    """Bits set past the last element, or more set bits than values: a foreign packed form
    cannot make the kernel write out of bounds; what it writes is the reference's."""
    from actcomp.kernels.positions import Bitmask

    bits = torch.full(((count + 7) // 8 + 8,), 0xFF, dtype=torch.uint8)  # every bit set, and more bytes
    values = torch.arange(1, count // 2 + 2, dtype=torch.float32).to(dtype)
    got = native_cpu.bitmask_expand(bits, values, count)
    expected = torch.zeros(count, dtype=dtype)
    expected[:values.numel()] = values[:count]
    assert torch.equal(got, expected)
    form = Bitmask(count, values.numel())
    assert torch.equal(form.scatter_on_cpu(values, (bits,)), expected)


def test_without_a_compiler_the_references_run_after_one_warning(monkeypatch):
    monkeypatch.setattr(native_cpu, "_loaded", [])
    monkeypatch.setattr(native_cpu, "_compiler", lambda: None)
    monkeypatch.setattr(errors, "WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference, native = both_ways("mink0.9+int8", values(70_000, torch.float32))
        both_ways("int4", values(70_000, torch.float32))
    assert_same(reference, native)
    assert [str(w.message) for w in caught if "C compiler" in str(w.message)] == [
        "actcomp: no C compiler found ($CC, cc, gcc or clang); the codecs run their eager reference, which is "
        "slower on CPU"]


def test_a_failed_build_warns_once_and_the_references_run(monkeypatch, tmp_path):
    monkeypatch.setattr(native_cpu, "_loaded", [])
    monkeypatch.setattr(native_cpu, "_compiler", lambda: "false")  # a "compiler" that always fails
    monkeypatch.setenv("ACTCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(errors, "WARNED", set())
    with pytest.warns(UserWarning, match="building the native CPU kernels failed"):
        reference, native = both_ways("int8", values(5000, torch.float32))
    assert_same(reference, native)
    assert native_cpu.library() is None and list(tmp_path.iterdir()) == []  # no half-built file left


@needs_native
def bf16_edges(count: int) -> torch.Tensor:
    """float32 values where a saturating bfloat16 cast can go wrong: around bfloat16's largest
    value (the clamp, and the halfway point that would round to inf), float32's largest, the
    infinities, NaNs of both signs and several payloads, subnormals, both zeros, rounding ties."""
    bits = [0x7F7F0000, 0x7F7F0001, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000,
            0x7FFFFFFF, 0x00000001, 0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0x00000000, 0x7F7EFFFF]
    bits += [b | 0x80000000 for b in bits]
    edges = torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits], dtype=torch.int32).view(torch.float32)
    x = values(count, torch.float32, seed=count)
    x[:min(count, edges.numel())] = edges[:count]
    if count > 2 * edges.numel():
        x[-edges.numel():] = edges  # the vector loop's tail too
    return x


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("count", [1, 7, 33, 64, 4099, 70_001])
def test_the_bf16_cast_gives_the_reference_bits(count, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = bf16_edges(count)
        for case in (x, x.view(-1, 1)[::2]):  # contiguous, and a strided view
            assert_same(*both_ways("bf16", case))
    finally:
        torch.set_num_threads(previous)


@needs_native
def test_the_bf16_cast_runs_natively_only_where_the_reference_takes_four_passes():
    fp32, bf16 = torch.ones(100), torch.ones(100, dtype=torch.bfloat16)
    codec = actcomp.parse("bf16").stages[0]
    assert backends.choose(codec, "encode", fp32, None) == "native"
    assert backends.choose(codec, "encode", fp32.half(), None) == "eager"  # fp16 -> bf16 is one .to()
    # The decode is ATen's one cast (a C loop did not beat it), into a decode buffer.
    assert backends.choose(codec, "decode", bf16, (), torch.float32) == "native"
    assert backends.choose(codec, "decode", bf16, (), torch.float16) == "eager"  # saturates on the way back
    assert backends.choose(actcomp.parse("fp16").stages[0], "encode", fp32, None) == "eager"


def pool_indices(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil: bool = False):
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
    _, indices = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil)
    codec = PoolOffsets(kernel=(kernel, kernel), stride=(stride, stride), padding=(padding, padding),
                        dilation=(dilation, dilation), width=size, out_size=tuple(indices.shape[-2:]))
    return codec, indices


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("size, kernel, stride, padding, dilation, ceil", [
    (8, 2, 2, 0, 1, False), (112, 3, 2, 1, 1, False), (11, 3, 1, 1, 2, False), (7, 1, 1, 0, 1, False),
    (20, 16, 4, 0, 1, False), (31, 4, 3, 2, 1, True), (9, 3, 2, 1, 1, True)])
def test_pool_offsets_give_the_reference_codes_and_positions(size, kernel, stride, padding, dilation, ceil, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        codec, indices = pool_indices(size, kernel, stride, padding, dilation, ceil)
        assert backends.choose(codec, "encode", indices, None) == "native"
        assert_same(*both_ways(codec, indices))
        # Not an argmax of its window (the transpose), so offsets out of range wrap alike.
        assert_same(*both_ways(codec, indices.transpose(-1, -2)))
    finally:
        torch.set_num_threads(previous)


@needs_native
def test_pool_offsets_of_positions_no_window_holds_wrap_as_the_reference():
    garbage = torch.randint(-10**12, 10**12, (4099,), generator=torch.Generator().manual_seed(1))
    garbage[:3] = torch.tensor([2**40, -(2**40), 0])  # beyond 32 bits: the general division
    for kernel in (1, 2, 3, 16):
        codec = PoolOffsets(kernel=(kernel, 2), stride=(2, 3), padding=(1, 0), dilation=(1, 2), width=37,
                            out_size=(1, 1))
        assert_same(*both_ways(codec, garbage))
        assert_same(*both_ways(codec, garbage % 5000))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the baseline target is x86-64's")
def test_the_portable_build_gives_the_reference_bytes(monkeypatch, tmp_path):
    # A CPU without AVX-512, FMA or BMI2 runs the kernels' portable loops; this machine's build
    # never does, so build for the x86-64 baseline and compare those loops too.
    monkeypatch.setenv(native_cpu.MARCH_ENVIRONMENT, "x86-64")
    monkeypatch.setattr(native_cpu, "_loaded", [])
    monkeypatch.setenv("ACTCOMP_CACHE_DIR", str(tmp_path))
    assert native_cpu.library() is not None and native_cpu.vector_bits() == 0
    # There the mask decode declines (slower than the reference), the other kernels run ...
    assert not native_cpu.unpacks_mask(torch.device("cpu"), torch.float32)
    assert native_cpu.quantizes(torch.device("cpu"), torch.float32, 100, 8)
    assert native_cpu.casts(torch.device("cpu"), torch.float32, 100) and native_cpu.selects(torch.zeros(100))
    # ... but its loop is the vector paths' tail everywhere: made to run, it must agree too.
    monkeypatch.setattr(native_cpu, "outruns_reference", lambda: True)
    x = values(70_001, torch.float32, seed=5)
    x[::9] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for spec in ("int8", "int4", "int2:group=7", "fp8", "mink0.9+int8", "smink0.8+int4"):
            assert_same(*both_ways(spec, x.to(dtype)))
        for name in ("relu-mask", "leaky-relu-mask"):
            assert_same(*both_ways(codec_class(name)(), x.to(dtype)))
    assert_same(*both_ways("bf16", bf16_edges(4099)))
    codec, indices = pool_indices(112, 3, 2, 1, 1)
    assert_same(*both_ways(codec, indices))


def builds_for_avx2() -> bool:
    """Whether this CPU runs AVX2 code and the compiler takes -march=x86-64-v3 (GCC 11, Clang 12 on)."""
    compiler = native_cpu._compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not set(native_cpu.MARCH_LEVELS["x86-64-v3"]) <= set(native_cpu._cpu_flags().split()):
        return False
    probe = subprocess.run([compiler, "-march=x86-64-v3", "-x", "c", "-E", "-o", "/dev/null", "-"], input="",
                           capture_output=True, text=True, check=False)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def avx2_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("avx2_build"))


@needs_native
@pytest.mark.skipif(not builds_for_avx2(), reason="no AVX2 CPU, or a compiler without -march=x86-64-v3")
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_gives_the_reference_bytes(dtype, threads, monkeypatch, avx2_cache):
    # A CPU with AVX2 and no AVX-512 (Zen 1-3, Intel before Ice Lake) runs the kernels' AVX2
    # paths; an AVX-512 machine's own build never does, so build for x86-64-v3 and compare.
    monkeypatch.setenv(native_cpu.MARCH_ENVIRONMENT, "x86-64-v3")
    monkeypatch.setattr(native_cpu, "_loaded", [])
    monkeypatch.setenv("ACTCOMP_CACHE_DIR", avx2_cache)
    assert native_cpu.vector_bits() == 256
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Sizes around the vector steps (8, 16, 32 elements) and the groups' tails.
        for count in (1, 7, 31, 33, 257, 4099, 70_001):
            x = values(count, torch.float32, seed=count)
            x[::9] = 0.0
            x[1::11] = -0.0
            for spec in ("int8", "int4", "int2", "int4:group=100", "int2:group=7", "fp8", "mink0.9+int8",
                         "smink0.8+int4"):
                assert_same(*both_ways(spec, x.to(dtype)))
            for name in ("relu-mask", "leaky-relu-mask"):
                assert_same(*both_ways(codec_class(name)(), x.to(dtype)))
            assert_same(*both_ways("bf16", bf16_edges(count)))
        codec, indices = pool_indices(112, 3, 2, 1, 1)
        assert_same(*both_ways(codec, indices))
        x = values(200_003, dtype)
        floor = magnitude_keys(torch.tensor([2.5], dtype=dtype))[0]
        positions, keys = native_cpu.positions_and_keys(x, floor)
        expected = (magnitude_keys(x) >= floor).nonzero().view(-1)
        assert torch.equal(positions.long(), expected) and torch.equal(keys, magnitude_keys(x)[expected])
    finally:
        torch.set_num_threads(previous)


@needs_native
@pytest.mark.skipif(not builds_for_avx2(), reason="no AVX2 CPU, or a compiler without -march=x86-64-v3")
@pytest.mark.parametrize("spec", ["int8", "int2:group=7", "fp8"])
@pytest.mark.parametrize("special", ["nan", "inf", "-inf"])
def test_the_avx2_build_treats_non_finite_values_as_the_reference(spec, special, monkeypatch, avx2_cache):
    monkeypatch.setenv(native_cpu.MARCH_ENVIRONMENT, "x86-64-v3")
    monkeypatch.setattr(native_cpu, "_loaded", [])
    monkeypatch.setenv("ACTCOMP_CACHE_DIR", avx2_cache)
    test_non_finite_values_not_set_aside_give_the_reference_values(spec, torch.float32, special)


@pytest.mark.parametrize("level", ["skylake", "x86-64-v5", "X86-64-V3"])
def test_an_unknown_march_is_an_error_naming_the_valid_ones(level, monkeypatch):
    monkeypatch.setenv(native_cpu.MARCH_ENVIRONMENT, level)
    with pytest.raises(errors.ActcompError, match=f"unknown ACTCOMP_NATIVE_MARCH='{level}'; valid: native, x86-64, "
                                                  "x86-64-v2, x86-64-v3, x86-64-v4"):
        native_cpu.march()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the levels are x86-64's")
def test_a_march_this_cpu_cannot_run_is_an_error(monkeypatch):
    # Loading AVX2 code on a CPU without AVX2 would stop the process at its first such instruction.
    monkeypatch.setattr(native_cpu, "_cpu_flags", lambda: "flags : fpu sse sse2 ssse3 sse4_2 popcnt cx16")
    monkeypatch.setenv(native_cpu.MARCH_ENVIRONMENT, "x86-64-v3")
    with pytest.raises(errors.ActcompError, match=r"needs CPU features this CPU lacks \(avx2, fma, bmi2, f16c, "
                                                  r"movbe\).*valid here: native, x86-64, x86-64-v2$"):
        native_cpu.march()
    monkeypatch.delenv(native_cpu.MARCH_ENVIRONMENT)
    assert native_cpu.march() == "native"


@needs_native
def test_the_library_is_built_once_per_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("ACTCOMP_CACHE_DIR", str(tmp_path))
    compiler = native_cpu._compiler()
    first = native_cpu._built(compiler)
    stamp = first.stat().st_mtime_ns
    assert native_cpu._built(compiler) == first and first.stat().st_mtime_ns == stamp
    assert [path.name for path in tmp_path.iterdir()] == [first.name]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [100_003, 32_769, 32_768, 13_056, 41, 1])
def test_radix_select_is_topk_and_its_ties(dtype, count):
    """Over the keys and over the data itself, on either side of the small selects' 32,768 keys
    (11-bit digits on the stack) against the 16-bit digits above: topk's key, and the ties."""
    x = (values(count, torch.float32) * 4).round().to(dtype)  # many ties
    keys = magnitude_keys(x)
    for kept in sorted({1, 7, count // 10, count // 2 + 1, count} & set(range(1, count + 1))):
        key, ties = native_cpu.select(keys, kept)
        assert key == int(torch.topk(keys, kept).values.min())
        assert ties == kept - int((keys > key).sum()) and 1 <= ties <= int((keys == key).sum())
        assert native_cpu.select_data(x, kept) == (key, ties)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 9, 13_056, 65_537, 131_071])
@pytest.mark.parametrize("spec", ["mink0.9", "mink0.99+int8", "mink0.95+int4"])
def test_min_k_of_a_tensor_its_sample_covers_selects_over_the_data(spec, count, dtype, monkeypatch):
    """Under 2 x 65,536 elements exact min-k's sample is the whole tensor: one select over the
    data and one pass writing the kept positions (no keys, no candidates), the reference's bytes,
    ties, NaN, infinities and zeros of both signs included."""
    native_calls = set()
    for name in ("positions_and_keys", "select", "select_data", "kept_positions", "bitmask_keep"):
        kernel = getattr(native_cpu, name)
        monkeypatch.setattr(native_cpu, name, lambda *a, _k=kernel, _n=name, **k: native_calls.add(_n) or _k(*a, **k))
    x = (values(count, torch.float32).clamp(-1e38, 1e38) * 2).round().div(2).to(dtype)
    if count > 200:
        x[100:110], x[150], x[151] = float("nan"), float("inf"), -float("inf")
    assert_same(*both_ways(spec, x))
    kept = actcomp.parse(spec).stages[0].kept_count(count)
    # The kept positions written for their form: a bitmask's where that is smaller (a few elements).
    assert kept == count and not native_calls or native_calls in ({"select_data", "kept_positions"},
                                                                  {"select_data", "bitmask_keep"})


@needs_native
def test_eager_select_without_the_kernels_still_gives_the_same_positions(monkeypatch):
    x = values(300_000, torch.float32)
    with_native = eager_select.exact_kept_positions(x, 30_000)
    previous = native_cpu.allow(False)
    try:
        without = eager_select.exact_kept_positions(x, 30_000)
    finally:
        native_cpu.allow(previous)
    assert torch.equal(with_native, without)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["relu-mask", "leaky-relu-mask", "dropout-mask"])
@pytest.mark.parametrize("count", [1, 7, 8, 15, 16, 17, 1000, 300_001])
def test_masks_give_the_reference_bytes(name, dtype, count, monkeypatch):
    native_calls = []
    for kernel_name in ("mask_pack", "mask_unpack"):
        kernel = getattr(native_cpu, kernel_name)
        monkeypatch.setattr(native_cpu, kernel_name, lambda *a, _k=kernel, _n=kernel_name: native_calls.append(_n) or _k(*a))
    codec = codec_class(name)()
    x = values(count, torch.float32, seed=count)
    x[::5] = 0.0
    x[1::7] = -0.0
    if count > 30:
        x[20:23] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    if name == "dropout-mask":
        x = torch.where(x > 0, 2.0, 0.0)  # a dropout output: 0 or the scale
    assert_same(*both_ways(codec, x.to(dtype)))
    # Dropout's mask decodes to its kept scale: it keeps its own (eager) decode.
    assert native_calls == ([] if name == "dropout-mask" else ["mask_pack", "mask_unpack"])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 7, 1023, 1024, 1025, 4099, 300_001])
def test_the_native_noise_seed_is_the_references(dtype, count):
    # Equal seeds give equal noise, so the codes stay the reference's; a sum's sign, the fold's
    # arithmetic shift and NaN/inf bit patterns are all in the sample here.
    from actcomp.kernels.noise import noise_seed

    x = values(count, torch.float32, seed=count).to(dtype)
    if count > 100:
        x[::97] = float("nan")
        x[::101] = -float("inf")
    assert int(native_cpu.noise_seed(x)) == int(noise_seed(x))
    torch.manual_seed(count)  # torch's seed is mixed in: another seed, another value, the same on both sides
    assert int(native_cpu.noise_seed(x)) == int(noise_seed(x))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("function", ["gelu", "silu"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("count", [1, 7, 63, 64, 65, 1000, 300_001])
def test_derivative_codes_give_the_reference_bytes(dtype, function, bits, count, monkeypatch):
    """Few-bit GELU/SiLU codes: one native pass each way, fields within a byte (1, 2, 4, 8 bits)
    or across bytes (3, 5), the reference's codes and values bit for bit."""
    from actcomp.whole_model.derivative_codes import DerivativeCode

    native_calls = []
    for kernel_name in ("interval_pack", "interval_unpack"):
        kernel = getattr(native_cpu, kernel_name)
        monkeypatch.setattr(native_cpu, kernel_name, lambda *a, _k=kernel, _n=kernel_name: native_calls.append(_n) or _k(*a))
    x = values(count, torch.float32, seed=count)
    if count > 100:
        x[50:60] = torch.linspace(-1, 1, 10)  # values on and around the edges near zero
    assert_same(*both_ways(DerivativeCode(function, bits=bits), x.to(dtype)))
    assert native_calls == ["interval_pack", "interval_unpack"]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_interval_codes_of_non_finite_values_and_edges_are_the_references(dtype, bits):
    """The kernel's codes themselves, where the chain's finite flag would hide them: NaN codes 0
    (no edge is below it), +inf the last interval, -inf the first; a value equal to an edge is
    not above it."""
    from actcomp.kernels.bitpack import pack_codes
    from actcomp.kernels.device_constants import device_table
    from actcomp.whole_model.derivative_codes import _codebook, _interval

    boundaries, _, _ = _codebook("gelu", "none", bits)
    edges = device_table(tuple(boundaries), dtype, torch.device("cpu"))
    x = torch.cat([edges.float(), torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0]),
                   values(1001, torch.float32, seed=bits)]).to(dtype)
    assert torch.equal(native_cpu.interval_pack(x, edges, bits), pack_codes(_interval(x, edges), bits))
