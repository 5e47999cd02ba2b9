"""The quantizers: int8/int4/int2 are one class at three widths, and every quantizer's encode and
decode compile to the eager codes."""

import math
import pickle

import pytest
import torch

import actcomp
from actcomp.compressors import GroupQuant, Int2, Int4, Int8
from actcomp.core.packed import Hints
from actcomp.core.registry import compressor_class
from actcomp.kernels.quantize import dequantize_affine, dequantize_affine_pointwise, grouped_shape, quantize_affine

QUANTIZERS = ["int8", "int4", "int2", "fp16", "bf16", "fp8", "mesa8"]


@pytest.mark.parametrize("cls, name, bits", [(Int8, "int8", 8), (Int4, "int4", 4), (Int2, "int2", 2)])
def test_each_width_is_group_quant_under_its_registry_name(cls, name, bits):
    stage = cls(group=64)

    assert compressor_class(name) is cls and issubclass(cls, GroupQuant)
    assert (stage.name, stage.bits, stage.group, str(stage), repr(stage)) == (
        name, bits, 64, f"{name}:group=64", f"{cls.__name__}(group=64, scale={stage.scale!r})")
    assert actcomp.parse(f"{name}:group=64").stages == (stage,) and str(cls()) == name
    assert pickle.loads(pickle.dumps(stage)) == stage and stage != cls(group=65)
    assert len({Int8(), Int4(), Int2()}) == 3  # equal settings, different widths: different stages


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_each_width_keeps_bits_codes_per_value(bits):
    x = torch.randn(4, 512)

    packed = compressor_class(f"int{bits}")().compress(x)

    assert packed.tensors[-1].numel() == x.numel() * bits // 8


def _encode(stage, x: torch.Tensor, state):
    hints = Hints(channel_dim=1)
    return stage.encode(x, hints) if state is None else stage.encode(x, hints, state)


@pytest.mark.parametrize("name", QUANTIZERS)
def test_encode_and_decode_compile_to_the_eager_codes(name):
    # fullgraph: no host read (.item(), int(t), bool(t)) and no graph break; dynamic: one graph
    # serves several shapes. Sizes large enough that a fused multiply-add in one of the two
    # would change some code. A stateful stage (mesa8) updates its state in both the same way.
    torch._dynamo.reset()  # each stage compiles afresh, not against earlier tests' graphs
    stage = compressor_class(name)()
    encode = torch.compile(_encode, fullgraph=True, dynamic=True)
    decode = torch.compile(stage.decode, fullgraph=True, dynamic=True)
    eager_state, compiled_state = stage.initial_state(), stage.initial_state()
    for seed, shape in enumerate([(64, 3000), (3, 40, 1001), (2, 6, 5, 77)]):
        torch.manual_seed(seed)
        x = torch.randn(shape) * torch.rand(shape[-1]) * 10

        eager = _encode(stage, x, eager_state)
        compiled = encode(stage, x, compiled_state)

        assert compiled.meta == eager.meta
        assert all(torch.equal(a, b) for a, b in zip((compiled.payload, *compiled.saved), (eager.payload, *eager.saved)))
        assert torch.equal(decode(*compiled), stage.decode(*eager))
        if eager_state is not None:
            assert torch.equal(compiled_state.low, eager_state.low) and torch.equal(compiled_state.high, eager_state.high)


def test_every_registered_codec_has_a_compile_test():
    # The compile tests run over these lists (quantizers here, sparsifiers in test_positions.py,
    # exact and derivative codecs in test_codecs.py): a new codec of any kind joins one of them.
    assert sorted(QUANTIZERS) == actcomp.list_codecs("quantizer")
    assert set(actcomp.list_codecs()) == set(actcomp.list_codecs("quantizer") + actcomp.list_codecs("sparsifier")
                                             + actcomp.list_codecs("exact") + actcomp.list_codecs("derivative"))


@pytest.mark.parametrize("spec", ["int8", "int4", "int2:group=64"])
@pytest.mark.parametrize("shape", [(48, 320), (7, 37)])  # whole groups; a partial last group
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_traced_graph_encodes_by_the_quantizers_op_and_decodes_as_eager_mode_does(spec, shape, dtype):
    # The encode is one extern call (the kernels the eager path chooses), not the reference's
    # loops: what makes compress_in_graph's first compile shorter. The decode is traced
    # pointwise, for Inductor to fuse into the kernel that reads it, and gives eager mode's values
    # bit for bit (int4's channel exponents, a partial last group, a non-finite value included).
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return graph_module

    pipeline = actcomp.parse(spec)
    x = torch.randn(shape).to(dtype)
    x[:, 3] *= 40  # an outlier channel, which int4's channel scales take out
    with_nan = x.clone()
    with_nan[1, 2] = math.nan

    def round_trip(x):
        packed = pipeline.compress(x, channel_dim=-1)
        return packed.tensors, pipeline.decompress(packed)

    for values in (x, with_nan):
        torch._dynamo.reset()
        graphs.clear()
        tensors, decoded = torch.compile(round_trip, backend=recording, fullgraph=True)(values)
        expected_tensors, expected = round_trip(values)
        for a, b in zip((*tensors, decoded), (*expected_tensors, expected), strict=True):
            # Bit for bit; NaN where eager mode has NaN (a non-finite value's group offset).
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert "group_quant_encode" in graphs[0] and "group_quant_decode" not in graphs[0]


def test_the_pointwise_decode_gives_the_reference_values_bit_for_bit():
    # The traced decode's formula against the reference's, eagerly, over widths, group sizes
    # (dividing the count or not), dtypes and values at the range's ends.
    for bits, group, count, dtype in [(8, 256, 1000, torch.float32), (4, 64, 999, torch.bfloat16),
                                      (2, 4, 10, torch.float16), (8, 3, 7, torch.float32)]:
        x = torch.cat([torch.randn(count - 2) * 5, torch.tensor([-6e4, 6e4])]).to(dtype)
        codes, offset, scale = quantize_affine(x, bits, group, torch.rand(grouped_shape(count, group)))
        reference = dequantize_affine(codes, offset, scale, bits, group, x.shape, dtype)
        assert torch.equal(dequantize_affine_pointwise(codes, offset, scale, bits, group, x.shape, dtype), reference)
