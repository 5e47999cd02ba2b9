"""actcomp: compress the activations autograd keeps for backward.

>>> import torch, actcomp
>>> pipeline = actcomp.parse("mink0.9+int8")
>>> x = torch.randn(64, 1024)
>>> packed = pipeline.compress(x)
>>> round(packed.nbytes / (x.numel() * x.element_size()), 3)
0.04
"""

from actcomp import compressors
from actcomp.convert import compressed_layers, from_compressed, to_compressed
from actcomp.errors import ActcompError
from actcomp.memory import MemoryReport, memory_report
from actcomp.packed import Packed
from actcomp.pipeline import Pipeline, parse
from actcomp.registry import list_compressors, register_compressor, unregister_compressor

# The one place the version is written: pyproject.toml reads it, CHANGELOG.md says what changed.
__version__ = "0.1.0"

__all__ = [
    "ActcompError", "MemoryReport", "Packed", "Pipeline", "compressed_layers", "compressors", "from_compressed",
    "list_compressors", "memory_report", "parse", "register_compressor", "to_compressed", "unregister_compressor",
]
