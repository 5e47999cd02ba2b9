"""Tools on top of both modes: the memory report (:mod:`~actcomp.tools.memory`: a recorder of the
saved tensors and the report built from it), fresh-process probes (:mod:`~actcomp.tools.probe`,
used by :mod:`~actcomp.tools.peak_rss` and :mod:`~actcomp.tools.temporaries`), the largest batch
(:mod:`~actcomp.tools.max_batch`), what the codecs cost a step (:mod:`~actcomp.tools.codec_cost`),
plotting, the demo and the command line (``python -m actcomp``).

>>> from actcomp.tools.memory import format_bytes
>>> format_bytes(3 * 2**20)
'3.0 MiB'
"""
