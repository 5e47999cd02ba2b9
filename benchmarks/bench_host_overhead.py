"""The host's time on the GPU path, kernels left out: what keeps a GPU waiting.

    python benchmarks/bench_host_overhead.py                 # results under benchmarks/results/
    python benchmarks/bench_host_overhead.py --rounds 10     # quicker
    python benchmarks/bench_host_overhead.py --device cuda   # on a GPU: with the launches, and without

On a GPU a converted step costs the codecs' kernels plus the host's time around them (Python, ATen
calls, Triton's launcher); when the host's time per layer passes the device's, the device waits
and the step is the host's. The H200 run of stop 44 put `int8` in Linear/Conv mode at 1.86x
plain's resnet50 step, where its kernels move a few percent of the bytes a step moves: the host's
share. This measures that share on any machine: the Triton path (``use_backend("triton")``, the
path CUDA tensors take) on small CPU tensors with every Triton launch replaced by a stub that
only counts it, so what is timed is everything but the kernels and Triton's own launcher (a few
µs a launch on a GPU, counted here as launches).

- **layers**: a stack of 12 ``Linear(64, 64)`` + GELU on an (8, 64) input, converted with
  ``to_compressed(model, spec)``: the extra host µs per layer of a training step (forward and
  backward) over the plain stack's;
- **whole model**: ViT-S at 32 px, batch 2, converted with ``rest``: per saved tensor, the
  host µs of the whole-model hooks (pack and unpack, the codec's time included) for the tensors
  they compress and for those they keep as they are, timed inside the hooks;
- **round trips**: ``compress`` then ``decompress`` of a (64, 384) tensor, host µs.

Each other figure is the fastest of ``--rounds`` interleaved rounds (host time is what noise adds to);
the stubbed kernels leave garbage in the codes, which nothing here reads.

With ``--device cuda`` every figure is taken twice on CUDA tensors, with the kernels launched
(``host µs``; the tensors are small, so the device keeps up and the time is the host's) and with
the launches stubbed (``stubbed µs``: actcomp's Python and ATen calls alone); what the launches
add, per launch, is Triton's launcher and its CUDA calls. A first table then times one launch of
a codec kernel (``_dequantize_kernel``, 15 arguments) as ``kernel[grid](...)``, through
:func:`actcomp.kernels.triton_runtime.launch`, and the CUDA calls around it (``torch.empty``,
the device guard). The stop 52 profile on an H200 put an ``int8`` round trip of 32x197x384 at 14
µs of kernels in 229 µs of wall time, where this harness with stubs measured 40 µs of Python on
a CPU: this says where the rest goes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import math
import os
import sys
import time
from pathlib import Path


def _asks_for_cuda(argv: list[str]) -> bool:
    """Whether the command line says ``--device cuda`` (read before argparse runs: the
    interpreter's switch must be set, or not, before triton is imported)."""
    return "--device=cuda" in argv or any(a == "--device" and b == "cuda" for a, b in zip(argv, argv[1:]))


if not _asks_for_cuda(sys.argv):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton path on CPU tensors; set before triton loads

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import RESULTS_DIR, header_lines, load_average, synchronize, write_results  # noqa: E402

import actcomp  # noqa: E402
from actcomp.core.backends import use_backend  # noqa: E402
from actcomp.kernels import triton_runtime  # noqa: E402

KERNEL_MODULES = ("triton_affine", "triton_masks", "triton_select", "triton_casts", "triton_flags",
                  "triton_channels", "triton_mesa")
COLUMNS = ["what", "spec", "host_us", "stubbed_us", "launches", "us_per_launch"]


def _counted_only(kernel, grid, *args, **meta):
    triton_runtime.LAUNCHES[kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__] += 1


@contextlib.contextmanager
def launches_stubbed(stubbed: bool = True):
    """Inside, every Triton launch only counted (where ``stubbed``), as before after."""
    modules = [importlib.import_module(f"actcomp.kernels.{name}") for name in KERNEL_MODULES]
    before = [module.launch for module in modules]
    if stubbed:
        for module in modules:
            module.launch = _counted_only
    try:
        yield
    finally:
        for module, launch in zip(modules, before, strict=True):
            module.launch = launch


def fastest(calls: dict[str, callable], rounds: int, repeats: int,
            device: torch.device | None = None) -> dict[str, float]:
    """Seconds per call of each, the fastest of ``rounds`` interleaved rounds of ``repeats`` calls
    (on a GPU, each round waits for the device at its end: its kernels are small, and a round
    that outran the device would time the device)."""
    best = dict.fromkeys(calls, float("inf"))
    for call in calls.values():
        for _ in range(3):
            call()
    device = device or torch.device("cpu")
    synchronize(device)
    for _ in range(rounds):
        for label, call in calls.items():
            started = time.perf_counter()
            for _ in range(repeats):
                call()
            synchronize(device)
            best[label] = min(best[label], (time.perf_counter() - started) / repeats)
    return best


def launches_of(call) -> int:
    triton_runtime.LAUNCHES.clear()
    call()
    return sum(triton_runtime.LAUNCHES.values())


def layers(specs: list[str], rounds: int, device: torch.device) -> list[dict]:
    count = 12
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(count)])
    plain = plain.to(device)
    x = torch.randn(8, 64, requires_grad=True, device=device)
    models = {"plain": plain, **{spec: actcomp.to_compressed(copy.deepcopy(plain), spec, first_layer=None)
                                 for spec in specs}}
    rows = []
    # Under bf16 autocast too: stop 52's H200 put int8's ViT-S step at 1.05x plain's in fp32 and
    # 2.35x under autocast, where plain's step is half as long.
    for autocast in (False, True):
        def call(model, autocast=autocast):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                out = model(x).float().sum()
            out.backward()

        calls = {label: functools.partial(call, model) for label, model in models.items()}
        best = fastest(calls, rounds, 20, device)
        rows += [{"what": "layer, bf16 autocast" if autocast else "layer", "spec": spec,
                  "host_us": (best[spec] - best["plain"]) / count * 1e6, "launches": launches_of(calls[spec]) / count}
                 for spec in specs]
    return rows


