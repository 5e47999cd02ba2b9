"""The Python whole-model mode runs per model op and per saved tensor: counted, then timed.

    PYTHONPATH=. python benchmarks/bench_forward_overhead.py                            # ~2 minutes
    PYTHONPATH=. python benchmarks/bench_forward_overhead.py --roots /path/to/base .    # A/B

Whole-model mode (``to_compressed(model, "mink0.9+int8", rest="8bit")``) watches every torch call
of the forward with a ``TorchFunctionMode`` (which op saves each tensor) and runs a pack hook per
saved tensor. Small inputs (batch 2; ViT-S at 64 px, resnet18 at 64 px, a GPT-2-shaped model of
4 blocks, 384 wide, 2 x 32 tokens) keep the kernels short, so the Python shows.

Counts, exact, per training step (forward, then ``sum().backward()``):

- ``model calls``: torch-function calls the plain model makes in its forward (a counting mode);
- ``mode calls``: calls the scope-tracking mode sees in the converted forward, the model's and
  any of actcomp's own that reach it; ``scopes``: those that open a scope (a recognised op);
- ``saved (plain)``: tensors plain autograd saves; ``packed`` / ``unpacked``: calls of
  whole-model mode's pack and unpack hooks (a compressed layer's saves included).

Times (this thread's CPU time, ``time.thread_time``: a loaded machine inflates it far less than
wall time; with one torch thread, the default, it covers the ops too), medians over rounds of
the forward alone (its graph dropped with the output): ``plain``, ``linear`` (``rest=None``: the
compressed layers, no mode, no hooks) and ``whole`` (``rest="8bit"``), each once a round in
rotating order, and inside ``whole`` the pack hooks' time (taken around each call, codecs
included) and the codecs' encode time:

- ``whole - plain, us/model call``: everything whole-model mode adds to the forward, codecs
  and compressed layers included, over the plain model's torch calls;
- ``tracking ms``: whole - linear - pack hooks: all whole-model mode adds outside its pack
  hooks (the scope-tracking mode, the module hooks, starting and ending the session, freeing
  its holders with the graph); per model call and per call the mode saw. A difference of
  large times: the noisiest figure here, where the counts and the per-call table are exact or
  nearly so;
- ``hook, us/saved``: pack-hook time per packed tensor; ``deciding, us/saved``: the same
  less the codecs' encode, the hook's own Python (choosing the codec, caches, holders).

And per call into the mode: a tensor attribute, an op no kind claims and a recognised op, each
timed plain and inside ``tracking_scopes()`` (best of 5 batches).

Each root of ``--roots`` (a checkout; default this one) runs in a process of its own with
``PYTHONPATH=ROOT``, and the parent asks each for one round at a time, back to back, so a load
that comes and goes slows the roots of a round alike; the comparison with the first root is the
median of per-round differences (and of the ratio of whole-model forwards). The results file is
``benchmarks/results/forward_overhead_torch<version>_cpu_t<threads>.md``.
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
    quantiles,
    results_stem,
    write_markdown,
)
from torch.overrides import TorchFunctionMode

SPEC, REST = "mink0.9+int8", "8bit"
# Every time here is this thread's CPU time: on a shared machine, wall time also counts the
# time the thread waited for a core, which swamps differences of a few microseconds a call.
# With one torch thread (the default), the ops run on this thread too.
cpu_clock = time.thread_time
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

        try:
            from actcomp.whole_model import choosing
        except ImportError:  # a tree from before stop 46, when the session module held the op table
            choosing = session

        self.mode_calls = self.scopes = self.packs = self.unpacks = 0
        self.pack_s = self.encode_s = 0.0
        self.counting = False
        probes, mode_class = self, saved_tensors._FunctionScopes
        # The unpack hook: the session's since stop 46's split, the model module's before.
        unpack = session._Session.unpack if hasattr(session._Session, "unpack") else compressed_model._unpack
        mode_call, pack, encode = (mode_class.__torch_function__, session._Session.pack,
                                   choosing.CodecChoice.encode)
        known = op_kinds.function_kind

        def counted_mode_call(self, func, types, args=(), kwargs=None):
            if probes.counting:
                probes.mode_calls += 1
                probes.scopes += known(func) is not None
            return mode_call(self, func, types, args, kwargs)

        def timed_pack(self, tensor):
            start = cpu_clock()
            try:
                return pack(self, tensor)
            finally:
                probes.pack_s += cpu_clock() - start
                probes.packs += 1

        def counted_unpack(holder):
            probes.unpacks += 1
            return unpack(holder)

        def timed_encode(self, tensor):
            start = cpu_clock()
            try:
                return encode(self, tensor)
            finally:
                probes.encode_s += cpu_clock() - start

        # Only the counting pass pays for the counting wrapper around every mode call.
        self.plain_mode_call, self.counted_mode_call = mode_call, counted_mode_call
        self.mode_class = mode_class
        session._Session.pack = timed_pack
        if hasattr(session._Session, "unpack"):
            session._Session.unpack = staticmethod(counted_unpack)
        else:
            compressed_model._unpack = counted_unpack
        choosing.CodecChoice.encode = timed_encode

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


class _Subject:
    """One model three ways (plain, Linear/Conv mode, whole-model mode), warmed up and counted."""

    def __init__(self, name: str, probes: _Probes, batch: int) -> None:
        import actcomp

        plain, self.inputs, first_layer = build(name, batch)
        linear = actcomp.to_compressed(copy.deepcopy(plain), SPEC, first_layer=first_layer)
        whole = actcomp.to_compressed(copy.deepcopy(plain), SPEC, first_layer=first_layer, rest=REST)
        self.name, self.probes, self.models = name, probes, {"plain": plain, "linear": linear, "whole": whole}
        for model in self.models.values():
            model.train()
            model(self.inputs).float().sum().backward()  # lazy initialisation, first-call caches
        self.counts = {"model": name, **_plain_counts(plain, self.inputs)}
        self.counts.update(probes.count(lambda: whole(self.inputs).float().sum().backward()))

    def round(self, index: int) -> dict[str, float]:
        """Each forward timed once (the graph dropped with the output), the starting one rotating;
        the whole-model forward's pack-hook and encode seconds with it."""
        names = list(self.models)
        times: dict[str, float] = {}
        for name in names[index % 3:] + names[:index % 3]:
            self.probes.reset()
            start = cpu_clock()
            self.models[name](self.inputs)
            times[name] = cpu_clock() - start
            if name == "whole":
                times.update(pack=self.probes.pack_s, encode=self.probes.encode_s, packs=self.probes.packs)
        return times


