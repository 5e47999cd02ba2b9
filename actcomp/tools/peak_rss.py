"""Peak process memory (RSS) of a few training steps, measured in a fresh subprocess.

Saved-tensor accounting (:mod:`actcomp.tools.memory`) counts what autograd keeps; peak RSS is
what the operating system saw, allocator slack and temporaries included. A fresh process
per measurement keeps one run's high-water mark from leaking into the next.

The probe runs as a user's training script does: AdamW, glibc's allocator as it comes, and
whatever :func:`~actcomp.to_compressed` does to it (it makes freed buffers of 1 MiB and up go
back to the OS, :mod:`actcomp.host_allocator`; a plain run keeps glibc's default). Two
settings measure otherwise, and a figure taken under them must say so: ``allocator="tuned"``
sets ``MALLOC_MMAP_THRESHOLD_=65536`` for every run, plain included (how the benchmarks measured
before stop 40: RSS then follows live memory in plain runs too), ``allocator="untouched"`` sets
``ACTCOMP_RETURN_FREED_MEMORY=0`` (the library's remedy off). ViT-S, batch 32, 224 px, 2
threads, AdamW (``benchmarks/bench_user_peak.py``): plain 3420 MiB as it comes (2889 tuned);
``"mink0.9+int8", rest="8bit"`` 1590 MiB as it comes, 2565 MiB untouched.

>>> peak_rss("resnet18", None, batch=2, img_size=32, steps=1) > 0  # doctest: +SKIP
True
>>> peak_rss("resnet18", "mink0.9+int8", rest="8bit", batch=2, img_size=32, steps=1) > 0  # doctest: +SKIP
True
"""

from __future__ import annotations

import json

from actcomp.errors import ActcompError
from actcomp.tools.probe import run_probe

