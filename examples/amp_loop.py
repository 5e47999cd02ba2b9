"""A plain PyTorch loop with autocast and GradScaler, plain and with actcomp, side by side.

    python examples/amp_loop.py                # ~20 s on 2 CPU cores
    python examples/amp_loop.py --tiny         # what CI runs, ~10 s

A small CNN (Conv, BatchNorm, ReLU, MaxPool) on scikit-learn's digits, under CUDA fp16 autocast
with a GradScaler, or CPU bf16 autocast without one. Both models start from the same weights and
see the same batches. Then: evaluate in eval mode, save a checkpoint (model, optimizer, scaler,
epoch) half way, load it into a fresh converted model and resume: the resumed run ends with the
weights of the uninterrupted one, bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch
import torch.nn.functional as F
from compare import Measured, Run, print_comparison
from torch import nn

import actcomp
from actcomp.tools.demo import load_digits_tensors


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="mink0.9+int8", help="spec for Linear/Conv inputs (default: %(default)s)")
    parser.add_argument("--rest", default="8bit", help="whole-model policy for every other saved tensor (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="CI settings: 4 epochs")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoints go here (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny:
        args.epochs = 4
    return args


def small_cnn() -> nn.Module:
    def block(inputs: int, outputs: int) -> list[nn.Module]:
        return [nn.Conv2d(inputs, outputs, 3, padding=1), nn.BatchNorm2d(outputs), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(1, 32), *block(32, 64), nn.Flatten(), nn.Linear(64 * 2 * 2, 10))


class Training:
    """One model's training state: everything a checkpoint must hold to resume exactly."""

    def __init__(self, model: nn.Module, args: argparse.Namespace, device: torch.device):
        self.model, self.args, self.device = model, args, device
        # CUDA fp16 has 5 exponent bits: small gradients underflow to 0 unless the loss is
        # scaled up first. bf16 has fp32's 8 exponent bits, so CPU bf16 needs no scaler; a
        # disabled GradScaler passes everything through, so the loop is the same either way.
        self.dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
        self.epoch = 0
        # The shuffling has a generator of its own, saved with the checkpoint.
        self.shuffle = torch.Generator().manual_seed(args.seed)

    def train_epoch(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.model.train()
        order = torch.randperm(len(labels), generator=self.shuffle).to(self.device)
        for batch in order.split(self.args.batch_size):
            with torch.autocast(self.device.type, dtype=self.dtype):
                loss = F.cross_entropy(self.model(images[batch]), labels[batch])
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.epoch += 1

    @torch.no_grad()
    def evaluate(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        self.model.eval()  # BatchNorm's running statistics; actcomp runs the plain forward
        with torch.autocast(self.device.type, dtype=self.dtype):
            predictions = self.model(images).argmax(1)
        return (predictions == labels).float().mean().item()

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "epoch": self.epoch, "shuffle": self.shuffle.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch = state["epoch"]
        self.shuffle.set_state(state["shuffle"])


def kept_bytes(training: Training, images: torch.Tensor) -> int:
    with torch.autocast(training.device.type, dtype=training.dtype):
        return actcomp.memory_report(training.model, images[: training.args.batch_size]).total_bytes


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # (N, 1, 8, 8) images in [0, 1], split 80/20 with a fixed seed.
    train_images, train_labels, test_images, test_labels = (t.to(device) for t in load_digits_tensors(args.seed))
    torch.manual_seed(args.seed)
    plain = small_cnn().to(device)
    compressed = actcomp.to_compressed(copy.deepcopy(plain), args.layers, rest=args.rest)

    runs, saved_accuracy = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.checkpoint_dir or scratch
        for name, model in (("plain", plain), ("actcomp", compressed)):
            training = Training(model, args, device)
            kept = kept_bytes(training, train_images)
            with Measured() as measured:
                while training.epoch < args.epochs:
                    training.train_epoch(train_images, train_labels)
                    if training.epoch == args.epochs // 2:
                        torch.save(training.state_dict(), os.path.join(directory, f"{name}.pt"))
                        saved_accuracy[name] = training.evaluate(test_images, test_labels)
            runs[name] = Run(name, kept, training.evaluate(test_images, test_labels), measured.seconds, measured.peak_cuda)
        print_comparison(runs["plain"], runs["actcomp"])

        # A fresh model, converted again, loads the checkpoint (state_dict keys are those of the
        # plain model) and evaluates exactly as the model that saved it did.
        fresh = actcomp.to_compressed(small_cnn().to(device), args.layers, rest=args.rest)
        resumed = Training(fresh, args, device)
        resumed.load_state_dict(torch.load(os.path.join(directory, "actcomp.pt"), weights_only=True))
        loaded_accuracy = resumed.evaluate(test_images, test_labels)
        print(f"checkpoint at epoch {resumed.epoch}: test acc {loaded_accuracy:.1%} after loading, "
              f"{saved_accuracy['actcomp']:.1%} when saved: equal: {loaded_accuracy == saved_accuracy['actcomp']}")
        while resumed.epoch < args.epochs:
            resumed.train_epoch(train_images, train_labels)
        final, uninterrupted = fresh.state_dict(), compressed.state_dict()
        same = all(torch.equal(final[key], uninterrupted[key]) for key in final)
        print(f"resumed to epoch {resumed.epoch}: weights equal to the uninterrupted run's: {same}, "
              f"test acc {resumed.evaluate(test_images, test_labels):.1%}")


if __name__ == "__main__":
    main()