class _HookClock:
    """Times whole-model mode's pack and unpack hooks, apart for the tensors they compress and
    the ones they keep as they are (benchmark-only wrappers around the session's hooks)."""

    def __init__(self):
        from actcomp.whole_model import compressed_model, session

        try:
            from actcomp.whole_model.kept_forms import AsIs
        except ImportError:  # a tree from before stop 46, when the session module held the forms
            AsIs = session._AsIs
        self.session, self.kept_as_is = session, AsIs
        self.seconds = {"compressed": 0.0, "kept": 0.0}
        self.calls = {"compressed": 0, "kept": 0}
        self.pack = session._Session.pack
        # Since stop 61 the hooks' unpack is the session's own (a staticmethod); before, the
        # module function compressed_model imported.
        if "unpack" in vars(session._Session):
            self.unpack_owner, self.unpack_name = session._Session, "unpack"
            self.unpack, self.unpack_held = session._Session.unpack, vars(session._Session)["unpack"]
        else:
            self.unpack_owner, self.unpack_name = compressed_model, "_unpack"
            self.unpack = self.unpack_held = compressed_model._unpack

    def __enter__(self):
        clock, pack, unpack, kept = self, self.pack, self.unpack, self.kept_as_is

        def timed_pack(session, tensor):
            started = time.perf_counter()
            holder = pack(session, tensor)
            clock.add(not isinstance(holder, kept), time.perf_counter() - started, count=True)
            return holder

        def timed_unpack(holder):
            started = time.perf_counter()
            tensor = unpack(holder)
            clock.add(not isinstance(holder, kept), time.perf_counter() - started, count=False)
            return tensor

        self.session._Session.pack = timed_pack
        wrapped = staticmethod(timed_unpack) if self.unpack_owner is self.session._Session else timed_unpack
        setattr(self.unpack_owner, self.unpack_name, wrapped)
        return self

    def add(self, compressed: bool, seconds: float, count: bool) -> None:
        which = "compressed" if compressed else "kept"
        self.seconds[which] += seconds
        self.calls[which] += count

    def __exit__(self, *exc):
        self.session._Session.pack = self.pack
        setattr(self.unpack_owner, self.unpack_name, self.unpack_held)


