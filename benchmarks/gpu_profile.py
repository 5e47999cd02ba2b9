"""Where a converted step's time goes on a GPU: the kernels, their time on the device, and the
device's idle share (the host's Python and launches keeping it waiting).

    python benchmarks/gpu_profile.py --device cuda --out-dir DIR     # gpu_check runs this
    python benchmarks/gpu_profile.py --device cpu --batch 2 --img-size 32 --shape 4x197x384   # a smoke run

The H200 run of stop 44 measured whole-model steps at 3-5x plain's with the Triton kernels, and a
``mink0.9+int8`` round trip of a (32, 197, 384) tensor at 0.65 ms against a clone's 0.02: from the
times alone it cannot tell a slow kernel from a waiting device. This profiles, with
``torch.profiler``:

1. **round trips** (``compress`` then ``decompress``) of each spec on a tensor of ``--shape``:
   per kernel, its launches and device µs per round trip;
2. **training steps** (``bench_training_speed``'s workloads: forward, loss, backward, SGD) of
   each model plain and converted: the step's wall time (synchronized, median of ``--steps``
   unprofiled steps), the device's kernel time and launches per step (profiled), the idle share
   ``1 - kernel time / wall time``, and the kernels taking the most device time;
3. **the host's Python** in each converted step (``cProfile``, ``--host-top`` functions by own
   time): where the device waits, what it waits for.

On a CPU there are no device kernels: the tables list the ATen ops' CPU time instead (a smoke
test of the script, not a figure).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from bench_compressors import CODEC_PREFIX, stage_for
from bench_training_speed import create_workload, step_fn
from common import RESULTS_DIR, header_lines, load_average, parse_shape, synchronize, write_results
from torch.profiler import ProfilerActivity, profile

import actcomp

TOP = 12


def _device_us(event) -> float:
    """An averaged event's own device time (µs), under either of torch's names for it."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _profiled(call, device: torch.device, repeats: int) -> list[tuple[str, int, float]]:
    """``(name, calls, µs)`` per op or kernel over ``repeats`` calls of ``call``, by device time
    on a GPU (kernels only) and by CPU time on a CPU, most first; each figure per call."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    call()
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            call()
        synchronize(device)
    # On a GPU, a device-side range named as a host-side one (an ``aten::`` op, an autograd
    # Function such as ``CompressedInputFunction``) repeats its kernels' time: only names that
    # never ran on the host are kernels. (``is_user_annotation`` missed the Functions' ranges on
    # torch 2.11: stop 52's H200 profile summed them and found the device idle -18% of a step.)
    host_names = _host_names(prof.events()) if device.type == "cuda" else set()
    rows = []
    for event in prof.key_averages():
        if getattr(event, "is_user_annotation", False) or event.key in host_names:
            continue
        micros = _device_us(event) if device.type == "cuda" else float(event.self_cpu_time_total)
        if micros > 0:
            rows.append((event.key, event.count / repeats, micros / repeats))
    return sorted(rows, key=lambda row: -row[2])


def _host_names(events) -> set[str]:
    """The names of ``events`` (a profile's) that ran on the host: ops, ranges, autograd Functions.

    >>> from types import SimpleNamespace as E
    >>> from torch.autograd import DeviceType
    >>> sorted(_host_names([E(name="aten::mm", device_type=DeviceType.CPU),
    ...                     E(name="_quantize_kernel", device_type=DeviceType.CUDA)]))
    ['aten::mm']
    """
    from torch.autograd import DeviceType

    return {event.name for event in events if event.device_type == DeviceType.CPU}


def _wall_ms(call, device: torch.device, steps: int) -> float:
    times = []
    for _ in range(steps):
        synchronize(device)
        started = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _table(heading: str, rows: list[tuple[str, float, float]], unit: str, divisor: float) -> list[str]:
    """A ``###`` heading and the first :data:`TOP` rows as a markdown table, µs divided by ``divisor``."""
    table = [f"### {heading}", "", f"| kernel | launches | {unit} |", "|---|---:|---:|"]
    table += [f"| `{name[:90]}` | {calls:.0f} | {micros / divisor:.{1 if divisor == 1 else 2}f} |"
              for name, calls, micros in rows[:TOP]]
    return [*table, ""]


def round_trips(specs: list[str], shape: tuple[int, ...], device: torch.device, repeats: int) -> list[str]:
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, device=device, dtype=dtype)
        for spec in specs:
            pipeline = stage_for(spec)
            channel_dim = 1 if len(shape) == 4 else -1
            # A mask codec packs what a ReLU saves, its output.
            values = torch.relu(x) if spec.startswith(CODEC_PREFIX) else x

            def call(pipeline=pipeline, x=values, channel_dim=channel_dim):
                pipeline.decompress(pipeline.compress(x, channel_dim=channel_dim))

            rows = _profiled(call, device, repeats)
            total = sum(row[2] for row in rows)
            launches = sum(row[1] for row in rows)
            wall = _wall_ms(call, device, repeats) * 1e3
            lines += _table(f"`{spec}`, {'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}: "
                            f"{launches:.0f} launches, {total:.0f} µs on the device, {wall:.0f} µs wall per round trip",
                            rows, "µs", 1.0)
            print(f"round trip {spec} {dtype}: {launches:.0f} launches, {total:.0f} us device, {wall:.0f} us wall", flush=True)
    return lines


