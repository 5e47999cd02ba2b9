"""Which elements a normalization normalizes together, so quantization groups never straddle two.

A norm's backward divides by each unit's spread (``1/std``). A quantization group spanning two
units takes its range from the wider one: a unit with a tiny spread (a class token with no
position embedding, std 1e-6, beside patch tokens) is rounded to a constant, and its backward
multiplies that error by ``1/std``. So whole-model mode lays a norm's input out as rows that
each lie inside one unit and quantizes in groups that divide a row:

=================================  ==================================  ======================
op                                 unit                                rows
=================================  ==================================  ======================
layer_norm, rms_norm               one row of the normalized shape     the trailing dims
group_norm                         one sample's group of channels      channels/groups x H x W
instance_norm                      one sample's channel plane          H x W
batch_norm                         one channel over the batch          H x W planes, or the
                                                                       channel's N x H x W
                                                                       when planes are small
a ``...Norm`` module's own ops     its last dimension (RMSNorm, T5)    the last dim
=================================  ==================================  ======================

>>> unit = normalized_unit("batch_norm", (4, 8, 2, 2))
>>> unit.permutation, unit.row  # 2x2 planes are small: each channel's 4 x 2 x 2 values form a row
((1, 0, 2, 3), 16)
>>> normalized_unit("layer_norm", (2, 197, 384), (384,)).row, row_group(384, 256), row_group(197, 256)
(384, 192, 197)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

# Planes smaller than this (in elements) put a BatchNorm's channel in one row across the batch
# instead: a group per 4x4 plane would spend more on ranges than on codes.
SMALL_PLANE = 64


class Unit(NamedTuple):
    """``tensor.permute(permutation).reshape(-1, row)``: each row inside one normalized unit."""

    permutation: tuple[int, ...] | None  # None: the tensor's own dimension order
    row: int


def normalized_unit(op: str | None, shape: Sequence[int], setting=None) -> Unit | None:
    """The unit of ``op`` (a norm's name in :mod:`actcomp.graph.op_kinds`, None for a norm module's
    own elementwise ops) for a saved tensor of ``shape``; ``setting`` is layer_norm's and
    rms_norm's ``normalized_shape`` or group_norm's ``num_groups``. None when the tensor's
    shape does not fit the op: then no layout is imposed."""
    shape = tuple(int(size) for size in shape)
    if not shape:
        return None
    if op in ("layer_norm", "rms_norm"):
        normalized = shape[-1:] if setting is None else setting
        normalized = (int(normalized),) if isinstance(normalized, int) else tuple(int(n) for n in normalized)
        if tuple(shape[len(shape) - len(normalized):]) != normalized:
            return None
        return Unit(None, math.prod(normalized))
    if op == "group_norm" and len(shape) >= 2 and setting is not None:
        groups = int(setting)
        if groups < 1 or shape[1] % groups:
            return None
        return Unit(None, shape[1] // groups * math.prod(shape[2:]))
    if op == "instance_norm" and len(shape) >= 3:
        return Unit(None, math.prod(shape[2:]))
    if op == "batch_norm" and len(shape) >= 2:
        plane = math.prod(shape[2:])
        if plane >= SMALL_PLANE:
            return Unit(None, plane)
        return Unit((1, 0, *range(2, len(shape))), shape[0] * plane)
    if op is None:
        return Unit(None, shape[-1])
    return None


def row_group(row: int, group: int) -> int:
    """The quantization group for rows of ``row`` elements, given the stage's ``group``: the
    largest divisor of ``row`` up to ``group`` when it is at least a quarter of ``group`` (few
    more ranges to store), else the whole row (one range per row, never straddling)."""
    if row <= group:
        return row
    divisor = next(d for d in range(group, 0, -1) if row % d == 0)
    return divisor if divisor * 4 >= group else row
