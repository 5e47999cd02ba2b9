"""A model zoo for exactness tests: timm families covering every Linear/Conv variant timm uses,
and Hugging Face models built from small configs (no weights are downloaded).

Each entry builds a model and one batch, small enough that a training step takes well under a
second on one CPU thread. ``train_step`` runs one training forward/backward and returns the
logits and every parameter gradient.

The harness runs on ``ACTCOMP_TEST_DEVICE`` (default ``cpu``): ``ACTCOMP_TEST_DEVICE=cuda python
-m pytest -m "" tests/integration/test_zoo.py`` runs it on a GPU, with deterministic kernels (tests/conftest.py),
as ``benchmarks/gpu_check.py`` does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import timm
import torch
import torch.nn.functional as F
from torch import nn

# Where train_step runs: the models are built on the CPU, converted, then moved.
DEVICE = torch.device(os.environ.get("ACTCOMP_TEST_DEVICE", "cpu"))


@dataclass(frozen=True)
class ZooModel:
    id: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict]
    # The Linear/Conv subclasses with a forward of their own this model brings (checked).
    own_forward_layers: tuple[str, ...] = ()
    # A batch in which every BatchNorm channel normalizes at least ROOMY values (checked), for
    # the lossy presets' gradient floors; None: ``batch`` already is (no BatchNorm). With 2 or 8
    # values a channel, BatchNorm's input gradient is mostly cancellation noise that any
    # rounding reshuffles (the documented exception).
    roomy_batch: Callable[[], dict] | None = None


# Values a BatchNorm channel normalizes in ``roomy_batch``.
ROOMY = 64


def _images(size: int, count: int = 2) -> Callable[[], dict]:
    return lambda: {"x": torch.randn(count, 3, size, size), "targets": torch.arange(count) % 3}


def _timm(name: str, size: int = 32, own: tuple[str, ...] = (), roomy: tuple[int, int] | None = None,
          **kwargs) -> ZooModel:
    """``roomy``: (images, size) of a batch giving every BatchNorm channel ROOMY values."""
    return ZooModel(name, lambda: timm.create_model(name, pretrained=False, num_classes=3, **kwargs), _images(size), own,
                    None if roomy is None else _images(roomy[1], roomy[0]))


def _tokens(labels: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], dict]:
    def batch() -> dict:
        ids = torch.randint(0, 64, (2, 12))
        return {"input_ids": ids, "labels": labels(ids)}

    return batch


def _hf(name: str, build: Callable[[], nn.Module], labels: Callable[[torch.Tensor], torch.Tensor]) -> ZooModel:
    return ZooModel(name, build, _tokens(labels))


def _bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def _t5() -> nn.Module:
    import transformers

    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(config)


TIMM_ZOO = [
    _timm("resnet18", roomy=(4, 128)),
    # BiT: every conv is timm's StdConv2d (weight standardisation in its own forward).
    _timm("resnetv2_50x1_bit", own=("StdConv2d",)),
    # NFNet: ScaledStdConv2d (standardised, gain-scaled weight).
    _timm("nfnet_l0", own=("ScaledStdConv2d",)),
    # TF ports: Conv2dSame pads TF-style in its own forward (stride 2 changes the shape if skipped).
    _timm("tf_efficientnet_b0", own=("Conv2dSame",), roomy=(4, 128)),
    _timm("efficientnet_b0", roomy=(4, 128)),
    # timm's own Linear subclass (a forward of its own for torchscript).
    _timm("mobilenetv3_small_050", own=("Linear",), roomy=(4, 128)),
    _timm("regnetx_002", roomy=(4, 128)),
    _timm("convnext_atto", size=64),
    _timm("swin_tiny_patch4_window7_224", size=56, img_size=56),
    _timm("vit_tiny_patch16_224", img_size=32),
    _timm("deit_tiny_patch16_224", img_size=32),
    _timm("levit_128s", size=64, img_size=64, roomy=(64, 64)),
    _timm("maxvit_nano_rw_256", size=64, img_size=64, roomy=(16, 64)),
]

HF_ZOO = [
    _hf("bert", _bert, lambda ids: torch.tensor([0, 2])),
    # GPT-2's projections are transformers' Conv1D (weight shaped in x out).
    _hf("gpt2", _gpt2, lambda ids: ids),
    _hf("llama", _llama, lambda ids: ids),
    _hf("t5", _t5, lambda ids: ids[:, :6].contiguous()),
]

ZOO = TIMM_ZOO + HF_ZOO

# Not in ZOO: a ViT whose class token gets no position embedding, so its LayerNorm row is the
# token itself (initialised with std 1e-6) among patch rows of std ~1. Quantization groups
# spanning rows rounded that row away (issue 15); the gradient-cosine checks use it.
CLASS_TOKEN_VIT = ZooModel(
    "vit_tiny_class_token",
    lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=32, no_embed_class=True),
    _images(32, 4),
)

# The models the default test tier runs every zoo sweep on (tests/conftest.py): a CNN with
# BatchNorm, ReLU and MaxPool, a ViT, and a causal LM whose projections are transformers'
# Conv1D. The full tier runs the whole zoo.
FAST_ZOO_IDS = {"resnet18", "vit_tiny_patch16_224", "gpt2"}


def train_step(model: nn.Module, batch: dict, autocast: bool = False, seed: int = 1):
    """One training forward/backward; returns (logits, {name: grad}).

    The RNG is seeded right before the forward so dropout draws the same masks for every model.
    Model and batch go to ``DEVICE`` first.
    """
    model.to(DEVICE).train()
    model.zero_grad(set_to_none=True)
    batch = {key: value.to(DEVICE) for key, value in batch.items()}
    torch.manual_seed(seed)
    amp = torch.autocast(DEVICE.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp:
        if "x" in batch:
            logits = model(batch["x"])
            loss = F.cross_entropy(logits.float(), batch["targets"])
        else:
            output = model(**batch)
            logits, loss = output.logits, output.loss
    loss.backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def gradient_cosine(grads: dict, ref_grads: dict) -> float:
    """Cosine between two sets of gradients ({name: grad}), flattened in the same order.

    Normalised first: ``cosine_similarity``'s eps would clamp the norms of tiny gradients (a
    layer-scaled ConvNeXt block's are 1e-9) and report nonsense.
    """
    names = [name for name, grad in ref_grads.items() if grad is not None]
    flat = [torch.cat([gs[name].reshape(-1).double() for name in names]) for gs in (grads, ref_grads)]
    a, b = (f / f.norm() for f in flat)
    return float((a * b).sum())


def preset_gradients(entry: ZooModel, rest, autocast: bool = False) -> tuple[dict, dict]:
    """(converted, plain) parameter gradients of one fp32 (or bf16 autocast) step of ``entry`` on
    its roomy batch, converted with a lossless layer spec (``mink0``) and whole-model policy ``rest``."""
    import copy

    import actcomp

    torch.manual_seed(0)
    plain = entry.build()
    # loss="plain": the codecs' gradients against plain's, the causal LMs' own loss in both.
    model = actcomp.to_compressed(copy.deepcopy(plain), "mink0", first_layer=None, rest=rest, loss="plain")
    torch.manual_seed(2)
    batch = (entry.roomy_batch or entry.batch)()
    _, ref_grads = train_step(plain, batch, autocast)
    _, grads = train_step(model, batch, autocast)
    return grads, ref_grads
