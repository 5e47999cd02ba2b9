"""Built-in stages. Importing this package registers them.

==========  ==========  =====================================================
name        kind        what it keeps
==========  ==========  =====================================================
mink        sparsifier  exact global min-k (largest |x|), compact positions
smink       sparsifier  one-pass min-k: threshold from a sample, kept fraction +-0.01
pmink       sparsifier  exact min-k per block of ``block`` elements
random      sparsifier  random elements (positions from a seed: free)
channel     sparsifier  channels with the largest L2 norm, their ids
rchannel    sparsifier  random channels, their ids
dropit      sparsifier  DropIT's published format (values + int32 indices)
int8/4/2    quantizer   per-group affine codes, stochastic rounding
mesa8       quantizer   8-bit codes of a running (EMA) range
fp16/bf16   quantizer   saturating storage cast
fp8         quantizer   e4m3 storage with a per-tensor scale
==========  ==========  =====================================================

Under int8/4/2 sit :func:`quantize_affine` and :func:`dequantize_affine`, pure functions
with the rounding noise passed in. Every stage works a chunk at a time (:mod:`.chunks`), so its
temporaries stay small whatever the tensor's size.
"""

from actcomp.compressors.affine import GroupQuant, Int2, Int4, Int8
from actcomp.compressors.casts import Bf16, Fp8, Fp16
from actcomp.compressors.channels import ChannelMinK, RandomChannels
from actcomp.compressors.elements import DropITReference, MinK, ParallelMinK, RandomDrop, SampledMinK
from actcomp.compressors.mesa import Mesa8
from actcomp.core.codec import Compressor, Encoded, Hints, drop_count, setting
from actcomp.kernels.quantize import dequantize_affine, quantize_affine

__all__ = [
    "Bf16", "ChannelMinK", "Compressor", "DropITReference", "Encoded", "Fp16", "Fp8", "GroupQuant",
    "Hints", "Int2", "Int4", "Int8", "Mesa8", "MinK", "ParallelMinK", "RandomChannels", "RandomDrop",
    "SampledMinK", "dequantize_affine", "drop_count", "quantize_affine", "setting",
]
