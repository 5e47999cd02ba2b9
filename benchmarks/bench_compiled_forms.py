"""What the compiled engine keeps of each saved tensor: a converted model compiled as users write
it, one training step, every form the pack hook chose with its count and bytes.

    python benchmarks/bench_compiled_forms.py                      # ViT-S, batch 16, 128 px (~1 minute)
    python benchmarks/bench_compiled_forms.py --model resnet18 --rest 4bit

``torch.compile(actcomp.to_compressed(model, SPEC, rest=REST))`` runs one step with Inductor's
caches off (a graph served from a cache retraces no hook); the benchmark wraps
:func:`actcomp.whole_model.in_graph._pack`, groups what it returned by form (the codec, or "as
is") and dtype, and prints each group's dense and kept bytes. The bytes are deterministic: they
follow from the model, the batch and the policy, not from the machine. A converted Linear/Conv
layer's own codes pass the hooks too, as uint8 tensors kept as they are.
"""

from __future__ import annotations

import collections
import time

import timm
import torch
from common import REPO_ROOT, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.whole_model import in_graph


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="vit_small_patch16_224", help="timm model name")
    parser.add_argument("--spec", default="int8", help="the Linear/Conv pipeline")
    parser.add_argument("--rest", default="8bit", help="the whole-model policy")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--img-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, load_before = time.time(), load_average()

    forms = []
    pack = in_graph._pack

    def recording(saved, plan):
        packed = pack(saved, plan)
        dense = saved.numel() * saved.element_size()
        if isinstance(packed, tuple):  # (template key, shape, *tensors)
            form, kept = packed[0].split(" PackedLayout")[0], sum(t.numel() * t.element_size() for t in packed[2:])
        else:
            form, kept = "as is", dense
        forms.append((form, str(saved.dtype).removeprefix("torch."), dense, kept))
        return packed

    in_graph._pack = recording
    in_graph._hooks.cache_clear()  # hooks that call the wrapper
    torch.manual_seed(args.seed)
    model = timm.create_model(args.model, num_classes=10, img_size=args.img_size)
    step = torch.compile(actcomp.to_compressed(model, args.spec, rest=args.rest))
    inputs = torch.randn(args.batch, 3, args.img_size, args.img_size)
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        step(inputs).square().mean().backward()

    groups: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    # AOTAutograd traces each pack hook twice (once to find the saved tensors, once to inline it).
    for form, dtype, dense, kept in forms[::2]:
        group = groups[(form, dtype)]
        group[0] += 1
        group[1] += dense
        group[2] += kept
    rows = [{"form": form, "dtype": dtype, "tensors": count, "dense_mib": dense / 2**20, "kept_mib": kept / 2**20}
            for (form, dtype), (count, dense, kept) in sorted(groups.items(), key=lambda item: -item[1][2])]
    total_dense, total_kept = sum(row["dense_mib"] for row in rows), sum(row["kept_mib"] for row in rows)
    body = ["| form | dtype | tensors | dense | kept |", "|---|---|---:|---:|---:|"]
    body += [f"| `{row['form']}` | {row['dtype']} | {row['tensors']} | {row['dense_mib']:.1f} MiB | "
             f"{row['kept_mib']:.1f} MiB |" for row in rows]
    body += [f"| all | | {sum(row['tensors'] for row in rows)} | {total_dense:.1f} MiB | {total_kept:.1f} MiB |"]
    for line in body:
        print(line)
    settings = {"model": args.model, "spec": args.spec, "rest": args.rest, "batch": args.batch, "img_size": args.img_size}
    header = header_lines(torch.device("cpu"), args.threads, args.seed, time.time() - start, settings, load_before)
    write_results("compiled_forms", torch.device("cpu"), args.threads, header,
                  f"What the compiled engine keeps of {args.model}'s saved tensors", body, rows, list(rows[0]),
                  REPO_ROOT / "benchmarks" / "results")


if __name__ == "__main__":
    main()
