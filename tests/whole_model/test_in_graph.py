"""Compression inside torch.compile'd training (actcomp.compress_in_graph): the exact forms give
the compiled step's own gradients bit for bit, the lossy ones stay close, and the codecs really
run inside the compiled graphs."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import actcomp
from actcomp.whole_model import in_graph
from actcomp.whole_model.exact_codecs import ComparisonMask
from actcomp.whole_model.kept_forms import on_side


class ReluMLP(torch.nn.Module):
    """A ReLU (its output also a Linear input), dropout (a bool mask), GELU and LayerNorm."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.last = torch.nn.Linear(64, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)
        self.norm = torch.nn.LayerNorm(256)

    def forward(self, x):
        h = F.dropout(F.relu(self.first(x)), 0.1, training=self.training)
        return self.last(self.norm(F.gelu(self.second(h))))


def gradients(model, step, x, hooks=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout mask in every run
    if hooks is None:
        loss = step(x).square().mean()
    else:
        with actcomp.compress_in_graph(*hooks[:1], rest=hooks[1]):
            loss = step(x).square().mean()
    loss.backward()
    return [parameter.grad.clone() for parameter in model.parameters()]


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = ReluMLP().train()
    return model, torch.compile(model), torch.randn(512, 64)


def recorded_forms(monkeypatch) -> list:
    """The forms ``_pack`` gives each saved tensor from now on (a codec's, or "as is"), in a list
    filled as graphs are compiled; the hooks' cache is cleared so new graph modules call it."""
    forms = []
    pack = in_graph._pack

    def recording(saved, plan):
        packed = pack(saved, plan)
        forms.append(packed[0] if isinstance(packed, tuple) else "as is")
        return packed

    monkeypatch.setattr(in_graph, "_pack", recording)
    in_graph._hooks.cache_clear()  # new graph modules that call the patched function
    return forms


def test_exact_forms_give_the_compiled_steps_gradients_bit_for_bit(compiled, monkeypatch):
    model, step, x = compiled
    forms = recorded_forms(monkeypatch)

    # A graph served from a cache (the same source compiled by an earlier run) retraces no hook.
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        plain = gradients(model, step, x)
        exact = gradients(model, step, x, (None, "exact"))

    assert all(torch.equal(a, b) for a, b in zip(plain, exact, strict=True))
    # The dropout mask took the 1-bit form: the test saw a codec run.
    assert any(form.startswith("DropoutMask(") for form in forms), forms
    in_graph._hooks.cache_clear()


def test_int8_inside_the_graph_keeps_the_gradients_close(compiled):
    model, step, x = compiled

    plain = gradients(model, step, x)
    lossy = gradients(model, step, x, ("int8", "8bit"))

    assert not all(torch.equal(a, b) for a, b in zip(plain, lossy))  # something was compressed
    cosines = [F.cosine_similarity(a.flatten(), b.flatten(), 0) for a, b in zip(plain, lossy)]
    assert min(cosines) > 0.999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threshold", [0.0, -1.0, 6.0, 1000.0, 3e-39])
def test_a_comparison_mask_decodes_to_the_same_comparison(dtype, threshold):
    # 1000 in bf16: a stand-in of threshold - 1 would round onto the threshold itself.
    x = torch.cat([torch.tensor([-1.5, 0.0, 0.25, 3.0, float("nan"), -0.0, float("inf"), -float("inf"), threshold]),
                   torch.randn(1000) * 2000]).to(dtype)
    for name in ("le", "lt", "ge", "gt"):
        codec = ComparisonMask(name, threshold)
        packed = codec.compress(x)
        assert packed.nbytes == (x.numel() + 7) // 8
        decoded = codec.decompress(packed)
        assert decoded.dtype == dtype
        assert torch.equal(getattr(torch, name)(decoded, threshold), getattr(torch, name)(x, threshold)), name


def test_lossy_values_decode_on_the_side_of_their_comparison():
    """A ReLU output that also feeds a Linear: int8 values, the mask exact."""
    x = torch.tensor([0.0, 1e-9, 0.3, 2.0, 0.0, 5e-8])
    lossy = torch.tensor([0.0, 0.0, 0.31, 1.9, 1e-3, 0.0])  # what a quantizer might give back
    for name in ("le", "lt", "ge", "gt"):
        decoded = on_side(lossy, getattr(torch, name)(x, 0.0), name, 0.0)
        assert torch.equal(getattr(torch, name)(decoded, 0.0), getattr(torch, name)(x, 0.0)), name
        assert (decoded - lossy).abs().max() <= 1e-3, name


def test_a_spec_that_cannot_compile_is_refused():
    with pytest.raises(actcomp.ActcompError, match="cannot run inside a compiled graph"):
        actcomp.compress_in_graph("mink0.9:rice=1")


def test_the_same_arguments_give_the_same_hooks():
    """Dynamo guards on the hooks' identity: new ones each step would recompile each step."""
    assert in_graph._hooks(in_graph._plan("int8", "8bit")) is in_graph._hooks(in_graph._plan("int8", "8bit"))


def test_eager_code_under_the_hooks_keeps_its_tensors():
    """A loss computed outside the compiled model runs eagerly under the hooks: kept as is."""
    layer = torch.nn.Linear(128, 128)
    x = torch.randn(64, 128)
    with actcomp.compress_in_graph("int8", rest="8bit"):
        y = F.gelu(layer(x))
    y.sum().backward()
    reference = torch.autograd.grad(F.gelu(layer(x)).sum(), layer.weight)[0]
    assert torch.equal(layer.weight.grad, reference)


def test_a_relu_output_feeding_a_linear_keeps_its_mask_exact_under_int8():
    """The ReLU output is the second Linear's input (int8) and ReLU's mask (1 bit, exact): the
    first layer's gradients, which only the mask and the exact weights reach, equal plain's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    step, x = torch.compile(model), torch.randn(512, 64)

    plain = gradients(model, step, x)
    lossy = gradients(model, step, x, ("int8", "8bit"))

    first_weight, first_bias, second_weight = 0, 1, 2
    assert torch.equal(plain[first_weight], lossy[first_weight]) and torch.equal(plain[first_bias], lossy[first_bias])
    assert not torch.equal(plain[second_weight], lossy[second_weight])  # its input was compressed


def test_the_cache_hash_changes_with_any_codec_source(monkeypatch):
    # The hooks inline the codecs: a graph cached before a quantizer changed must not be
    # served after it, so the hash reads every module of the package, kernels included.
    read = []
    original = in_graph.pathlib.Path.read_bytes

    def recording(path):
        read.append(path.name)
        return original(path) + (b"# edited" if path.name == "quantize.py" else b"")

    in_graph._source_hash.cache_clear()
    before = in_graph._source_hash()
    monkeypatch.setattr(in_graph.pathlib.Path, "read_bytes", recording)
    in_graph._source_hash.cache_clear()
    try:
        after = in_graph._source_hash()
    finally:
        monkeypatch.undo()
        in_graph._source_hash.cache_clear()
    assert {"quantize.py", "positions.py", "chain.py", "in_graph.py"} <= set(read)
    assert after != before


def test_a_nan_in_a_linear_input_makes_the_compiled_weight_gradient_nan(compiled):
    # The compiled graphs keep eager mode's finite flag (a reduction, nothing read back): a tensor
    # holding NaN decodes to NaN, so loss scalers see it, and a finite step after it is finite.
    model, step, x = compiled
    broken = x.clone()
    broken[3, 10] = float("nan")

    for inputs, nan in ((broken, True), (x, False)):
        grads = gradients(model, step, inputs, ("int8", "8bit"))
        assert bool(grads[0].isnan().any()) == nan  # the first Linear's weight reads the input


def test_the_template_table_holds_one_entry_per_distinct_form(compiled):
    # A recompile of the same step names the same forms: the table does not grow per compile.
    model, _, x = compiled
    # No cache: a graph served from disk retraces no hooks, and the table would stay empty.
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        gradients(model, torch.compile(model), x, ("int8", "8bit"))
        before = dict(in_graph._TEMPLATES)
        torch._dynamo.reset()
        gradients(model, torch.compile(model), x, ("int8", "8bit"))

    assert before and in_graph._TEMPLATES.keys() == before.keys()


def _node(graph, target, args, name=None):
    return graph.create_node("call_function", target, args, name=name)


def test_packing_moves_next_to_the_tensor_it_codes():
    # AOTAutograd inlines each pack hook at the end of the forward graph; Inductor's reordering
    # moves generated loops up but not an extern call, so the pass places them itself.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    saved = _node(graph, torch.ops.aten.relu.default, (x,))
    scaled = _node(graph, torch.ops.aten.mul.Tensor, (saved, 2.0))
    later = _node(graph, torch.ops.aten.sin.default, (scaled,))
    buffer = _node(graph, torch.ops.aten.empty.memory_format, ([0],))  # made from nothing
    magnitude = _node(graph, torch.ops.aten.abs.default, (saved,))
    coded = _node(graph, torch.ops.aten.add.Tensor, (magnitude, buffer))
    packed = _node(graph, torch.ops.aten.neg.default, (coded,), name="relu_hook_1")
    unread = _node(graph, torch.ops.aten.cos.default, (coded,))  # read by nobody: dropped
    output = graph.output((later, packed))

    in_graph._hoist_packing(graph)
    graph.lint()

    assert unread not in graph.nodes
    assert list(graph.nodes) == [x, saved, magnitude, buffer, coded, packed, scaled, later, output]


def test_a_graph_without_inlined_hooks_keeps_its_order():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first = _node(graph, torch.ops.aten.relu.default, (x,))
    graph.output((_node(graph, torch.ops.aten.sin.default, (x,)), _node(graph, torch.ops.aten.abs.default, (first,))))
    before = [node.name for node in graph.nodes]

    in_graph._hoist_packing(graph)

    assert [node.name for node in graph.nodes] == before


def test_decoding_that_reads_a_constant_moves_to_its_first_use():
    # A codec's decode op reads its packed inputs and an empty buffer made in the graph; it must
    # still move down to the backward's first use of the decoded tensor.
    graph = torch.fx.Graph()
    gradient, packed = graph.placeholder("tangents_1"), graph.placeholder("relu_hook_1")
    buffer = _node(graph, torch.ops.aten.empty.memory_format, ([0],))
    decoded = _node(graph, torch.ops.aten.add.Tensor, (packed, buffer))
    step = _node(graph, torch.ops.aten.mul.Tensor, (gradient, 2.0))
    product = _node(graph, torch.ops.aten.mul.Tensor, (step, decoded))
    output = graph.output((product,))

    in_graph._sink_decoding(graph)
    graph.lint()

    assert list(graph.nodes) == [gradient, packed, step, buffer, decoded, product, output]


@pytest.mark.parametrize("user_reuse", [True, False])
def test_the_backward_graph_frees_each_buffer_at_its_last_use(monkeypatch, user_reuse):
    # Inductor's buffer reuse kept MLP-sized buffers alive from block to block of a compiled
    # ViT-S backward (its peak estimate misreads the fused decodes): the backward graph is
    # written without it, the forward graph as the user set it, and the setting is the user's
    # again after the block.
    seen = []
    monkeypatch.setattr(in_graph, "set_buffer_reuse",
                        lambda value: seen.append(value) or torch._inductor.config.__setattr__("allow_buffer_reuse", value))
    torch.manual_seed(0)
    model = NormGeluMLP().train()
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False, allow_buffer_reuse=user_reuse):
        torch._dynamo.reset()
        gradients(model, torch.compile(model), torch.randn(512, 64), ("int8", "8bit"))
        assert torch._inductor.config.allow_buffer_reuse is user_reuse
    assert seen == [user_reuse, False]  # the forward graph, then the backward graph


def test_the_quantizers_pack_inside_the_forward_not_at_its_end(monkeypatch):
    # The int8 codec goes into the graph as one extern call per saved tensor; each must run as
    # soon as its tensor is made, before the layers after it, or the tensor lives to the end.
    torch.manual_seed(0)
    model = ReluMLP().train()
    graphs = []
    hoist = in_graph._hoist_packing
    monkeypatch.setattr(in_graph, "_hoist_packing", lambda graph: hoist(graph) or graphs.append(list(graph.nodes)))
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        gradients(model, torch.compile(model), torch.randn(512, 64), ("int8", "8bit"))

    forward = [nodes for nodes in graphs if any("_hook_" in node.name for node in nodes)]
    assert len(forward) == 1
    targets = [str(node.target) for node in forward[0]]
    encodes = [index for index, target in enumerate(targets) if "group_quant_encode" in target]
    matmuls = [index for index, target in enumerate(targets) if "addmm" in target]
    assert encodes and matmuls
    assert min(encodes) < max(matmuls)  # the second Linear's input is packed before the last Linear runs


def _mask(shape=(4, 2, 64, 64)):
    return torch.where(torch.rand(shape) > 0.3, 0.0, -float("inf"))


def _padded_log_sum_exp():
    return torch.cat([torch.randn(64, 4, 12), torch.full((64, 4, 20), float("inf"))], dim=-1)


@pytest.mark.parametrize("op, position, make", [
    # The H200 zoo run found eager mode's int8 turning SDPA's -inf mask to NaN gradients.
    (torch.ops.aten._scaled_dot_product_efficient_attention_backward.default, 4, _mask),  # CUDA's memory-efficient
    (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "attn_mask", _mask),
    # Memory-efficient attention pads its log-sum-exp with +inf past the sequence; a finite-range
    # code decoded it to NaN (the H100 zoo run of stop 50).
    (torch.ops.aten._scaled_dot_product_efficient_attention_backward.default, 6, _padded_log_sum_exp),
    (torch.ops.aten._scaled_dot_product_flash_attention_backward.default, 5, _padded_log_sum_exp),  # CUDA's flash
])
def test_a_mask_or_log_sum_exp_the_attention_backward_reads_is_kept_as_it_is(monkeypatch, op, position, make):
    # The compiled hooks read the backward graph, where the tensor is the attention backward's
    # argument (eager mode's twin: test_codec_choice).
    from torch import fx

    plan = in_graph._plan("int8", "8bit")
    in_graph._hooks(plan)
    saved_tensor = make()

    def context(read_by):
        graph = fx.Graph()
        saved = graph.placeholder("saved")
        graph.output(read_by(graph, saved))
        return {"_node": saved, "_bw_graph": graph}

    def attention(graph, saved):
        args = [graph.placeholder(f"arg{i}") for i in range(12)]
        kwargs = {}
        if isinstance(position, int):
            args[position] = saved
        else:
            kwargs[position] = saved
        return graph.call_function(op, tuple(args), kwargs)

    monkeypatch.setattr(in_graph, "aot_saved_tensor_hook_context", lambda: context(attention))
    assert in_graph._pack(saved_tensor, plan.cache_hash) is saved_tensor
    # The same tensor read by anything else is packed as before.
    monkeypatch.setattr(in_graph, "aot_saved_tensor_hook_context",
                        lambda: context(lambda graph, saved: graph.call_function(torch.ops.aten.mul.Tensor, (saved, saved))))
    assert in_graph._pack(saved_tensor.clamp(-1.0, 1.0), plan.cache_hash)[0].startswith("Pipeline('int8')")


class Attention(torch.nn.Module):
    """One attention block (LayerNorm, qkv, SDPA, projection) on rows long enough that the
    norm's statistics (64 x 128 of them) pass the size floor."""

    def __init__(self, width=32, heads=2):
        super().__init__()
        self.heads, self.norm = heads, torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width)
        return x + self.proj(attended)


