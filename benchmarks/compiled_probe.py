"""One fresh process of ``bench_compiled.py``: a ``torch.compile`` d timm training step under one
configuration; prints one JSON line (the median step time, the step's peak RSS above the memory
held before it; on a CPU the same from a start with glibc's free heap handed back, and the peak of
its live tensors' bytes; and the first call's compile time)."""

import argparse
import ctypes
import ctypes.util
import json
import statistics
import time

import timm
import torch

import actcomp


def high_water_mark() -> int:
    status = open("/proc/self/status").read()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def resident() -> int:
    status = open("/proc/self/status").read()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def trimmed_rss_peak(step) -> int:
    """The step's RSS peak above its start, with glibc's free heap handed back first
    (``malloc_trim``): each configuration then pays for the heap pages its own step touches."""
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    before = resident()
    reset_high_water_mark()
    step()
    return high_water_mark() - before


def live_peak(step) -> int:
    """The highest sum of the bytes ``step`` allocated and has not freed, over its run: torch's
    CPU allocations as the profiler records them, whatever glibc keeps resident beside them (the
    RSS peak also counts what the heap holds free from before the step: the same step measured
    up to 3 MiB apart by that alone)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        step()
    events = sorted((event for event in profile.profiler.kineto_results.events() if event.name() == "[memory]"),
                    key=lambda event: event.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", required=True, choices=["plain", "fp8-pass", "actcomp-8bit", "actcomp-4bit", "actcomp-exact",
                                                            "converted-8bit"])
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--img-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda (peak allocated)")
    parser.add_argument("--mode", default="default", choices=["default", "reduce-overhead"],
                        help="torch.compile's mode (reduce-overhead: CUDA graphs, on CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.config == "fp8-pass":
        # Inductor's own pass: saved activations of at least 1 MiB stored as fp8 (e5m2), scaled.
        torch._inductor.config.post_grad_fusion_options = {"activation_quantization_aten_pass": {
            "allowed_dtypes": "torch.float32", "size_in_mb": 1, "use_scaling": True,
            "quant_type": "torch.float8_e5m2"}}
    kwargs = {"img_size": args.img_size} if "vit" in args.model else {}
    model = timm.create_model(args.model, pretrained=False, num_classes=10, **kwargs).train().to(device)
    if args.config == "converted-8bit":  # as users write it: torch.compile(to_compressed(...))
        model = actcomp.to_compressed(model, "int8", rest="8bit")
    compiled = torch.compile(model, mode=None if args.mode == "default" else args.mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    hooks = {"actcomp-8bit": ("int8", "8bit"), "actcomp-4bit": ("int4", "4bit"),
             "actcomp-exact": (None, "exact")}.get(args.config)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if hooks is None:
            loss = torch.nn.functional.cross_entropy(compiled(x), y)
        else:
            with actcomp.compress_in_graph(hooks[0], rest=hooks[1]):
                loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    compile_s = step()
    step()
    times = [step() for _ in range(args.steps)]
    # The peak above what the step starts from: parameters, optimizer state, no gradients.
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = resident()
        reset_high_water_mark()
        step()
        peak = high_water_mark() - before
    optimizer.zero_grad(set_to_none=True)
    trimmed = peak if device.type == "cuda" else trimmed_rss_peak(step)
    optimizer.zero_grad(set_to_none=True)
    live = peak if device.type == "cuda" else live_peak(step)
    print(json.dumps({"step_s": statistics.median(times), "peak_bytes": peak, "trimmed_peak_bytes": trimmed,
                      "live_peak_bytes": live,
                      "compile_s": compile_s,
                      "actcomp_file": actcomp.__file__}))


if __name__ == "__main__":
    main()
