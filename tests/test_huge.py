"""More than 2**31 elements round-trip: no position, count or offset overflows 32 bits.

Slow (about ten minutes on 2 cores) and large (the tensor is 4 GiB in bf16, the checks need
about 12 GiB), so it runs only when asked: ``ACTCOMP_SLOW=1 python -m pytest tests/test_huge.py``.
The README's results section records its last run.
"""

import os

import pytest
import torch

import actcomp

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("ACTCOMP_SLOW") != "1", reason="slow and 12 GiB: set ACTCOMP_SLOW=1"),
]

# Past 2**31 by a few chunks and an odd tail, so the last positions need 32 bits unsigned.
COUNT = 2**31 + 3 * 2**18 + 5


@pytest.fixture(scope="module")
def huge():
    torch.manual_seed(0)
    return torch.randn(COUNT, dtype=torch.bfloat16)


def test_mink_keeps_exactly_the_largest_past_two_to_the_31(huge):
    packed = actcomp.parse("mink0.9").compress(huge)
    y = actcomp.parse("mink0.9").decompress(packed)
    kept = y != 0

    assert int(kept.sum()) == COUNT - int(0.9 * COUNT)
    assert torch.equal(y[kept], huge[kept])
    assert float(huge[~kept].abs().max()) <= float(huge[kept].abs().min())
    # The last elements, past 2**31, land where they were.
    tail = slice(2**31, COUNT)
    assert torch.equal(y[tail][kept[tail]], huge[tail][kept[tail]]) and bool(kept[tail].any())


def test_int8_stays_within_a_step_past_two_to_the_31(huge):
    stage = actcomp.parse("int8")
    packed = stage.compress(huge)
    y = stage.decompress(packed)
    offset, scale, codes = packed.tensors

    assert codes.numel() == COUNT and offset.numel() == scale.numel() == -(-COUNT // 256)
    worst = 0.0
    for start in range(0, COUNT, 2**26):
        stop = min(start + 2**26, COUNT)
        step = scale[start // 256:-(-stop // 256)].float().repeat_interleave(256)[:stop - start]
        error = (y[start:stop].float() - huge[start:stop].float()).abs()
        # A step, plus bf16's rounding of the rebuilt value (half an ulp: |x| 2**-9).
        worst = max(worst, float((error - step - huge[start:stop].float().abs() * 2**-8).max()))
    assert worst <= 0
