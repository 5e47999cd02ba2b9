"""The version is written once, in ``actcomp.__version__``; the installed metadata agrees."""

import importlib.metadata
import re

import actcomp


def test_the_package_and_its_metadata_give_one_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", actcomp.__version__)
    assert importlib.metadata.version("actcomp") == actcomp.__version__
