"""PEFT LoRA: the adapters' gradients stay accurate, their shared input is compressed once."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import actcomp  # noqa: E402
from actcomp.layers.compressed_layer import CompressedLayer  # noqa: E402
from actcomp.losses.causal_lm import is_routed  # noqa: E402


def lora_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora).train()
    # PEFT starts lora_B at zero (so lora_A's gradient is zero): a trained adapter's state instead.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    return model


def adapter_grads(model, input_ids):
    model.zero_grad()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    return torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters() if p.requires_grad])


def test_adapters_keep_the_quantizer_alone_and_lora_b_stays_plain():
    model = lora_llama()
    actcomp.to_compressed(model, "mink0.9+int8")
    pipelines = {name: module.actcomp_pipeline.spec for name, module in model.named_modules()
                 if isinstance(module, CompressedLayer)}
    down = [name for name in pipelines if ".lora_A." in name]
    assert down and all(pipelines[name] == "int8" for name in down)
    assert not any(".lora_B." in name for name in pipelines)
    assert pipelines["base_model.model.model.layers.0.self_attn.q_proj.base_layer"] == "mink0.9+int8"


@pytest.mark.parametrize("rest", [None, "8bit"])
def test_the_adapters_gradients_stay_accurate(rest):
    input_ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    plain = lora_llama()
    compressed = copy.deepcopy(plain)
    expected = adapter_grads(plain, input_ids)
    actcomp.to_compressed(compressed, "mink0.9+int8", rest=rest)
    got = adapter_grads(compressed, input_ids)
    cosine = F.cosine_similarity(got, expected, dim=0)
    assert cosine >= 0.999, cosine


def test_the_adapters_inputs_are_compressed():
    input_ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    model = lora_llama()
    plain = actcomp.memory_report(model, input_ids=input_ids, labels=input_ids).total_bytes
    actcomp.to_compressed(model, "mink0.9+int8", rest="8bit")
    # The causal LM inside the PEFT wrapper has its loss routed too.
    assert is_routed(model)
    kept = actcomp.memory_report(model, input_ids=input_ids, labels=input_ids).total_bytes
    # 3.4x: SDPA's query and key stay bf16 (tests/test_lm_outliers.py), was 3.5x.
    assert plain > 3.2 * kept, (plain, kept)
