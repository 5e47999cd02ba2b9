"""DDP or FSDP2 training, plain and with actcomp, side by side in one launch.

    torchrun --nproc_per_node 2 examples/distributed.py --mode ddp             # ~45 s on 2 CPU cores
    torchrun --nproc_per_node 2 examples/distributed.py --mode fsdp2 --tiny    # what CI runs, ~25 s

A small transformer reads scikit-learn's digits as 8 tokens (the image rows); each rank trains
on its DistributedSampler shard, on CPU with gloo (CUDA with NCCL when there is a GPU). The model
is converted before it is wrapped: DistributedDataParallel around it, or FSDP2's fully_shard on
each block, then on the root. Both runs start from the same weights and see the same batches.
Then a checkpoint: rank 0 saves ``model.module.state_dict()`` (DDP), or every rank writes its
shards with torch.distributed.checkpoint (FSDP2); a fresh converted model loads it and evaluates
as the trained one did.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from compare import Measured, Run, print_comparison
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import actcomp
from actcomp.tools.demo import load_digits_tensors


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ddp", "fsdp2"], required=True)
    parser.add_argument("--layers", default="mink0.9+int8", help="spec for Linear inputs (default: %(default)s)")
    parser.add_argument("--rest", default="8bit", help="whole-model policy for every other saved tensor (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--tiny", action="store_true", help="CI settings: 4 epochs")
    parser.add_argument("--checkpoint-dir", default=None, help="shared by the ranks (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny:
        args.epochs = 4
    return args


class Block(nn.Module):
    """Pre-norm transformer block: attention (one qkv Linear, SDPA) and a GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim))
        return x + self.mlp(self.norm2(x))


class RowTransformer(nn.Module):
    """8x8 digits as 8 tokens of 8 pixels, a few blocks, mean-pooled into 10 classes."""

    def __init__(self, dim: int = 64, depth: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.position = nn.Parameter(torch.randn(1, 8, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(N, 8, 8) images in [0, 1] and labels, split 80/20 with a fixed seed."""
    train_images, train_labels, test_images, test_labels = load_digits_tensors(seed)
    return TensorDataset(train_images.squeeze(1), train_labels), TensorDataset(test_images.squeeze(1), test_labels)


def build(args: argparse.Namespace, device: torch.device, compress: bool) -> nn.Module:
    """The same initial weights on every rank and for every run; converted, then wrapped."""
    torch.manual_seed(args.seed)
    model = RowTransformer().to(device)
    if compress:
        actcomp.to_compressed(model, args.layers, rest=args.rest)
    if args.mode == "ddp":
        return DistributedDataParallel(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@torch.no_grad()
def accuracy(model: nn.Module, test: TensorDataset, device: torch.device) -> float:
    """On the whole test set, on every rank (FSDP2 needs every rank in each forward)."""
    model.eval()
    images, labels = (tensor.to(device) for tensor in test.tensors)
    return (model(images).argmax(1) == labels).float().mean().item()


def fit(name: str, args: argparse.Namespace, device: torch.device, train: TensorDataset,
        test: TensorDataset) -> tuple[Run, nn.Module, torch.optim.Optimizer]:
    model = build(args, device, compress=name == "actcomp")
    sampler = DistributedSampler(train, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    # Bytes autograd keeps for one per-rank batch (every rank runs the report's forward).
    kept = actcomp.memory_report(model, next(iter(loader))[0].to(device)).total_bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with Measured() as measured:
        for epoch in range(args.epochs):
            model.train()
            sampler.set_epoch(epoch)
            for images, labels in loader:
                loss = F.cross_entropy(model(images.to(device)), labels.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        dist.barrier()
    return Run(name, kept, accuracy(model, test, device), measured.seconds, measured.peak_cuda), model, optimizer


def save_and_reload(args: argparse.Namespace, device: torch.device, model: nn.Module, optimizer: torch.optim.Optimizer,
                    directory: str, test: TensorDataset) -> float:
    """Checkpoint the trained compressed model, load it into a fresh converted one, and return
    that one's test accuracy."""
    fresh = build(args, device, compress=True)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    if args.mode == "ddp":
        path = os.path.join(directory, "checkpoint.pt")
        if dist.get_rank() == 0:  # every rank holds the same weights: one writes them
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, path)
        dist.barrier()
        state = torch.load(path, map_location=device, weights_only=True)
        fresh.module.load_state_dict(state["model"])
        fresh_optimizer.load_state_dict(state["optimizer"])
    else:
        # Each rank writes and reads its own shards (DTensors); the directory must be shared.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
        model_state, optimizer_state = get_state_dict(fresh, fresh_optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return accuracy(fresh, test, device)


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g.: torchrun --nproc_per_node 2 examples/distributed.py --mode ddp")
    torch.set_num_threads(1)  # one core per rank; more threads per rank oversubscribe small machines
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    try:
        train, test = digits(args.seed)
        plain_run, _, _ = fit("plain", args, device, train, test)
        packed_run, model, optimizer = fit("actcomp", args, device, train, test)
        if rank == 0:
            print(f"{args.mode}, {dist.get_world_size()} ranks, memory per rank:")
            print_comparison(plain_run, packed_run)

        # A directory every rank can see: rank 0 makes it and tells the others.
        directory = [args.checkpoint_dir or (tempfile.mkdtemp() if rank == 0 else None)]
        dist.broadcast_object_list(directory)
        reloaded = save_and_reload(args, device, model, optimizer, directory[0], test)
        dist.barrier()
        if rank == 0:
            print(f"checkpoint ({'rank 0 state_dict' if args.mode == 'ddp' else 'torch.distributed.checkpoint'}) "
                  f"reloaded into a fresh converted model: test acc {reloaded:.1%}, "
                  f"equal to the trained model's: {reloaded == packed_run.accuracy}")
            if args.checkpoint_dir is None:
                shutil.rmtree(directory[0])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
