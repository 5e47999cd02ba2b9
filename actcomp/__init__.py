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
from actcomp.core.registry import list_compressors, register_compressor, unregister_compressor
from actcomp.errors import ActcompError
from actcomp.tools.memory import MemoryReport, memory_report

# The one place the version is written: pyproject.toml reads it, CHANGELOG.md says what changed.
__version__ = "0.1.0"

legacy_paths.install()

__all__ = [
    "ActcompError", "MemoryReport", "Packed", "Pipeline", "compressed_layers", "compressors", "from_compressed",
    "list_compressors", "memory_report", "parse", "register_compressor", "to_compressed", "unregister_compressor",
]
