"""Command line: ``actcomp report ...``, ``actcomp check ...`` and ``actcomp demo`` (the
installed command; ``python -m actcomp ...`` runs the same).

>>> main(["report", "--model", "resnet18", "--pipeline", "mink0.9", "--batch", "2", "--img-size", "32"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from actcomp.convert import compressed_layers, to_compressed
from actcomp.core.pipeline import parse
from actcomp.errors import ActcompError
from actcomp.tools import peak_rss
from actcomp.tools.check import spec_summary
from actcomp.tools.demo import run_demo
from actcomp.tools.max_batch import largest_batch, parse_budget
from actcomp.tools.memory import MemoryReport, format_bytes, memory_report
from actcomp.tools.plotting import X_LESS_NOTE, pyplot_for
from actcomp.whole_model.policy import RestPolicy


def program_name(argv0: str | None = None) -> str:
    """The name usage and errors give the program: what the user typed to run it.

    >>> program_name("/venv/bin/actcomp"), program_name("/src/actcomp/__main__.py")
    ('actcomp', 'python -m actcomp')
    """
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    # Under `python -m actcomp` argv[0] is the package's __main__.py, which nobody types.
    return "python -m actcomp" if name in ("__main__.py", "") else name


class _Version(argparse.Action):
    """``--version``: the installed distribution's version (pyproject.toml reads it from
    ``actcomp.__version__``, a layer above this one), looked up only when asked."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import importlib.metadata

        try:
            version = importlib.metadata.version("actcomp")
        except importlib.metadata.PackageNotFoundError:
            version = "(not installed: pip install -e . to give it one)"
        print(f"{parser.prog} {version}")  # to stdout, as argparse's own version action prints
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program_name(), description="Activation compression for training.")
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, help="what to run; add -h after it for its options")
    _add_report_arguments(commands.add_parser(
        "report", help="saved-activation bytes of a timm model, plain vs compressed"))
    _add_check_arguments(commands.add_parser(
        "check", help="your model's gradient, plain against compressed: per op kind and layer, with fixes"))
    _add_demo_arguments(commands.add_parser(
        "demo", help="train a small CNN and ViT on scikit-learn's digits, plain vs compressed"))
    return parser


def _add_check_arguments(check: argparse.ArgumentParser) -> None:
    source = check.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="FILE.py:FUNCTION",
                        help="a function returning (model, batch): a file path or module name, a colon, its name "
                             "(batch: a tensor, a tuple of positional arguments or a dict of keyword arguments)")
    source.add_argument("--timm", metavar="NAME", help="a timm model (random weights) on random images instead")
    check.add_argument("--pipeline", default=None, type=_spec_or_mapping,
                       help="spec for Linear/Conv inputs (default mink0.9+int8), or a mapping of layer names to "
                            "specs as --budget prints it: \"{'fc': 'int8', '*': 'int4'}\"")
    check.add_argument("--rest", metavar="PRESET_OR_SPEC", default=None, type=_spec_or_mapping,
                       help="whole-model policy ('8bit', '4bit', 'exact', a spec, or a mapping of op kinds as "
                            "--budget prints it; 'none': Linear/Conv mode only; default 8bit)")
    check.add_argument("--budget", metavar="FRACTION_OR_SIZE", default=None,
                       help="plan the codecs instead (actcomp.plan_budget): a fraction of plain's kept bytes (0.1) or "
                            "a size for this batch (1.5GiB); prints the plan, then checks it")
    check.add_argument("--floor", type=float, default=0.99,
                       help="lowest gradient cosine for each op kind, a layer under a quantizer alone, and the whole "
                            "model unless a sparsifier's layers set a lower one (default %(default)s)")
    check.add_argument("--layer-floor", type=float, default=None,
                       help="lowest cosine of every converted layer's weight gradient (default: under a sparsifier, "
                            "what dropping as many values at random keeps, less 5%%; else --floor)")
    check.add_argument("--rounds", type=int, default=3, help="interleaved timed steps (default %(default)s)")
    check.add_argument("--amp", choices=["bf16"], default=None,
                       help="measure (and plan) under bf16 autocast, as a mixed-precision training step runs")
    check.add_argument("--batch", type=int, default=8,
                       help="--timm: images per batch, seeded like the weights (default %(default)s)")
    check.add_argument("--img-size", type=int, default=224, help="--timm: image size (default %(default)s)")


