"""LoRA and QLoRA: the adapters' gradient against plain's, and the bytes kept, with outliers built in.

    python benchmarks/bench_lora.py          # ~2 minutes on 2 cores (bitsandbytes for the nf4 rows)

A Llama-shaped model from a config (hidden 256, intermediate 768, 2 layers, vocabulary 512)
with a trained model's outlier channels and sink token built in
(``actcomp.tools.llm_outliers.add_outliers``), saved once and loaded as the base in fp32 or,
through bitsandbytes, in nf4 (QLoRA). PEFT LoRA (r 8, every Linear) is added with ``lora_B``
drawn from N(0, 0.02) as a trained adapter's (PEFT starts it at zero, which leaves ``lora_A``
without a gradient at step 0), then the PEFT model converted. One batch of 2 x 256 tokens
starting with the sink token. Reported: the cosine of the adapters' whole gradient, and of
lora_A's and lora_B's apart, against the unconverted PEFT model's (float64), and the bytes kept
for backward (``actcomp.memory_report``, loss inside the forward) against it. Targets (issue
24): cosine >= 0.999 with the default preset, kept >= 4x.

Writes ``benchmarks/results/lora_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.tools.llm_outliers import add_outliers

# (label, Linear/Conv spec, rest)
CONFIGS = [
    ('"mink0.9+int8" (Linear/Conv mode)', "mink0.9+int8", None),
    ('"mink0.9+int8", rest="8bit" (the default preset: on LoRA, SDPA query/key/value bf16, output recomputed; '
     'the loss\'s hidden states int8)',
     "mink0.9+int8", "8bit"),
    ('"mink0.9+int8", rest={"attention": "bf16"} (all of SDPA bf16)', "mink0.9+int8", {"attention": "bf16"}),
    ('"mink0.9+int4", rest="8bit"', "mink0.9+int4", "8bit"),
    ('"mink0.9+int8", rest={"attention": "int8"}', "mink0.9+int8", {"attention": "int8"}),
    ('"mink0.9+int8", rest="4bit"', "mink0.9+int8", "4bit"),
]
COLUMNS = ["base", "config", "adapter_cosine", "lora_a_cosine", "lora_b_cosine", "kept_vs_plain"]


def base_model(folder: str, nf4: bool):
    import transformers

    if nf4:
        quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=torch.float32)
        return transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization,
                                                             device_map="cpu")
    return transformers.LlamaForCausalLM.from_pretrained(folder)


def with_lora(base):
    import peft

    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules="all-linear")).train()
    # PEFT starts lora_B at zero, which leaves lora_A (whose input is the compressed one) without
    # a gradient: a trained adapter's state instead.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    return model


def adapter_gradient(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of every lora_A, every lora_B, and all adapters, each as one float64 vector."""
    model.zero_grad()
    torch.manual_seed(1)
    model(input_ids=ids, labels=ids).loss.backward()
    parts = {part: torch.cat([p.grad.double().reshape(-1) for name, p in model.named_parameters() if part in name])
             for part in ("lora_A", "lora_B")}
    return {**parts, "adapters": torch.cat([parts["lora_A"], parts["lora_B"]])}


def main() -> None:
    import transformers

    parser = benchmark_parser(__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    load_before, started = load_average(), time.perf_counter()
    try:
        import bitsandbytes  # noqa: F401

        bases = ["fp32", "nf4"]
    except ImportError:
        bases = ["fp32"]
    ids = torch.randint(1, 512, (2, 256), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0  # the sink token
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                                          num_attention_heads=8, num_key_value_heads=4)
        model = transformers.LlamaForCausalLM(config)
        add_outliers(model)
        model.save_pretrained(folder)
        for base in bases:
            plain = with_lora(base_model(folder, base == "nf4"))
            reference = adapter_gradient(plain, ids)
            plain_bytes = actcomp.memory_report(plain, input_ids=ids, labels=ids).total_bytes
            for label, spec, rest in CONFIGS:
                converted = actcomp.to_compressed(with_lora(base_model(folder, base == "nf4")), spec, rest=rest)
                gradients = adapter_gradient(converted, ids)
                cosines = {part: float(F.cosine_similarity(gradients[part], reference[part], dim=0))
                           for part in gradients}
                kept = actcomp.memory_report(converted, input_ids=ids, labels=ids).total_bytes
                rows.append({"base": base, "config": label, "adapter_cosine": cosines["adapters"],
                             "lora_a_cosine": cosines["lora_A"], "lora_b_cosine": cosines["lora_B"],
                             "kept_vs_plain": plain_bytes / kept})
                print(f"{base} {label}: cosine {cosines['adapters']:.5f} (A {cosines['lora_A']:.5f}, "
                      f"B {cosines['lora_B']:.5f}), {plain_bytes / kept:.2f}x fewer bytes", flush=True)
    body = ["The adapters' gradient cosine against the unconverted PEFT model's, and its bytes kept over the "
            "converted model's; outlier channels and a sink token built in. Targets: cosine >= 0.999 with the "
            "default preset, kept >= 4x. lora_A's gradient is the one that reads the compressed input "
            "(lora_B's reads lora_A's output, kept as is).", "",
            "| base | conversion | adapters' cosine | lora_A | lora_B | fewer bytes |", "|---|---|---:|---:|---:|---:|"]
    body += [f"| {row['base']} | `{row['config']}` | **{row['adapter_cosine']:.5f}** | {row['lora_a_cosine']:.5f} "
             f"| {row['lora_b_cosine']:.5f} | {row['kept_vs_plain']:.2f}x |" for row in rows]
    device = torch.device("cpu")
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, {"bases": " ".join(bases)},
                          load_before)
    write_results("lora", device, args.threads, header, "LoRA and QLoRA with outliers built in", body, rows,
                  COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
