"""The README says what is true: its links lead to files that exist, and its Quickstart prints
what the README shows."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    """The README's text under ``## title``, up to the next ``## `` heading."""
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.M | re.S)
    assert found, f"README has no section {title!r}"
    return found.group(1)


def test_every_relative_link_leads_to_a_file():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert relative, "the README links to its documentation"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_readme_stays_short():
    # A newcomer reads it in a few minutes; the rest lives in docs/.
    assert len(README.splitlines()) <= 220


def test_the_quickstart_prints_what_the_readme_shows(tmp_path):
    blocks = re.findall(r"```(\w*)\n(.*?)```", section("Quickstart"), flags=re.S)
    code = next(body for language, body in blocks if language == "python")
    shown = next(body for language, body in blocks if language == "")
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    printed, expected = result.stdout.splitlines(), shown.splitlines()
    # The bytes are exact; the losses are the same to float rounding across machines.
    assert printed[0] == expected[0]
    assert len(printed) == len(expected)
    for got, want in zip(printed[1:], expected[1:]):
        (got_step, got_loss), (want_step, want_loss) = (re.fullmatch(r"step (\d): loss ([\d.]+)", line).groups()
                                                        for line in (got, want))
        assert got_step == want_step and float(got_loss) == pytest.approx(float(want_loss), abs=0.02)


def _ci_blocks() -> list[str]:
    """The commands of the README's ``<!-- ci:test -->`` blocks, as .ci/run takes them."""
    marked = re.findall(r"<!-- ci:test -->\n```bash\n(.*?)```\n<!-- /ci:test -->", README, flags=re.S)
    assert marked, "the README has ci:test blocks"
    return marked


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# Pages whose prose says they show what CI runs: "this is what CI runs", "which CI runs verbatim".
_SAYS_WHAT_CI_RUNS = re.compile(r"what\s+CI\s+runs|CI\s+runs\s+verbatim")
PAGES_SAYING_WHAT_CI_RUNS = [str(page.relative_to(ROOT)) for page in _pages()[1:]
                             if _SAYS_WHAT_CI_RUNS.search(page.read_text())]


def test_the_pages_that_say_what_ci_runs_are_found():
    assert {"docs/install.md", "docs/index.md"} <= set(PAGES_SAYING_WHAT_CI_RUNS)


@pytest.mark.parametrize("page", PAGES_SAYING_WHAT_CI_RUNS)
def test_pages_that_say_what_ci_runs_show_the_same_commands(page):
    # A newcomer copies the first block a page shows: it must be what CI installs and runs.
    text = (ROOT / page).read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    for commands in _ci_blocks():
        assert commands in blocks, f"{page} does not show the README's ci:test block:\n{commands}"


def test_a_command_said_to_be_run_as_ci_runs_it_is_one_ci_runs():
    # development.md lists commands with comments; "as CI runs it" must be CI's line verbatim.
    ci_lines = {line for commands in _ci_blocks() for line in commands.splitlines()}
    claimed = [(page, command.strip()) for page in _pages()
               for command in re.findall(r"^([^#\n]+)#.*\bas CI runs", page.read_text(), flags=re.M)]
    assert claimed, "development.md says which of its commands CI runs"
    for page, command in claimed:
        assert command in ci_lines, f"{page.relative_to(ROOT)}: {command!r} is not a line CI runs: {sorted(ci_lines)}"


def test_no_page_installs_with_other_extras_than_ci():
    installs = {line for commands in _ci_blocks() for line in commands.splitlines() if "pip install -e" in line}
    for page in _pages():
        for line in re.findall(r"^pip install -e .*$", page.read_text(), flags=re.M):
            assert line in installs, f"{page.relative_to(ROOT)} installs with {line!r}; CI runs {sorted(installs)}"


def _demo_outputs(text: str) -> list[str]:
    """The blocks of a page that show ``actcomp demo``'s output."""
    return re.findall(r"^```\n(actcomp demo:.*?)```", text, flags=re.S | re.M)


def test_every_page_that_shows_the_demo_shows_the_readmes_run():
    # One run, one CPU line: a page's copy must not keep an older run's numbers. The README's
    # "..." leaves lines out; another page may show them.
    (shown,) = _demo_outputs(README)
    pattern = "".join(r"(?:.*\n)*?" if line == "..." else re.escape(line) + r"\n" for line in shown.splitlines())
    pages = [page for page in _pages()[1:] if _demo_outputs(page.read_text())]
    assert {"docs/index.md", "docs/install.md"} <= {str(page.relative_to(ROOT)) for page in pages}
    for page in pages:
        for output in _demo_outputs(page.read_text()):
            assert re.fullmatch(pattern, output), f"{page.relative_to(ROOT)} shows another demo run than the README's"


# What the home page says where the README cannot: the README's links lead into docs/ on GitHub.
HOME_PAGE_ONLY = {
    "# actcomp\n": "# actcomp\n\n*This page is the repository's README; the pages in the menu hold the rest.*\n",
    "The documentation (`mkdocs serve`, or the Markdown under `docs/`):": "The rest of this site:",
    "MIT licensed ([LICENSE](LICENSE)).": "MIT licensed (`LICENSE` in the repository).",
    "](CHANGELOG.md)": "](changelog.md)",
}


def test_the_home_page_is_the_readme():
    # docs/index.md is the README with its links made relative to docs/: an edit to one goes
    # to the other.
    home = re.sub(r"^<!-- /?ci:test -->\n", "", README, flags=re.M)
    home = re.sub(r"\[docs/(?:[\w-]+/)*([\w-]+)\.md\]\(docs/", r"[\1](", home)  # [docs/x.md](docs/x.md)
    home = home.replace("](docs/", "](")
    for readme_text, home_text in HOME_PAGE_ONLY.items():
        assert readme_text in home, f"HOME_PAGE_ONLY names README text that is gone: {readme_text!r}"
        home = home.replace(readme_text, home_text, 1)
    page = (ROOT / "docs/index.md").read_text()
    diff = "\n".join(difflib.unified_diff(home.splitlines(), page.splitlines(), "README.md, made a page", "docs/index.md",
                                          lineterm="", n=1))
    assert home == page, f"docs/index.md and README.md differ:\n{diff}"