def _add_report_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument("--model", required=True, help="timm model name, e.g. resnet18 or vit_small_patch16_224")
    report.add_argument("--pipeline", default=None, type=_spec_or_mapping,
                        help="spec for Linear/Conv inputs, e.g. 'mink0.9+int8', or a mapping of layer names to specs "
                             "as --budget prints it: \"{'fc': 'int8', '*': 'int4'}\"")
    report.add_argument("--rest", metavar="PRESET_OR_SPEC", default=None, type=_spec_or_mapping,
                        help="whole-model mode: compress every other saved tensor too ('8bit', '4bit', 'exact', a spec, "
                             "or a mapping of op kinds as --budget prints it)")
    report.add_argument("--budget", metavar="FRACTION_OR_SIZE", default=None,
                        help="plan the codecs instead of --pipeline and --rest (actcomp.plan_budget on this batch): a "
                             "fraction of plain's kept bytes (0.1) or a size (1.5GiB); prints the plan, then reports it")
    report.add_argument("--batch", type=int, default=8,
                        help="batch size of the measured forward and of the --rss steps (default %(default)s)")
    report.add_argument("--img-size", type=int, default=224,
                        help="input images are IMG_SIZE x IMG_SIZE pixels, here and in the --rss/--max-batch probes "
                             "(default %(default)s)")
    report.add_argument("--amp", choices=["bf16"], default=None, help="run the forward under bf16 autocast")
    report.add_argument("--layers", action="store_true", help="also list the largest modules")
    report.add_argument("--rss", action="store_true", help="also measure peak RSS of 3 steps in fresh processes")
    # nargs="+": "--max-batch 4 GiB" (unquoted) reads as 4 GiB, not as a stray argument "GiB".
    report.add_argument("--max-batch", metavar=("BUDGET", "UNIT"), nargs="+",
                        help="also find the largest batch whose training step peaks under BUDGET, a size with its "
                             "unit (4GiB, '4 GiB', 3.5GB, 512MiB): plain, checkpointed per block, and compressed; "
                             "fresh processes, minutes on a large model")
    report.add_argument("--threads", type=int, default=None, help="torch threads in the --rss/--max-batch probes")
    report.add_argument("--plot", metavar="FILE.png", help="bar chart per layer type (needs matplotlib)")


def _add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--epochs", type=int, default=8, help="passes over the digits training set (default %(default)s)")
    demo.add_argument("--threads", type=int, default=1, help="torch threads (tiny models run best on one)")
    demo.add_argument("--pipelines", nargs="+", default=["mink0.9+int8"],
                      help="Linear/Conv specs; each runs in Linear/Conv mode and in whole-model mode")
    demo.add_argument("--rest", metavar="PRESET_OR_SPEC", default="8bit",
                      help="whole-model policy for the whole-model rows ('8bit', '4bit', 'exact', a spec; 'none': no such rows)")
    demo.add_argument("--models", nargs="+", default=["cnn", "vit"], choices=["cnn", "vit"],
                      help="which to train: cnn (3 convs), vit (3 transformer blocks); default both")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed of the weights, the train/test split and the batch order (default %(default)s)")
    demo.add_argument("--plot", metavar="FILE.png", help="save the loss curves (needs matplotlib)")


