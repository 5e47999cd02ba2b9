"""The largest-batch search: its bisection on a known peak curve, the fresh-process probe helper,
and real fresh-process probes."""

from __future__ import annotations

import pytest

import actcomp
from actcomp.tools import max_batch
from actcomp.tools.max_batch import largest_batch
from actcomp.tools.memory import parse_bytes
from actcomp.tools.peak_rss import peak_rss
from actcomp.tools.probe import PACKAGE_ROOT, run_probe

MiB = 2**20


def affine_curve(base: int, per_sample: int, wobble: int = 0):
    """A peak curve like a real one: affine in the batch, with a little non-linearity."""
    return lambda batch: base + per_sample * batch + wobble * (batch % 7)


def fake_probe(monkeypatch, curve):
    """Make the search measure ``curve`` instead of fresh processes; returns the batches asked for."""
    asked: list[int] = []

    def probe(model, spec, *, batch, abort_above, **kwargs):
        asked.append(batch)
        return curve(batch)

    monkeypatch.setattr(max_batch, "peak_rss", probe)
    return asked


@pytest.mark.parametrize("budget_mib", [850, 1000, 4096, 20000])
@pytest.mark.parametrize("wobble", [0, 3 * MiB])
@pytest.mark.parametrize("tolerance", [0.0, 0.02])
def test_search_finds_the_largest_batch_within_tolerance(monkeypatch, budget_mib, wobble, tolerance):
    curve = affine_curve(800 * MiB, 17 * MiB, wobble)
    asked = fake_probe(monkeypatch, curve)
    budget = budget_mib * MiB

    search = largest_batch("m", None, budget=budget, tolerance=tolerance)

    true_largest = max((b for b in range(1, 5000) if curve(b) <= budget), default=0)
    assert search.batch <= true_largest
    assert search.batch >= int(true_largest * (1 - tolerance)) - 1
    assert search.batch == 0 or (search.peak == curve(search.batch) <= budget)
    # What the search reports as over really was, and it is just above the answer.
    assert search.smallest_over is not None and curve(search.smallest_over) > budget
    assert search.smallest_over - search.batch <= max(1, tolerance * search.batch)
    assert len(asked) == len(set(asked))  # no batch is measured twice
    assert len(asked) <= 14


def test_search_when_even_the_smallest_probe_is_over(monkeypatch):
    fake_probe(monkeypatch, affine_curve(800 * MiB, 100 * MiB))
    search = largest_batch("m", None, budget=1000 * MiB)
    assert search.batch == 2 and search.smallest_over == 3
    assert largest_batch("m", None, budget=850 * MiB).batch == 0


@pytest.mark.parametrize("budget, tolerance, message", [(0, 0.02, "positive"), (MiB, 1.0, "tolerance")])
def test_bad_search_settings_raise(budget, tolerance, message):
    with pytest.raises(actcomp.ActcompError, match=message):
        largest_batch("m", None, budget=budget, tolerance=tolerance)


def test_a_probe_imports_this_actcomp_from_any_directory(tmp_path, monkeypatch):
    # Run elsewhere, the child would otherwise import whichever actcomp is installed.
    monkeypatch.chdir(tmp_path)

    # Where the child finds actcomp, without importing it (and torch): a fraction of a second.
    code = "import importlib.util, json; print(json.dumps(importlib.util.find_spec('actcomp').origin))"

    found = run_probe(["-c", code], what="an import probe")

    assert found == actcomp.__file__ and found.startswith(PACKAGE_ROOT)


@pytest.mark.parametrize("program, message", [
    ("import sys; print('Traceback ...', file=sys.stderr); sys.exit(3)",
     "a probe failed (exit status 3):\nTraceback ..."),
    ("print('no json here')", "a probe printed no JSON result on its last line ('no json here')"),
    ("import time; print('started', file=sys.stderr, flush=True); time.sleep(30)", "a probe ran past 1 s:\nstarted"),
])
def test_a_failing_probe_raises_with_its_stderr(program, message):
    with pytest.raises(actcomp.ActcompError) as raised:
        run_probe(["-c", f"import sys; {program}"], what="a probe", timeout=1)

    assert str(raised.value).startswith(message)


def test_a_probe_gets_the_environment_it_asks_for():
    code = "import json, os; print(json.dumps(os.environ['ACTCOMP_PROBE_TEST']))"

    assert run_probe(["-c", code], what="an environment probe", env={"ACTCOMP_PROBE_TEST": "on"}) == "on"


def test_probe_stops_early_above_a_limit_and_checkpoint_runs():
    # One real fresh-process probe of each kind: a limit far below the process's own size is
    # passed at once, and a checkpointed whole-model step trains to the end.
    stopped = peak_rss("resnet18", None, batch=2, img_size=32, steps=1, threads=1, abort_above=MiB)
    assert stopped > MiB
    finished = peak_rss("resnet18", "mink0.9+int8", rest="8bit", checkpoint=True, batch=2, img_size=32, steps=1,
                        threads=1)
    assert finished > 100 * MiB


def test_a_small_warmup_step_then_one_step_peaks_like_two_full_steps():
    # The search's probes run a batch-2 step and then one full step: the full step must start
    # from what a second step starts with (the first step's gradients), or the search would
    # overrate every batch by the gradients' size.
    # 32 px: resnet18's last BatchNorm sees 1x1 maps, where a batch-1 warm-up step would raise.
    # The tuned allocator makes resident memory follow live memory, which is what this compares:
    # as a user's process runs, glibc's heap keeps whatever layout the step's allocations leave,
    # and the same comparison measured 1.9% and 3.8% apart (AdamW), -0.7% (SGD), run to run.
    sizes = dict(batch=16, img_size=32, threads=1, allocator="tuned")
    two_steps = peak_rss("resnet18", None, steps=2, **sizes)
    warmed_up = peak_rss("resnet18", None, steps=1, warmup_batch=2, **sizes)
    # Measured: 0.1-0.2% apart; one step without the warm-up is 1.3% lower (resnet18's gradients).
    assert abs(warmed_up - two_steps) <= 0.008 * two_steps


@pytest.mark.parametrize("text, expected", [("4GiB", 4 * 2**30), ("4 gib", 4 * 2**30), ("3.5GB", 3_500_000_000),
                                            ("512M", 512 * MiB), ("100", 100), ("2k", 2048)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["4 GiBs", "GiB", "-1G", "0", "nanG", "infG", ""])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(actcomp.ActcompError, match="memory size.*4GiB"):
        parse_bytes(text)


@pytest.mark.parametrize("text, expected", [("4GiB", 4 * 2**30), ("4 GiB", 4 * 2**30), ("512M", 512 * MiB),
                                            ("64MiB", 64 * MiB)])
def test_parse_budget(text, expected):
    assert max_batch.parse_budget(text) == expected


@pytest.mark.parametrize("text, message", [
    ("4", r"budget '4' has no unit; write the size with one, e\.g\. '4GiB', '3\.5GB', '512MiB', '512M'"),
    ("0.5", "budget '0.5' has no unit.*'0.5GiB'"),
    ("10KiB", r"budget '10KiB' is 10\.0 KiB, below 64\.0 MiB.*'4GiB'"),
    ("4B", "below 64.0 MiB"),
    ("4 gigs", "budget: cannot read '4 gigs' as a memory size.*'4GiB'"),
    ("-4", "cannot read '-4' as a memory size"),
])
def test_parse_budget_refuses_a_number_without_unit_or_too_small(text, message):
    with pytest.raises(actcomp.ActcompError, match=message):
        max_batch.parse_budget(text)