def test_the_compiled_engine_reads_the_policy_as_eager_mode_does(monkeypatch):
    """One policy reading: attention's query and key take bf16 (a float format, as eager mode
    gives them: int8's range-wide steps move a sink token's logits), its value and output the
    kind's int8, and a norm's statistics stay as they are."""
    forms = []
    pack = in_graph._pack

    def recording(saved, plan):
        packed = pack(saved, plan)
        forms.append((tuple(saved.shape), packed[0] if isinstance(packed, tuple) else "as is"))
        return packed

    monkeypatch.setattr(in_graph, "_pack", recording)
    in_graph._hooks.cache_clear()
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(64, 128, 32)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        step = torch.compile(model)
        plain = gradients(model, step, x)
        lossy = gradients(model, step, x, ("int8", "8bit"))
    in_graph._hooks.cache_clear()

    head = (64, 2, 128, 16)
    coded = {form.split(" PackedLayout")[0] for shape, form in forms if shape == head}
    assert "Pipeline('bf16')" in coded and "Pipeline('int8')" in coded, coded  # q, k; v and the output
    assert all(form == "as is" for shape, form in forms if shape == (64, 128, 1)), forms  # mean, rstd
    cosines = [F.cosine_similarity(a.flatten(), b.flatten(), 0) for a, b in zip(plain, lossy)]
    assert min(cosines) > 0.999


