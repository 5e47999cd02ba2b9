"""The Python whole-model mode runs per model op and per saved tensor: counted, then timed.

    PYTHONPATH=. python benchmarks/bench_forward_overhead.py                       # ~2 minutes
    PYTHONPATH=. python benchmarks/bench_forward_overhead.py --roots . /work/main  # A/B: ~4 minutes

Whole-model mode (``to_compressed(model, "mink0.9+int8", rest="8bit")``) watches every torch call
of the forward with a ``TorchFunctionMode`` (which op saves each tensor) and runs a pack hook per
saved tensor. Small inputs (batch 2; ViT-S at 64 px, resnet18 at 64 px, a GPT-2-shaped model of
4 blocks, 384 wide, 2 x 32 tokens) keep the kernels short, so the Python shows.

Counts, exact, per training step (forward, then ``sum().backward()``):

- ``model calls``: torch-function calls the plain model makes in its forward (a counting mode);
- ``mode calls``: calls the scope-tracking mode sees in the converted forward, the model's and
  any of actcomp's own that reach it; ``scopes``: those that open a scope (a recognised op);
- ``saved (plain)``: tensors plain autograd saves; ``packed`` / ``unpacked``: calls of
  whole-model mode's pack and unpack hooks.

Times, medians over interleaved rounds (``common.time_rounds``) of the forward alone (its graph
dropped) on ``--threads`` threads: ``plain``, ``linear`` (``rest=None``: the compressed layers,
no mode, no hooks) and ``whole`` (``rest="8bit"``), and inside ``whole`` the pack hooks' wall
time (``time.perf_counter`` around each call, codecs included) and the codecs' encode time:

- ``us/op, whole - plain``: (whole - plain) / mode calls: everything whole-model mode adds,
  codecs included, spread over the calls the mode saw;
- ``us/op, tracking``: (whole - linear - pack hooks) / mode calls: the scope-tracking mode and
  the module hooks, what the forward pays outside the compressed layers and the pack hooks;
- ``us/saved, hook``: pack-hook wall time per packed tensor; ``us/saved, deciding``: the same
  less the codecs' encode, the hook's own Python (choosing the codec, caches, holders).

And per call into the mode: a tensor attribute, an op no kind claims and a recognised op, each
timed plain and inside ``tracking_scopes()`` (best of 5 batches).

``--roots A B`` runs the measurement in fresh processes with ``PYTHONPATH=A`` then ``B``,
alternating ``--repeats`` times; the tables give each root's median over its processes. The
results file is ``benchmarks/results/forward_overhead_<torch>_cpu_t<threads>.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import (
    RESULTS_DIR,
    benchmark_parser,
    header_lines,
    load_average,
    results_stem,
    time_rounds,
    write_markdown,
)
from torch.overrides import TorchFunctionMode

SPEC, REST = "mink0.9+int8", "8bit"
MODELS = ("vit_small", "resnet18", "gpt2")


def build(name: str, batch: int) -> tuple[torch.nn.Module, torch.Tensor, str | None]:
    """A seeded model, its input batch and ``to_compressed``'s ``first_layer``."""
    torch.manual_seed(0)
    if name == "gpt2":
        from gpt2_shaped import GPT2Config, GPT2Model, gpt2_tokens

        config = GPT2Config(vocab_size=1024, max_positions=64, width=384, heads=6, blocks=4)
        return GPT2Model(config), gpt2_tokens(config, batch, 32), None
    import timm

    if name == "vit_small":
        model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=64, num_classes=10)
    else:
        model = timm.create_model(name, pretrained=False, num_classes=10)
    return model, torch.randn(batch, 3, 64, 64), "auto"