def main(argv: list[str] | None = None) -> int:
    """Run one command; 0 on success, 2 (with the message on stderr) on an :class:`ActcompError`.

    >>> main(["report", "--model", "resnet18", "--pipeline", "int8", "--batch", "0"])
    2
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ActcompError as error:
        # argparse's own form, so a bad value and a bad option read alike.
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    """``python -m actcomp demo``: see :func:`actcomp.tools.demo.run_demo`."""
    rest = None if args.rest.lower() == "none" else args.rest
    run_demo(epochs=args.epochs, specs=args.pipelines, models=args.models, seed=args.seed, threads=args.threads,
             plot=args.plot, rest=rest)
    return 0


@dataclass(frozen=True)
class _ReportSettings:
    """The report's arguments once read and checked, before any model is built."""

    # The codecs as given (a spec, or a mapping as --budget prints it), or as the plan chose them.
    spec: str | dict | None
    rest: str | dict | None
    plan_budget: float | str | None
    max_batch: int | None
    plt: Any

    @property
    def label(self) -> str:
        """The Linear/Conv codecs in words: the spec, or a mapping's distinct specs."""
        return self.spec if isinstance(self.spec, str) else spec_summary(self.spec)

    @property
    def rest_label(self) -> str:
        """The whole-model policy in words: a preset or spec, or a mapping's rule per kind."""
        return self.rest if isinstance(self.rest, str) else str(RestPolicy.parse(self.rest))

    def title(self) -> str:
        """``pipeline 'int8', rest '8bit'``; a mapping's words unquoted."""
        rest = f", rest {_quoted(self.rest, self.rest_label)}" if self.rest is not None else ""
        return f"pipeline {_quoted(self.spec, self.label)}{rest}"

    def method(self) -> str:
        """The compressed row's name in a table of methods: the spec and preset, or the plan's."""
        if isinstance(self.spec, dict) or isinstance(self.rest, dict):
            return "compressed (the codecs above)"
        return self.label + (f", rest {self.rest}" if self.rest is not None else "")


def _quoted(value: str | dict, words: str) -> str:
    """``words`` quoted where ``value`` is a spec or preset as the user typed it."""
    return repr(words) if isinstance(value, str) else words


def _report(args: argparse.Namespace) -> int:
    """``python -m actcomp report``: the memory tables (of the plan ``--budget`` makes, printed
    first, where asked), then each measurement asked for."""
    settings = _read_report_arguments(args)
    plain = _timm_model(args.model, args.img_size)
    x = torch.randn(args.batch, 3, args.img_size, args.img_size)
    with torch.autocast("cpu", dtype=torch.bfloat16) if args.amp else contextlib.nullcontext():
        if settings.plan_budget is not None:
            settings = _planned(settings, plain, x)
        compressed = to_compressed(copy.deepcopy(plain), settings.spec, rest=settings.rest)
        before = memory_report(plain, x)
        after = memory_report(compressed, x)
    _print_memory(args, settings, before, after)
    _print_conversion(compressed, after)
    if args.layers:
        print(after.table())
    if args.rss:
        _print_peak_rss(args, settings)
    if settings.max_batch is not None:
        _print_largest_batches(args, settings)
    if settings.plt is not None:
        _plot_by_type(settings.plt, args, settings.label, before, after)
    return 0


def _read_report_arguments(args: argparse.Namespace) -> _ReportSettings:
    """Every check that needs no model, so a typo fails in a second, not after the measurements."""
    plan_budget = _planning_budget(args)
    if plan_budget is None and args.pipeline is None:
        raise ActcompError("report needs the codecs: --pipeline SPEC (e.g. 'mink0.9+int8', with --rest for whole-model "
                           "mode), or --budget FRACTION to plan them")
    if plan_budget is None:
        _check_pipeline(args.pipeline)
        if args.rest is not None:
            RestPolicy.parse(args.rest)
    max_batch = parse_budget(" ".join(args.max_batch), "--max-batch") if args.max_batch is not None else None
    plt = pyplot_for(args.plot) if args.plot else None
    _check_timm_arguments(args.model, args.batch, args.img_size)
    return _ReportSettings(args.pipeline, args.rest, plan_budget, max_batch, plt)


