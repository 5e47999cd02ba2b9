"""The core: the spec grammar, stage settings, the codec interface, the packed form, the chain
loop, the registry and the pipeline. Imports nothing of actcomp above it.

>>> from actcomp.core.pipeline import parse
>>> parse("mink0.9+int8").spec
'mink0.9+int8'
"""