def per_call() -> dict[str, dict[str, float]]:
    """Microseconds per call, plain and inside ``tracking_scopes()``, for three kinds of call."""
    from actcomp.graph.saved_tensors import tracking_scopes

    x, y = torch.ones(8, requires_grad=True), torch.ones(8)
    calls = {"x.shape (an attribute)": lambda: x.shape, "torch.add (no kind)": lambda: torch.add(x, y),
             "torch.relu (a kind)": lambda: torch.relu(x)}

    def best(call, repeat: int = 20000) -> float:
        fastest = float("inf")
        for _ in range(5):
            start = cpu_clock()
            for _ in range(repeat):
                call()
            fastest = min(fastest, (cpu_clock() - start) / repeat)
        return fastest * 1e6

    results = {}
    for label, call in calls.items():
        plain = best(call)
        with tracking_scopes():
            tracked = best(call)
        results[label] = {"plain": plain, "tracked": tracked}
    return results


def serve(args) -> None:
    """The child: build and count, print one JSON line; then time one round per ``round`` line
    read from stdin, printing each as a JSON line, until stdin closes."""
    import actcomp

    torch.set_num_threads(args.threads)
    probes = _Probes()
    subjects = [_Subject(name, probes, args.batch) for name in args.models]
    print(json.dumps({"actcomp": actcomp.__file__, "counts": [subject.counts for subject in subjects],
                      "per call": per_call()}), flush=True)
    for index, _ in enumerate(sys.stdin):
        print(json.dumps([subject.round(index) for subject in subjects]), flush=True)


def _commit(root: Path) -> str:
    def git(*arguments: str) -> str:
        return subprocess.run(["git", "-C", str(root), *arguments], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "actcomp")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + (" + uncommitted changes in actcomp/" if dirty else "")


class _Child:
    """A serving child process importing actcomp from ``root``."""

    def __init__(self, root: Path, args) -> None:
        env = {**os.environ, "PYTHONPATH": str(root), "ACTCOMP_SOURCE_VERSION": _commit(root)}
        command = [sys.executable, __file__, "--serve", "--threads", str(args.threads), "--batch", str(args.batch),
                   "--models", *args.models]
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.setup = json.loads(self.process.stdout.readline())
        if not self.setup["actcomp"].startswith(str(root)):
            raise SystemExit(f"the child imported {self.setup['actcomp']}, not actcomp from {root}")

    def round(self) -> list[dict[str, float]]:
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


COUNT_COLUMNS = ("model calls", "mode calls", "scopes", "saved (plain)", "packed", "unpacked")
TIME_COLUMNS = ("plain ms", "linear ms", "whole ms", "whole - plain, us/model call", "tracking ms",
                "tracking, us/model call", "tracking, us/mode call", "hook, us/saved", "deciding, us/saved")


