"""Train with PyTorch Lightning, plain and with actcomp, the conversion inside the LightningModule.

    python examples/lightning_trainer.py                  # ~20 s on 2 CPU cores
    python examples/lightning_trainer.py --device cuda    # any Lightning accelerator
    python examples/lightning_trainer.py --tiny           # what CI runs, ~15 s (half of it importing Lightning)

The LightningModule builds the plain model in ``__init__`` and converts it in ``configure_model``,

    def configure_model(self):
        if not actcomp.compressed_layers(self.model):   # Lightning calls this hook once per fit/test/...
            actcomp.to_compressed(self.model, "mink0.9+int8", rest="8bit")

so the Trainer converts it where it will run it: after ``setup``, before the strategy moves the
model to its device or wraps it (DDP, FSDP) and before a checkpoint is restored into it.
``load_from_checkpoint`` calls the hook too, before loading the weights.

The model is the demo's small CNN on scikit-learn's digits (nothing is downloaded). Both runs start
from the same weights and see the same batches; "step time" is the median training step (forward,
backward, optimizer step), timed by a Callback. Then the converted model's Lightning checkpoint
(``trainer.save_checkpoint``) loads into a fresh plain module: conversion leaves the state_dict's
keys as they were.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from compare import Measured, Run, print_comparison
from torch.utils.data import DataLoader, TensorDataset

import actcomp
from actcomp.tools.demo import SmallCNN, load_digits_tensors


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="mink0.9+int8", help="spec for Linear/Conv inputs (default: %(default)s)")
    parser.add_argument("--rest", default="8bit", help="whole-model policy for every other saved tensor (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="the Trainer's accelerator: cpu, cuda, mps, auto (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="CI settings: 3 epochs, no progress bar")
    parser.add_argument("--checkpoint-dir", default=None, help="the checkpoint goes here (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny:
        args.epochs = 3
    return args


class DigitsClassifier(pl.LightningModule):
    """The demo's small CNN; ``layers`` and ``rest`` are ``to_compressed``'s (``layers=None``: plain)."""

    def __init__(self, layers: str | None = None, rest: str | None = None, learning_rate: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()  # the checkpoint records them; load_from_checkpoint may override
        self.model = SmallCNN()
        self.configure_model_calls, self.conversions = 0, 0  # the example prints both

    def configure_model(self) -> None:
        # Here rather than in __init__: the Trainer calls this hook where the model will train
        # (after setup, inside the strategy's device and precision context), before it moves or
        # wraps the model (DDP, FSDP: actcomp converts before wrapping) and before it restores a
        # checkpoint into it; a module built outside a Trainer stays plain. Lightning calls it
        # for every fit, validate, test and predict, and load_from_checkpoint calls it: converting
        # again would give each layer a fresh pipeline (a stateful stage such as mesa8 would lose
        # its ranges), so only the first call converts.
        self.configure_model_calls += 1
        if self.hparams.layers is None or actcomp.compressed_layers(self.model):
            return
        actcomp.to_compressed(self.model, self.hparams.layers, rest=self.hparams.rest)
        self.conversions += 1

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: list[torch.Tensor], batch_index: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def test_step(self, batch: list[torch.Tensor], batch_index: int) -> None:
        images, labels = batch
        # Under no_grad, as Lightning evaluates: the converted model runs the plain forward.
        self.log("test_acc", (self(images).argmax(1) == labels).float().mean(), batch_size=len(labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate, weight_decay=1e-4)


class Measurements(pl.Callback):
    """Every training step's wall time (forward, backward, optimizer step; ``median_step``), and
    the bytes autograd keeps for backward for ``images`` (``kept_bytes``), measured on the device
    the model trained on when training ends (the Trainer moves it back to the CPU afterwards)."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images, self.step_seconds = images, []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch, batch_index: int) -> None:
        self.start = self._now(module)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, batch_index: int) -> None:
        self.step_seconds.append(self._now(module) - self.start)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.device = module.device
        self.kept_bytes = actcomp.memory_report(module, self.images.to(module.device)).total_bytes

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_seconds)

    @staticmethod
    def _now(module: pl.LightningModule) -> float:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)  # the GPU's work, not its queueing
        return time.perf_counter()


def fit(name: str, module: DigitsClassifier, args: argparse.Namespace, train: TensorDataset,
        test: TensorDataset) -> tuple[Run, pl.Trainer]:
    # The same shuffling for both runs: a generator of the loader's own.
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(args.seed))
    measurements = Measurements(train.tensors[0][: args.batch_size])
    run_trainer = pl.Trainer(max_epochs=args.epochs, accelerator=args.device, devices=1, callbacks=[measurements],
                             # "warn": deterministic algorithms where PyTorch has them, a warning where not.
                             deterministic="warn", enable_checkpointing=False, logger=False,
                             enable_model_summary=False, enable_progress_bar=not args.tiny)
    with Measured() as measured:
        run_trainer.fit(module, train_loader)
    [scores] = run_trainer.test(module, DataLoader(test, batch_size=len(test)), verbose=False)
    peak_cuda = measured.peak_cuda if measurements.device.type == "cuda" else None
    return Run(name, measurements.kept_bytes, scores["test_acc"], measurements.median_step, peak_cuda), run_trainer


def same_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> bool:
    return ours.keys() == theirs.keys() and all(torch.equal(ours[key].cpu(), theirs[key].cpu()) for key in ours)


def main() -> None:
    args = parse_args()
    # Lightning's start-up notes (devices found, seed set) and its advice to add DataLoader
    # workers, which these in-memory tensors do not need.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    train_images, train_labels, test_images, test_labels = load_digits_tensors(args.seed)
    train, test = TensorDataset(train_images, train_labels), TensorDataset(test_images, test_labels)

    runs, modules, trainers = {}, {}, {}
    for name, layers, rest in (("plain", None, None), ("actcomp", args.layers, args.rest)):
        pl.seed_everything(args.seed, verbose=False)  # the same initial weights
        modules[name] = DigitsClassifier(layers, rest)
        runs[name], trainers[name] = fit(name, modules[name], args, train, test)
    print_comparison(runs["plain"], runs["actcomp"])
    compressed = modules["actcomp"]
    print(f"configure_model ran {compressed.configure_model_calls} times (fit, test), converted "
          f"{compressed.conversions} time(s): to_compressed(model, {args.layers!r}, rest={args.rest!r}), "
          f"{len(actcomp.compressed_layers(compressed.model))} layers")

    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(args.checkpoint_dir or scratch, "actcomp.ckpt")
        trainers["actcomp"].save_checkpoint(path)
        # layers=None overrides the saved hyperparameter: configure_model leaves this one plain.
        plain = DigitsClassifier.load_from_checkpoint(path, layers=None, map_location="cpu")
        converted = DigitsClassifier.load_from_checkpoint(path, map_location="cpu")
    trained = compressed.state_dict()
    print(f"trainer.save_checkpoint -> load_from_checkpoint: into a plain module "
          f"({len(actcomp.compressed_layers(plain.model))} converted layers): weights equal: "
          f"{same_weights(trained, plain.state_dict())} ({len(trained)} tensors); into a converted module "
          f"({len(actcomp.compressed_layers(converted.model))} converted layers): weights equal: "
          f"{same_weights(trained, converted.state_dict())}")


if __name__ == "__main__":
    main()
