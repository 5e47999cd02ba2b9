"""Losses that never materialize what plain PyTorch keeps whole: the logits of a language model.

>>> from actcomp.losses import linear_cross_entropy
"""

from actcomp.losses.linear_cross_entropy import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
