"""Language models trained with attention dropout (BERT's and GPT-2's default): bytes kept for
backward and the training step's peak, plain against whole-model mode.

    python benchmarks/bench_attention_dropout.py                   # ~6 minutes on 2 cores
    python benchmarks/bench_attention_dropout.py --layers 2 --no-peaks   # a check, seconds

A CPU call of ``scaled_dot_product_attention`` with dropout runs SDPA's math path: it saves its
scaled query and key, its value, its probabilities, the dropout's mask and the dropped
probabilities, the two largest of them (batch x heads x tokens x tokens) in fp32. The models are
Hugging Face's with their default dropouts (0.1 on attention probabilities and hidden states),
random weights, built from configs of the base sizes (hidden 768, 12 heads, ``--layers``):
``BertForMaskedLM`` and ``GPT2LMHeadModel``, the labels the inputs (the loss computed inside the
forward, a causal LM's routed through the chunked cross-entropy under whole-model mode).

1. **Bytes** (``actcomp.memory_report``: one training-mode forward, deduplicated by storage):
   plain, and ``to_compressed(model, "mink0.9+int8", rest=...)`` for each of ``--rests``, at
   each of ``--lengths`` (batch ``--batch``); the attention kind's row beside the total.
2. **Peaks** (``--no-peaks`` skips them): BERT at the longest length, plain and the first of
   ``--rests``, each in a fresh process (AdamW, two steps; the process's VmHWM above its
   resident memory once the model and batch are built: what training adds), ``--rounds``
   rounds whose order alternates, the median; the second step's time beside it.

Writes ``benchmarks/results/attention_dropout_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.tools.probe import run_probe

MODELS = ("bert", "gpt2")
COLUMNS = ["model", "tokens", "config", "kept_mib", "x_plain", "attention_kept_mib", "attention_x_plain",
           "attention_codecs"]


def build(name: str, layers: int) -> torch.nn.Module:
    """A base-sized model of ``name`` with its default dropouts, seeded, in training mode."""
    import transformers

    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers)
        return transformers.BertForMaskedLM(config).train()
    config = transformers.GPT2Config(n_layer=layers)
    return transformers.GPT2LMHeadModel(config).train()


def tokens(name: str, model: torch.nn.Module, batch: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def convert(model: torch.nn.Module, config: str) -> torch.nn.Module:
    return model if config == "plain" else actcomp.to_compressed(model, "mink0.9+int8", rest=config)


def probe(settings: dict) -> None:
    """Two training steps of one configuration in this (fresh) process: what training adds to
    the resident memory once built, and the second step's seconds."""
    from bench_lm_loss import resident

    torch.set_num_threads(settings["threads"])
    model = convert(build(settings["model"], settings["layers"]), settings["config"])
    batch = tokens(settings["model"], model, settings["batch"], settings["length"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    built = resident("VmRSS")
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        model(**batch).loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    print(json.dumps({"added": resident("VmHWM") - built, "step_seconds": seconds[-1]}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        probe(json.loads(sys.argv[2]))
        return
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--rests", nargs="+", default=["8bit", "4bit"])
    parser.add_argument("--no-peaks", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    rows = []
    body = ["Bytes kept for backward (`actcomp.memory_report`), and the attention kind's share of them.", "",
            "| model | tokens | config | kept | x plain | attention kept | attention x plain | attention codecs |",
            "|---|---:|---|---:|---:|---:|---:|---|"]
    for name in args.models:
        model = build(name, args.layers)
        for length in args.lengths:
            batch = tokens(name, model, args.batch, length)
            plain = actcomp.memory_report(model, **batch)
            plain_attention = next((row.plain_bytes for row in plain.kinds if row.kind == "attention"), 0)
            for config in ["plain", *args.rests]:
                report = plain if config == "plain" else actcomp.memory_report(convert(copy.deepcopy(model), config),
                                                                               **batch)
                attention = next((row for row in report.kinds if row.kind == "attention"), None)
                kept = attention.kept_bytes if attention is not None and config != "plain" else plain_attention
                codecs = ", ".join(attention.codecs) if attention is not None and config != "plain" else "as is"
                row = {"model": name, "tokens": f"{args.batch}x{length}", "config": config,
                       "kept_mib": report.total_bytes / 2**20, "x_plain": plain.total_bytes / report.total_bytes,
                       "attention_kept_mib": kept / 2**20, "attention_x_plain": plain_attention / kept if kept else 0.0,
                       "attention_codecs": codecs}
                rows.append(row)
                body.append(f"| {name} | {row['tokens']} | {config} | {row['kept_mib']:.0f} MiB | {row['x_plain']:.2f}x "
                            f"| {row['attention_kept_mib']:.0f} MiB | {row['attention_x_plain']:.2f}x | {codecs} |")
                print(body[-1], flush=True)
        del model
    if not args.no_peaks and "bert" in args.models:
        length, configs = max(args.lengths), ["plain", args.rests[0]]
        found = {config: [] for config in configs}
        for index in range(args.rounds):
            for config in configs[index % 2:] + configs[:index % 2]:
                settings = {"model": "bert", "layers": args.layers, "batch": args.batch, "length": length,
                            "config": config, "threads": args.threads}
                probed = run_probe([str(Path(__file__).resolve()), "--probe", json.dumps(settings)],
                                   what=f"bert {config} at {args.batch}x{length}")
                found[config].append(probed)
                print(f"round {index} {config}: +{probed['added'] / 2**20:.0f} MiB, step {probed['step_seconds']:.2f} s",
                      flush=True)
        plain_peak = statistics.median(probe["added"] for probe in found["plain"])
        plain_step = statistics.median(probe["step_seconds"] for probe in found["plain"])
        body += ["", f"BERT at {args.batch}x{length} tokens, AdamW, fresh processes (median of {args.rounds} rounds): "
                     "what training adds to the resident memory once the model and batch are built, and the "
                     "second step's time.", "", "| config | training adds | x lower | step vs plain |",
                 "|---|---:|---:|---:|"]
        for config in configs:
            peak = statistics.median(probe["added"] for probe in found[config])
            step = statistics.median(probe["step_seconds"] for probe in found[config])
            body.append(f"| {config} | {peak / 2**20:.0f} MiB | {plain_peak / peak:.2f}x | {step / plain_step:.2f}x |")
    header = header_lines(torch.device("cpu"), args.threads, 0, time.perf_counter() - started,
                          {"models": args.models, "layers": args.layers, "batch": args.batch, "lengths": args.lengths,
                           "rests": args.rests, "rounds": args.rounds}, load_before)
    write_results("attention_dropout", torch.device("cpu"), args.threads, header,
                  "Attention dropout: bytes kept and the training step's peak", body, rows, COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
