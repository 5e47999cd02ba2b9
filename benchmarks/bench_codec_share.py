"""Where a converted step's codec time goes: per codec, direction and implementation, the time
spent inside it during one training step, beside the step itself.

    python benchmarks/bench_codec_share.py                                # resnet18 and ViT-S, 1 thread
    python benchmarks/bench_codec_share.py --models resnet50 --threads 2 --steps 3

Each model (timm names), converted as ``step_probe.py`` converts it, takes two warm-up steps, then
``--steps`` steps with every call of :func:`actcomp.core.backends` ``encode``/``decode`` timed (the
registry's one entry point: whole-model codecs and the quantizer stage of a Linear/Conv layer's
pipeline; a sparsifier's selection runs inside its own encode, which the registry does not
dispatch, so Linear/Conv min-k appears only through its quantizer). The table lists, per
``codec / direction / implementation / input dtype``, calls, milliseconds a step, millions of
elements and nanoseconds per element, the largest first: a codec still on its eager reference
(``eager``) where a kernel could run shows up at once. Times are wall clock in one process and
move with the machine's load; read them as where the time goes, not as ratios.
"""

from __future__ import annotations

import collections
import copy
import time

import timm
import torch
from common import REPO_ROOT, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.core import backends


def codec_times(model_name: str, args) -> tuple[list[dict], float]:
    """The rows of one model's table, and its step's milliseconds (the median of ``--steps``)."""
    torch.manual_seed(0)
    model = timm.create_model(model_name, pretrained=False, num_classes=10)
    rest = None if args.rest == "none" else args.rest
    model = actcomp.to_compressed(copy.deepcopy(model), args.spec, rest=rest).train()
    x = torch.randn(args.batch, 3, args.img_size, args.img_size)
    y = torch.randint(0, 10, (args.batch,))

    def step() -> float:
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        return time.perf_counter() - start

    step()
    step()
    totals: dict[tuple, list] = collections.defaultdict(lambda: [0, 0.0, 0])
    original = backends._run

    def timed(codec, method, call_args, backend):
        name = backends._chosen_implementation(codec, method, call_args, backends._asked(backend))[0]
        start = time.perf_counter()
        result = original(codec, method, call_args, backend)
        entry = totals[(type(codec).__name__, method, name, str(call_args[0].dtype).replace("torch.", ""))]
        entry[0] += 1
        entry[1] += time.perf_counter() - start
        entry[2] += call_args[0].numel()
        return result

    backends._run = timed
    try:
        steps = sorted(step() for _ in range(args.steps))
    finally:
        backends._run = original
    rows = [{"model": model_name, "codec": key[0], "direction": key[1], "implementation": key[2], "dtype": key[3],
             "calls_per_step": calls / args.steps, "ms_per_step": seconds * 1e3 / args.steps,
             "M_elements_per_step": elements / args.steps / 1e6, "ns_per_element": seconds * 1e9 / max(elements, 1)}
            for key, (calls, seconds, elements) in totals.items()]
    return sorted(rows, key=lambda row: -row["ms_per_step"]), steps[len(steps) // 2] * 1e3


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["resnet18", "vit_small_patch16_224"])
    parser.add_argument("--spec", default="mink0.9+int8")
    parser.add_argument("--rest", default="8bit", help="rest= ('none': Linear/Conv mode)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="codec_share")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, load_before = time.time(), load_average()
    rows, body = [], []
    for model_name in args.models:
        model_rows, step_ms = codec_times(model_name, args)
        rows += model_rows
        inside = sum(row["ms_per_step"] for row in model_rows)
        body += [f"**{model_name}**: step {step_ms:.0f} ms, of it {inside:.1f} ms inside the registry's codecs", "",
                 "| codec | direction | implementation | input dtype | calls / step | ms / step | M elements | ns / element |",
                 "|---|---|---|---|---:|---:|---:|---:|"]
        body += [f"| {r['codec']} | {r['direction']} | {r['implementation']} | {r['dtype']} | {r['calls_per_step']:.0f} | "
                 f"{r['ms_per_step']:.2f} | {r['M_elements_per_step']:.2f} | {r['ns_per_element']:.2f} |"
                 for r in model_rows]
        body.append("")
    print("\n".join(body))
    header = header_lines(torch.device("cpu"), args.threads, 0, time.time() - start,
                          {"spec": args.spec, "rest": args.rest, "batch": args.batch, "img_size": args.img_size,
                           "steps": args.steps}, load_before)
    write_results(args.name, torch.device("cpu"), args.threads, header, "Codec time inside a converted step",
                  body, rows, list(rows[0]), REPO_ROOT / "benchmarks" / "results")


if __name__ == "__main__":
    main()
