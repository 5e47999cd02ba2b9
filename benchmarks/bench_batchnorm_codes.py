"""BatchNorm inputs in fewer bits: the bytes a ResNet keeps and the gradient it gets (issue 39,
item 5: resnet50 under bf16 autocast keeps 3.1x fewer bytes under ``rest="8bit"``, target 4x).

    python benchmarks/bench_batchnorm_codes.py          # ~3 minutes on 2 cores

timm's resnet50 (random weights, ``zero_init_last=False`` so every convolution has a gradient),
fp32 and under CPU bf16 autocast. For each code of the normalization kind (every other kind as
``rest="8bit"`` has it; Linear/Conv inputs ``mink0.9+int8``):

- **kept**: plain's bytes kept for backward over the converted model's (``memory_report``, batch
  8 at 224 px);
- **cosine**: the whole gradient's cosine against plain's with the normalization kind alone lossy
  (Linear/Conv inputs and every other kind exact; batch 8 at 128 px, so layer4's BatchNorm
  channels still normalize 128 values each).

Writes ``benchmarks/results/batchnorm_codes_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp

# The normalization kind's code, by label: a spec for every norm, or (None) the "8bit" preset's own
# (since stop 57: int8, and int4:group=64 for a BatchNorm input in bf16 or fp16).
CODES = {"int8": "int8", "int4:group=64": "int4:group=64", "int4": "int4", "int2:group=32": "int2:group=32",
         '"8bit"': None}
COLUMNS = ["dtype", "normalization", "kept_ratio", "cosine"]


def autocast(dtype: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def gradient(model: torch.nn.Module, images: torch.Tensor, dtype: str) -> torch.Tensor:
    model.zero_grad()
    torch.manual_seed(0)
    with autocast(dtype):
        out = model(images)
    direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out.float() * direction).sum().backward()
    return torch.cat([p.grad.double().reshape(-1) for p in model.parameters() if p.grad is not None])


def main() -> None:
    import timm

    parser = benchmark_parser(__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    torch.manual_seed(0)
    base = timm.create_model("resnet50", pretrained=False, zero_init_last=False)
    big, small = torch.randn(8, 3, 224, 224), torch.randn(8, 3, 128, 128)
    rows = []
    for dtype in ("fp32", "bf16"):
        with autocast(dtype):
            plain = actcomp.memory_report(copy.deepcopy(base), big).total_bytes
        reference = gradient(copy.deepcopy(base), small, dtype)
        for code, spec in CODES.items():
            normalization = {} if spec is None else {"normalization": spec}
            converted = actcomp.to_compressed(copy.deepcopy(base), "mink0.9+int8", rest=normalization or "8bit")
            with autocast(dtype):
                kept = actcomp.memory_report(converted, big).total_bytes
            alone = actcomp.to_compressed(copy.deepcopy(base), "mink0", loss="plain", rest={
                "activation": "exact", "attention": "exact", **normalization})
            cosine = float(F.cosine_similarity(gradient(alone, small, dtype), reference, dim=0))
            rows.append({"dtype": dtype, "normalization": code, "kept_ratio": plain / kept, "cosine": cosine})
            print(f"{dtype} {code}: {plain / kept:.2f}x fewer bytes, cosine {cosine:.5f}", flush=True)
    body = ["Kept: plain's bytes over the converted model's (`\"mink0.9+int8\"`, `rest=\"8bit\"` with the "
            "normalization code of the row; `\"8bit\"`: the preset's own, int8 and, since stop 57, int4:group=64 for "
            "a BatchNorm input in bf16 or fp16). Cosine: the whole gradient against plain's with "
            "the normalization kind alone lossy.", "",
            "| normalization code | fp32: kept | fp32: cosine | bf16: kept | bf16: cosine |", "|---|---:|---:|---:|---:|"]
    for code in CODES:
        fp32, bf16 = (next(row for row in rows if row["dtype"] == dtype and row["normalization"] == code)
                      for dtype in ("fp32", "bf16"))
        body.append(f"| `{code}` | {fp32['kept_ratio']:.2f}x | {fp32['cosine']:.5f} | {bf16['kept_ratio']:.2f}x "
                    f"| {bf16['cosine']:.5f} |")
    device = torch.device("cpu")
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, {"model": "resnet50"}, load_before)
    write_results("batchnorm_codes", device, args.threads, header, "BatchNorm inputs in fewer bits (resnet50)", body,
                  rows, COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
