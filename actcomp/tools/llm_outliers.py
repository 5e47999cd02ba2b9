"""The outliers trained language models carry, built into a randomly initialised one.

Trained LLMs have outlier feature channels (a few hidden channels 20-60x the rest on every
token, LLM.int8()) and massive activations on sink tokens (100-1000x, Sun et al. 2024); a random
model has neither, so a quality check on one overstates what lossy codecs keep. This puts both
in a Hugging Face decoder (Llama, Mistral, Qwen2 shapes: ``model.model.embed_tokens`` and decoder
layers with ``input_layernorm`` / ``post_attention_layernorm``):

- ``channels`` hidden channels get every norm's gain times ``gain``: every layer's inputs (the
  norms' outputs) carry them on every token;
- token id ``sink_token``'s embedding is ``sink`` times larger on those channels: that token's
  residual stream carries massive activations through every layer, and attention gathers on it.

>>> import transformers
>>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                   num_attention_heads=4, num_key_value_heads=2)
>>> add_outliers(transformers.LlamaForCausalLM(config), channels=2).shape
torch.Size([2])
"""

from __future__ import annotations

import torch
from torch import nn

from actcomp.errors import ActcompError


def add_outliers(model: nn.Module, *, channels: int = 4, gain: float = 40.0, sink: float = 300.0,
                 sink_token: int = 0, seed: int = 1) -> torch.Tensor:
    """Build outlier channels and a sink token into ``model`` in place; returns the channels."""
    decoder = getattr(model, "model", model)
    embed, layers = getattr(decoder, "embed_tokens", None), getattr(decoder, "layers", None)
    if embed is None or layers is None:
        raise ActcompError(f"add_outliers needs a Hugging Face decoder (embed_tokens and layers), got "
                           f"{type(model).__name__}")
    hidden = embed.weight.shape[1]
    if not 0 < channels <= hidden:
        raise ActcompError(f"add_outliers: channels={channels} must be between 1 and the hidden size {hidden}")
    chosen = torch.randperm(hidden, generator=torch.Generator().manual_seed(seed))[:channels]
    with torch.no_grad():
        for layer in layers:
            for name in ("input_layernorm", "post_attention_layernorm"):
                norm = getattr(layer, name, None)
                if norm is not None:
                    norm.weight[chosen] *= gain
        embed.weight[sink_token, chosen] *= sink
    return chosen