class _CountingMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class _Probes:
    """Counters and timers wrapped around whole-model mode's hooks (the names both the current
    code and older commits define), installed for the whole measurement."""

    def __init__(self) -> None:
        from actcomp.graph import op_kinds, saved_tensors
        from actcomp.whole_model import compressed_model, session

        self.mode_calls = self.scopes = self.packs = self.unpacks = 0
        self.pack_s = self.encode_s = 0.0
        self.counting = False
        probes, mode_class = self, saved_tensors._FunctionScopes
        mode_call, pack, unpack, encode = (mode_class.__torch_function__, session._Session.pack,
                                           compressed_model._unpack, session.CodecChoice.encode)
        known = op_kinds.function_kind

        def counted_mode_call(self, func, types, args=(), kwargs=None):
            if probes.counting:
                probes.mode_calls += 1
                probes.scopes += known(func) is not None
            return mode_call(self, func, types, args, kwargs)

        def timed_pack(self, tensor):
            start = time.perf_counter()
            try:
                return pack(self, tensor)
            finally:
                probes.pack_s += time.perf_counter() - start
                probes.packs += 1

        def counted_unpack(holder):
            probes.unpacks += 1
            return unpack(holder)

        def timed_encode(self, tensor):
            start = time.perf_counter()
            try:
                return encode(self, tensor)
            finally:
                probes.encode_s += time.perf_counter() - start

        # Only the counting pass pays for the counting wrapper around every mode call.
        self.plain_mode_call, self.counted_mode_call = mode_call, counted_mode_call
        self.mode_class = mode_class
        session._Session.pack = timed_pack
        compressed_model._unpack = counted_unpack
        session.CodecChoice.encode = timed_encode

    def reset(self) -> None:
        self.mode_calls = self.scopes = self.packs = self.unpacks = 0
        self.pack_s = self.encode_s = 0.0

    def count(self, step) -> dict[str, int]:
        self.reset()
        self.mode_class.__torch_function__ = self.counted_mode_call
        self.counting = True
        try:
            step()
        finally:
            self.counting = False
            self.mode_class.__torch_function__ = self.plain_mode_call
        return {"mode calls": self.mode_calls, "scopes": self.scopes, "packed": self.packs, "unpacked": self.unpacks}


def _plain_counts(model: torch.nn.Module, inputs: torch.Tensor) -> dict[str, int]:
    saved = 0

    def pack(tensor):
        nonlocal saved
        saved += 1
        return tensor

    counting = _CountingMode()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with counting:
            out = model(inputs)
    out.float().sum().backward()
    return {"model calls": counting.calls, "saved (plain)": saved}


def measure_model(name: str, probes: _Probes, batch: int, rounds: int, warmup: int) -> dict:
    import actcomp

    plain, inputs, first_layer = build(name, batch)
    linear = actcomp.to_compressed(copy.deepcopy(plain), SPEC, first_layer=first_layer)
    whole = actcomp.to_compressed(copy.deepcopy(plain), SPEC, first_layer=first_layer, rest=REST)
    for model in (plain, linear, whole):
        model.train()
        model(inputs).float().sum().backward()  # warm-up: lazy initialisation, first-call caches

    row = {"model": name, **_plain_counts(plain, inputs)}
    row.update(probes.count(lambda: whole(inputs).float().sum().backward()))

    pack_s: list[float] = []
    encode_s: list[float] = []
    packs: list[int] = []

    def forward(model):
        return lambda: model(inputs)  # the result, and with it the graph, is dropped at once

    def whole_forward():
        probes.reset()
        whole(inputs)
        pack_s.append(probes.pack_s)
        encode_s.append(probes.encode_s)
        packs.append(probes.packs)

    times = time_rounds({"plain": forward(plain), "linear": forward(linear), "whole": whole_forward},
                        rounds, warmup, torch.device("cpu"))
    pack_s, encode_s, packs = pack_s[warmup:], encode_s[warmup:], packs[warmup:]
    calls = row["mode calls"]
    row["plain ms"] = statistics.median(times["plain"]) * 1e3
    row["linear ms"] = statistics.median(times["linear"]) * 1e3
    row["whole ms"] = statistics.median(times["whole"]) * 1e3
    row["us/op, whole - plain"] = statistics.median(
        (w - p) / calls * 1e6 for w, p in zip(times["whole"], times["plain"]))
    row["us/op, tracking"] = statistics.median(
        (w - lin - hooks) / calls * 1e6 for w, lin, hooks in zip(times["whole"], times["linear"], pack_s))
    row["us/saved, hook"] = statistics.median(s / n * 1e6 for s, n in zip(pack_s, packs))
    row["us/saved, deciding"] = statistics.median((s - e) / n * 1e6 for s, e, n in zip(pack_s, encode_s, packs))
    return row


