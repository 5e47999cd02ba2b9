"""Models to try ``actcomp check`` on: each function returns ``(model, batch)``, the form its
``--model FILE.py:FUNCTION`` option takes. Write one like them for your own model.

    actcomp check --model examples/check_models.py:quickstart
    actcomp check --model examples/check_models.py:llama
    actcomp check --model examples/check_models.py:llama_with_outliers --rest 4bit

Nothing is downloaded: the weights are random (``pretrained=False``, or a config).
"""

from __future__ import annotations

import torch


def quickstart():
    """The README's Quickstart model: a ViT-S at 64 px, a batch of 8 random images."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=64)
    return model, torch.randn(8, 3, 64, 64)


def llama():
    """A small untrained Llama-shaped causal LM from a config (random weights), its loss computed
    from ``labels``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    ids = torch.randint(1, 1000, (2, 128), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def llama_with_outliers():
    """:func:`llama` with a trained model's outlier channels and sink token built in
    (``actcomp.tools.llm_outliers``)."""
    from actcomp.tools.llm_outliers import add_outliers

    model, batch = llama()
    add_outliers(model)
    batch["input_ids"][:, 0] = 0  # the sink token (labels is the same tensor)
    return model, batch