def whole_model(rests: list[str], rounds: int, device: torch.device, whole_steps: bool | None = None) -> list[dict]:
    """Per saved tensor, the hooks' own time (pack and unpack, the codec's included), measured
    inside them: a step's time less the plain step's is mostly compute here and was bimodal
    across processes (7-13 or 30-36 ms for one figure)."""
    torch.manual_seed(0)
    plain = timm.create_model("vit_small_patch16_224", num_classes=10, img_size=32).to(device)
    images, labels = torch.randn(2, 3, 32, 32, device=device), torch.randint(0, 10, (2,), device=device)
    rows = []
    for rest in rests:
        model = actcomp.to_compressed(copy.deepcopy(plain), "int8", rest=rest)

        def step(model=model):
            F.cross_entropy(model(images), labels).backward()

        step()
        per_step = {"compressed": [], "kept": []}
        for _ in range(rounds):
            with _HookClock() as clock:
                step()
            for which in per_step:
                per_step[which].append(clock.seconds[which] / max(1, clock.calls[which]))
        for which in ("compressed", "kept"):
            rows.append({"what": f"saved tensor {which} ({clock.calls[which]} a step), pack + unpack",
                         "spec": f"int8@{rest}", "host_us": min(per_step[which]) * 1e6,
                         "launches": launches_of(step) if which == "compressed" else float("nan")})
        if device.type == "cuda" if whole_steps is None else whole_steps:
            # A whole step less plain's: on a GPU, at this size, the host's time (on a CPU the
            # compute's, which is why the rows above time the hooks from inside).
            def plain_step():
                F.cross_entropy(plain(images), labels).backward()

            best = fastest({"plain": plain_step, rest: step}, rounds, 3, device)
            rows.append({"what": "step less plain's (ViT-S, 32 px, batch 2)", "spec": f"int8@{rest}",
                         "host_us": (best[rest] - best["plain"]) * 1e6, "launches": launches_of(step)})
    return rows


def round_trips(specs: list[str], rounds: int, device: torch.device) -> list[dict]:
    x = torch.randn(64, 384, device=device)
    pipelines = {spec: actcomp.parse(spec) for spec in specs}
    calls = {spec: (lambda p=p: p.decompress(p.compress(x, channel_dim=-1))) for spec, p in pipelines.items()}
    best = fastest(calls, rounds, 50, device)
    return [{"what": "round trip", "spec": spec, "host_us": best[spec] * 1e6, "launches": launches_of(calls[spec])}
            for spec in specs]


