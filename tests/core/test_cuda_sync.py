"""On a CUDA device, no codec reads a value back to the host: every registered pipeline codec's
encode and decode run under ``torch.cuda.set_sync_debug_mode("error")``, eager and compiled, and
a whole converted training step synchronizes no more often than the plain model's.
Skipped without CUDA (``benchmarks/gpu_check.py`` runs it where one is lent).

Nor does the chain around them: its non-finite check is a flag kept on the device
(``core/chain.py``), and whole training steps count no reads on CPU (tests/integration/test_host_reads.py).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import actcomp
from actcomp.core import backends
from actcomp.core.packed import Hints

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPECS = ["int8", "int4", "int2", "fp16", "bf16", "fp8", "mesa8", "mink0.9", "smink0.9", "pmink0.9", "random0.9",
         "channel0.9", "rchannel0.9", "dropit0.9", "mink0.9+int8", "smink0.9+int8"]


def test_the_list_covers_every_registered_pipeline_codec():
    names = {stage.name for spec in SPECS for stage in actcomp.parse(spec).stages}
    assert names == set(actcomp.list_codecs("quantizer") + actcomp.list_codecs("sparsifier"))


@contextlib.contextmanager
def synchronizing_is_an_error():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def codec_round_trip(pipeline: actcomp.Pipeline, x: torch.Tensor) -> torch.Tensor:
    """Each stage's encode, then each decode in reverse, as the chain calls them, without the chain."""
    payload, hints, kept = x, Hints(channel_dim=-1), []
    for stage in pipeline.stages:
        state = stage.initial_state()
        encoded = backends.encode(stage, payload, hints) if state is None else stage.encode(payload, hints, state)
        payload = encoded.payload
        kept.append(encoded)
        if payload.dim() != x.dim():
            hints = Hints(channel_dim=None)
    for stage, encoded in zip(reversed(pipeline.stages), reversed(kept)):
        payload = backends.decode(stage, payload, encoded.saved, encoded.meta)
    return payload


@pytest.mark.parametrize("spec", SPECS)
def test_the_round_trip_without_the_chain_decodes_what_the_chain_does(spec):
    # On CPU, so the helper the CUDA check relies on is checked everywhere.
    pipeline = actcomp.parse(spec)
    x = torch.randn(4, 19, 96)
    torch.manual_seed(0)
    alone = codec_round_trip(pipeline, x)
    torch.manual_seed(0)
    chained = pipeline.decompress(pipeline.compress(x, channel_dim=-1))
    assert torch.equal(alone.reshape(chained.shape), chained)


@needs_cuda
@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("spec", SPECS)
def test_codec_encode_and_decode_never_synchronize(spec, backend):
    pipeline = actcomp.parse(spec)
    x = torch.randn(64, 197, 96, device="cuda")
    with backends.use_backend(backend):
        codec_round_trip(pipeline, x)  # lazy CUDA and compile set-up
        with synchronizing_is_an_error():
            codec_round_trip(pipeline, x)


@needs_cuda
def test_the_chain_around_them_never_synchronizes():
    pipeline = actcomp.parse("int8")
    x = torch.randn(64, 197, 96, device="cuda")
    pipeline.decompress(pipeline.compress(x))
    with synchronizing_is_an_error():
        pipeline.decompress(pipeline.compress(x))


def synchronizations(step) -> int:
    """How many synchronizing CUDA calls ``step()`` makes (sync debug mode's warnings)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


@needs_cuda
@pytest.mark.parametrize("rest", ["8bit", "exact"])
@pytest.mark.parametrize("model_id", ["resnet18", "vit_tiny_patch16_224", "llama"])
def test_a_whole_training_step_synchronizes_no_more_than_plain(model_id, rest):
    # Not one codec: a converted model's whole step (forward, the chunked LM loss, backward),
    # every saved tensor through whole-model mode, with CUDA's own kernels as the device path.
    # Counted against the plain model's step, which may synchronize on its own (a library's
    # mask checks), so that only what actcomp adds is judged.
    from integration.test_host_reads import MODELS, training_step

    entry = MODELS[model_id]
    torch.manual_seed(0)
    plain = entry.build().cuda()
    model = actcomp.to_compressed(entry.build(), "mink0.9+int8", rest=rest, return_freed_memory=False).cuda()
    batch = {key: value.cuda() for key, value in entry.batch().items()}
    counts = []
    for net in (plain, model):
        training_step(net, batch)  # lazy CUDA set-up, first-call caches
        counts.append(synchronizations(lambda net=net: training_step(net, batch)))
    assert counts[1] == counts[0], f"plain's step synchronizes {counts[0]} times, the converted one's {counts[1]}"


def _issue_model(model_id: str):
    """(model, batch, step) for the issue's own models, at sizes a test affords: resnet50 and
    ViT-S from timm (fp32, 64 px), a Llama-shaped model in bf16 (2 layers, 256 tokens)."""
    import timm
    import torch.nn.functional as F

    if model_id == "llama_bf16":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
        ids = torch.randint(0, 512, (2, 128))
        return (lambda: LlamaForCausalLM(config).to(torch.bfloat16)), {"input_ids": ids, "labels": ids}, \
            (lambda net, batch: net(**batch).loss)
    kwargs = {"img_size": 64} if "vit" in model_id else {}
    batch = {"x": torch.randn(4, 3, 64, 64), "targets": torch.randint(0, 10, (4,))}
    return (lambda: timm.create_model(model_id, num_classes=10, **kwargs)), batch, \
        (lambda net, batch: F.cross_entropy(net(batch["x"]), batch["targets"]))


@needs_cuda
@pytest.mark.parametrize("rest", ["8bit", "exact"])
@pytest.mark.parametrize("model_id", ["resnet50", "vit_small_patch16_224", "llama_bf16"])
def test_the_issues_models_train_a_step_that_synchronizes_no_more_than_plain(model_id, rest):
    # Issue 37's "done when": resnet50, ViT-S and a Llama block, whole steps, on a lent GPU.
    build, batch, loss = _issue_model(model_id)
    torch.manual_seed(0)
    plain = build().cuda()
    model = actcomp.to_compressed(build(), "mink0.9+int8", rest=rest, return_freed_memory=False).cuda()
    batch = {key: value.cuda() for key, value in batch.items()}

    def step(net):
        torch.manual_seed(1)
        loss(net, batch).backward()

    counts = []
    for net in (plain, model):
        step(net)
        counts.append(synchronizations(lambda net=net: step(net)))
    assert counts[1] == counts[0], f"plain's step synchronizes {counts[0]} times, the converted one's {counts[1]}"
