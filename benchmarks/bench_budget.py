"""``actcomp.plan_budget`` against its targets: where each budget lands, the gradient it keeps,
what the search costs, and the plan against the hand-picked presets at the presets' own bytes.

    python benchmarks/bench_budget.py            # ~10 minutes on 2 cores

Models (random weights, one batch each, as a user would plan on theirs): timm's resnet50 and
ViT-S at 224 px (8 images; ``--images``), and the Llama-shaped model of ``bench_lm_quality.py`` with a trained
model's outliers built in (hidden 256, 4 layers, 2 x 256 tokens, a sink token first; ``--sequences``
for more rows); asked for
by name only, ``"llama 8 layers (outliers, 2048 tokens)"``: the same with hidden 512, 8 layers and
1 x 2048 tokens (``bench_lm_families.py``'s sizes, a 2000-token vocabulary), whose step is long
enough for the search's fixed costs to show less. For each:

- every budget of ``--fractions``: the bytes the plan keeps (fraction of plain's, measured by
  ``memory_report`` as the plan's own report does), the whole gradient's cosine against plain's,
  and the search's cost in steps and in seconds over one plain step's (median of 3);
- every preset: its kept fraction and cosine, then the plan asked for exactly the preset's bytes
  (``--no-presets`` skips them);
- with ``--lift-attention-floors``, every budget again with ``attention_floors=False`` (SDPA's query and
  key no longer bf16 at most, value and output no longer int8 at least);
- with ``--peaks``, what users decide on: each timm model's plans (planned on the batch of 8)
  trained as a user's script runs them (:func:`actcomp.tools.peak_rss.training_steps`: fresh
  processes, ``--peak-batch`` images at 224 px, 10 classes, AdamW, 3 steps) beside plain and the
  ``"mink0.9+int8", rest="8bit"`` preset: peak RSS and step time against plain's, in rounds
  whose order rotates (``--peak-rounds``).

Writes ``benchmarks/results/budget_<torch>_cpu_t<threads>.{md,csv}``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from bench_lm_quality import llama
from common import RESULTS_DIR, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.tools.peak_rss import training_steps
from actcomp.tools.user_batch import UserBatch, copy_model, gradient_cosine

PRESETS = [("int8", "8bit"), ("mink0.9+int8", "8bit"), ("int4", "4bit"), ("mink0.9+int8", "4bit")]
COLUMNS = ["model", "asked", "config", "kept_fraction", "cosine", "preset_cosine", "steps", "search_steps_equivalent"]


DEFAULT_MODELS = ("resnet50", "vit_small_patch16_224", "llama (outliers)")
LONG_LLAMA = "llama 8 layers (outliers, 2048 tokens)"


def build(name: str, images: int = 8, sequences: int = 2) -> tuple[torch.nn.Module, object]:
    """One model of the benchmark and its batch, built when asked for."""
    if name in ("resnet50", "vit_small_patch16_224"):
        import timm

        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False), torch.randn(images, 3, 224, 224)
    if name == "llama (outliers)":
        ids = torch.randint(1, 2000, (sequences, 256), generator=torch.Generator().manual_seed(0))
        ids[:, 0] = 0  # the sink token
        return llama(outliers=True), {"input_ids": ids, "labels": ids}
    if name == LONG_LLAMA:
        import transformers

        from actcomp.tools.llm_outliers import add_outliers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=2000, hidden_size=512, intermediate_size=1408,
                                          num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                          max_position_embeddings=2048)
        model = transformers.LlamaForCausalLM(config).train()
        add_outliers(model)
        ids = torch.randint(1, 2000, (1, 2048), generator=torch.Generator().manual_seed(0))
        ids[:, 0] = 0
        return model, {"input_ids": ids, "labels": ids}
    raise SystemExit(f"unknown model {name!r}; models: {', '.join((*DEFAULT_MODELS, LONG_LLAMA))}")


def step_seconds(model: torch.nn.Module, batch) -> float:
    run, copied = UserBatch(batch), copy_model(model)
    times = []
    for _ in range(4):
        started = time.perf_counter()
        run.step(copied)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def preset(model: torch.nn.Module, batch, spec: str, rest: str) -> tuple[int, int, float]:
    run = UserBatch(batch)
    plain = run.memory(copy_model(model)).total_bytes
    converted = actcomp.to_compressed(copy_model(model), spec, rest=rest)
    kept = run.memory(converted).total_bytes
    return plain, kept, gradient_cosine(run.gradients(converted), run.gradients(copy_model(model)))


def planned(model, batch, budget, step: float, attention_floors: bool = True,
            rounds: int = 1) -> tuple[actcomp.BudgetPlan | None, float, str]:
    """The plan, and the search's time over one plain step's: over ``step`` (seconds) for one
    round; for more, each search over a plain step timed right after it, the median over rounds
    (one search's time otherwise moves 10-20% with this machine's other load)."""
    run, copied, costs = UserBatch(batch), copy_model(model), []
    for _ in range(rounds):
        started = time.perf_counter()
        try:
            plan = actcomp.plan_budget(model, batch, budget, attention_floors=attention_floors)
        except actcomp.ActcompError as error:
            return None, 0.0, str(error)
        seconds = time.perf_counter() - started
        if rounds > 1:
            started = time.perf_counter()
            run.step(copied)
            step = time.perf_counter() - started
        costs.append(seconds / step)
    return plan, statistics.median(costs), ""


def peaks(name: str, plans: dict[str, actcomp.BudgetPlan], args) -> list[str]:
    """Fresh-process peak RSS and step time of plain, the 8bit preset and each plan of timm model
    ``name``: a markdown table, the median over ``--peak-rounds`` rotating rounds."""
    runs = {"plain": (None, None), '"mink0.9+int8", rest="8bit"': ("mink0.9+int8", "8bit")}
    runs.update({label: (plan.pipeline, plan.rest) for label, plan in plans.items()})
    found = {label: [] for label in runs}
    ratios = {label: [] for label in runs}
    labels = list(runs)
    for index in range(args.peak_rounds):
        seconds = {}
        for label in labels[index % len(labels):] + labels[:index % len(labels)]:
            spec, rest = runs[label]
            peak, steps = training_steps(name, spec, rest=rest, batch=args.peak_batch, img_size=224, steps=3,
                                         threads=args.threads)
            found[label].append(peak)
            seconds[label] = statistics.median(steps[1:])
            print(f"{name} round {index} {label}: peak {peak / 2**20:.0f} MiB, step {seconds[label]:.2f} s", flush=True)
        for label in labels:
            ratios[label].append(seconds[label] / seconds["plain"])
    plain = statistics.median(found["plain"])
    table = ["", f"{name}, batch {args.peak_batch} at 224 px, AdamW, fresh processes (median of {args.peak_rounds} "
                 "rounds): peak RSS and step time against plain's.", "",
             "| run | peak RSS | x lower | step time vs plain |", "|---|---:|---:|---:|"]
    for label in labels:
        peak = statistics.median(found[label])
        table.append(f"| {label} | {peak / 2**20:.0f} MiB | {plain / peak:.2f}x | {statistics.median(ratios[label]):.2f}x |")
    return table


def measure_errors_on_tokens(count: int) -> None:
    """Make every search in this process measure a language model's parts' errors on the first
    ``count`` tokens of its sequences (``--error-tokens``): does a shorter prefix choose as well?"""
    from actcomp.tools import budget

    error_rows = budget._Search._error_rows

    def on_tokens(search, whole_norm):
        first_tokens = search.run.first_tokens
        search.run.first_tokens = lambda _quarter: first_tokens(count)
        try:
            return error_rows(search, whole_norm)
        finally:
            del search.run.first_tokens

    budget._Search._error_rows = on_tokens


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.2, 0.1])
    parser.add_argument("--no-presets", action="store_true")
    parser.add_argument("--lift-attention-floors", action="store_true")
    parser.add_argument("--peaks", action="store_true", help="the timm models' plans' peaks in fresh processes")
    parser.add_argument("--peak-batch", type=int, default=32)
    parser.add_argument("--peak-rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=None, help="a subset of the models, by name")
    parser.add_argument("--images", type=int, default=8,
                        help="the timm models' batch (the errors are measured on one of its rows at 224 px)")
    parser.add_argument("--sequences", type=int, default=2,
                        help="the Llama-shaped model's batch: sequences of 256 tokens (the search's cost falls with it)")
    parser.add_argument("--error-tokens", type=int, default=None,
                        help="an experiment: a language model's errors measured on its first N tokens, not on "
                             "the search's quarter of them (the bytes and the plan's cosine as the search has them)")
    parser.add_argument("--search-rounds", type=int, default=1,
                        help="searches per budget, each timed against a plain step right after it (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.error_tokens is not None:
        measure_errors_on_tokens(args.error_tokens)
    load_before, started = load_average(), time.perf_counter()
    rows, body = [], ["Budgets: where the plan lands (kept fraction of plain's bytes for backward), the whole "
                      "gradient's cosine against plain's, and the search's cost (steps run; wall time over one "
                      "plain step's).", "",
                      "| model | budget | kept | cosine | search: steps | search: time in steps |",
                      "|---|---:|---:|---:|---:|---:|"]
    against = ["", "At a preset's own bytes: the preset's cosine, then the plan's.", "",
               "| model | preset | kept | preset cosine | plan cosine |", "|---|---|---:|---:|---:|"]
    notes, peak_tables = [], []
    for name in args.models or DEFAULT_MODELS:
        model, batch = build(name, args.images, args.sequences)
        step = step_seconds(model, batch)
        plans = {}
        budgets = [(fraction, True) for fraction in args.fractions]
        budgets += [(fraction, False) for fraction in args.fractions] if args.lift_attention_floors else []
        for fraction, floors in budgets:
            plan, cost, error = planned(model, batch, fraction, step, floors, args.search_rounds)
            label = "plan" if floors else "plan, attention_floors=False"
            asked = fraction if floors else f"{fraction}, floors lifted"
            if plan is None:
                body.append(f"| {name} | {asked} | unreachable | | | |")
                notes.append(f"- {name}, budget {asked}: {error}")
                print(f"{name} {asked}: {error}", flush=True)
                continue
            rows.append({"model": name, "asked": fraction, "config": label, "kept_fraction": plan.kept_fraction,
                         "cosine": plan.cosine, "preset_cosine": "", "steps": plan.steps,
                         "search_steps_equivalent": cost})
            body.append(f"| {name} | {asked} | {plan.kept_fraction:.3f} | {plan.cosine:.4f} | {plan.steps} "
                        f"| {cost:.1f} |")
            print(f"{name} {asked}: kept {plan.kept_fraction:.3f} cosine {plan.cosine:.4f} ({cost:.1f} steps)",
                  flush=True)
            if fraction == min(args.fractions):
                notes.append(f"- {name}, budget {asked} (errors measured on {plan.errors_on}): `{plan.call()}`")
            if floors:
                plans[f"plan, budget {fraction} (kept {plan.kept_fraction:.3f})"] = plan
        for spec, rest in [] if args.no_presets else PRESETS:
            plain, kept, cosine = preset(model, batch, spec, rest)
            plan, cost, error = planned(model, batch, kept, step)
            label = f'"{spec}", rest="{rest}"'
            plan_cosine = plan.cosine if plan is not None else float("nan")
            rows.append({"model": name, "asked": kept / plain, "config": label, "kept_fraction": kept / plain,
                         "cosine": plan_cosine, "preset_cosine": cosine, "steps": plan.steps if plan else 0,
                         "search_steps_equivalent": cost})
            against.append(f"| {name} | {label} | {kept / plain:.3f} | {cosine:.4f} | **{plan_cosine:.4f}** |")
            print(f"{name} {label}: kept {kept / plain:.3f} preset {cosine:.4f} plan {plan_cosine:.4f} {error}",
                  flush=True)
        if args.peaks and not name.startswith("llama"):
            peak_tables += peaks(name, plans, args)
        del model
    body += against + ["", "The plans asked for the smallest budget, and what could not be met:", "", *notes]
    if peak_tables:
        body += ["", "## What a user gets: peaks in fresh processes", *peak_tables]
    device = torch.device("cpu")
    header = header_lines(device, args.threads, 0, time.perf_counter() - started,
                          {"fractions": args.fractions, "images": args.images, "sequences": args.sequences,
                           "search rounds": args.search_rounds},
                          load_before)
    write_results("budget", device, args.threads, header, "Memory budgets: plan_budget against its targets", body,
                  rows, COLUMNS, Path(args.out))


if __name__ == "__main__":
    main()
