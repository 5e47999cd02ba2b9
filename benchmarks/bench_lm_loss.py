"""A language model's loss: bytes kept, step peak and step time, plain against chunked losses.

    python benchmarks/bench_lm_loss.py                       # Llama-shaped, 2048 tokens, fp32 and bf16: ~6 minutes
    python benchmarks/bench_lm_loss.py --tokens 256 --layers 2 --rounds 2   # a check: ~1 minute
    python benchmarks/bench_lm_loss.py --device cuda --tokens 2048 4096     # on a GPU

A Llama-shaped model from a config (hidden 512, 8 layers, vocabulary 32,000, batch 1), AdamW,
its loss computed four ways:

- ``plain``: ``model(input_ids, labels=labels).loss``, transformers' own (the logits upcast to
  float32, their log-softmax kept for backward);
- ``torch-chunked``: the pure-PyTorch chunked loss torchtune uses (``CEWithChunkedOutputLoss``):
  the output projection and the cross-entropy 8 chunks of tokens at a time, each under autograd;
- ``actcomp-loss``: the model converted with ``to_compressed(model, "int8", filter_fn=lambda m, n:
  False, loss="chunked")``: only the loss changes (:func:`actcomp.linear_cross_entropy`);
- ``actcomp-8bit``: ``to_compressed(model, "mink0.9+int8", rest="8bit")``, which routes the loss too;
- ``checkpoint``: Hugging Face's ``gradient_checkpointing_enable()`` (non-reentrant), and
  ``checkpoint+actcomp-8bit``: both (actcomp compresses what lies outside the checkpointed
  layers, the loss routed too, and since stop 48 what each layer's recomputation saves in
  backward; the layers' stored inputs stay as checkpointing keeps them).

Reported per dtype: bytes kept for backward (``actcomp.memory_report``, deduplicated by
storage), split into the loss's (kept with labels minus kept without: the head's log-softmax,
or what the chunked loss keeps) and the rest of the model's;
the peak of training, each method in a fresh process: on a CPU as a user's process runs
(glibc's allocator as it comes), the process's peak RSS above its memory once the model and
batch are built, or with ``--allocator tuned`` (``MALLOC_MMAP_THRESHOLD_=65536``, the setting
of the figures before stop 40) the second step's peak above its start; on a GPU, the step's
``torch.cuda.max_memory_allocated`` above ``memory_allocated`` at its start, with the process's
allocated and reserved peaks beside it; and the step time against plain's, interleaved in one
process (median of per-round ratios).

Writes ``benchmarks/results/lm_loss_<torch>_<device>_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, ratio_summary, time_rounds, write_results

import actcomp
from actcomp.tools.peak_rss import ALLOCATORS
from actcomp.tools.probe import run_probe

METHODS = ("plain", "torch-chunked", "actcomp-loss", "actcomp-8bit", "checkpoint", "checkpoint+actcomp-8bit")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLUMNS = ["dtype", "tokens", "method", "kept_mib", "loss_kept_mib", "rest_kept_mib", "loss_vs_plain", "rest_vs_plain",
           "peak_mib", "peak_vs_plain", "process_peak_mib", "reserved_peak_mib", "step_ratio", "step_p25", "step_p75",
           "step_s"]


def build(args: argparse.Namespace, dtype: torch.dtype, method: str):
    """``(model, step_loss)`` for ``method``: the model converted as the method says, and
    ``step_loss(input_ids, labels)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocabulary,
                         max_position_embeddings=max(args.tokens, 128))
    model = LlamaForCausalLM(config).to(device=args.device, dtype=dtype).train()
    if method.startswith("checkpoint"):
        # Hugging Face's own, non-reentrant (as transformers recommends): each decoder layer's
        # forward runs again in backward.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        method = method.removeprefix("checkpoint").removeprefix("+") or "plain"
    if method == "actcomp-loss":
        actcomp.to_compressed(model, "int8", filter_fn=lambda module, name: False, loss="chunked")
    elif method == "actcomp-8bit":
        actcomp.to_compressed(model, "mink0.9+int8", rest="8bit")
    if method == "torch-chunked":
        model = TorchChunked(model)
        return model, lambda ids, labels: model(input_ids=ids, labels=labels)
    return model, lambda ids, labels: model(input_ids=ids, labels=labels).loss