def _planning_budget(args: argparse.Namespace) -> float | str | None:
    """``--budget`` of ``report`` and ``check``, read and checked before any model is built
    (None where not given): it excludes ``--pipeline`` and ``--rest``, and a malformed one fails."""
    from actcomp.tools.budget import bytes_of_budget

    if args.budget is None:
        return None
    if args.pipeline is not None or args.rest is not None:
        raise ActcompError("--budget chooses the pipeline and rest itself: drop --pipeline and --rest, or --budget")
    budget = _budget_argument(args.budget)
    bytes_of_budget(budget, 1)
    return budget


def _check_pipeline(pipeline: str | dict) -> None:
    """A spec, or every spec of a layer mapping, parsed: a typo is an error before any work."""
    for spec in pipeline.values() if isinstance(pipeline, dict) else [pipeline]:
        if spec is not None:
            parse(spec)


def _planned(settings: _ReportSettings, plain: nn.Module, x: torch.Tensor) -> _ReportSettings:
    """``settings`` with the codecs :func:`actcomp.plan_budget` chooses on ``x``; the plan printed."""
    from actcomp.tools.budget import plan_budget

    plan = plan_budget(plain, x, settings.plan_budget)
    print(plan, end="\n\n")
    return replace(settings, spec=plan.pipeline, rest=plan.rest)


def _check_timm_arguments(name: str, batch: int, img_size: int) -> None:
    """A timm model's name and sizes, checked before anything is built."""
    timm = _timm()
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:8]
        hint = f"; similar: {', '.join(close)}" if close else "; see timm.list_models()"
        raise ActcompError(f"unknown timm model {name!r}{hint}")
    if batch < 1 or img_size < 1:
        raise ActcompError(f"--batch and --img-size must be positive, got {batch} and {img_size}")


def _timm():
    try:
        import timm
    except ImportError:
        raise ActcompError("this command builds timm models: pip install timm") from None
    return timm


def _timm_model(name: str, img_size: int) -> nn.Module:
    """A timm model with seeded random weights, sized for ``img_size`` where it takes one."""
    timm = _timm()
    torch.manual_seed(0)
    try:
        return timm.create_model(name, pretrained=False, img_size=img_size)
    except TypeError:
        return timm.create_model(name, pretrained=False)


def _print_memory(args: argparse.Namespace, settings: _ReportSettings, before: MemoryReport,
                  after: MemoryReport) -> None:
    """The title, then bytes per layer type (Linear/Conv mode) or per op kind (whole-model mode)."""
    precision = "bf16 autocast" if args.amp else "fp32"
    print(f"{args.model}, batch {args.batch}, {args.img_size}x{args.img_size}, {precision}, {settings.title()}")
    print(f"memory: {X_LESS_NOTE}")
    if settings.rest is None:
        _print_rows("layer type", _type_rows(before, after), before.total_bytes, after.total_bytes)
    else:
        _print_rows("op kind", _kind_rows(before, after), before.total_bytes, after.total_bytes)
        whole = [s for s in after.kept_as_is() if s.nbytes >= 0.01 * before.total_bytes]
        for storage in whole[:5]:
            print(f"! kept as is: {format_bytes(storage.nbytes)} {tuple(storage.shape)} saved by "
                  f"{', '.join(storage.savers)} ({storage.op_kind})")
    if before.parameter_copy_bytes or after.parameter_copy_bytes:
        print(f"(not counted above: parameter copies kept for backward, e.g. autocast weights: "
              f"plain {format_bytes(before.parameter_copy_bytes)}, compressed {format_bytes(after.parameter_copy_bytes)})")


