"""Kernels: pure tensor functions the codecs are built from (bit packing, chunked passes, rounding
noise, kept positions, thresholds, affine codes, memory layouts). No registry, no settings.

>>> from actcomp.kernels.bitpack import pack_bits, unpack_bits
>>> import torch
>>> unpack_bits(pack_bits(torch.tensor([True, False, True])), 3).tolist()
[True, False, True]
"""
