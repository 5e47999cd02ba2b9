"""Fine-tune a small BERT with Hugging Face's Trainer, plain and with actcomp, side by side.

    python examples/hf_trainer.py              # ~50 s on 2 CPU cores
    python examples/hf_trainer.py --tiny       # what CI runs, ~20 s

Both models start from the same weights and see the same batches. actcomp converts the model
*before* the Trainer is built; then train, evaluate, checkpoint, resume from a checkpoint the
compressed model wrote, and save_pretrained into a plain BertForSequenceClassification all work
as usual. Nothing is downloaded: the config is built here and the data is synthetic token ids.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import numpy as np
import torch
import transformers
from compare import Measured, Run, print_comparison
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

import actcomp

PAD, CLS, FIRST_MARKER = 0, 1, 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="mink0.9+int8", help="spec for Linear inputs (default: %(default)s)")
    parser.add_argument("--rest", default="8bit", help="whole-model policy for every other saved tensor (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="CI settings: 40 steps on 1024 examples")
    parser.add_argument("--output-dir", default=None, help="checkpoints go here (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.train_size = 40, 1024
    return args


def make_data(count: int, seed: int, classes: int = 4, length: int = 32, vocab: int = 64) -> list[dict]:
    """Sequences of random tokens in which one class's marker token appears more often than the
    others' (3 times vs once): the label is that class. Padded to ``length``, lengths vary."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        size = int(torch.randint(length // 2, length, (), generator=generator))
        tokens = torch.randint(FIRST_MARKER + classes, vocab, (size,), generator=generator)
        label, other = torch.randperm(classes, generator=generator)[:2].tolist()
        where = torch.randperm(size - 1, generator=generator)[:4] + 1
        tokens[where] = torch.tensor([label, label, label, other]) + FIRST_MARKER
        tokens[0] = CLS
        input_ids = torch.full((length,), PAD)
        input_ids[:size] = tokens
        examples.append({"input_ids": input_ids, "attention_mask": (input_ids != PAD).long(), "labels": torch.tensor(label)})
    return examples


def accuracy(prediction: transformers.EvalPrediction) -> dict:
    return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}


def build_trainer(model: BertForSequenceClassification, args: argparse.Namespace, output_dir: str, train: list[dict],
                  test: list[dict]) -> Trainer:
    training_args = TrainingArguments(
        output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=256,
        learning_rate=3e-3, warmup_steps=args.steps // 10, weight_decay=0.01, seed=args.seed,
        save_strategy="steps", save_steps=args.steps // 2, logging_strategy="no", eval_strategy="no",
        report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=test, compute_metrics=accuracy)
    # disable_tqdm swaps the progress bar for a callback printing every log dict; the table is the output.
    trainer.remove_callback(PrinterCallback)
    return trainer


def fit(name: str, model: BertForSequenceClassification, args: argparse.Namespace, output_dir: str, train: list[dict],
        test: list[dict], batch: dict) -> tuple[Run, Trainer]:
    kept = actcomp.memory_report(model, **batch).total_bytes
    trainer = build_trainer(model, args, output_dir, train, test)
    with Measured() as measured:
        trainer.train()
    return Run(name, kept, trainer.evaluate()["eval_accuracy"], measured.seconds, measured.peak_cuda), trainer


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    state_a, state_b = a.state_dict(), b.state_dict()
    return state_a.keys() == state_b.keys() and all(torch.equal(state_a[key], state_b[key]) for key in state_a)


def main() -> None:
    args = parse_args()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    train, test = make_data(args.train_size, args.seed), make_data(1024, args.seed + 1)
    batch = {key: torch.stack([example[key] for example in train[: args.batch_size]]) for key in train[0]}
    config = BertConfig(vocab_size=64, hidden_size=args.hidden, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=4 * args.hidden, max_position_embeddings=64, num_labels=4)
    torch.manual_seed(args.seed)
    plain = BertForSequenceClassification(config)
    compressed = actcomp.to_compressed(copy.deepcopy(plain), args.layers, rest=args.rest)
    assert list(compressed.state_dict()) == list(plain.state_dict())  # conversion keeps every key

    with tempfile.TemporaryDirectory() as scratch:
        output_dir = args.output_dir or scratch
        plain_run, _ = fit("plain", plain, args, os.path.join(output_dir, "plain"), train, test, batch)
        packed_run, trainer = fit("actcomp", compressed, args, os.path.join(output_dir, "actcomp"), train, test, batch)
        print_comparison(plain_run, packed_run)

        # Resume the compressed run from its mid-way checkpoint, into a freshly converted model.
        checkpoint = os.path.join(output_dir, "actcomp", f"checkpoint-{args.steps // 2}")
        fresh = actcomp.to_compressed(BertForSequenceClassification(config), args.layers, rest=args.rest)
        resumed = build_trainer(fresh, args, os.path.join(output_dir, "resumed"), train, test)
        resumed.train(resume_from_checkpoint=checkpoint)
        print(f"resumed from {os.path.basename(checkpoint)}: weights equal to the uninterrupted run's: "
              f"{same_weights(fresh, compressed)}, test acc {resumed.evaluate()['eval_accuracy']:.1%}")

        # save_model writes the usual safetensors and config.json, and the plain class loads them.
        # config.architectures is the saving model's class name, CompressedBertForSequenceClassification;
        # loading by class or by AutoModel* (which go by model_type) never reads it. For tools that
        # do, export with actcomp.from_compressed(model).save_pretrained(path).
        saved = os.path.join(output_dir, "final")
        trainer.save_model(saved)
        loaded = BertForSequenceClassification.from_pretrained(saved).to(compressed.device)
        assert type(loaded) is BertForSequenceClassification and same_weights(loaded, compressed)
        inputs = {key: value.to(compressed.device) for key, value in batch.items()}
        compressed.eval()
        with torch.no_grad():
            equal = torch.equal(loaded.eval()(**inputs).logits, compressed(**inputs).logits)
        print(f"save_model -> plain BertForSequenceClassification.from_pretrained: same logits: {equal} "
              f"(config.architectures: {loaded.config.architectures})")


if __name__ == "__main__":
    main()
