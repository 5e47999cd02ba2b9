"""A Hugging Face causal LM's labels= loss routed through the chunked linear cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import actcomp  # noqa: E402
from actcomp.losses.causal_lm import NOT_COMPUTED, _forward_goes_straight, is_routed, route_causal_lm_loss  # noqa: E402


def tiny_llama(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def batch(seed=1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 300, (2, 24), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100  # a prompt that does not count
    return input_ids, labels


def grads(model):
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


@pytest.mark.parametrize("num_items_in_batch", [None, 40])
def test_the_routed_loss_and_gradients_are_plains(num_items_in_batch):
    input_ids, labels = batch()
    plain, routed = tiny_llama(), tiny_llama()
    assert route_causal_lm_loss(routed) and is_routed(routed)
    extra = {} if num_items_in_batch is None else {"num_items_in_batch": torch.tensor(num_items_in_batch)}
    results = []
    for model in (plain, routed):
        output = model(input_ids=input_ids, labels=labels, **extra)
        output.loss.backward()
        results.append((output, grads(model)))
    (plain_output, plain_grads), (routed_output, routed_grads) = results
    assert plain_output.logits is not None and routed_output.logits is NOT_COMPUTED  # never made
    with pytest.raises(actcomp.ActcompError, match="the logits were not computed.*loss='plain'"):
        routed_output.logits.argmax(-1)
    torch.testing.assert_close(routed_output.loss, plain_output.loss, rtol=1e-6, atol=1e-6)
    assert routed_grads.keys() == plain_grads.keys()
    for name, expected in plain_grads.items():
        torch.testing.assert_close(routed_grads[name], expected, rtol=1e-4, atol=1e-6, msg=name)


def test_eval_no_grad_and_calls_without_labels_run_the_models_own_forward():
    input_ids, labels = batch()
    model = tiny_llama()
    route_causal_lm_loss(model)
    plain = tiny_llama()
    assert torch.equal(model(input_ids=input_ids).logits, plain(input_ids=input_ids).logits)
    with torch.no_grad():
        output = model(input_ids=input_ids, labels=labels)
        assert torch.equal(output.logits, plain(input_ids=input_ids, labels=labels).logits)
    model.eval()
    assert model(input_ids=input_ids, labels=labels).logits is not None


def test_an_error_inside_the_forward_leaves_the_model_as_it_was():
    model = tiny_llama()
    route_causal_lm_loss(model)
    with pytest.raises(Exception):  # noqa: B017 - whatever the model raises
        model(input_ids=torch.tensor([[0, 1, 999]]), labels=torch.tensor([[0, 1, 2]]))  # 999: past the vocabulary
    assert "forward" not in vars(model.lm_head)
    input_ids, labels = batch()
    assert model(input_ids=input_ids).logits.shape == (2, 24, 300)


def test_a_forward_the_head_held_of_its_own_is_put_back():
    # accelerate's device hooks wrap a module's forward as an instance attribute.
    model = tiny_llama()
    route_causal_lm_loss(model)
    calls = []
    original = model.lm_head.forward
    model.lm_head.forward = lambda hidden: calls.append(1) or original(hidden)
    wrapped = model.lm_head.forward
    input_ids, labels = batch()
    model(input_ids=input_ids, labels=labels).loss.backward()
    assert model.lm_head.forward is wrapped and calls == []  # passed by while routed
    assert model(input_ids=input_ids).logits.shape == (2, 24, 300) and calls == [1]


def test_to_compressed_routes_where_the_conversion_is_lossy_and_from_compressed_undoes_it():
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = tiny_llama(torch.float32)
    actcomp.to_compressed(model, "int8", rest="8bit")
    assert is_routed(model)
    input_ids, labels = batch()
    model(input_ids=input_ids, labels=labels).loss.backward()
    # An exact conversion stays bit for bit: the loss is the model's own.
    actcomp.to_compressed(model, "mink0", rest="exact")
    assert not is_routed(model) and model.loss_function is ForCausalLMLoss
    actcomp.to_compressed(model, "mink0")
    assert not is_routed(model)
    # Lossy layers make the conversion lossy, whatever rest is.
    actcomp.to_compressed(model, "int8", rest="exact")
    assert is_routed(model)
    actcomp.to_compressed(model, "mink0", rest="exact", loss="chunked")
    assert is_routed(model)
    actcomp.from_compressed(model)
    assert not is_routed(model) and model.loss_function is ForCausalLMLoss
    actcomp.to_compressed(model, "int8", loss="plain")
    assert not is_routed(model)
    with pytest.raises(actcomp.ActcompError, match="loss='fused' is not one of 'auto', 'chunked', 'plain'"):
        actcomp.to_compressed(model, "int8", loss="fused")


def test_the_routed_model_keeps_a_small_part_of_the_logits_bytes():
    # Vocabulary 300 against hidden 32: the float32 logits' log-softmax (2 x 24 x 300) was most
    # of what the head kept.
    input_ids, labels = batch()
    kept = []
    for routed in (False, True):
        model = tiny_llama()
        if routed:
            route_causal_lm_loss(model)
        kept.append(actcomp.memory_report(model, input_ids=input_ids, labels=labels).total_bytes)
    assert kept[1] < kept[0] - 2 * 24 * 300 * 4 * 0.9, kept


@pytest.mark.parametrize(("spec", "kept_as"), [("mink0.9+int8", "int8"), ("bf16", "bf16"), ("int4", "int8"),
                                               ("mink0", "as is")])
def test_the_loss_keeps_the_hidden_states_as_lm_heads_spec_quantizes_them(spec, kept_as):
    # lm_head's input, which the routed loss keeps in its place: the head's quantizer alone (min-k
    # would drop values the input's gradient needs), 8 bits at least; a lossless spec keeps it.
    input_ids, labels = batch()
    model = actcomp.to_compressed(tiny_llama(), {"lm_head": spec, "*": None}, loss="chunked")
    report = actcomp.memory_report(model, input_ids=input_ids, labels=labels)
    (row,) = [row for row in report.kinds if row.kind == "other"]
    hidden_bytes = 2 * 24 * 32 * 4
    assert {"as is": row.kept_bytes >= hidden_bytes, "bf16": row.kept_bytes < hidden_bytes * 0.6,
            "int8": row.kept_bytes < hidden_bytes * 0.4}[kept_as], row
    plain = tiny_llama()
    plain(input_ids=input_ids, labels=labels).loss.backward()
    model(input_ids=input_ids, labels=labels).loss.backward()
    got, want = grads(model), grads(plain)
    cosine = F.cosine_similarity(torch.cat([got[n].flatten() for n in want]), torch.cat([want[n].flatten() for n in want]), 0)
    assert cosine > 0.9999


def test_forwards_that_change_the_logits_first_are_not_routed():
    # Gemma-2 softcaps the logits between lm_head and the loss: identity there would be wrong.
    assert not _forward_goes_straight(transformers.Gemma2ForCausalLM)
    assert _forward_goes_straight(transformers.LlamaForCausalLM)
    assert _forward_goes_straight(transformers.Qwen2ForCausalLM)
    assert _forward_goes_straight(transformers.MistralForCausalLM)
    custom = tiny_llama()
    custom.loss_function = lambda logits, labels, vocab_size, **kwargs: F.cross_entropy(
        logits.view(-1, vocab_size), labels.view(-1))
    assert not route_causal_lm_loss(custom)  # a loss of the user's own stays theirs
    with pytest.warns(UserWarning, match="the loss of this LlamaForCausalLM stays its own"):
        actcomp.to_compressed(custom, "int8", loss="chunked")


def test_routing_the_loss_alone_is_a_change():
    # No layer selected, but the loss routed: no "left unchanged" warning.
    import warnings

    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actcomp.to_compressed(model, "int8", filter_fn=lambda module, name: False, loss="chunked")
    assert is_routed(model)


def test_a_compiled_model_computes_the_routed_loss():
    # The hooks and the swapped lm_head forward under torch.compile: the same loss, no logits,
    # and label-less calls still give them.
    input_ids, labels = batch()
    plain, routed = tiny_llama(), tiny_llama()
    route_causal_lm_loss(routed)
    compiled = torch.compile(routed)
    for _ in range(2):
        output = compiled(input_ids=input_ids, labels=labels)
        output.loss.backward()
        assert output.logits is NOT_COMPUTED
    torch.testing.assert_close(output.loss, plain(input_ids=input_ids, labels=labels).loss, rtol=1e-6, atol=1e-6)
    assert compiled(input_ids=input_ids).logits.shape == (2, 24, 300)


def test_a_routed_model_is_freed_when_dropped_and_its_copies_route_their_own_loss():
    """The routed loss holds its model weakly: a strong reference made every routed model a
    reference cycle, freed only by the garbage collector (plan_budget's copies piled up). A deep
    copy or a pickle routes the copy's own loss, with the original's gradients."""
    import copy
    import gc
    import io
    import pickle
    import weakref

    input_ids, labels = batch()
    gc.collect()
    gc.disable()
    try:
        model = actcomp.to_compressed(tiny_llama(), "int8", rest="8bit")
        model(input_ids=input_ids, labels=labels).loss.backward()
        alive, stale = weakref.ref(model), model.loss_function
        del model
        assert alive() is None  # freed by its reference count, with the collector off
    finally:
        gc.enable()
    logits = torch.randn(2, 24, 300)  # a loss function kept past its model's life computes the plain loss
    assert torch.equal(stale(logits, labels, 300), stale.plain_loss(logits, labels, 300))
    assert copy.deepcopy(stale) is stale.plain_loss  # and copies or pickles as it
    assert pickle.loads(pickle.dumps(stale)) is stale.plain_loss
    model = actcomp.to_compressed(tiny_llama(), "int8", rest="8bit")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    results = []
    for each in [model, *copies]:
        output = each(input_ids=input_ids, labels=labels)
        assert output.logits is NOT_COMPUTED  # each copy's own forward routed its loss
        output.loss.backward()
        results.append(grads(each))
    for got in results[1:]:
        assert got.keys() == results[0].keys()
        for name, expected in results[0].items():
            assert torch.equal(got[name], expected), name
