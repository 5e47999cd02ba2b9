"""PEFT LoRA: the adapters' gradients stay accurate, their shared input is compressed once."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from models import sdpa_codecs  # noqa: E402

import actcomp  # noqa: E402
from actcomp.layers.compressed_layer import CompressedLayer  # noqa: E402
from actcomp.losses.causal_lm import is_routed  # noqa: E402
from actcomp.whole_model import session  # noqa: E402


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
    # 2.8x: SDPA's query and key stay as they are on a LoRA model (below), value and output
    # bf16; 3.1x with all four in bf16, 3.5x with the preset's int8.
    assert plain > 2.6 * kept, (plain, kept)


def outlier_llama_on_disk(folder) -> str:
    """A small Llama with a trained model's outlier channels and sink token, saved to ``folder``."""
    from actcomp.tools.llm_outliers import add_outliers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    add_outliers(model)
    model.save_pretrained(folder)
    return str(folder)


def lora_of(folder: str, nf4: bool):
    if nf4:
        pytest.importorskip("bitsandbytes")
        quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=torch.float32)
        base = transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization,
                                                             device_map="cpu")
    else:
        base = transformers.LlamaForCausalLM.from_pretrained(folder)
    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules="all-linear")).train()
    # PEFT starts lora_B at zero, which leaves lora_A (the compressed input's consumer) without a
    # gradient: a trained adapter's state instead.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    return model


# The floor for the adapters: 0.999 with the default preset, outliers built in. The
# preset's 8-bit SDPA value and output gave 0.9984 here (0.9978 on the nf4 base); on a LoRA
# model SDPA's query and key stay as they are, value and output bf16.
@pytest.mark.parametrize("nf4", [False, True], ids=["float-base", "qlora-nf4-base"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_default_preset_keeps_the_adapters_gradient_with_outliers_built_in(tmp_path, nf4):
    folder = outlier_llama_on_disk(tmp_path)
    input_ids = torch.randint(1, 300, (2, 128), generator=torch.Generator().manual_seed(0))
    input_ids[:, 0] = 0  # the sink token
    plain, compressed = lora_of(folder, nf4), lora_of(folder, nf4)
    actcomp.to_compressed(compressed, "mink0.9+int8", rest="8bit")
    assert str(compressed.actcomp_rest.attention) == "bf16" and compressed.actcomp_rest.attention.query_key_as_is
    compressed_grads, plain_grads = adapter_grads(compressed, input_ids), adapter_grads(plain, input_ids)
    assert F.cosine_similarity(compressed_grads, plain_grads, dim=0) >= 0.999
    # lora_A's gradient, the one that reads the compressed input, on its own (it is a sixth of
    # the whole's norm here: the whole's cosine would hide it).
    lora_a = torch.cat([torch.full((p.numel(),), "lora_A" in name)
                        for name, p in plain.named_parameters() if p.requires_grad])
    assert lora_a.any() and plain_grads[lora_a].norm() > 0
    assert F.cosine_similarity(compressed_grads[lora_a], plain_grads[lora_a], dim=0) >= 0.999


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_on_a_lora_model_sdpa_keeps_query_and_key_at_16_bits(monkeypatch):
    input_ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    model = actcomp.to_compressed(lora_llama(), "mink0.9+int8", rest="8bit")
    with sdpa_codecs(monkeypatch) as choices:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    # Key, query and value in bf16, the output and log-sum-exp run again in backward (CPU).
    assert choices == ["bf16", "bf16", "bf16", "recomputed", "recomputed"] * 2
    # Where the call cannot be run again: query and key as they are, value and output in bf16.
    monkeypatch.setattr(session, "_recomputable_call", lambda scope: False)
    with sdpa_codecs(monkeypatch) as choices:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert choices == [None, None, "bf16", "bf16"] * 2


def test_a_mapping_keeps_its_own_attention_choice_on_a_lora_model():
    model = actcomp.to_compressed(lora_llama(), "mink0.9+int8", rest={"attention": "int8"})
    assert str(model.actcomp_rest.attention) == "int8"
    assert str(actcomp.to_compressed(lora_llama(), "int8", rest="8bit").actcomp_rest.attention) == "bf16"
    # Without adapters the preset is the preset.
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    bare = actcomp.to_compressed(transformers.LlamaForCausalLM(config), "int8", rest="8bit")
    assert str(bare.actcomp_rest.attention) == "int8"