def derived(times: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """One round's figures (see the module docstring) from its times and the model's counts."""
    tracking = times["whole"] - times["linear"] - times["pack"]
    return {
        "plain ms": times["plain"] * 1e3, "linear ms": times["linear"] * 1e3, "whole ms": times["whole"] * 1e3,
        "whole - plain, us/model call": (times["whole"] - times["plain"]) / counts["model calls"] * 1e6,
        "tracking ms": tracking * 1e3,
        "tracking, us/model call": tracking / counts["model calls"] * 1e6,
        "tracking, us/mode call": tracking / counts["mode calls"] * 1e6,
        "hook, us/saved": times["pack"] / times["packs"] * 1e6,
        "deciding, us/saved": (times["pack"] - times["encode"]) / times["packs"] * 1e6,
    }


def _table(columns: tuple[str, ...], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f"{value:.2f}" if isinstance(value, float) else str(value)
                                       for value in row) + " |")
    return lines


def _spread(values: list[float]) -> str:
    low, median, high = quantiles(values)
    return f"{median:+.2f} [{low:+.2f}, {high:+.2f}]"


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--roots", nargs="+", type=Path, default=[Path(__file__).resolve().parent.parent],
                        help="checkouts to measure, each in a process of its own (PYTHONPATH=ROOT); the first "
                             "is the baseline of the comparison")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return

    load_before, started = load_average(), time.perf_counter()
    roots = [root.resolve() for root in args.roots]
    children = {root: _Child(root, args) for root in roots}
    # rounds[root][model index] = that model's derived figures, one per round.
    rounds: dict[Path, list[list[dict[str, float]]]] = {root: [[] for _ in args.models] for root in roots}
    for index in range(args.warmup + args.rounds):
        # One round of every root back to to back, the first one rotating: a load that comes
        # and goes slows the members of a round alike.
        for root in roots[index % len(roots):] + roots[:index % len(roots)]:
            measured = children[root].round()
            if index >= args.warmup:
                for model, (times, counts) in enumerate(zip(measured, children[root].setup["counts"])):
                    rounds[root][model].append(derived(times, counts))
        print(f"round {index + 1}/{args.warmup + args.rounds} (load {load_average()})", flush=True)
    for child in children.values():
        child.close()

    body: list[str] = []
    for root in roots:
        setup = children[root].setup
        body += [f"## {root} (git {_commit(root)})", "", "Counts per training step:", ""]
        body += _table(("model",) + COUNT_COLUMNS,
                       [[row["model"], *(row[c] for c in COUNT_COLUMNS)] for row in setup["counts"]])
        body += ["", f"Times, medians over {args.rounds} rounds:", ""]
        body += _table(("model",) + TIME_COLUMNS,
                       [[name, *(statistics.median(r[c] for r in rounds[root][model]) for c in TIME_COLUMNS)]
                        for model, name in enumerate(args.models)])
        body += ["", "Per call into the mode (us, best of 5 batches of 20,000):", ""]
        body += _table(("call", "plain", "inside tracking_scopes()", "added"), [
            [label, value["plain"], value["tracked"], value["tracked"] - value["plain"]]
            for label, value in setup["per call"].items()])
        body.append("")
    base = roots[0]
    for root in roots[1:]:
        body += [f"## {root} against {base}, round by round", "",
                 "Median [quartiles] over rounds of the difference (this root's minus the baseline's in the same "
                 "round), and of the ratio of whole-model forwards:", ""]
        columns = ("model", "whole / baseline whole", "tracking ms", "hook, us/saved", "deciding, us/saved")
        rows = []
        for model, name in enumerate(args.models):
            pairs = list(zip(rounds[root][model], rounds[base][model]))
            low, median, high = quantiles([a["whole ms"] / b["whole ms"] for a, b in pairs])
            rows.append([name, f"{median:.3f} [{low:.3f}, {high:.3f}]",
                         *(_spread([a[c] - b[c] for a, b in pairs])
                           for c in ("tracking ms", "hook, us/saved", "deciding, us/saved"))])
        body += _table(columns, rows) + [""]
    for line in body:
        print(line)

    device = torch.device("cpu")
    settings = {"spec": SPEC, "rest": REST, "batch": args.batch, "rounds": args.rounds, "warmup": args.warmup}
    header = header_lines(device, args.threads, 0, time.perf_counter() - started, settings, load_before)
    header.append("actcomp of each root: " + ", ".join(f"{root} = git {_commit(root)}" for root in roots))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{results_stem('forward_overhead', device, args.threads)}.md"
    write_markdown(path, "Python per model op and per saved tensor in whole-model mode", header, body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