def _type_rows(before: MemoryReport, after: MemoryReport) -> list[tuple[str, int, int, str]]:
    """(layer type, plain bytes, compressed bytes, ""), the plain model's largest first."""
    plain_types, packed_types = before.by_type(), after.by_type()
    return [(name, plain_types.get(name, 0), packed_types.get(name, 0), "")
            for name in sorted(set(plain_types) | set(packed_types), key=lambda t: -plain_types.get(t, 0))]


def _kind_rows(before: MemoryReport, after: MemoryReport) -> list[tuple[str, int, int, str]]:
    """(op kind, plain model's bytes, kept bytes, codecs): whole-model mode is chosen per op kind,
    so its table is too."""
    plain_kinds = {row.kind: row.kept_bytes for row in before.kinds}
    kept_kinds = {row.kind: row for row in after.kinds}
    return [(kind, plain_kinds.get(kind, 0), kept_kinds[kind].kept_bytes if kind in kept_kinds else 0,
             ", ".join(kept_kinds[kind].codecs) if kind in kept_kinds else "")
            for kind in dict.fromkeys([*plain_kinds, *kept_kinds])]


def _print_rows(title: str, rows: list[tuple[str, int, int, str]], plain_total: int, packed_total: int) -> None:
    """The bytes table: a row per (name, plain bytes, compressed bytes, codecs), then the totals.

    >>> _print_rows("layer type", [("GELU", 4096, 1024, ""), ("Linear", 2048, 0, "")], 6144, 1024)
    layer type                     plain  compressed  x less
    GELU                         4.0 KiB     1.0 KiB   4.00x
    Linear                       2.0 KiB         0 B       -
    total                        6.0 KiB     1.0 KiB   6.00x
    """
    kept_as = any(row[3] for row in rows)
    print(f"{title:<24} {'plain':>11} {'compressed':>11} {'x less':>7}" + ("  kept as" if kept_as else ""))
    for name, plain, packed, codecs in rows:
        line = f"{name:<24} {format_bytes(plain):>11} {format_bytes(packed):>11} {_ratio(plain, packed):>7}"
        print(line + (f"  {codecs}" if codecs else ""))
    total = _ratio(plain_total, packed_total)
    print(f"{'total':<24} {format_bytes(plain_total):>11} {format_bytes(packed_total):>11} {total:>7}")


def _ratio(plain: int, compressed: int) -> str:
    # One convention for every memory ratio the CLI prints, so "2x" always means half the bytes.
    return f"{plain / compressed:.2f}x" if compressed else "-"


def _print_conversion(compressed: nn.Module, after: MemoryReport) -> None:
    """How many layers were converted, which ran plain, and how many free nothing."""
    layers = compressed_layers(compressed)
    lost = sum(item.input_bytes for item in after.not_freed)
    reads, runs = ("reads", "it runs") if len(after.plain_on_input) == 1 else ("read", "they run")
    plain_note = f" ({', '.join(after.plain_on_input)} {reads} the model input, so {runs} plain)" if after.plain_on_input else ""
    print(f"{len(layers)} layers converted{plain_note}; {len(after.not_freed)} free nothing because another op keeps "
          f"their input ({format_bytes(lost)} kept anyway)")


