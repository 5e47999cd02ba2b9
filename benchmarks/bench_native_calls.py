"""Where a converted CPU step's native codec time goes: each C kernel's milliseconds a step, its
calls, and its time per call, by the size of the last tensor the call passes (a decode's output;
an encode's last output, such as a quantizer's scales).

    python benchmarks/bench_native_calls.py                              # ViT-S, batch 4, 2 threads
    python benchmarks/bench_native_calls.py --models resnet50 --threads 1

For each timm model, ``to_compressed(model, SPEC, rest=REST)`` as a user converts it (the mmap
threshold of :mod:`actcomp.host_allocator` included), two warm-up steps (SGD), then ``--steps``
steps with every call into :mod:`actcomp.kernels.native_cpu` timed (wall clock around the call:
a decode's page faults on a fresh buffer land in its kernel's time). One process; the figures are
absolute times on a shared machine, to compare kernels within a run, not runs with each other.
"""

from __future__ import annotations

import collections
import time

import timm
import torch
from common import REPO_ROOT, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.kernels import native_cpu


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["vit_small_patch16_224"])
    parser.add_argument("--spec", default="mink0.9+int8")
    parser.add_argument("--rest", default="8bit")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, load_before = time.time(), load_average()

    spent: dict[tuple[str, int], float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    timing = [False]
    call = native_cpu._call

    def timed(name, tensors, *rest, **options):
        begin = time.perf_counter()
        result = call(name, tensors, *rest, **options)
        if timing[0]:
            written = tensors[-1].numel() * tensors[-1].element_size() if tensors else 0  # a decode's output
            spent[(name, written)] += time.perf_counter() - begin
            calls[(name, written)] += 1
        return result

    native_cpu._call = timed
    rows, body = [], ["| model | kernel | last tensor's bytes | calls a step | ms a call | ms a step |",
                      "|---|---|---:|---:|---:|---:|"]
    for name in args.models:
        spent.clear()
        calls.clear()
        torch.manual_seed(args.seed)
        model = actcomp.to_compressed(timm.create_model(name, num_classes=10), args.spec, rest=args.rest)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        inputs = torch.randn(args.batch, 3, args.img_size, args.img_size)
        labels = torch.randint(0, 10, (args.batch,))

        for _ in range(2):
            _step(model, optimizer, inputs, labels)
        timing[0] = True
        begin = time.perf_counter()
        for _ in range(args.steps):
            _step(model, optimizer, inputs, labels)
        step_ms = (time.perf_counter() - begin) / args.steps * 1e3
        timing[0] = False
        total = sum(spent.values()) / args.steps * 1e3
        print(f"{name}: step {step_ms:.0f} ms, native kernels {total:.1f} ms a step")
        for (kernel, written), seconds in sorted(spent.items(), key=lambda item: -item[1]):
            per_step = seconds / args.steps * 1e3
            row = {"model": name, "kernel": kernel, "last_tensor_bytes": written, "calls_per_step": calls[(kernel, written)]
                   / args.steps, "ms_per_call": seconds / calls[(kernel, written)] * 1e3, "ms_per_step": per_step}
            rows.append(row)
            if per_step >= 0.5:
                body.append(f"| {name} | `{kernel}` | {written:,} | {row['calls_per_step']:.0f} | "
                            f"{row['ms_per_call']:.3f} | {per_step:.2f} |")
        body.append(f"| {name} | all (step {step_ms:.0f} ms) | | | | {total:.1f} |")
    for line in body:
        print(line)
    settings = {"models": " ".join(args.models), "spec": args.spec, "rest": args.rest, "batch": args.batch,
                "img_size": args.img_size, "steps": args.steps}
    header = header_lines(torch.device("cpu"), args.threads, args.seed, time.time() - start, settings, load_before)
    write_results("native_calls", torch.device("cpu"), args.threads, header,
                  "Native codec kernels in a converted step, by kernel and buffer size", body, rows, list(rows[0]),
                  REPO_ROOT / "benchmarks" / "results")


def _step(model, optimizer, inputs, labels) -> None:
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