def launch_costs(rounds: int, device: torch.device) -> list[dict]:
    """Host µs of one launch of a codec kernel, bare and through actcomp's ``launch``, and of
    the CUDA calls a codec makes around its launches."""
    from actcomp.kernels import triton_affine

    codes = torch.zeros(64, dtype=torch.uint8, device=device)
    offset, scale = torch.zeros(1, device=device), torch.ones(1, dtype=torch.bfloat16, device=device)
    out = torch.empty(64, device=device)
    kernel = triton_affine._dequantize_kernel
    args = (codes, offset, scale, codes, codes, out, 64, 64, 1, 1.0)
    meta = {"BITS": 8, "PER_BYTE": 1, "BLOCK": 1024, "SCALED": False, "FLAGGED": False}
    calls = {
        "kernel[grid](...)": lambda: kernel[(1,)](*args, enable_fp_fusion=False, **meta),
        "triton_runtime.launch": lambda: triton_runtime.launch(kernel, (1,), *args, **meta),
        "torch.empty": lambda: torch.empty(4096, device=device),
        "device guard": lambda: triton_runtime.device_guard(out).__enter__(),
    }
    best = fastest(calls, rounds, 200, device)
    launches = {"kernel[grid](...)": 1.0, "triton_runtime.launch": 1.0}
    return [{"what": "one call", "spec": label, "host_us": seconds * 1e6, "launches": launches.get(label, 0.0)}
            for label, seconds in best.items()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu: Triton's interpreter's path, launches stubbed; cuda: with and without them")
    parser.add_argument("--layer-specs", nargs="+", default=["int8", "smink0.9+int8", "bf16", "mink0"])
    parser.add_argument("--rests", nargs="*", default=["8bit"],
                        help="whole-model presets to time (none: skip)")
    parser.add_argument("--codecs", nargs="+", default=["int8", "fp8", "bf16", "smink0.9+int8", "mink0.9+int8"])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="host_overhead")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_num_threads(1)
    started, load_before = time.perf_counter(), load_average()
    import warnings

    def measured(stubbed: bool) -> list[dict]:
        with warnings.catch_warnings(), use_backend("triton"), launches_stubbed(stubbed):
            warnings.simplefilter("ignore")  # the backend's one fallback warning (shape-only codecs)
            return layers(args.layer_specs, args.rounds, device) \
                + (whole_model(args.rests, args.rounds, device) if args.rests else []) \
                + round_trips(args.codecs, args.rounds, device)

    rows = measured(stubbed=True)
    for row in rows:
        row["stubbed_us"] = row["host_us"]
    if device.type == "cuda":
        launched = measured(stubbed=False)
        for row, real in zip(rows, launched, strict=True):
            row["host_us"] = real["host_us"]
        rows = launch_costs(args.rounds, device) + rows
    else:
        for row in rows:
            row["host_us"] = float("nan")
    for row in rows:
        row.setdefault("stubbed_us", float("nan"))
        launches = row["launches"]
        row["us_per_launch"] = ((row["host_us"] - row["stubbed_us"]) / launches
                                if launches and not math.isnan(launches) else float("nan"))
        print(f"{row['what']:>42} {row['spec']:>22}: {row['host_us']:8.1f} us, stubbed {row['stubbed_us']:8.1f} us, "
              f"launches {row['launches']}", flush=True)
    if device.type == "cuda":
        intro = ("The host's time on CUDA tensors (small: the device keeps up), with the Triton launches run "
                 "(`host µs`) and stubbed (`stubbed µs`, actcomp's Python and ATen calls alone); `µs a launch`: "
                 "what each launch adds. Per layer, the extra over the plain model's step; per saved tensor, the "
                 "whole-model hooks' own time; per step, the converted step less plain's; per round trip, all "
                 "of it; per call, one launch of `_dequantize_kernel` and the CUDA calls around it.")
    else:
        intro = ("The host's time on the Triton path (what CUDA tensors take) with every launch stubbed: per "
                 "layer, the extra over the plain model's step; per saved tensor, the whole-model hooks' own "
                 "time; per round trip, all of it. `launches`: Triton launches per layer, per step, per round "
                 "trip (each a few µs more on a GPU).")
    body = [intro, "", "| what | spec | host µs | stubbed µs | Triton launches | µs a launch |",
            "|---|---|---:|---:|---:|---:|"]
    body += [f"| {row['what']} | `{row['spec']}` | {row['host_us']:.1f} | {row['stubbed_us']:.1f} | "
             f"{row['launches']:.1f} | {row['us_per_launch']:.1f} |" for row in rows]
    header = header_lines(device, 1, 0, time.perf_counter() - started, {"rounds": args.rounds}, load_before)
    write_results(args.name, device, 1, header, "Host time on the GPU path, kernels stubbed", body,
                  rows, COLUMNS, args.out_dir)


if __name__ == "__main__":
    main()
