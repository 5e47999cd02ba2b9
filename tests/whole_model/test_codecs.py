"""Every registered whole-model codec, and every op in the whole-model op table, by default.

Parametrized over ``actcomp.list_codecs()`` and ``OP_CODECS``: a codec registered (or an op
given a codec) is tested without a new test. What must hold:

- exact codecs give plain PyTorch's gradients bit for bit, through the op that saved the
  tensor, for edge values (signed zeros, +-inf, NaN), dtypes (fp32, bf16, fp16) and layouts
  (contiguous, permuted, sliced);
- what the backward reads comes back bit-identical when encoded again (a round trip);
- ``nbytes`` is what the codec's docstring formula says;
- the stand-in has the saved tensor's shape, dtype and (dense) axis order;
- ``encode`` and ``decode`` compile with ``fullgraph=True, dynamic=True`` and give the eager codes
  (the full tier: compiling is slow);
- the user example in docs/codecs.md runs.

Pipeline stages (sparsifiers, quantizers) are parametrized over the registry in test_compressors.py.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actcomp
from actcomp.core.packed import Hints
from actcomp.graph.op_kinds import _FUNCTIONS
from actcomp.graph.saved_tensors import listening
from actcomp.kernels.layouts import dense_strides_like
from actcomp.whole_model.choosing import OP_CODECS, CodecChoice

pytestmark = pytest.mark.usefixtures("seeded", "single_thread")

WHOLE_MODEL = [name for name in actcomp.list_codecs() if actcomp.codec_class(name).kind in ("exact", "derivative")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def with_edges(x: torch.Tensor) -> torch.Tensor:
    """``x`` with signed zeros, +-inf and NaN scattered in (floats only)."""
    edges = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 6.0], dtype=x.dtype)
    flat = x.reshape(-1).clone()
    flat[torch.randperm(flat.numel())[:edges.numel() * 3]] = edges.repeat(3)
    return flat.view(x.shape)


def pool_indices(dtype: torch.dtype, layout) -> tuple[actcomp.compressors.Compressor, torch.Tensor]:
    # The layout is the pool input's: indices of a sliced pool output point outside its windows.
    x = layout(torch.randn(2, 3, 11, 14).to(dtype))
    _, indices = torch.ops.aten.max_pool2d_with_indices(x, 3, 2, 1)
    return actcomp.codec_class("pool-offsets")(kernel=(3, 3), stride=(2, 2), padding=(1, 1), width=x.shape[-1],
                                               out_size=tuple(indices.shape[-2:])), indices


def dropout_noise(dtype: torch.dtype) -> torch.Tensor:
    return (torch.rand(4, 6, 8, 8) > 0.3).to(dtype) / 0.7


# The example each codec is tested on: (codec, saved tensor) for a dtype and a layout. A codec
# whose default settings take a float tensor needs no entry.
EXAMPLES = {
    "pool-offsets": pool_indices,
    "dropout-mask": lambda dtype, layout: (actcomp.codec_class("dropout-mask")(), layout(dropout_noise(dtype))),
    "fewbit": lambda dtype, layout: (actcomp.codec_class("fewbit")(), layout(torch.randn(4, 6, 8, 8).mul(3).to(dtype))),
}

# Each codec's size formula, in its docstring: bytes for ``n`` elements.
SIZES = {
    "relu-mask": lambda codec, n, dtype: math.ceil(n / 8),
    "comparison-mask": lambda codec, n, dtype: math.ceil(n / 8),
    "leaky-relu-mask": lambda codec, n, dtype: math.ceil(n / 8),
    "clamp-mask": lambda codec, n, dtype: math.ceil(n * (codec.states - 1) / 8),
    "dropout-mask": lambda codec, n, dtype: math.ceil(n / 8) + dtype.itemsize,
    "shape-only": lambda codec, n, dtype: 0,
    "pool-offsets": lambda codec, n, dtype: math.ceil(n * codec.bits / 8),
    "fewbit": lambda codec, n, dtype: math.ceil(n * codec.bits / 8) + 1,  # and the chain's finite flag
}


LAYOUTS = {
    "contiguous": lambda t: t,
    "permuted": lambda t: t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),  # channels_last
    "sliced": lambda t: t[:, :, 1:],
}


def example(name: str, dtype: torch.dtype, layout: str = "contiguous"):
    if name in EXAMPLES:
        return EXAMPLES[name](dtype, LAYOUTS[layout])
    return actcomp.codec_class(name)(), LAYOUTS[layout](with_edges(torch.randn(4, 6, 8, 8).mul(3).to(dtype)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", WHOLE_MODEL)
def test_codec_round_trips_with_its_size_dtype_and_layout(name, dtype, layout):
    codec, saved = example(name, dtype, layout)
    if name == "fewbit":
        saved = saved.nan_to_num(0.0, 0.0, 0.0)  # a non-finite input decodes to NaN (test below)

    kept = CodecChoice(codec).encode(saved)
    standin = kept.unpack()
    again = CodecChoice(codec).encode(standin)

    assert name in SIZES, f"state {name!r}'s size formula in its docstring and in SIZES"
    assert kept.packed.nbytes == SIZES[name](codec, saved.numel(), saved.dtype)
    assert standin.shape == saved.shape and standin.dtype == saved.dtype
    assert standin.stride() == dense_strides_like(saved) or name == "shape-only"
    if name != "shape-only":  # its stand-in is a broadcast zero: no values to round-trip
        assert all(map(torch.equal, kept.packed.tensors, again.packed.tensors)), "codes change on a round trip"
        torch.testing.assert_close(again.unpack(), standin, rtol=0, atol=0, equal_nan=True)


# How each op of the table is called in the exactness test; an op without an entry is called
# as ``function(h)`` (a user's unary activation).
CALLS = {
    "leaky_relu": lambda f, h: f(h, 0.1),
    "hardtanh": lambda f, h: f(h, -0.5, 0.7),
    "dropout": lambda f, h: f(h, 0.3, True),
    "max_pool2d": lambda f, h: f(h, 3, 2, 1),
    "avg_pool": lambda f, h: f(h, 3, 2, 1),
    "sdpa": lambda f, h: f(h, h, h, dropout_p=0.3),
}


def table_functions(exact: bool) -> list[tuple[str, object]]:
    """(op, one torch function recognised as it) for every op whose table codecs are (not) exact."""
    found = {}
    for function, known in _FUNCTIONS.items():
        entries = OP_CODECS.get(known.op, ())
        if entries and all((entry.codec.kind == "exact") == exact for entry in entries):
            found.setdefault(known.op, function)
    return sorted(found.items())


class Op(nn.Module):
    def __init__(self, op: str, function, layout: str):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.op, self.function, self.layout = op, function, layout

    def forward(self, x):
        hidden = LAYOUTS[self.layout](x * self.scale.to(x.dtype))  # saved by the op, not the model's input
        return CALLS.get(self.op, lambda f, h: f(h))(self.function, hidden)


def op_gradients(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    torch.manual_seed(5)
    output = model(x)
    output.backward(torch.linspace(-1, 1, output.numel()).view(output.shape).to(output.dtype))
    return x.grad, model.scale.grad


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op, function", table_functions(exact=True), ids=lambda value: value if isinstance(value, str) else "")
def test_exact_op_codecs_give_plain_gradients_bit_for_bit(op, function, dtype, layout, request):
    if op in ("hardtanh", "relu6") and dtype != torch.float32 and layout == "sliced":
        # Known since 0.1.0 (the closure-based mask fails the same way): on a non-dense bf16/fp16
        # input the CPU kernel takes another loop than on the dense stand-in, and the two answer
        # differently for NaN. A NaN state in the same place is not enough there.
        request.applymarker(pytest.mark.xfail(strict=True, reason="hardtanh NaN on a sliced reduced-precision input"))
    x = with_edges(torch.randn(2, 3, 9, 10).mul(3)).to(dtype)
    plain = Op(op, function, layout)
    try:
        expected = op_gradients(plain, x)
    except RuntimeError as error:  # an op without a kernel for this dtype on CPU
        pytest.skip(str(error))
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0", rest="exact")

    events = []
    with listening(events.append):
        grads = op_gradients(model, x)

    assert {event.kind for event in events if event.codec is not None}, "an exact codec ran: the test checks something"
    for grad, reference in zip(grads, expected):
        torch.testing.assert_close(grad, reference, rtol=0, atol=0, equal_nan=True)


def encode_tensors(codec, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    payload, saved, _ = codec.encode(x, Hints())
    return (payload, *saved)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_derivative_codes_of_a_tensor_holding_nan_or_inf_decode_to_nan(bad):
    # No interval holds NaN, and whole-model mode chooses codecs without reading values: the
    # chain's finite flag makes the whole stand-in NaN, so the gradient is NaN, never a guess.
    codec, saved = example("fewbit", torch.float32)
    saved = saved.nan_to_num(0.0, 0.0, 0.0)
    saved.view(-1)[7] = bad

    kept = CodecChoice(codec).encode(saved)

    assert kept.packed.layout.flagged and not kept.packed.tensors[0]
    assert kept.unpack().isnan().all()


@pytest.mark.parametrize("name", WHOLE_MODEL)
def test_codec_encode_and_decode_compile_to_the_eager_codes(name):
    codec, saved = example(name, torch.float32)
    flat = saved.reshape(-1)
    if name == "fewbit":
        flat = flat.nan_to_num(0.0, 0.0, 0.0)  # the codes of NaN and inf are the flag's business
    payload, kept, meta = codec.encode(flat, Hints())
    torch._dynamo.reset()

    encoded = torch.compile(lambda x: encode_tensors(codec, x), fullgraph=True, dynamic=True)(flat)
    decoded = torch.compile(lambda payload, *kept: codec.decode(payload, kept, meta), fullgraph=True,
                            dynamic=True)(payload, *kept)

    assert all(map(torch.equal, encoded, (payload, *kept)))
    torch.testing.assert_close(decoded, codec.decode(payload, kept, meta), rtol=0, atol=0, equal_nan=True)


def test_the_user_codec_example_in_the_docs_runs():
    text = (Path(__file__).resolve().parents[2] / "docs" / "codecs.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    before = actcomp.list_codecs()

    try:
        exec(compile(code, "docs/codecs.md", "exec"), {})
        assert actcomp.list_codecs() == before  # the example cleans up after itself
    finally:  # and if it failed half way, this does
        if F.hardshrink in _FUNCTIONS:
            actcomp.unregister_op_codec(F.hardshrink)
        if "hardshrink-mask" in actcomp.list_codecs():
            actcomp.unregister_codec("hardshrink-mask")


def test_registered_codecs_are_listed_by_kind():
    assert sorted(actcomp.list_codecs("sparsifier") + actcomp.list_codecs("quantizer")) == actcomp.list_compressors()
    assert set(actcomp.list_codecs("exact")) >= {"relu-mask", "clamp-mask", "dropout-mask", "shape-only",
                                                 "pool-offsets"}
    assert actcomp.list_codecs("derivative") == ["fewbit"]
    with pytest.raises(actcomp.ActcompError, match="unknown codec kind 'lossless'; kinds: sparsifier, quantizer, "
                                                   "exact, derivative"):
        actcomp.list_codecs("lossless")


def test_a_whole_model_codec_is_not_a_pipeline_stage():
    with pytest.raises(actcomp.ActcompError, match="unknown stage 'relu-mask'"):
        actcomp.parse("relu-mask")
    with pytest.raises(actcomp.ActcompError, match="has kind 'exact'; valid kinds: sparsifier, quantizer"):
        actcomp.register_compressor(type(actcomp.codec_class("relu-mask").__name__, (actcomp.codec_class("relu-mask"),),
                                         {"name": "another_mask"}))


def test_an_op_codec_must_be_a_registered_whole_model_codec():
    with pytest.raises(actcomp.ActcompError, match="expects a registered codec of kind 'exact' or 'derivative'"):
        actcomp.register_op_codec(F.hardshrink, "int8")
    with pytest.raises(actcomp.ActcompError, match=r"op 'relu' has codecs already \(relu-mask\); pass replace=True"):
        actcomp.register_op_codec(F.relu, "relu-mask")
    with pytest.raises(actcomp.ActcompError, match="no op codec was registered"):
        actcomp.unregister_op_codec(F.hardshrink)


@pytest.mark.parametrize("seed", range(4))
def test_the_derivative_codes_runs_are_the_greedy_definitions_and_stop_early_alike(seed):
    """_pieces (comparisons, an early stop for the codebook's bisection) against the greedy runs
    written plainly: the same starts, and with ``most`` the first ``most + 1`` of them."""
    from actcomp.whole_model.derivative_codes import _pieces

    def plainly(values, tolerance):
        starts, low, high = [0], values[0], values[0]
        for index, value in enumerate(values):
            low, high = min(low, value), max(high, value)
            if high - low > 2 * tolerance:
                starts.append(index)
                low = high = value
        return starts

    values = torch.randn(2000, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).cumsum(0).tolist()
    for tolerance in (0.0, 0.3, 2.0, 40.0, 1e9):
        expected = plainly(values, tolerance)
        assert _pieces(values, tolerance) == expected
        for most in (1, 4, 16):
            assert _pieces(values, tolerance, most) == expected[:most + 1]
