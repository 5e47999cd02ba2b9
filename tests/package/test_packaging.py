"""The package as users get it: ``python -m build`` makes a wheel and an sdist that ``twine check
--strict`` accepts, each holding what it should, and the wheel, installed into a fresh virtual
environment, imports from there and runs the README's Quickstart and the ``actcomp`` command.

The build runs on a copy of the checkout, so its ``build/`` and ``*.egg-info`` stay out of it.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the sdist holds at its top level: the package, the files it ships beside it, and what
# setuptools adds (PKG-INFO, setup.cfg, the egg-info). No tests, benchmarks or build outputs.
SDIST_TOP_LEVEL = {"actcomp", "actcomp.egg-info", "README.md", "CHANGELOG.md", "LICENSE", "MANIFEST.in",
                   "pyproject.toml", "PKG-INFO", "setup.cfg"}
# Subprocesses see neither a PYTHONPATH pointing at a checkout nor this one as their directory.
ENV = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def run(*command: str | Path, cwd: Path) -> str:
    """Run ``command`` in ``cwd``; its stdout, or a failure that shows what it printed."""
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command} exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def quickstart() -> str:
    """The first ```python block under the README's "## Quickstart" heading."""
    _, heading, rest = (ROOT / "README.md").read_text().partition("\n## Quickstart\n")
    block = re.search(r"^```python\n(.*?)^```", rest.split("\n## ", 1)[0], re.DOTALL | re.MULTILINE)
    assert heading and block, 'README.md has no ```python block under "## Quickstart"'
    return block.group(1)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """A folder holding the wheel and the sdist built from this checkout, without isolation (the
    installed setuptools; no network). `python -m build` builds the wheel from the sdist, so the
    sdist is shown to hold what a wheel needs."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info"))
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", source, cwd=tmp)
    return tmp / "dist"


def test_twine_accepts_the_wheel_and_the_sdist(dist):
    run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()), cwd=dist)


def test_the_wheel_holds_the_package_its_type_marker_kernel_source_and_license(dist):
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    assert {"actcomp/__init__.py", "actcomp/py.typed", "actcomp/kernels/native_cpu.c"} <= names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert {name.split("/")[0] for name in names} == {"actcomp", wheel.name.split("-py")[0] + ".dist-info"}


def test_the_sdist_holds_the_package_changelog_and_license_and_nothing_else(dist):
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}

    assert {"README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml", "actcomp/py.typed",
            "actcomp/kernels/native_cpu.c"} <= names
    assert {name.split("/")[0] for name in names} <= SDIST_TOP_LEVEL
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def test_the_installed_wheel_runs_the_quickstart_and_the_command(dist, tmp_path):
    venv = tmp_path / "venv"
    # Torch and timm come from the interpreter that runs the tests, not the network. Without
    # pip: this interpreter's pip installs into the environment that runs it.
    run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    if sys.prefix != sys.base_prefix:
        # Run from a virtual environment, whose packages the new one's system site lacks: a
        # .pth line appends them to its path, after its own site-packages.
        purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path).strip()
        Path(purelib, "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (wheel,) = dist.glob("*.whl")
    # --ignore-installed: an actcomp the outer environment has (this checkout's editable install)
    # is neither reused nor uninstalled.
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--no-index",
        "--ignore-installed", wheel, cwd=tmp_path)

    printed = run(python, "-c", "import actcomp\nprint(actcomp.__file__)\n" + quickstart(), cwd=tmp_path)

    assert Path(printed.splitlines()[0]).is_relative_to(venv), f"actcomp imported from {printed.splitlines()[0]}"
    assert "usage:" in run(venv / "bin" / "actcomp", "--help", cwd=tmp_path)
