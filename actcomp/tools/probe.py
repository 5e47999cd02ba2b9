"""Fresh-process probes: a Python program run in a new interpreter that imports this actcomp.

Peak memory is measured in a process of its own, so one measurement's high-water mark never
leaks into the next (:mod:`actcomp.tools.peak_rss`, :mod:`actcomp.tools.temporaries`). Every
such probe goes through :func:`run_probe`: it puts this copy of actcomp first on the child's
``PYTHONPATH``, reads the JSON value the probe prints on its last line, and turns a failure
into an :class:`~actcomp.errors.ActcompError` that ends with the probe's own error output.

>>> run_probe(["-c", "import json; print(json.dumps({'answer': 42}))"], what="a trivial probe")
{'answer': 42}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from actcomp.errors import ActcompError

# The directory that holds this actcomp package (the repository root in a checkout).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

# Enough of a traceback to see the error and where it came from.
_STDERR_TAIL = 2000


def run_probe(program: list[str], *, what: str, env: Mapping[str, str | None] | None = None,
              package_root: str = PACKAGE_ROOT, timeout: float | None = None) -> Any:
    """Run ``python *program`` in a fresh process and return the JSON value on its last stdout line.

    ``what`` names the probe in errors. ``env`` adds to (or overrides) this process's environment,
    a ``None`` value removes that variable;
    ``package_root`` goes first on the child's ``PYTHONPATH``, so the probe imports that actcomp
    (by default this one) rather than whichever copy the interpreter would find first, such as
    an installed one that predates an option the caller passes. A probe that exits with an
    error, runs past ``timeout`` seconds or prints no JSON raises :class:`ActcompError` with
    the end of its stderr.

    >>> run_probe(["-c", "import sys; sys.exit('out of memory')"], what="a failing probe")
    Traceback (most recent call last):
    ...
    actcomp.errors.ActcompError: a failing probe failed (exit status 1):
    out of memory
    """
    environment = {**os.environ, **(env or {})}
    environment = {name: value for name, value in environment.items() if value is not None}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environment.get("PYTHONPATH")]))
    try:
        done = subprocess.run([sys.executable, *program], capture_output=True, text=True, check=False,
                              env=environment, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        # Captured output comes as bytes here, whatever ``text`` says.
        stderr = (expired.stderr or b"").decode(errors="replace")
        raise ActcompError(f"{what} ran past {timeout} s:\n{stderr[-_STDERR_TAIL:]}") from None
    if done.returncode != 0:
        raise ActcompError(f"{what} failed (exit status {done.returncode}):\n{done.stderr[-_STDERR_TAIL:].rstrip()}")
    last_line = done.stdout.strip().rpartition("\n")[2]
    try:
        return json.loads(last_line)
    except json.JSONDecodeError:
        raise ActcompError(f"{what} printed no JSON result on its last line ({last_line[-200:]!r}):\n"
                           f"{done.stderr[-_STDERR_TAIL:].rstrip()}") from None
