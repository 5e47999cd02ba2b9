"""Small models and helpers shared by the training-integration tests.

The tests build one of these (or a timm model), convert a deep copy, and compare the two.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import socket
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

import actcomp


class Conv1D(nn.Module):
    """Mimics ``transformers.pytorch_utils.Conv1D``: weight shaped (in, out), attribute ``nf``.

    The class name matters: actcomp detects it by name, without importing transformers.
    """

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Block(nn.Module):
    """Attention + MLP with GPT-2's Conv1D projections (c_attn, c_proj, c_fc, mlp c_proj)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = Conv1D(3 * dim, dim)
        self.c_proj = Conv1D(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = Conv1D(4 * dim, dim)
        self.mlp_proj = Conv1D(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(attn.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT2(nn.Module):
    """A GPT-2-shaped language model: embeddings, Conv1D blocks, a tied-free Linear head."""

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, layers: int = 2, context: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.ModuleList(GPT2Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def conv1d_net(classes: int = 3) -> nn.Module:
    """Conv1d layers with stride, dilation, groups and a non-zero padding mode."""
    return nn.Sequential(
        nn.Conv1d(2, 8, 5, padding=2),
        nn.ReLU(),
        nn.Conv1d(8, 8, 3, stride=2, padding=1, groups=4, padding_mode="reflect"),
        nn.ReLU(),
        nn.Conv1d(8, 16, 3, dilation=2, padding="same"),
        nn.ReLU(),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


def conv3d_net(classes: int = 3) -> nn.Module:
    """Conv3d layers with stride, groups and circular padding."""
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv3d(4, 8, 3, stride=2, padding=1, groups=2, padding_mode="circular"),
        nn.ReLU(),
        nn.Conv3d(8, 8, (1, 3, 3), padding="same"),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(8, classes),
    )


def small_cnn(classes: int = 10, channels: int = 8) -> nn.Module:
    """A small 2-d CNN for 8x8 single-channel images (scikit-learn digits)."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, classes),
    )


# (id, model builder, batch builder): models that run a step in well under a second, with a
# batch that splits between two processes.
SMALL_MODELS = [
    ("small_cnn", functools.partial(small_cnn, classes=4, channels=4),
     lambda: (torch.randn(8, 1, 8, 8), torch.tensor([0, 1, 2, 3, 3, 2, 1, 0]))),
    ("tiny_gpt2", TinyGPT2, lambda: (torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12)))),
]


def reset_parameters(model: nn.Module) -> None:
    """Initialise a model materialised from the meta device as its constructors would have,
    drawing random numbers in the same order. GPT-2's Conv1D has no ``reset_parameters``
    (transformers initialises it from the model); it gets what its ``__init__`` does."""
    for module in model.modules():
        if isinstance(module, Conv1D):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()


def loss_and_grads(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
    """Cross-entropy loss of one training forward/backward and every parameter's gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def free_port() -> int:
    """A free local TCP port for a process group to meet on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, port: int):
    """This process as ``rank`` of a CPU (gloo) process group, single-threaded, for the block.
    A spawned worker's block is all its work: when it ends without an error the process exits
    there (``os._exit(0)``), skipping the interpreter's teardown, where gloo's threads now and
    then abort the process ("terminate called without an active exception": a DDP test in
    stop 45's CI, an FSDP2 one in stop 46's, each passing when rerun)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


DDP_RESTS = (None, "exact")


def ddp_worker(rank: int, world_size: int, port: int, spec: str, inputs, targets, state, out_dir: str):
    """One DDP rank: for each ``rest`` of :data:`DDP_RESTS` (None: layers only, else whole-model
    mode too), a train step on its half of the batch; saves the averaged gradients, the converted
    layers and the codecs whole-model mode used, by ``rest``."""
    with gloo_group(rank, world_size, port):
        results = {}
        for rest in DDP_RESTS:
            model = small_cnn(classes=4, channels=4)
            model.load_state_dict(state)
            actcomp.to_compressed(model, spec, first_layer=None, rest=rest)
            ddp = DistributedDataParallel(model)
            shard = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
            with saved_codecs() as codecs:
                loss = F.cross_entropy(ddp(shard[0]), shard[1])
            loss.backward()
            grads = {name: p.grad for name, p in model.named_parameters()}
            results[rest] = {"grads": grads, "layers": sorted(actcomp.compressed_layers(model)), "codecs": codecs}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@contextlib.contextmanager
def saved_codecs():
    """The codecs whole-model mode's hooks kept saved tensors with while the block ran."""
    from actcomp.graph.saved_tensors import listening

    codecs: set[str] = set()
    with listening(lambda event: codecs.add(event.codec) if event.codec else None):
        yield codecs


def record_unpacks(form: type, monkeypatch) -> list[tuple[object, torch.Tensor]]:
    """A list that fills with ``(holder, value)`` each time a whole-model kept ``form`` (a class
    of :mod:`actcomp.whole_model.kept_forms`) is unpacked in backward, the value as returned."""
    unpacked, original = [], form.unpack

    def unpack(self):
        unpacked.append((self, original(self)))
        return unpacked[-1][1]

    monkeypatch.setattr(form, "unpack", unpack)
    return unpacked


@contextlib.contextmanager
def sdpa_codecs(monkeypatch):
    """What each tensor SDPA saves gets while the block runs, in saving order: a codec's spec,
    ``"recomputed"`` (the output and log-sum-exp of a call run again in backward), or None (kept
    as it is); a log-sum-exp kept as it is (a statistic) is left out."""
    from actcomp.graph.saved_tensors import innermost_kind
    from actcomp.whole_model import session
    from actcomp.whole_model.attention_recompute import RecomputedAttention
    from actcomp.whole_model.kept_forms import Compressed

    choices: list[str | None] = []
    original = session._Session.choose

    def recording(self, tensor):
        kind, kept = original(self, tensor)
        scope = innermost_kind()
        if scope is not None and scope.op == "sdpa":
            if isinstance(kept, RecomputedAttention):
                choices.append("recomputed")
            elif tensor.numel() * 4 >= scope.reference:
                choices.append(kept.packed.layout.spec if isinstance(kept, Compressed) else None)
        return kind, kept

    with monkeypatch.context() as patch:
        patch.setattr(session._Session, "choose", recording)
        yield choices


def fully_shard_blocks(model: nn.Module, mesh) -> nn.Module:
    """FSDP2 bottom-up: every Linear/Conv/Conv1D layer (so they become ``FSDP<Class>`` too),
    then TinyGPT2's blocks (holding the LayerNorms), then the root (embeddings)."""
    from torch.distributed.fsdp import fully_shard

    layers = [m for m in model.modules() if actcomp.layers.compressed_layer.is_supported(m)]
    for block in [*layers, *getattr(model, "h", [])]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def output_nodes(model: nn.Module) -> dict[str, str]:
    """Filled by each forward: the autograd node that made each converted layer's output. A
    lossless pipeline's gradients cannot tell whether the compressing Function ran; this can."""
    nodes: dict[str, str] = {}
    modules = dict(model.named_modules())
    for name in actcomp.compressed_layers(model):
        modules[name].register_forward_hook(
            lambda module, args, out, name=name: nodes.__setitem__(name, type(out.grad_fn).__name__)
        )
    return nodes


# Unconverted, then converted with mink0 before or after sharding, then the same in whole-model
# mode (rest="exact").
FSDP_ORDERS = ("plain", "convert_then_shard", "shard_then_convert", "whole_then_shard", "shard_then_whole")
FSDP_REST = {"whole_then_shard": "exact", "shard_then_whole": "exact"}


def fsdp_worker(rank: int, world_size: int, port: int, build, inputs, targets, state, out_dir: str):
    """One FSDP2 rank: for each of :data:`FSDP_ORDERS`, a train step on its half of the batch
    with ``mink0`` (or no) conversion; saves the full gradients, :func:`output_nodes` and the
    codecs whole-model mode used."""
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_group(rank, world_size, port):
        mesh = init_device_mesh("cpu", (world_size,))
        shard = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
        results = {}
        for order in FSDP_ORDERS:
            model = build()
            model.load_state_dict(state)
            rest = FSDP_REST.get(order)
            if order.endswith("_then_shard"):
                actcomp.to_compressed(model, "mink0", first_layer=None, rest=rest)
            fully_shard_blocks(model, mesh)
            if order.startswith("shard_then_"):
                actcomp.to_compressed(model, "mink0", first_layer=None, rest=rest)
            nodes = output_nodes(model)
            with saved_codecs() as codecs:
                _, grads = loss_and_grads(model, *shard)
            results[order] = {"grads": {name: grad.full_tensor() for name, grad in grads.items()}, "nodes": nodes,
                              "codecs": codecs}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def fsdp_memory_worker(rank: int, world_size: int, port: int, cases, out_dir: str):
    """One FSDP2 rank: the :func:`actcomp.memory_report` of each ``(build, state, spec, inputs)``
    case, converted with ``spec`` (None: not converted), sharded, on its part of ``inputs``, and
    the types of the parameters the model registers after the report."""
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_group(rank, world_size, port):
        mesh = init_device_mesh("cpu", (world_size,))
        results = []
        for build, state, spec, inputs in cases:
            model = build()
            model.load_state_dict(state)
            if spec is not None:
                actcomp.to_compressed(model, spec)
            fully_shard_blocks(model, mesh)
            report = actcomp.memory_report(model, inputs.chunk(world_size)[rank])
            results.append((report, {type(p).__name__ for p in model.parameters()}))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def names_seen_by_scopes(model: nn.Module, *inputs) -> list[str]:
    """The names of the torch functions whole-model mode's scope-tracking mode sees in a
    training step of ``model`` (a forward, a sum, its backward)."""
    from actcomp.graph import saved_tensors

    seen = []
    original = saved_tensors._FunctionScopes.__torch_function__

    def watching(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return original(self, func, types, args, kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(saved_tensors._FunctionScopes, "__torch_function__", watching)
        model(*inputs).float().sum().backward()
    return seen


# Every aten op whose output depends on values read back to the host (or whose size does).
HOST_READS = {"_local_scalar_dense", "nonzero", "nonzero_static", "bincount", "unique", "_unique", "_unique2",
              "unique_consecutive", "unique_dim", "masked_select", "repeat_interleave", "histc", "equal",
              "is_nonzero"}


class HostReads(TorchDispatchMode):
    """Counts the ops of :data:`HOST_READS` that run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in HOST_READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes (a fresh CPU copy), every NaN first made the dtype's one quiet NaN: a
    NaN's sign and payload differ between torch's own paths (a bf16 cast writes 0x7FC0 on one CPU
    path and 0xFFFF on another, 0x7FFF on a GPU), and nothing downstream reads them. Every other
    value is compared bit for bit."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.cpu())
    if copy.is_floating_point():
        copy = torch.where(copy.isnan(), torch.tensor(float("nan"), dtype=copy.dtype), copy)
    return copy.reshape(-1).view(torch.uint8)