def _print_peak_rss(args: argparse.Namespace, settings: _ReportSettings) -> None:
    """Peak RSS of plain and compressed training steps, each in a fresh process."""
    sizes = dict(batch=args.batch, img_size=args.img_size, amp=args.amp, threads=args.threads)
    rss = []
    probes = [("plain", None, None), ("compressed", settings.spec, settings.rest)]
    # Each probe trains in a fresh process and can take minutes on a large model: say what is running.
    for number, (label, probe_spec, rest) in enumerate(probes, start=1):
        print(f"measuring peak RSS: {label} ({number}/2) ...", end="", file=sys.stderr, flush=True)
        started = time.perf_counter()
        # Looked up at call time (the module's, not a copy), so tests can stand in for the fresh processes.
        rss.append(peak_rss.peak_rss(args.model, probe_spec, rest=rest, **sizes))
        print(f" done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    rss_plain, rss_packed = rss
    print(f"peak RSS of 3 training steps: plain {format_bytes(rss_plain)}, compressed {format_bytes(rss_packed)}"
          " (fresh processes, AdamW, the allocator as your process gets it: actcomp.tools.peak_rss)")


def _print_largest_batches(args: argparse.Namespace, settings: _ReportSettings) -> None:
    """The largest batch under ``--max-batch``: plain, checkpointed per block, and compressed."""
    budget, spec, rest = settings.max_batch, settings.spec, settings.rest
    methods = [("plain", None, None, False), ("checkpoint per block", None, None, True),
               (settings.method(), spec, rest, False)]
    found = []
    for label, method_spec, rest, checkpoint in methods:
        print(f"largest batch in {format_bytes(budget)}: {label} ...", file=sys.stderr, flush=True)
        # Bisection over fresh processes: each probe can take minutes on a large model, so show each one.
        search = largest_batch(args.model, method_spec, rest=rest, checkpoint=checkpoint, budget=budget,
                               img_size=args.img_size, threads=args.threads, progress=_print_probe)
        found.append((label, search))
    plain_batch = found[0][1].batch
    print(f"largest batch whose training step peaks under {format_bytes(budget)} (RSS after a batch-2 step, "
          f"fresh processes, {args.img_size} px):")
    print(f"{'method':<40} {'batch':>6} {'peak':>10} {'x plain':>8}")
    for label, search in found:
        ratio = f"{search.batch / plain_batch:.2f}x" if plain_batch else "-"
        print(f"{label:<40} {search.batch:>6} {format_bytes(search.peak):>10} {ratio:>8}")


def _print_probe(batch: int, peak: int, fits: bool) -> None:
    """Progress of the largest-batch search, one line per fresh-process probe (on stderr)."""
    print(f"  batch {batch}: peak {format_bytes(peak)}{'' if fits else ' (over)'}", file=sys.stderr, flush=True)


def _plot_by_type(plt, args: argparse.Namespace, spec: str, before: MemoryReport, after: MemoryReport) -> None:
    """Bars per layer type, plain beside compressed, saved to ``--plot``."""
    plain_types, packed_types = before.by_type(), after.by_type()
    names = list(plain_types)
    figure, axes = plt.subplots(figsize=(8, 4))
    positions = range(len(names))
    axes.bar([p - 0.2 for p in positions], [plain_types[n] / 2**20 for n in names], 0.4, label="plain")
    axes.bar([p + 0.2 for p in positions], [packed_types.get(n, 0) / 2**20 for n in names], 0.4, label=spec)
    axes.set_xticks(list(positions), names, rotation=30, ha="right")
    axes.set_ylabel("saved for backward (MiB)")
    axes.set_title(f"{args.model}, batch {args.batch}, {'bf16 autocast' if args.amp else 'fp32'}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.plot)
    print(f"bar chart saved to {args.plot}")


def _check(args: argparse.Namespace) -> int:
    """``actcomp check``: :func:`actcomp.tools.check.check` on a model of the user's (with
    ``--budget``, of the plan :func:`actcomp.tools.budget.plan_budget` makes for it)."""
    from actcomp.tools.budget import plan_budget
    from actcomp.tools.check import check

    budget = _planning_budget(args)
    if args.timm:
        _check_timm_arguments(args.timm, args.batch, args.img_size)
        model = _timm_model(args.timm, args.img_size)
        batch = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=torch.Generator().manual_seed(0))
    else:
        model, batch = _from_factory(args.model)
    # Autocast on the model's device: the steps, the plan's bytes and the codecs all see the
    # dtypes a mixed-precision step gives them (a BatchNorm's bf16 input takes "8bit"'s int4).
    device = next((parameter.device.type for parameter in model.parameters()), "cpu")
    with torch.autocast(device, dtype=torch.bfloat16) if args.amp else contextlib.nullcontext():
        if budget is not None:
            plan = plan_budget(model, batch, budget)
            print(plan, end="\n\n")
            pipeline, rest = plan.pipeline, plan.rest
        else:
            pipeline = args.pipeline or "mink0.9+int8"
            rest = args.rest or "8bit"
            rest = None if isinstance(rest, str) and rest.lower() == "none" else rest
        print(check(model, batch, pipeline, rest=rest, floor=args.floor, layer_floor=args.layer_floor,
                    rounds=args.rounds))
    return 0


def _spec_or_mapping(text: str) -> str | dict:
    """``--pipeline`` or ``--rest``: a spec or preset as it is, or a mapping written as Python
    or JSON writes one (the plan ``--budget`` prints pastes here).

    >>> _spec_or_mapping("int8"), _spec_or_mapping("{'fc': 'int8', '*': None}")
    ('int8', {'fc': 'int8', '*': None})
    """
    if not text.lstrip().startswith("{"):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a mapping: write it as Python or JSON does, "
                                         "\"{'fc': 'int8', '*': 'int4'}\"")
    return value


