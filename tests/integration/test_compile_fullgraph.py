"""torch.compile(fullgraph=True) of a converted model's training forward: no graph break, in
Linear/Conv mode (``to_compressed(model, "int8")``) and under ``compress_in_graph``.

A graph break makes ``fullgraph=True`` raise, so compiling at all is the zero-breaks check;
dynamo's counters say it again. ``aot_eager`` runs the traced forward and backward graphs op by
op: the codecs' compiled path then gives the eager codes bit for bit, which the gradients show
(a weight gradient is computed from the decoded input). Inductor's fused kernels round their
own way on top of that (measured on ViT-tiny with 12 blocks: the largest gradient difference
1.6% of the gradient's largest value); that run takes minutes on 2 cores, and is left out.
"""

import copy

import pytest
import timm
import torch
import transformers
from torch._dynamo.utils import counters

import actcomp
from actcomp.errors import WARNED
from actcomp.graph.not_compiled import LAYER_FALLBACK


def vit():
    # Two blocks of ViT-tiny, not twelve: each block is the same code, and tracing is per layer.
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10, depth=2)
    return model, lambda m: m(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)))


def llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return transformers.LlamaForCausalLM(config), lambda m: m(input_ids=ids).logits


MODELS = {"vit_tiny": vit, "llama": llama}


def gradients(model, run) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    run(model).square().mean().backward()
    return {name: parameter.grad for name, parameter in model.named_parameters()}


def fullgraph(model, run):
    """``run`` through ``torch.compile(model, fullgraph=True)``, with dynamo's counters fresh."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    return lambda _: run(compiled)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_converted_layers_compile_into_one_graph_with_the_eager_codes(name):
    torch.manual_seed(0)
    plain, run = MODELS[name]()
    plain.train()
    eager = actcomp.to_compressed(copy.deepcopy(plain), "int8")
    compiled_model = copy.deepcopy(eager)
    WARNED.discard(LAYER_FALLBACK)
    compiled = gradients(compiled_model, fullgraph(compiled_model, run))
    assert not counters["graph_break"]
    assert LAYER_FALLBACK not in WARNED
    expected, uncompressed = gradients(eager, run), gradients(plain, run)
    for parameter, grad in expected.items():
        assert torch.equal(compiled[parameter], grad), parameter
    # And int8 really ran inside the graph: the Linear weights' gradients are not plain autograd's.
    assert any(not torch.equal(compiled[parameter], uncompressed[parameter])
               for parameter in expected if parameter.endswith("proj.weight"))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compress_in_graph_compiles_into_one_graph(name):
    torch.manual_seed(0)
    model, run = MODELS[name]()
    model.train()
    expected = gradients(model, run)
    step = fullgraph(model, run)
    model.zero_grad(set_to_none=True)
    with actcomp.compress_in_graph("int8", rest="8bit"):
        loss = step(model).square().mean()
    loss.backward()
    assert not counters["graph_break"]
    for parameter, grad in expected.items():
        # int8 and 8-bit codes of every saved activation: close to plain autograd's, not equal.
        compressed = model.get_parameter(parameter).grad
        assert torch.nn.functional.cosine_similarity(compressed.flatten(), grad.flatten(), dim=0) > 0.99, parameter