def per_call() -> dict[str, dict[str, float]]:
    """Microseconds per call, plain and inside ``tracking_scopes()``, for three kinds of call."""
    from actcomp.graph.saved_tensors import tracking_scopes

    x, y = torch.ones(8, requires_grad=True), torch.ones(8)
    calls = {"x.shape (an attribute)": lambda: x.shape, "torch.add (no kind)": lambda: torch.add(x, y),
             "torch.relu (a kind)": lambda: torch.relu(x)}

    def best(call, repeat: int = 20000) -> float:
        fastest = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeat):
                call()
            fastest = min(fastest, (time.perf_counter() - start) / repeat)
        return fastest * 1e6

    results = {}
    for label, call in calls.items():
        plain = best(call)
        with tracking_scopes():
            tracked = best(call)
        results[label] = {"plain": plain, "tracked": tracked}
    return results


def child(args) -> None:
    """Measure in this process (actcomp as ``PYTHONPATH`` gives it); print one JSON line."""
    import actcomp

    torch.set_num_threads(args.threads)
    probes = _Probes()
    rows = [measure_model(name, probes, args.batch, args.rounds, args.warmup) for name in args.models]
    print(json.dumps({"actcomp": actcomp.__file__, "rows": rows, "per call": per_call(), "load": load_average()}))


def _commit(root: Path) -> str:
    def git(*arguments: str) -> str:
        return subprocess.run(["git", "-C", str(root), *arguments], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "actcomp")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + (" + uncommitted changes in actcomp/" if dirty else "")


def _run_child(root: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "ACTCOMP_SOURCE_VERSION": _commit(root)}
    command = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--batch", str(args.batch),
               "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--models", *args.models]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    if not measured["actcomp"].startswith(str(root)):
        raise SystemExit(f"the child imported {measured['actcomp']}, not actcomp from {root}")
    return measured


COUNT_COLUMNS = ("model calls", "mode calls", "scopes", "saved (plain)", "packed", "unpacked")
TIME_COLUMNS = ("plain ms", "linear ms", "whole ms", "us/op, whole - plain", "us/op, tracking", "us/saved, hook",
                "us/saved, deciding")


def _table(columns: tuple[str, ...], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f"{value:.2f}" if isinstance(value, float) else str(value)
                                       for value in row) + " |")
    return lines


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--roots", nargs="+", type=Path, default=[Path(__file__).resolve().parent.parent],
                        help="checkouts to measure, each in its own processes (PYTHONPATH=ROOT)")
    parser.add_argument("--repeats", type=int, default=2, help="processes per root, alternating between roots")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    load_before, started = load_average(), time.perf_counter()
    roots = [root.resolve() for root in args.roots]
    runs: dict[Path, list[dict]] = {root: [] for root in roots}
    for repeat in range(args.repeats):
        for root in roots:
            runs[root].append(_run_child(root, args))
            print(f"repeat {repeat + 1}/{args.repeats}: {root} done (load {runs[root][-1]['load']})", flush=True)

    body: list[str] = []
    for root in roots:
        measured = runs[root]
        body += [f"## {root} (git {_commit(root)}), {len(measured)} processes", "", "Counts per training step:", ""]
        body += _table(("model",) + COUNT_COLUMNS,
                       [[row["model"], *(row[c] for c in COUNT_COLUMNS)] for row in measured[0]["rows"]])
        body += ["", "Times (median over processes of each process's median over rounds):", ""]
        table_rows = []
        for index, row in enumerate(measured[0]["rows"]):
            table_rows.append([row["model"], *(statistics.median(run["rows"][index][c] for run in measured)
                                               for c in TIME_COLUMNS)])
        body += _table(("model",) + TIME_COLUMNS, table_rows)
        body += ["", "Per call into the mode (us, best of 5 batches; median over processes):", ""]
        labels = list(measured[0]["per call"])
        body += _table(("call", "plain", "inside tracking_scopes()", "added"), [
            [label, *(statistics.median(run["per call"][label][key] for run in measured) for key in ("plain", "tracked")),
             statistics.median(run["per call"][label]["tracked"] - run["per call"][label]["plain"] for run in measured)]
            for label in labels])
        body.append("")
    for line in body:
        print(line)

    device = torch.device("cpu")
    settings = {"spec": SPEC, "rest": REST, "batch": args.batch, "rounds": args.rounds, "warmup": args.warmup,
                "processes per root": args.repeats}
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, settings, load_before)
    header.append("actcomp of each root: " + ", ".join(f"{root} = git {_commit(root)}" for root in roots))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{results_stem('forward_overhead', device, args.threads)}.md"
    write_markdown(path, "Python per model op and per saved tensor in whole-model mode", header, body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
