"""Tools on top of both modes: the memory report, fresh-process probes, the largest batch, the
temporaries meter, plotting, the demo and the command line (``python -m actcomp``).

>>> from actcomp.tools.memory import format_bytes
>>> format_bytes(3 * 2**20)
'3.0 MiB'
"""
