"""Module paths that pickles made by actcomp 0.1.0 name, before the code moved into packages.

A pickle names each function and class by its module; these aliases let ``pickle.load`` and
``torch.load`` find them where they live now.

>>> import sys, actcomp
>>> sys.modules["actcomp.pipeline"] is sys.modules["actcomp.core.pipeline"]
True
"""

import importlib
import sys

MOVED = {
    "actcomp.pipeline": "actcomp.core.pipeline",
    "actcomp.packed": "actcomp.core.packed",
    "actcomp.model_inputs": "actcomp.graph.model_inputs",
}


def install() -> None:
    """Register every old path as an alias of its new module."""
    for old, new in MOVED.items():
        sys.modules.setdefault(old, importlib.import_module(new))
