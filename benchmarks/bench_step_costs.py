"""The costs of a converted training step that timing does not decide: counts per step, and
the ATen ops (kernel launches on a GPU) each saved tensor's pack and unpack run.

    python benchmarks/bench_step_costs.py                     # the four models, 1 thread
    python benchmarks/bench_step_costs.py --models resnet18 --name step_costs_resnet18

For each model (timm names, or ``gpt2``: the GPT-2-shaped model of ``gpt2_shaped.py``), converted
with ``to_compressed(model, spec, rest=rest)`` as ``step_probe.py`` converts it, one warm-up step,
then one step per backend under a ``TorchDispatchMode`` that counts:

- **saved tensors**: the calls of the whole-model saved-tensor hooks (pack; of them, those kept
  in a compressed form; unpack), and the **codec calls**: top-level packs and unpacks through
  :mod:`actcomp.core.chain` (the whole-model hooks' and the Linear/Conv layers' alike), told by
  :mod:`actcomp.core.watchers`;
- **launches per pack / per unpack**: the ATen ops run inside a top-level codec call, views and
  bare allocations (``empty*``, which launch nothing) left out, native CPU kernels counted as
  one each; on a GPU each is a kernel launch. ``eager`` (``use_backend("eager")``: the
  reference codecs, the device path, no CPU shortcut) runs a stage a chunk at a time
  (:mod:`actcomp.kernels.chunks`), chunks of ``CPU_CHUNK`` elements on a CPU but of at least
  ``CUDA_CHUNK`` on a GPU, so its launches grow with the tensor here; ``eager-device-chunks``
  is the reference with CUDA's chunk length (``CPU_CHUNK`` set to ``CUDA_CHUNK``, which for
  tensors under 8 x ``CUDA_CHUNK`` elements chunks as CUDA does): the launches a GPU runs, the
  figure the Triton kernels are to bring to 2 or fewer per encode and per decode. ``native``
  (the default on a CPU) is given beside them, and ``triton`` (``use_backend("triton")``: the
  Triton kernels where a codec has one, each launch counted; on a machine without a GPU they
  run under Triton's interpreter, ``TRITON_INTERPRET=1``, slowly: give small sizes), and
  ``triton-host``: the same path, its codec time taken without the time inside Triton's
  launches: the host's own share of a GPU step's codecs (Python and the small ATen ops around
  the kernels; Triton's own launcher, a few µs a launch on a GPU, not included). Also per
  spec (codec), and the most frequent ops;
- **hook ops**: ATen ops the whole-model hooks run outside the codecs (choosing, caching);
- **host reads**: ops that read a value back to the host or whose size depends on the data
  (the list of ``tests/test_host_reads.py``), in the converted step minus the plain step's,
  on the eager backend (0 expected) and the native one (the CPU shortcuts' reads).

And two timed figures per backend, from ``--timed-steps`` further steps without the dispatch
mode (their median; record the load average): the codecs' **µs per saved tensor** (the
wall time inside top-level codec calls, per codec pack, its unpack included) and **µs per op**
(that time over the codec ops counted above).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import statistics
import time
from typing import Any

import timm
import torch
import torch.nn.functional as F
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results
from gpt2_shaped import GPT2, GPT2Config, GPT2Model, gpt2_tokens
from torch.utils._python_dispatch import TorchDispatchMode

import actcomp
from actcomp.core import watchers
from actcomp.core.backends import use_backend
from actcomp.kernels import chunks, native_cpu, triton_runtime
from actcomp.whole_model import compressed_model, kept_forms, session

# As tests/integration/test_host_reads.py: ops that read a value back to the host, or whose size depends on the data.
HOST_READS = {"_local_scalar_dense", "nonzero", "nonzero_static", "bincount", "unique", "_unique", "_unique2",
              "unique_consecutive", "unique_dim", "masked_select", "repeat_interleave", "histc", "equal",
              "is_nonzero"}
# Allocations without a kernel: not launches.
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
BACKENDS = ("eager", "eager-device-chunks", "native", "triton", "triton-host")


@contextlib.contextmanager
def backend_of(name: str):
    """``use_backend`` of the name; ``eager-device-chunks``: the reference with CUDA's chunk length;
    ``triton-host``: the Triton path (timed without the time inside its launches)."""
    if name == "triton-host":
        name = "triton"
    if name != "eager-device-chunks":
        with use_backend(name):
            yield
        return
    saved, chunks.CPU_CHUNK = chunks.CPU_CHUNK, chunks.CUDA_CHUNK
    try:
        with use_backend("eager"):
            yield
    finally:
        chunks.CPU_CHUNK = saved


def op_name(func: Any) -> str:
    return func._schema.name.split("::")[-1]


class Counter(TorchDispatchMode):
    """Counts ATen ops by where they run: in a top-level codec pack or unpack (told by the
    watchers), in a whole-model hook outside the codecs, or elsewhere (the model's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.direction, self.in_hook, self.current, self.inside_triton = 0, None, 0, 0, 0
        self.packs = self.unpacks = 0
        self.ops = collections.Counter()  # "pack" / "unpack" / "hook" -> launches
        self.views = collections.Counter()
        self.names = {"pack": collections.Counter(), "unpack": collections.Counter()}
        self.per_call = {"pack": [], "unpack": []}
        self.per_spec = collections.defaultdict(list)  # (spec, direction) -> launches per call
        self.host_reads = collections.Counter()
        self.hook_packs = self.hook_compressed = self.hook_unpacks = 0

    # watchers.Watcher
    def begin(self, direction: str) -> None:
        if self.depth == 0:
            self.direction, self.current = direction, 0
        self.depth += 1

    def end(self, direction: str, source: Any, result: Any) -> None:
        self.depth -= 1
        if self.depth:
            return
        packed = result if direction == "pack" else source
        spec = getattr(getattr(packed, "layout", None), "spec", "?")
        self.per_call[direction].append(self.current)
        self.per_spec[(spec, direction)].append(self.current)
        if direction == "pack":
            self.packs += 1
        else:
            self.unpacks += 1
        self.direction = None

    # native_cpu observer: a native kernel is one launch
    def kernel(self, name: str, tensors: tuple, data_sized: bool):
        self.launch(f"native.{name}")
        if data_sized:
            self.host_reads[f"native.{name}"] += 1
        return _nothing()

    @contextlib.contextmanager
    def triton_launch(self, name: str):
        """A Triton kernel is one launch; the ATen ops the interpreter runs inside it are none."""
        self.launch(f"triton.{name}")
        self.inside_triton += 1
        try:
            yield
        finally:
            self.inside_triton -= 1

    def launch(self, name: str) -> None:
        where = self.direction if self.depth else ("hook" if self.in_hook else None)
        if where is None:
            return
        self.ops[where] += 1
        if where != "hook":
            self.current += 1
            self.names[where][name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside_triton:
            return func(*args, **(kwargs or {}))
        name = op_name(func)
        if name in HOST_READS:
            self.host_reads[name] += 1
        if func.is_view:
            if self.depth:
                self.views[self.direction] += 1
        elif name not in NO_LAUNCH:
            self.launch(name)
        return func(*args, **(kwargs or {}))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class HookTracker:
    """Wraps the whole-model saved-tensor hooks (the session's pack, the module's unpack) to
    count their calls and mark the ops they run; undone by :meth:`restore`."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.pack, self.unpack = session._Session.pack, compressed_model._unpack
        tracker = self

        def pack(self_, tensor):
            counter.in_hook += 1
            try:
                holder = tracker.pack(self_, tensor)
            finally:
                counter.in_hook -= 1
            counter.hook_packs += 1
            counter.hook_compressed += not isinstance(holder, kept_forms.AsIs)
            return holder

        def unpack(holder):
            counter.in_hook += 1
            try:
                return tracker.unpack(holder)
            finally:
                counter.in_hook -= 1
                counter.hook_unpacks += 1

        session._Session.pack, compressed_model._unpack = pack, unpack

    def restore(self) -> None:
        session._Session.pack, compressed_model._unpack = self.pack, self.unpack


class Timer:
    """Wall time inside top-level codec calls (a watcher), less the time inside Triton launches
    (an observer of :mod:`~actcomp.kernels.triton_runtime`): the host's own share where the
    kernels run under the interpreter (``triton-host``)."""

    def __init__(self) -> None:
        self.depth, self.start, self.seconds, self.packs = 0, 0.0, 0.0, 0

    @contextlib.contextmanager
    def launch(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds -= time.perf_counter() - started

    def begin(self, direction: str) -> None:
        if self.depth == 0:
            self.start = time.perf_counter()
        self.depth += 1

    def end(self, direction: str, source: Any, result: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.seconds += time.perf_counter() - self.start
            self.packs += direction == "pack"


def build(name: str, batch: int, img_size: int, seq_len: int):
    if name == GPT2:
        config = GPT2Config()
        return GPT2Model(config), gpt2_tokens(config, batch, seq_len), gpt2_tokens(config, batch, seq_len), None
    model = timm.create_model(name, pretrained=False, num_classes=10, img_size=img_size) \
        if "vit" in name else timm.create_model(name, pretrained=False, num_classes=10)
    return model, torch.randn(batch, 3, img_size, img_size), torch.randint(0, 10, (batch,)), "auto"


def step_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, -2), y.flatten()).backward()
        optimizer.step()

    return step


def counted(step) -> Counter:
    counter = Counter()
    hooks = HookTracker(counter)
    try:
        with watchers.watching(counter), native_cpu.observed(counter), \
                triton_runtime.observed(counter.triton_launch), counter:
            step()
    finally:
        hooks.restore()
    return counter


def timed(step, steps: int, without_kernels: bool = False) -> tuple[float, int]:
    """Median seconds inside the codecs per step (``without_kernels``: less the time inside
    Triton launches), and codec packs per step."""
    seconds, packs = [float("nan")], 0
    for _ in range(steps):
        timer = Timer()
        with watchers.watching(timer), \
                triton_runtime.observed(timer.launch if without_kernels else lambda name: contextlib.nullcontext()):
            step()
        seconds.append(timer.seconds)
        packs = timer.packs
    return statistics.median(seconds[1:] or seconds), packs


def plain_host_reads(step) -> int:
    counter = Counter()
    with counter:
        step()
    return sum(counter.host_reads.values())


def mean(values: list[int]) -> float:
    return sum(values) / max(len(values), 1)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50", "vit_small_patch16_224", GPT2])
    parser.add_argument("--spec", default="mink0.9+int8")
    parser.add_argument("--rest", default="8bit")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=128)
    parser.add_argument("--gpt2-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--name", default="step_costs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, load_before = time.time(), load_average()
    rows, details = [], []
    for name in args.models:
        torch.manual_seed(0)
        batch = args.gpt2_batch if name == GPT2 else args.batch
        plain, x, y, first_layer = build(name, batch, args.img_size, args.seq_len)
        converted = actcomp.to_compressed(copy.deepcopy(plain), args.spec, rest=args.rest, first_layer=first_layer)
        plain_step, step = step_of(plain, x, y), step_of(converted, x, y)
        plain_step()
        plain_reads = plain_host_reads(plain_step)
        for backend in args.backends:
            with backend_of(backend):
                step()  # warm-up (native build, lazy set-up)
                counter = counted(step)
                seconds, packs = timed(step, args.timed_steps, without_kernels=backend == "triton-host")
            codec_ops = counter.ops["pack"] + counter.ops["unpack"]
            row = {
                "model": name, "backend": backend, "input": "x".join(map(str, x.shape)),
                "hook_packs": counter.hook_packs, "hook_compressed": counter.hook_compressed,
                "hook_unpacks": counter.hook_unpacks, "codec_packs": counter.packs, "codec_unpacks": counter.unpacks,
                "launches_per_pack": mean(counter.per_call["pack"]), "max_per_pack": max(counter.per_call["pack"], default=0),
                "launches_per_unpack": mean(counter.per_call["unpack"]),
                "max_per_unpack": max(counter.per_call["unpack"], default=0),
                "views_per_pack": counter.views["pack"] / max(counter.packs, 1),
                "hook_ops_per_saved": counter.ops["hook"] / max(counter.hook_packs, 1),
                "extra_host_reads": sum(counter.host_reads.values()) - plain_reads,
                "codec_us_per_saved": seconds * 1e6 / max(packs, 1),
                "codec_us_per_op": seconds * 1e6 / max(codec_ops, 1), "load": load_average(),
            }
            rows.append(row)
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            specs = sorted({spec for spec, _ in counter.per_spec})
            details.append(f"- {name}, {backend}: " + "; ".join(
                f"`{spec}` x{len(counter.per_spec[(spec, 'pack')])}: "
                f"{mean(counter.per_spec[(spec, 'pack')]):.1f} per pack, "
                f"{mean(counter.per_spec[(spec, 'unpack')]):.1f} per unpack"
                for spec in specs) + ". Most run in a pack: " + ", ".join(
                f"{op} {count / max(counter.packs, 1):.2f}" for op, count in counter.names["pack"].most_common(8))
                + "; in an unpack: " + ", ".join(
                f"{op} {count / max(counter.unpacks, 1):.2f}" for op, count in counter.names["unpack"].most_common(8)))
    header = header_lines(torch.device("cpu"), args.threads, 0, time.time() - start,
                          {"spec": args.spec, "rest": args.rest, "batch": args.batch, "img_size": args.img_size,
                           "gpt2": f"{args.gpt2_batch}x{args.seq_len} tokens", "timed_steps": args.timed_steps},
                          load_before)
    body = ["Counts per training step (after one warm-up step); launches = ATen ops other than views and "
            "bare allocations, a native kernel one; timed figures are medians of the timed steps.", "",
            "| model | backend | saved tensors via hooks (compressed) / unpacked | codec packs / unpacks | "
            "launches per pack (max) | per unpack (max) | hook ops per saved tensor | host reads added | "
            "codec µs per saved tensor | codec µs per op |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    body += [f"| {r['model']} | {r['backend']} | {r['hook_packs']} ({r['hook_compressed']}) / {r['hook_unpacks']} | "
             f"{r['codec_packs']} / {r['codec_unpacks']} | {r['launches_per_pack']:.1f} ({r['max_per_pack']}) | "
             f"{r['launches_per_unpack']:.1f} ({r['max_per_unpack']}) | {r['hook_ops_per_saved']:.1f} | "
             f"{r['extra_host_reads']} | {r['codec_us_per_saved']:.0f} | {r['codec_us_per_op']:.1f} |" for r in rows]
    body += ["", "Per codec (launches per call) and the ops most run per call:", "", *details]
    print("\n".join(body))
    write_results(args.name, torch.device("cpu"), args.threads, header, "Deterministic costs of a converted step",
                  body, rows, list(rows[0]), RESULTS_DIR)


if __name__ == "__main__":
    main()
