"""Fine-tune a small causal LM with PEFT LoRA through Hugging Face's Trainer, plain and with actcomp.

    python examples/lora_trainer.py                # ~1 minute on 2 CPU cores
    python examples/lora_trainer.py --qlora        # the base in bitsandbytes nf4 (QLoRA)
    python examples/lora_trainer.py --tiny         # what CI runs

The recommended call: wrap the model with PEFT first, then convert the PEFT model,

    model = get_peft_model(base, LoraConfig(...))
    actcomp.to_compressed(model, "mink0.9+int8", rest="8bit")

Each adapter's ``lora_A`` then keeps its input with the spec's quantizers alone (int8: the
adapters' gradients are the whole training signal, and a sparsifier there cost them 30% of
their direction), ``lora_B`` stays plain, the frozen base layers compress as usual, and the
causal LM's ``labels=`` loss goes through the chunked cross-entropy (the logits are never held
whole). Converting the base before ``get_peft_model`` works too.

The text is English prose a package ships (scikit-learn's dataset descriptions), read as bytes;
the base is a Llama-shaped model built from a config with a trained model's outlier channels and
sink token built in (``actcomp.tools.llm_outliers``), its weights random (nothing is
downloaded). Plain and compressed runs start from the same weights and see the same batches; the
table's "test acc" is next-byte accuracy on the held-out 10%. Before training, the adapters'
gradient on one batch is compared with plain's (cosine; on a pair whose ``lora_B`` is drawn as a
trained adapter's, since PEFT starts it at zero and ``lora_A``, the reader of the compressed
input, would get no gradient), and after training the adapters saved with ``save_pretrained``
are loaded back into a fresh PEFT model.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from compare import Measured, Run, print_comparison
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

import actcomp
from actcomp.tools.llm_outliers import add_outliers

WINDOW = 128


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="mink0.9+int8", help="spec for Linear inputs (default: %(default)s)")
    parser.add_argument("--rest", default="8bit", help="whole-model policy for every other saved tensor (default: %(default)s)")
    parser.add_argument("--qlora", action="store_true", help="load the base in bitsandbytes nf4 (needs bitsandbytes)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="CI settings: 30 steps, hidden 128")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.hidden = 30, 128
    return args


def text_windows() -> tuple[list[dict], list[dict]]:
    """scikit-learn's dataset descriptions as bytes, cut into windows: (train, held-out 10%)."""
    import sklearn

    folder = Path(sklearn.__file__).parent / "datasets" / "descr"
    data = torch.tensor(list(b"\n\n".join(path.read_bytes() for path in sorted(folder.glob("*.rst")))))
    split = data.numel() * 9 // 10

    def cut(part: torch.Tensor, step: int) -> list[dict]:
        return [{"input_ids": part[start:start + WINDOW], "labels": part[start:start + WINDOW]}
                for start in range(0, part.numel() - WINDOW, step)]

    return cut(data[:split], WINDOW // 2), cut(data[split:], WINDOW)


def base_model(args: argparse.Namespace, folder: str) -> LlamaForCausalLM:
    """The base, saved once to ``folder`` and loaded from there (in nf4 with ``--qlora``)."""
    if not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(args.seed)
        # Every projection's input width a multiple of 64: bitsandbytes' CPU inference path
        # (evaluate, under no_grad) repacks nf4 weights in blocks of 64 inputs and fails otherwise.
        config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=WINDOW)
        model = LlamaForCausalLM(config)
        add_outliers(model)
        model.save_pretrained(folder)
    if not args.qlora:
        return LlamaForCausalLM.from_pretrained(folder)
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.float32)
    return LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")


def with_lora(base: LlamaForCausalLM, seed: int, trained: bool = False):
    """PEFT LoRA on every Linear; ``trained`` draws lora_B from N(0, 0.02) instead of PEFT's zeros."""
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    if trained:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.02)
    return model


def adapter_gradient(model, batch: dict, part: str = "lora_") -> torch.Tensor:
    model.zero_grad()
    torch.manual_seed(0)
    model(**batch).loss.backward()
    return torch.cat([p.grad.double().reshape(-1) for name, p in model.named_parameters() if part in name])


def next_byte_accuracy(prediction: transformers.EvalPrediction) -> dict:
    logits, labels = prediction.predictions, prediction.label_ids
    return {"accuracy": float((np.argmax(logits[:, :-1], -1) == labels[:, 1:]).mean())}


def fit(name: str, model, args: argparse.Namespace, output_dir: str, train: list[dict], test: list[dict],
        batch: dict) -> tuple[Run, Trainer, float]:
    kept = actcomp.memory_report(model, **batch).total_bytes
    training_args = TrainingArguments(
        output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=16,
        learning_rate=2e-3, warmup_steps=args.steps // 10, seed=args.seed, save_strategy="no", logging_strategy="no",
        eval_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                      compute_metrics=next_byte_accuracy)
    trainer.remove_callback(PrinterCallback)
    with Measured() as measured:
        trainer.train()
    scores = trainer.evaluate()
    return Run(name, kept, scores["eval_accuracy"], measured.seconds, measured.peak_cuda), trainer, scores["eval_loss"]


def main() -> None:
    args = parse_args()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    train, test = text_windows()
    batch = {key: torch.stack([example[key] for example in train[: args.batch_size]]) for key in train[0]}
    with tempfile.TemporaryDirectory() as scratch:
        base = os.path.join(scratch, "base")
        # PEFT models of the same base and seed (a deep copy of an nf4 base is not supported).
        cosines = []
        for part in ("lora_", "lora_A"):
            reference = adapter_gradient(with_lora(base_model(args, base), args.seed, trained=True), batch, part)
            converted = actcomp.to_compressed(with_lora(base_model(args, base), args.seed, trained=True),
                                              args.layers, rest=args.rest)
            cosines.append(float(torch.nn.functional.cosine_similarity(adapter_gradient(converted, batch, part),
                                                                       reference, dim=0)))
        print(f"{'QLoRA (nf4 base)' if args.qlora else 'LoRA'}, to_compressed(peft_model, {args.layers!r}, "
              f"rest={args.rest!r}): adapters' gradient cosine to plain's: {cosines[0]:.5f}, "
              f"lora_A's alone: {cosines[1]:.5f}")
        plain = with_lora(base_model(args, base), args.seed)
        compressed = actcomp.to_compressed(with_lora(base_model(args, base), args.seed), args.layers, rest=args.rest)

        plain_run, _, plain_loss = fit("plain", plain, args, os.path.join(scratch, "plain"), train, test, batch)
        packed_run, trainer, packed_loss = fit("actcomp", compressed, args, os.path.join(scratch, "actcomp"), train,
                                               test, batch)
        print_comparison(plain_run, packed_run)
        print(f"held-out loss: plain {plain_loss:.4f}, actcomp {packed_loss:.4f} ({packed_loss / plain_loss:.4f}x)")

        # The adapters save as PEFT saves them and load into a fresh PEFT model of the same base.
        adapters = os.path.join(scratch, "adapters")
        compressed.save_pretrained(adapters)
        loaded = PeftModel.from_pretrained(base_model(args, base), adapters)
        ours = {name: value for name, value in compressed.state_dict().items() if "lora_" in name}
        theirs = {name: value for name, value in loaded.state_dict().items() if "lora_" in name}
        equal = ours.keys() == theirs.keys() and all(torch.equal(ours[name].cpu(), theirs[name].cpu()) for name in ours)
        print(f"save_pretrained -> PeftModel.from_pretrained: adapter weights equal: {equal} ({len(ours)} tensors)")


if __name__ == "__main__":
    main()