def steps(models: list[str], specs: list[str], args: argparse.Namespace, device: torch.device) -> list[str]:
    lines = []
    for name in models:
        torch.manual_seed(args.seed)
        plain, inputs, loss = create_workload(name, args, device)
        for spec in ["plain", *specs]:
            if spec == "plain":
                model = plain
            else:
                linear, _, rest = spec.partition("@")
                model = actcomp.to_compressed(copy.deepcopy(plain), linear, rest=rest or None)
            step = step_fn(model, inputs, loss)
            step()
            wall = _wall_ms(step, device, args.steps)
            rows = _profiled(step, device, 2)
            kernel_ms = sum(row[2] for row in rows) / 1e3
            launches = sum(row[1] for row in rows)
            idle = 1 - kernel_ms / wall if device.type == "cuda" else float("nan")
            lines += _table(f"{name}, `{spec}`: wall {wall:.1f} ms, kernels {kernel_ms:.1f} ms in {launches:.0f} "
                            f"launches, device idle {idle:.0%} of the step", rows, "ms per step", 1e3)
            print(f"{name} {spec}: wall {wall:.1f} ms, kernels {kernel_ms:.1f} ms, {launches:.0f} launches", flush=True)
            if args.host_top and spec != "plain":
                lines += _host_profile(f"{name}, `{spec}`", step, device, args.host_top)
            del model, step
    return lines


def _host_profile(heading: str, step, device: torch.device, top: int) -> list[str]:
    """The host's Python in 3 steps under ``cProfile``: the ``top`` functions by own time, per
    step (what keeps the device waiting where the idle share is high)."""
    import cProfile
    import pstats

    synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        step()
    synchronize(device)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    total = sum(entry[2] for entry in stats.stats.values()) / 3 * 1e3
    table = [f"#### host: {heading}, {total:.1f} ms of Python own time per step (cProfile, 3 steps)", "",
             "| function | calls per step | own ms per step | with callees ms |", "|---|---:|---:|---:|"]
    for (file, line, function), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(file).name}:{line} {function}" if line else function
        table.append(f"| `{where[:90]}` | {calls / 3:.0f} | {own / 3 * 1e3:.2f} | {cumulative / 3 * 1e3:.2f} |")
    return [*table, ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_small_patch16_224"])
    parser.add_argument("--specs", nargs="+", default=["mink0.9+int8@8bit", "int8@8bit", "int8"],
                        help="SPEC or SPEC@REST (whole-model), as bench_training_speed takes them")
    parser.add_argument("--codecs", nargs="+", default=["int8", "fp8", "codec:relu-mask", "smink0.9", "mink0.9",
                                                        "smink0.9+int8", "mink0.9+int8"])
    parser.add_argument("--shape", type=parse_shape, default=(32, 197, 384))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5, help="unprofiled steps timed for the wall time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host-top", type=int, default=25,
                        help="functions listed from a cProfile of each converted step's host Python (0: none)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    started, load_before = time.perf_counter(), load_average()
    body = ["Per round trip and per step: kernels by device time (on a CPU, ATen ops by CPU time); "
            "`device idle`: 1 - kernel time / wall time, the share of the step the device waits on the host.", "",
            "## Round trips", ""]
    body += round_trips(args.codecs, args.shape, device, 10)
    body += ["## Training steps", ""] + steps(args.models, args.specs, args, device)
    settings = {"batch": args.batch, "img_size": args.img_size, "shape": "x".join(map(str, args.shape))}
    header = header_lines(device, torch.get_num_threads(), args.seed, time.perf_counter() - started, settings, load_before)
    write_results("gpu_profile", device, torch.get_num_threads(), header, "Where a converted step's time goes",
                  body, [], [], args.out_dir)


if __name__ == "__main__":
    main()