class TorchChunked(torch.nn.Module):
    """A causal LM whose labels= loss is torch_chunked_loss; without labels, the model's own forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels=None):
        if labels is None:
            return self.model(input_ids=input_ids)
        return torch_chunked_loss(self.model, input_ids, labels)


def torch_chunked_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, chunks: int = 8) -> torch.Tensor:
    """torchtune's CEWithChunkedOutputLoss, written out: the head and the loss per chunk of tokens."""
    hidden = model.model(input_ids=input_ids).last_hidden_state
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    total = hidden.new_zeros((), dtype=torch.float32)
    for part, target in zip(hidden.chunk(chunks, dim=1), shifted.chunk(chunks, dim=1), strict=True):
        logits = model.lm_head(part).float()
        total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
    return total / (shifted != -100).sum()


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocabulary, (1, args.tokens), generator=generator).to(args.device)
    return ids, ids.clone()


def kept_bytes(args, dtype, method) -> tuple[int, int]:
    """Bytes kept for backward with labels (the loss computed) and without (the model alone)."""
    model, _ = build(args, dtype, method)
    ids, labels = batch(args)
    with_labels = actcomp.memory_report(model, input_ids=ids, labels=labels).total_bytes
    return with_labels, actcomp.memory_report(model, input_ids=ids).total_bytes


def probe(settings: dict) -> None:
    """One method's peaks, in this (fresh) process: on a CPU, the process's VmHWM, the resident
    memory once the model and batch are built, and the second step's peak above its start; on a
    GPU, the second step's allocated peak above its start and the process's allocated and
    reserved peaks (reserved is what an out-of-memory error and nvidia-smi see)."""
    args = argparse.Namespace(**settings)
    torch.set_num_threads(args.threads)
    model, step_loss = build(args, DTYPES[args.dtype], args.method)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, labels = batch(args)
    built = 0 if args.device.startswith("cuda") else resident("VmRSS")

    def step():
        optimizer.zero_grad(set_to_none=False)
        step_loss(ids, labels).backward()
        optimizer.step()

    step()  # gradients and optimizer state allocated: the steady state
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        print(json.dumps({"peak_above_start": torch.cuda.max_memory_allocated() - start,
                          "peak": torch.cuda.max_memory_allocated(), "reserved_peak": torch.cuda.max_memory_reserved()}))
        return
    first_peak = resident("VmHWM")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS
    start = resident("VmRSS")
    step()
    peak = resident("VmHWM")
    print(json.dumps({"peak_above_start": peak - start, "peak": max(first_peak, peak), "built": built}))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape and the threads, as this script and bench_lm_longest.py take them."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocabulary", type=int, default=32_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--allocator", default="as-user", choices=list(ALLOCATORS),
                        help="glibc's setting in the probes (actcomp.tools.peak_rss.ALLOCATORS): as a user's process "
                             "runs, or tuned (MALLOC_MMAP_THRESHOLD_=65536 for every method: resident memory follows "
                             "live memory, plain's too)")


def step_peaks(args: argparse.Namespace, dtype: str, method: str, tokens: int) -> dict:
    """:func:`probe` in a fresh process: the step's peak above its start, and the process's peak."""
    settings = {"tokens": tokens, "layers": args.layers, "hidden": args.hidden, "vocabulary": args.vocabulary,
                "threads": args.threads, "dtype": dtype, "method": method, "device": args.device}
    return run_probe([__file__, "--probe", json.dumps(settings)], env=ALLOCATORS[args.allocator],
                     what=f"{method} {dtype} at {tokens} tokens")


# Which peak the table's `peak` column holds, by where it was measured.
PEAK_MEANING = {
    "training": "the process's peak RSS above its resident memory once the model and batch were built (what "
                "training adds: gradients, AdamW's state, the step's activations and temporaries), each method in "
                "a fresh process, glibc's allocator as it comes (a converted model returns freed buffers to the OS, "
                "actcomp.host_allocator).",
    "step": "the second step's peak RSS above its start (/proc/self/clear_refs before it), each method in a fresh "
            "process with MALLOC_MMAP_THRESHOLD_=65536 for every method (resident memory then follows live "
            "memory, plain's too).",
    "cuda": "the second step's torch.cuda.max_memory_allocated() above memory_allocated() at its start, each "
            "method in a fresh process; `process peak` is max_memory_allocated() over the process, and in brackets "
            "max_memory_reserved() (what an out-of-memory error and nvidia-smi see).",
}


def peak_kind(args: argparse.Namespace) -> str:
    if args.device.startswith("cuda"):
        return "cuda"
    return "step" if args.allocator == "tuned" else "training"


def headline_peak(args: argparse.Namespace, probed: dict) -> int:
    """The probe's peak that the table compares (:data:`PEAK_MEANING`)."""
    return probed["peak"] - probed["built"] if peak_kind(args) == "training" else probed["peak_above_start"]


