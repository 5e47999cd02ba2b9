"""LoRA adapters (PEFT's ``lora_A`` and ``lora_B``): what a Linear layer of an adapter keeps.

In a LoRA fine-tune the adapters are the whole training signal: the frozen base layer keeps
nothing for backward (its weight needs no gradient), ``lora_A`` keeps its input (the base
layer's input, through the adapter's dropout) for its weight's gradient, and ``lora_B`` keeps
``lora_A``'s rank-r output. A sparsifier on ``lora_A``'s input drops most of what its gradient
is made of (PEFT LoRA on a small Llama with ``mink0.9``: the adapters' gradient cosine 0.75), so
an adapter's ``lora_A`` keeps the pipeline's quantizers alone, and ``lora_B``, whose input is r
values a token, stays plain.

>>> from actcomp.core.pipeline import parse
>>> adapter_pipeline("model.layers.0.self_attn.q_proj.lora_A.default", parse("mink0.9+int8"))
Pipeline('int8')
>>> adapter_pipeline("model.layers.0.self_attn.q_proj.lora_B.default", parse("mink0.9+int8")) is None
True
>>> adapter_pipeline("model.layers.0.self_attn.q_proj.base_layer", parse("mink0.9+int8"))
Pipeline('mink0.9+int8')
"""

from __future__ import annotations

from actcomp.core.pipeline import Pipeline, parse

# PEFT names an adapter's layers <layer>.lora_A.<adapter name> and <layer>.lora_B.<adapter name>.
_DOWN, _UP = "lora_A", "lora_B"


def adapter_part(name: str) -> str | None:
    """``"lora_A"`` or ``"lora_B"`` where the module called ``name`` is one of a LoRA adapter's
    layers, else None."""
    parts = name.split(".")
    for part in (_DOWN, _UP):
        if part in parts[:-1]:
            return part
    return None


def adapter_pipeline(name: str, pipeline: Pipeline) -> Pipeline | None:
    """The pipeline the layer called ``name`` gets when ``pipeline`` was chosen for it: its
    quantizers alone for a ``lora_A`` (None where it has none), None for a ``lora_B``, and
    ``pipeline`` itself for any other layer."""
    part = adapter_part(name)
    if part is None:
        return pipeline
    if part == _UP:
        return None
    quantizers = [str(stage) for stage in pipeline.stages if stage.kind == "quantizer"]
    return parse("+".join(quantizers)) if quantizers else None