def test_dynamic_shapes_compile_once_and_keep_the_exact_gradients():
    """Under dynamic=True a mask's element count and a tensor's strides are expressions of the
    forward's symbols; the forms carry the shape across to the unpack hook instead (a graph
    over several batch sizes failed to compile before)."""
    torch.manual_seed(0)
    model = ReluMLP().train()
    step = torch.compile(model, dynamic=True)
    for rows in (512, 640, 768):
        x = torch.randn(rows, 64)
        plain = gradients(model, step, x)
        exact = gradients(model, step, x, (None, "exact"))
        lossy = gradients(model, step, x, ("int8", "8bit"))
        assert all(torch.equal(a, b) for a, b in zip(plain, exact, strict=True)), rows
        cosines = [F.cosine_similarity(a.flatten(), b.flatten(), 0) for a, b in zip(plain, lossy)]
        assert min(cosines) > 0.999, rows


class NormGeluMLP(torch.nn.Module):
    """A LayerNorm and a GELU whose outputs only the next Linear reads in backward."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.norm(x))))


def test_a_lossy_plan_rebuilds_the_norms_and_gelus_outputs_instead_of_keeping_them(monkeypatch):
    """Under a lossy plan the partitioner may recompute a value only a matrix product reads in
    backward (the norm's output, GELU's output) from what the backward keeps anyway; under an
    exact plan it keeps them, as the compiled step without hooks does."""
    saved = []
    kept_form = in_graph._kept_form

    def recording(plan, tensor, users, name):
        saved.append((plan.lossy, tuple(tensor.shape), all(user.target in in_graph._MATMULS for user in users)))
        return kept_form(plan, tensor, users, name)

    monkeypatch.setattr(in_graph, "_kept_form", recording)
    in_graph._hooks.cache_clear()
    torch.manual_seed(0)
    model, x = NormGeluMLP(), torch.randn(512, 64)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        step = torch.compile(model)
        plain = gradients(model, step, x)
        exact = gradients(model, step, x, (None, "exact"))
        torch._dynamo.reset()
        lossy = gradients(model, step, x, ("int8", "8bit"))
    in_graph._hooks.cache_clear()

    only_a_matmul_reads = {(lossy_plan, shape) for lossy_plan, shape, matmul_only in saved if matmul_only}
    assert {(False, (512, 64)), (False, (512, 256))} <= only_a_matmul_reads  # the norm's, GELU's output
    assert not {shape for lossy_plan, shape in only_a_matmul_reads if lossy_plan}, saved
    assert {(True, (512, 256))} <= {(lossy_plan, shape) for lossy_plan, shape, _ in saved}  # GELU's input
    assert all(torch.equal(a, b) for a, b in zip(plain, exact, strict=True))
    cosines = [F.cosine_similarity(a.flatten(), b.flatten(), 0) for a, b in zip(plain, lossy)]
    assert min(cosines) > 0.999, cosines


def test_the_joint_pass_keeps_every_compared_value_after_the_users_own_pass():
    from torch import fx

    from actcomp.whole_model.recomputation import KeepComparedValues

    graph = fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.ops.aten.relu.default, (x,))
    graph.call_function(torch.ops.aten.le.Scalar, (relu, 0))
    gelu = graph.call_function(torch.ops.aten.gelu.default, (x,))
    graph.call_function(torch.ops.aten.mm.default, (gelu, gelu))
    seen = []
    keep = KeepComparedValues()
    keep.previous = seen.append
    keep(graph)
    assert seen == [graph]
    assert [node.name for node in graph.nodes if "recompute" in node.meta] == [relu.name]


def test_a_compiled_converted_sequential_compresses_inside_the_graph(monkeypatch):
    # nn.Sequential's forward is torch's own code, where Dynamo starts no graph: called from the
    # model's eager entry frame it ran eagerly, every layer with it, and the hooks kept what
    # eager code saved as it was (the rest uncompressed, the step uncompiled).
    from actcomp.layers import compressed_layer

    eager_layers, kept = [], []
    eager_forward, kept_form = compressed_layer._eager_forward, in_graph._kept_form
    monkeypatch.setattr(compressed_layer, "_eager_forward",
                        lambda module, *args: eager_layers.append(module) or eager_forward(module, *args))
    monkeypatch.setattr(in_graph, "_kept_form",
                        lambda plan, tensor, users, name: kept.append(name) or kept_form(plan, tensor, users, name))
    monkeypatch.setattr(in_graph, "_hooks", functools.cache(in_graph._hooks.__wrapped__))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 8))
    converted = actcomp.to_compressed(copy.deepcopy(plain), "int8", rest="8bit", return_freed_memory=False)
    x = torch.randn(512, 64)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        reference = gradients(plain, torch.compile(plain), x)
        lossy = gradients(converted, torch.compile(converted), x)

    assert not eager_layers and kept
    cosines = [F.cosine_similarity(a.flatten(), b.flatten(), 0) for a, b in zip(reference, lossy)]
    assert min(cosines) > 0.999, cosines


def test_more_converted_sequentials_than_dynamos_recompile_limit_all_compile(monkeypatch):
    # The frame that lets Dynamo start a graph for nn.Sequential's forward is a copy per model:
    # with one for all, the ninth model a process compiled ran eagerly (Dynamo's limit: 8 graphs
    # a code object).
    from actcomp.layers import compressed_layer

    eager_layers = []
    eager_forward = compressed_layer._eager_forward
    monkeypatch.setattr(compressed_layer, "_eager_forward",
                        lambda module, *args: eager_layers.append(module) or eager_forward(module, *args))
    torch._dynamo.reset()
    for width in range(16, 16 + 10):
        net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
        compiled = torch.compile(actcomp.to_compressed(net, "int8", rest="8bit", return_freed_memory=False))
        compiled(torch.randn(16, 8)).square().mean().backward()
    assert not eager_layers


def test_a_compiled_converted_model_keeps_no_codes_of_what_the_backward_rebuilds(monkeypatch):
    """torch.compile(to_compressed(model, "int8", rest="8bit")): the converted Linear layers
    (one pipeline) leave their inputs to the hooks, which code them with that pipeline, and the
    partitioner rebuilds the norm's and GELU's outputs in backward, as under compress_in_graph
    on the plain model: no layer's own codes are kept."""
    saved, linears = [], set()
    kept_form = in_graph._kept_form

    def recording(plan, tensor, users, name):
        kept = kept_form(plan, tensor, users, name)
        saved.append((tuple(tensor.shape), tensor.dtype, kept is not None))
        linears.add(plan.linear and plan.linear.spec)
        return kept

    monkeypatch.setattr(in_graph, "_kept_form", recording)
    monkeypatch.setattr(in_graph, "_hooks", functools.cache(in_graph._hooks.__wrapped__))
    torch.manual_seed(0)
    plain, x = NormGeluMLP(), torch.randn(512, 64)
    converted = actcomp.to_compressed(copy.deepcopy(plain), "int8", rest="8bit", return_freed_memory=False)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        reference = gradients(plain, torch.compile(plain), x)
        lossy = gradients(converted, torch.compile(converted), x)

    assert saved and all(kept for _, _, kept in saved), saved
    assert linears == {"int8"}  # the hooks' Linear rule has the layers' pipeline
    assert not [entry for entry in saved if entry[1] == torch.uint8], saved  # no layer's own codes
    # GELU's input alone: the norm's input is the step's, which torch keeps without the hooks.
    assert {shape for shape, _, _ in saved} == {(512, 256)}, saved
    cosines = [F.cosine_similarity(a.flatten(), b.flatten(), 0) for a, b in zip(reference, lossy)]
    assert min(cosines) > 0.999, cosines


