"""The documentation site builds as CI builds it: ``mkdocs build --strict``.

Strict mode turns every warning into a failure, and mkdocs.yml makes a warning of each broken
link or anchor between pages, each page left out of the nav, each results file or changelog
included by a path that does not exist (``check_paths``), and each docstring the API reference
cannot render. Full tier: it needs the ``docs`` extra and a few seconds.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    pytest.importorskip("pymdownx")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    # The API reference rendered its doctests as code, not as Markdown block quotes.
    api = (site / "api" / "index.html").read_text()
    assert "to_compressed" in api and "<blockquote>" not in api