# What each allocator setting adds to the probe's environment. A user's own MALLOC_* settings
# are dropped from it, so "as-user" means glibc as it comes.
ALLOCATORS = {
    "as-user": {"MALLOC_MMAP_THRESHOLD_": None, "ACTCOMP_RETURN_FREED_MEMORY": None},
    "tuned": {"MALLOC_MMAP_THRESHOLD_": "65536", "ACTCOMP_RETURN_FREED_MEMORY": None},
    "untouched": {"MALLOC_MMAP_THRESHOLD_": None, "ACTCOMP_RETURN_FREED_MEMORY": "0"},
    # Transparent huge pages for glibc's mapped blocks: a 2 MiB fault where there were 512.
    "hugetlb": {"MALLOC_MMAP_THRESHOLD_": None, "ACTCOMP_RETURN_FREED_MEMORY": None,
                "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}

_PROBE = r"""
import json, os, resource, sys, threading, time, torch, timm, actcomp
args = json.loads(sys.argv[1])

def high_water_mark():
    # VmHWM belongs to this process's memory map, which exec created fresh. ru_maxrss would
    # also remember the parent's size at fork, whatever the probe itself used.
    try:
        status = open("/proc/self/status").read()
        return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def stop_when_over(limit):
    # A batch that cannot fit is known as soon as the peak passes the limit: no need to finish it.
    while True:
        peak = high_water_mark()
        if peak > limit:
            print(json.dumps({"peak": peak, "step_seconds": []}), flush=True)
            os._exit(0)
        time.sleep(0.02)

if args["abort_above"]:
    threading.Thread(target=stop_when_over, args=(args["abort_above"],), daemon=True).start()
if args["threads"]:
    torch.set_num_threads(args["threads"])
torch.manual_seed(0)
model = timm.create_model(args["model"], pretrained=False, num_classes=10)
if args["checkpoint"]:
    # timm's own per-block checkpointing (checkpoint_seq), non-reentrant as torch recommends.
    timm.layers.set_reentrant_ckpt(False)
    model.set_grad_checkpointing(True)
if args["spec"]:
    actcomp.to_compressed(model, args["spec"], first_layer=args["first_layer"], rest=args["rest"])
optimizer = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[args["optimizer"]](model.parameters(), lr=1e-3)
dtype = {"bf16": torch.bfloat16, None: None}[args["amp"]]

def step(batch):
    x = torch.randn(batch, 3, args["img_size"], args["img_size"])
    y = torch.randint(0, 10, (batch,))
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

if args["warmup_batch"]:
    # A small first step leaves what every later step starts with (the gradients, optimizer
    # state): the full-size step that follows then peaks as a steady-state step would.
    step(args["warmup_batch"])
seconds = []
for _ in range(args["steps"]):
    start = time.perf_counter()
    step(args["batch"])
    seconds.append(time.perf_counter() - start)
print(json.dumps({"peak": high_water_mark(), "step_seconds": seconds}), flush=True)
os._exit(0)  # the watcher thread may be mid-print otherwise
"""


def peak_rss(model: str, spec: str | None, *, batch: int, img_size: int, steps: int = 3, **options) -> int:
    """Peak RSS in bytes of ``steps`` training steps of timm ``model`` (``spec`` None = plain);
    the options are :func:`training_steps`'."""
    return training_steps(model, spec, batch=batch, img_size=img_size, steps=steps, **options)[0]


def training_steps(model: str, spec: str | None, *, batch: int, img_size: int, steps: int = 3,
                   amp: str | None = None, allocator: str = "as-user", optimizer: str = "adamw",
                   rest: str | dict | None = None,
                   first_layer: str | None = "auto", checkpoint: bool = False, threads: int | None = None,
                   abort_above: int | None = None, warmup_batch: int | None = None) -> tuple[int, list[float]]:
    """Peak RSS in bytes of ``steps`` training steps of timm ``model`` (``spec`` None = plain),
    and the seconds each of those steps took (none where ``abort_above`` stopped the probe).

    ``rest`` (a preset such as ``"8bit"``, or a spec) and ``first_layer`` are passed on to
    :func:`actcomp.to_compressed` with ``spec``; ``rest=None`` is Linear/Conv mode.
    ``allocator`` is ``"as-user"`` (glibc as it comes; a converted model's process returns freed
    buffers, as it would in the user's), ``"tuned"`` (``MALLOC_MMAP_THRESHOLD_=65536`` for every
    run, plain's too), ``"untouched"`` (``ACTCOMP_RETURN_FREED_MEMORY=0``: no remedy anywhere) or
    ``"hugetlb"`` (as a user's, started with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``);
    ``optimizer`` is ``"adamw"`` (the Quickstart's) or ``"sgd"``.
    ``checkpoint=True`` turns on timm's per-block activation checkpointing (non-reentrant
    ``torch.utils.checkpoint``), alone or under ``spec``. ``threads`` sets torch's intra-op
    threads. With ``abort_above`` (bytes) the probe stops as soon as its peak passes it and
    returns that peak (some value above ``abort_above``), which is all a search for the
    largest batch needs to know. ``warmup_batch`` runs one step of that batch first, so that a
    single full-size step already starts from a trained step's state (gradients allocated):
    ``steps=1, warmup_batch=2`` measures the steady-state peak at half the cost of ``steps=2``
    (resnet18, batch 16 at 96 px: 891 MiB either way, 874 MiB for one step alone;
    ``tests/tools/test_max_batch.py`` checks the first two agree). Read from
    ``VmHWM`` in ``/proc/self/status`` (Linux), else ``ru_maxrss`` (in KiB on Linux).
    """
    if spec is None and rest is not None:
        raise ActcompError(f"peak_rss: rest={rest!r} needs a spec for the Linear/Conv layers (spec is None: plain)")
    if allocator not in ALLOCATORS:
        raise ActcompError(f"peak_rss: allocator={allocator!r} is not one of {', '.join(map(repr, ALLOCATORS))}")
    if optimizer not in ("adamw", "sgd"):
        raise ActcompError(f"peak_rss: optimizer={optimizer!r} is not one of 'adamw', 'sgd'")
    settings = {"model": model, "spec": spec, "batch": batch, "img_size": img_size, "steps": steps, "amp": amp,
                "rest": rest, "first_layer": first_layer, "checkpoint": checkpoint, "threads": threads,
                "abort_above": abort_above, "warmup_batch": warmup_batch, "optimizer": optimizer}
    env = ALLOCATORS[allocator]
    result = run_probe(["-c", _PROBE, json.dumps(settings)], env=env,
                       what=f"peak-RSS probe for {model} {spec!r} rest={rest!r} checkpoint={checkpoint} batch={batch}")
    return int(result["peak"]), [float(seconds) for seconds in result["step_seconds"]]