def test_the_linear_layers_shared_pipeline_is_found_once_and_forgotten_when_converting_again():
    from actcomp.whole_model.compressed_model import _shared_linear_spec

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    actcomp.to_compressed(model, "int8", rest="8bit", return_freed_memory=False)
    assert _shared_linear_spec(model) == "int8"
    actcomp.to_compressed(actcomp.from_compressed(model), "fp8", rest="8bit", return_freed_memory=False)
    assert _shared_linear_spec(model) == "fp8"
    model[0].actcomp_pipeline = actcomp.core.pipeline.as_pipeline("int8", "test")  # two pipelines: none shared
    actcomp.to_compressed(model, "fp8", rest="8bit", filter_fn=lambda module, name: False, return_freed_memory=False)
    assert _shared_linear_spec(model) is None


def test_an_average_poolings_input_keeps_its_shape_alone_and_the_gradients_bit_for_bit(monkeypatch):
    # avg_pool2d_backward reads its input for the shape: kept as shape-only, as eager mode keeps
    # it (stop 64), not in the activation kind's code.
    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Linear(16, 4)

        def forward(self, x):
            y = torch.tanh(self.conv(x)) * 2
            y = F.avg_pool2d(y, 3, 1, 1, count_include_pad=False) - y
            return self.head(F.adaptive_avg_pool2d(F.avg_pool2d(y, 2), 1).flatten(1))

    torch.manual_seed(0)
    model = Pooled()
    step, x = torch.compile(model), torch.randn(8, 3, 32, 32)
    forms = recorded_forms(monkeypatch)
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        plain = gradients(model, step, x)
        for rest in ("exact", "8bit"):
            forms.clear()
            kept = gradients(model, step, x, (None, rest))
            assert sum(str(form).startswith("ShapeOnly(") for form in forms) >= 2, forms  # both pools
            if rest == "exact":
                assert all(torch.equal(a, b) for a, b in zip(plain, kept, strict=True))
    in_graph._hooks.cache_clear()