def _budget_argument(text: str) -> float | str:
    """``--budget``: a fraction ("0.1") or a size ("1.5GiB").

    >>> _budget_argument("0.1"), _budget_argument("1.5GiB")
    (0.1, '1.5GiB')
    """
    try:
        return float(text)
    except ValueError:
        return text


def _from_factory(text: str) -> tuple[nn.Module, Any]:
    """``(model, batch)`` from ``"path/to/file.py:function"`` or ``"package.module:function"``,
    a relative path or module found from the current folder, as ``python -m`` finds one."""
    where, _, name = text.rpartition(":")
    if not where or not name:
        raise ActcompError(f"--model wants FILE.py:FUNCTION or module:function, got {text!r}")
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    folder = os.path.dirname(os.path.abspath(where)) if is_file else os.getcwd()
    # The file's own imports of its neighbours, and a module beside the user, resolve as they would
    # under `python my_models.py`: its folder goes first on the path while it loads and builds.
    with _on_path(folder):
        module = _load_file(where) if is_file else _import(where)
        factory = getattr(module, name, None)
        if not callable(factory):
            defined = sorted(key for key, value in vars(module).items() if callable(value) and not key.startswith("_")
                             and getattr(value, "__module__", None) == module.__name__)
            listing = f"; it defines: {', '.join(defined)}" if defined else "; it defines no function"
            raise ActcompError(f"--model: {where!r} has no function {name!r}{listing}")
        made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise ActcompError(f"--model: {name}() must return (model, batch), got {type(made).__name__}")
    return made


@contextlib.contextmanager
def _on_path(folder: str):
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)


def _load_file(where: str):
    """The module in file ``where`` (``.py`` may be left off), relative to the current folder."""
    path = where if where.endswith(".py") else f"{where}.py"
    if not os.path.isfile(path):
        raise ActcompError(f"--model: no file {path!r} (looked in {os.path.abspath(os.path.dirname(path) or '.')}); "
                           "give FILE.py:FUNCTION with a path from the current folder, or module:function")
    stem = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise ActcompError(f"--model: {path!r} could not import what it needs: {error}") from error
    return module


def _import(where: str):
    """Module ``where``, from the current folder or the installed packages."""
    try:
        return importlib.import_module(where)
    except ImportError as error:
        missing = getattr(error, "name", None)
        if missing is not None and (where == missing or where.startswith(f"{missing}.")):
            raise ActcompError(f"--model: no module {where!r} in the current folder ({os.getcwd()}) or the installed "
                               "packages; give module:function from the folder that holds it, or FILE.py:FUNCTION"
                               ) from None
        raise ActcompError(f"--model: module {where!r} could not import what it needs: {error}") from error


_COMMANDS = {"report": _report, "check": _check, "demo": _demo}
