"""The Triton kernels of the exact codecs and the fewbit codes (actcomp.kernels.triton_masks), run
under Triton's interpreter on CPU tensors: every packed tensor and every decoded value equal the
eager reference's bit for bit (sizes around the block, dtypes, strides, the NaN states the masks
keep), in one launch per encode and decode (dropout's float scale: one more), reading nothing
back to the host; fewbit's decode applies the finite flag in its own launch."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from models import HostReads, bits

from actcomp.core import backends
from actcomp.core.backends import use_backend
from actcomp.core.codec import Hints
from actcomp.kernels import triton_runtime
from actcomp.whole_model.derivative_codes import DerivativeCode
from actcomp.whole_model.exact_codecs import ClampMask, DropoutMask, LeakyReluMask, PoolOffsets, ReluMask

pytestmark = pytest.mark.skipif(not triton_runtime.runs_on(torch.device("cpu")), reason="needs Triton's interpreter")

SIZES = [1, 7, 1000, 4099]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HINTS = Hints(channel_dim=None)


def values(count: int, dtype: torch.dtype, special: bool = True) -> torch.Tensor:
    """``count`` values of ``dtype``, with signed zeros, the clamp bounds exactly, and (where
    ``special``) NaN and infinities among them."""
    x = torch.randn(count, generator=torch.Generator().manual_seed(count)) * 3
    picks = [0.0, -0.0, 0.7, -0.7, 1.0, -1.0, 6.0] + ([math.nan, math.inf, -math.inf] if special else [])
    for position, value in zip(range(0, count, 3), picks):
        x[position] = value
    return x.to(dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    assert torch.equal(bits(got), bits(want))


def check(codec, x: torch.Tensor, launches: tuple[int, int] = (1, 1)) -> None:
    """The Triton encode and decode of ``x`` against the reference's, and their launches."""
    want_payload, want_saved, want_meta = backends.reference(codec, "encode", x, HINTS)
    want = backends.reference(codec, "decode", want_payload, want_saved, want_meta)
    with use_backend("triton"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the reference would warn
        # numpy's, where the interpreter multiplies an infinite dropout scale by 0 (a GPU is silent)
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        assert backends.choose(codec, "encode", x, HINTS) == "triton"
        triton_runtime.LAUNCHES.clear()
        payload, saved, meta = backends.encode(codec, x, HINTS)
        encoded = sum(triton_runtime.LAUNCHES.values())
        assert backends.choose(codec, "decode", payload, saved, meta) == "triton"
        triton_runtime.LAUNCHES.clear()
        decoded = backends.decode(codec, payload, saved, meta)
        assert (encoded, sum(triton_runtime.LAUNCHES.values())) == (launches if x.numel() else (0, 0))
    assert meta == want_meta
    assert_same(payload, want_payload)
    assert len(saved) == len(want_saved)
    for got, expected in zip(saved, want_saved):
        assert_same(got, expected)
    assert_same(decoded, want)


MASKS = [ReluMask(), LeakyReluMask(), ClampMask(), ClampMask(-0.7, 0.7), ClampMask(0.0, 6.0),
         ClampMask(-0.7, 0.7, states=3), ClampMask(-1e39, 1e39)]


@pytest.mark.parametrize("codec", MASKS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masks_give_the_reference_codes_and_stand_ins(codec, dtype):
    for count in SIZES:
        check(codec, values(count, dtype))


def test_the_nan_states_the_masks_keep():
    x = torch.tensor([math.nan, -1.0, 0.5, 2.0, -math.nan])
    with use_backend("triton"):
        assert ReluMask().decompress(ReluMask().compress(x)).tolist() == [1, 0, 1, 1, 1]  # not (NaN <= 0)
        assert LeakyReluMask().decompress(LeakyReluMask().compress(x)).tolist() == [0, 0, 1, 1, 0]  # NaN > 0 fails
        three = ClampMask(-1.0, 1.0, states=3)
        decoded = three.decompress(three.compress(x))
        assert decoded.isnan().tolist() == [True, False, False, False, True]
        assert decoded[1:4].tolist() == [-math.inf, 0.0, -math.inf]


def test_strided_and_empty_inputs():
    x = values(4099, torch.float32).view(-1, 1)[:-3].reshape(64, 64)
    for codec in (ReluMask(), ClampMask(states=3), DerivativeCode("gelu", bits=3), DropoutMask()):
        launches = (2, 1) if isinstance(codec, DropoutMask) else (1, 1)
        check(codec, x.t(), launches)
        check(codec, x.bfloat16()[:, ::3], launches)
        if not isinstance(codec, DropoutMask):  # its reference raises on no values
            check(codec, x[:0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_masks_and_their_scale(dtype):
    generator = torch.Generator().manual_seed(0)
    for count in SIZES:
        kept = torch.rand(count, generator=generator) > 0.3
        check(DropoutMask(), kept)
        mask = (kept.to(dtype) * (1 / 0.7)).to(dtype)
        check(DropoutMask(other_values="nan"), mask, (2, 1))
    for count in (7, 4099):
        for codec in (DropoutMask(), DropoutMask(other_values="nan")):
            check(codec, values(count, dtype), (2, 1))  # not a mask: NaN scale ("nan"), or the largest
            check(codec, values(count, dtype, special=False), (2, 1))
    for case in ([0.0, 0.0], [-0.0], [0.0, -2.0, -2.0], [-2.0, -2.0], [math.inf, 0.0, math.inf], [-math.inf, 0.0],
                 [1.0, 0.0, 2.0]):
        for codec in (DropoutMask(), DropoutMask(other_values="nan")):
            check(codec, torch.tensor(case, dtype=dtype), (2, 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("function, approximate, widths", [("gelu", "none", (1, 2, 3, 5, 8)), ("gelu", "tanh", (3,)),
                                                           ("silu", "none", (4, 7))])
def test_fewbit_codes_give_the_reference_intervals_and_representatives(dtype, function, approximate, widths):
    for width in widths:
        codec = DerivativeCode(function, approximate, bits=width)
        for count in SIZES:
            x = values(count, dtype, special=False)
            if count > 100:  # values on the edges themselves, where > and >= part
                boundaries = torch.tensor(_edges(codec), dtype=dtype)
                x[-boundaries.numel():] = boundaries
            check(codec, x)


def _edges(codec: DerivativeCode) -> list[float]:
    from actcomp.whole_model.derivative_codes import _codebook

    return _codebook(codec.function, codec.approximate, codec.bits)[0]


def test_fewbit_decode_applies_the_finite_flag_in_its_own_launch(monkeypatch):
    codec = DerivativeCode("gelu", bits=3)
    monkeypatch.setattr(backends, "nan_unless_finite", None)  # a pass of its own would call it
    for dtype in DTYPES:
        x = values(1000, dtype)
        with use_backend("triton"):
            packed = codec.compress(x)
            triton_runtime.LAUNCHES.clear()
            decoded = codec.decompress(packed)
            assert dict(triton_runtime.LAUNCHES) == {"_decode_kernel": 1}
            assert decoded.dtype == dtype and decoded.isnan().all()
            finite = values(1000, dtype, special=False)
            assert torch.equal(codec.decompress(codec.compress(finite)),
                               backends.reference(codec, "decode", *backends.reference(codec, "encode", finite, HINTS)))


def pool_case(size: int, kernel: int, stride: int, padding: int, dilation: int):
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
    _, indices = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation)
    codec = PoolOffsets(kernel=(kernel, kernel), stride=(stride, stride), padding=(padding, padding),
                        dilation=(dilation, dilation), width=size, out_size=tuple(indices.shape[-2:]))
    return codec, indices


@pytest.mark.parametrize("size, kernel, stride, padding, dilation", [(8, 2, 2, 0, 1), (9, 3, 2, 1, 1),
                                                                     (11, 3, 1, 1, 2), (7, 1, 1, 0, 1),
                                                                     (20, 16, 4, 0, 1), (31, 4, 3, 2, 1)])
def test_pool_offsets_give_the_reference_codes_and_positions(size, kernel, stride, padding, dilation):
    codec, indices = pool_case(size, kernel, stride, padding, dilation)
    check(codec, indices)
    check(codec, indices.transpose(-1, -2))  # strided, and not an argmax of its window: the codes still wrap alike
    check(codec, indices.int())
    check(codec, indices[:0])


def test_pool_offsets_of_values_no_window_holds_wrap_as_the_reference():
    garbage = torch.randint(-10**6, 10**6, (4099,), generator=torch.Generator().manual_seed(1))
    for kernel in (1, 2, 3, 16):
        check(PoolOffsets(kernel=(kernel, 2), stride=(2, 3), padding=(1, 0), dilation=(1, 2), width=37,
                          out_size=(1, 1)), garbage)


def test_nothing_is_read_back_to_the_host():
    codecs = [(codec, values(100, torch.bfloat16)) for codec in MASKS + [DerivativeCode("silu", bits=3)]]
    codecs += [(DropoutMask(other_values="nan"), values(100, torch.float16)), pool_case(9, 3, 2, 1, 1)]
    for codec, x in codecs:
        with use_backend("triton"), HostReads() as reads:
            payload, saved, meta = backends.encode(codec, x, HINTS)
            backends.decode(codec, payload, saved, meta)
        assert not reads.counts, (codec, dict(reads.counts))