def resident(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(field + ":")).split()[1]) * 1024


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        probe(json.loads(sys.argv[2]))
        return
    parser = benchmark_parser(__doc__)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048], help="sequence lengths, each measured")
    add_model_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    if "plain" not in args.methods:
        parser.error("--methods needs plain: the ratios are against it")
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    device, lengths, rows = torch.device(args.device), args.tokens, []
    for tokens, dtype_name in [(tokens, dtype_name) for tokens in lengths for dtype_name in args.dtypes]:
        args.tokens, dtype = tokens, DTYPES[dtype_name]
        kept = {method: kept_bytes(args, dtype, method) for method in args.methods}
        # On a GPU the allocator's counters are per process: probes may run side by side there.
        with ThreadPoolExecutor(1 if device.type == "cpu" else 4) as pool:
            measured = pool.map(lambda method, d=dtype_name, n=tokens: step_peaks(args, d, method, n), args.methods)
            probes = dict(zip(args.methods, measured))
        peaks = {method: headline_peak(args, result) for method, result in probes.items()}
        for method in args.methods:
            print(f"{dtype_name} {tokens} tokens {method}: kept {kept[method][0] / 2**20:.1f} MiB, "
                  f"peak +{peaks[method] / 2**20:.0f} MiB", flush=True)
        steps, ids_labels = {}, batch(args)
        for method in args.methods:
            model, step_loss = build(args, dtype, method)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(step_loss=step_loss, optimizer=optimizer, ids_labels=ids_labels):
                optimizer.zero_grad(set_to_none=False)
                step_loss(*ids_labels).backward()
                optimizer.step()

            steps[method] = step
        times = time_rounds(steps, args.rounds, 1, device)
        plain_with, plain_without = kept["plain"]
        for method in args.methods:
            with_labels, without = kept[method]
            summary = ratio_summary(times[method], times["plain"])
            loss_bytes = with_labels - without
            rows.append({"dtype": dtype_name, "tokens": tokens, "method": method, "kept_mib": with_labels / 2**20,
                         "loss_kept_mib": loss_bytes / 2**20, "rest_kept_mib": without / 2**20,
                         "loss_vs_plain": (plain_with - plain_without) / loss_bytes if loss_bytes > 0 else float("inf"),
                         "rest_vs_plain": plain_without / without, "peak_mib": peaks[method] / 2**20,
                         "peak_vs_plain": peaks["plain"] / peaks[method],
                         "process_peak_mib": probes[method]["peak"] / 2**20,
                         "reserved_peak_mib": probes[method].get("reserved_peak", 0) / 2**20,
                         "step_ratio": summary["ratio"],
                         "step_p25": summary["ratio_p25"], "step_p75": summary["ratio_p75"],
                         "step_s": summary["median_s"]})
        del steps

    body = [f"Llama-shaped: hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocabulary}, batch 1 x "
            f"{', '.join(map(str, lengths))} tokens, AdamW. "
            "`loss kept`: bytes kept with labels minus without (the loss's share); "
            "`rest`: the model without its loss; `x plain` columns: plain's bytes (or peak) over the method's. "
            f"`peak`: {PEAK_MEANING[peak_kind(args)]} "
            "Step time: median of per-round ratios to plain, interleaved in one process.", "",
            "| dtype | tokens | method | kept MiB | loss kept MiB | loss x plain | rest MiB | rest x plain | peak MiB "
            f"| peak x plain | process peak MiB{' (reserved)' * (device.type == 'cuda')} | step time |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        reserved = f" ({row['reserved_peak_mib']:.0f})" if device.type == "cuda" else ""
        body.append(f"| {row['dtype']} | {row['tokens']} | {row['method']} | {row['kept_mib']:.1f} "
                    f"| {row['loss_kept_mib']:.2f} | {row['loss_vs_plain']:.1f}x | {row['rest_kept_mib']:.1f} "
                    f"| {row['rest_vs_plain']:.2f}x | +{row['peak_mib']:.0f} | {row['peak_vs_plain']:.2f}x "
                    f"| {row['process_peak_mib']:.0f}{reserved} "
                    f"| **{row['step_ratio']:.2f}x** ({row['step_p25']:.2f}-{row['step_p75']:.2f}) |")
    settings = {"tokens": " ".join(map(str, lengths)), "layers": args.layers, "hidden": args.hidden,
                "vocabulary": args.vocabulary, "rounds": args.rounds, "allocator": args.allocator}
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, settings, load_before)
    write_results("lm_loss", device, args.threads, header, "A language model's loss: plain against chunked losses",
                  body, rows, COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
