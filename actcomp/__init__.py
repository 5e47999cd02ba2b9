"""actcomp: compress the activations autograd keeps for backward.

>>> import torch, actcomp
>>> pipeline = actcomp.parse("mink0.9+int8")
>>> x = torch.randn(64, 1024)
>>> packed = pipeline.compress(x)
>>> round(packed.nbytes / (x.numel() * x.element_size()), 3)
0.042
"""

# Importing the compressors registers the built-in stages, before anything can list them.
from actcomp import compressors, legacy_paths
from actcomp.convert import compressed_layers, from_compressed, to_compressed
from actcomp.core.packed import Packed
from actcomp.core.pipeline import Pipeline, parse
from actcomp.core.registry import (
    codec_class,
    list_codecs,
    list_compressors,
    register_codec,
    register_compressor,
    unregister_codec,
    unregister_compressor,
)
from actcomp.errors import ActcompError
from actcomp.losses import linear_cross_entropy
from actcomp.tools.budget import BudgetPlan, plan_budget
from actcomp.tools.check import CheckReport, check
from actcomp.tools.memory import MemoryReport, memory_report
from actcomp.whole_model.choosing import register_op_codec, unregister_op_codec

# The one place the version is written: pyproject.toml reads it, CHANGELOG.md says what changed.
__version__ = "0.1.0"

legacy_paths.install()


def __getattr__(name: str):
    # compress_in_graph's module imports Inductor (its graph-pass base class): 2 s that every
    # `import actcomp` paid, compiling or not. It loads on first use instead.
    if name == "compress_in_graph":
        from actcomp.whole_model.in_graph import compress_in_graph

        return compress_in_graph
    raise AttributeError(f"module 'actcomp' has no attribute {name!r}")

__all__ = [
    "ActcompError", "BudgetPlan", "CheckReport", "MemoryReport", "Packed", "Pipeline", "check", "codec_class",
    "compress_in_graph", "compressed_layers", "compressors", "from_compressed", "linear_cross_entropy", "list_codecs",
    "list_compressors", "memory_report", "parse", "plan_budget", "register_codec", "register_compressor",
    "register_op_codec", "to_compressed", "unregister_codec", "unregister_compressor", "unregister_op_codec",
]
