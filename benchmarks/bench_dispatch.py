"""What a codec pays to be picked: a ``torch.library`` custom op against a plain Python call.

    PYTHONPATH=. python benchmarks/bench_dispatch.py          # about a minute on 2 cores
    PYTHONPATH=. python benchmarks/bench_dispatch.py --rounds 401 --threads 1

For an int8 encode (``Int8()``, groups of 256) of each shape, in interleaved rounds (medians of
per-call times, each round a batch of ``--calls`` calls):

- ``direct``: the CPU implementation called as a Python function;
- ``registry``: the same through :func:`actcomp.core.backends.encode` (look-up by codec class
  and device, the choice of implementation, the call);
- ``custom op``: the same function registered as ``torch.library.custom_op`` with
  ``register_fake`` and ``register_kernel("cpu")``, called through the dispatcher;

and the dispatch alone: a Python function and a custom op that each return an empty tensor,
and the registry's choice of implementation (:func:`actcomp.core.backends.choose`).

Then, under ``torch.compile(backend="eager")`` (Dynamo only: graph breaks are Dynamo's), a
function that encodes and decodes is traced three ways (the registry's encode, the custom op,
and the reference called directly) over three sizes: the graphs, graph breaks and compiles
each makes. Written to ``benchmarks/results/dispatch_overhead.md``; the numbers are quoted by
:mod:`actcomp.core.backends`' docstring, which says what they decided.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_markdown

from actcomp.compressors.affine import Int8
from actcomp.compressors.affine import _cpu_encode as cpu_encode
from actcomp.core import backends
from actcomp.core.packed import Hints

CODEC = Int8()
HINTS = Hints(channel_dim=None)


@torch.library.custom_op("actcomp_bench::int8_encode", mutates_args=())
def int8_encode_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference for devices without a kernel of their own."""
    payload, saved, _ = CODEC.encode(x, HINTS)
    return payload, *saved


@int8_encode_op.register_kernel("cpu")
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    payload, saved, _ = cpu_encode(CODEC, x, HINTS)
    return payload, *saved


@int8_encode_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The output count and shapes follow from x's size and the settings: what an op needs.
    count, group = x.numel(), CODEC.group
    groups = -(-count // group)
    return (x.new_empty(count, dtype=torch.uint8), x.new_empty(groups), x.new_empty(groups, dtype=torch.bfloat16))


@torch.library.custom_op("actcomp_bench::nothing", mutates_args=())
def nothing_op(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


@nothing_op.register_kernel("cpu")
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


@nothing_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


def nothing(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


def direct(x: torch.Tensor):
    return cpu_encode(CODEC, x, HINTS)


def time_calls(calls: dict, rounds: int, per_round: int) -> dict[str, list[float]]:
    """Microseconds per call of each entry, interleaved round by round, the order rotating."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            function = calls[name]
            start = time.perf_counter()
            for _ in range(per_round):
                function()
            times[name].append((time.perf_counter() - start) / per_round * 1e6)
    return times


def traced(function, sizes: list[int]) -> dict[str, int]:
    """Graphs, graph breaks and compiles Dynamo makes of ``function`` over ``sizes``."""
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(function, backend="eager")
    for size in sizes:
        compiled(torch.randn(size))
    breaks = sum(counts["graph_break"].values())
    return {"graphs": counts["stats"]["unique_graphs"], "breaks": breaks,
            "compiles": counts["stats"]["calls_captured"] and counts["frames"]["ok"]}


def through_registry(x: torch.Tensor) -> torch.Tensor:
    payload, saved, meta = backends.encode(CODEC, x, HINTS)
    return backends.decode(CODEC, payload, saved, meta)


def through_op(x: torch.Tensor) -> torch.Tensor:
    codes, offset, scale = int8_encode_op(x)
    return CODEC.decode(codes, (offset, scale), (x.shape, x.dtype))


def reference(x: torch.Tensor) -> torch.Tensor:
    payload, saved, meta = CODEC.encode(x, HINTS)
    return CODEC.decode(payload, saved, meta)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--shapes", nargs="+", default=["4x256", "32x197x384"], help="fp32 tensor shapes")
    parser.add_argument("--rounds", type=int, default=101, help="interleaved rounds per shape")
    parser.add_argument("--calls", type=int, default=20, help="calls per round (small tensors time better in batches)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "dispatch_overhead.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    load_before, began = load_average(), time.perf_counter()
    body = ["## Per call, int8 encode on CPU (microseconds, median of per-round means)", "",
            "| shape | direct | registry | custom op | registry - direct | custom op - direct |",
            "|---|---|---|---|---|---|"]
    for text in args.shapes:
        shape = tuple(int(size) for size in text.split("x"))
        x = torch.randn(shape)
        op_codes = int8_encode_op(x)
        assert all(torch.equal(a, b) for a, b in zip(op_codes, (direct(x)[0], *direct(x)[1]))), "the op's codes differ"
        calls = {"direct": lambda x=x: direct(x), "registry": lambda x=x: backends.encode(CODEC, x, HINTS),
                 "op": lambda x=x: int8_encode_op(x)}
        per_round = max(1, args.calls if x.numel() < 10**5 else 1)
        time_calls(calls, 3, per_round)  # warm-up
        times = {name: statistics.median(values) for name, values in time_calls(calls, args.rounds, per_round).items()}
        body.append(f"| {text} | {times['direct']:.1f} | {times['registry']:.1f} | {times['op']:.1f} | "
                    f"{times['registry'] - times['direct']:+.1f} | {times['op'] - times['direct']:+.1f} |")
        print(body[-1], flush=True)
    # The dispatch alone, around a kernel that does nothing (an empty tensor): the rows above
    # move with the machine's load by more than the differences they show.
    x = torch.randn(4, 256)
    calls = {"python": lambda: nothing(x), "custom op": lambda: nothing_op(x),
             "registry choice": lambda: backends.choose(CODEC, "encode", x, HINTS)}
    time_calls(calls, 3, args.calls * 10)
    times = {name: statistics.median(values) for name, values in time_calls(calls, args.rounds, args.calls * 10).items()}
    body += ["", "## The dispatch alone, around a kernel that returns an empty tensor (microseconds per call)", "",
             "| plain Python call | custom op (register_kernel cpu + register_fake) | the registry's choice of int8's "
             "encode (backends.choose) |", "|---|---|---|",
             f"| {times['python']:.2f} | {times['custom op']:.2f} | {times['registry choice']:.2f} |"]
    print(body[-1], flush=True)
    sizes = [1000, 1500, 4096]
    body += ["", f"## Under torch.compile(backend='eager'), encode then decode, sizes {sizes}", "",
             "| traced | graphs | graph breaks | frames compiled |", "|---|---|---|---|"]
    for name, function in [("backends.encode/decode (the registry)", through_registry),
                           ("custom op encode + reference decode", through_op),
                           ("reference encode/decode called directly", reference)]:
        counts = traced(function, sizes)
        body.append(f"| {name} | {counts['graphs']} | {counts['breaks']} | {counts['compiles']} |")
        print(body[-1], flush=True)
    header = header_lines(torch.device("cpu"), args.threads, args.seed, time.perf_counter() - began,
                          {"rounds": args.rounds, "calls per round": args.calls}, load_before)
    write_markdown(args.out, "Dispatch overhead: a Python registry against torch.library custom ops", header, body)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
