"""Plotting for the CLI, the demo and the benchmarks: matplotlib, checked before any work starts.

>>> X_LESS_NOTE
'x less = plain / compressed bytes, higher is better'
"""

from __future__ import annotations

import os
from pathlib import Path

from actcomp.errors import ActcompError

X_LESS_NOTE = "x less = plain / compressed bytes, higher is better"


def pyplot_for(path: str, where: str = "--plot"):
    """pyplot, once ``path`` is known to be a file matplotlib can write; ``where`` names the
    option (or the plot) in errors.

    Called before any model is built or trained, so a bad ``--plot`` fails in a second, not
    after the whole run.

    >>> pyplot_for("/no/such/dir/loss.png")
    Traceback (most recent call last):
    ...
    actcomp.errors.ActcompError: --plot '/no/such/dir/loss.png': directory '/no/such/dir' does not exist
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ActcompError(f"{where} needs matplotlib: pip install matplotlib (or pip install 'actcomp[plot]')") from None
    target = Path(path)
    formats = FigureCanvasBase.get_supported_filetypes()
    # savefig reads the format from the suffix, lower-cased; without one it would write FILE.png instead.
    suffix = target.suffix.lower()
    if suffix.lstrip(".") not in formats:
        found = f"suffix {suffix!r}" if suffix else "no suffix"
        raise ActcompError(f"{where} {path!r} has {found}; matplotlib writes {', '.join('.' + f for f in formats)}")
    if target.is_dir():
        raise ActcompError(f"{where} {path!r} is a directory; give a file name such as {str(target / 'plot.png')!r}")
    if not target.parent.is_dir():
        raise ActcompError(f"{where} {path!r}: directory {str(target.parent)!r} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise ActcompError(f"{where} {path!r}: directory {str(target.parent)!r} is not writable")
    return plt
