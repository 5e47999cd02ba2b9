"""More than 2**31 elements round-trip: no position, count or offset overflows 32 bits.

Slow (minutes on 2 cores) and large (the tensor is 4 GiB in bf16, its round trip another
4 GiB), so it runs only when asked: ``ACTCOMP_SLOW=1 python -m pytest tests/kernels/test_huge.py``.
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


def slices():
    """The checks run a slice at a time: whole-tensor masks and gathers would need 20 GiB."""
    for start in range(0, COUNT, 2**26):
        yield slice(start, min(start + 2**26, COUNT))


def test_mink_keeps_exactly_the_largest_past_two_to_the_31(huge):
    stage = actcomp.parse("mink0.9")
    y = stage.decompress(stage.compress(huge))

    kept_count, smallest_kept, largest_dropped = 0, float("inf"), 0.0
    for part in slices():
        kept = y[part] != 0
        kept_count += int(kept.sum())
        assert torch.equal(y[part][kept], huge[part][kept])
        smallest_kept = min(smallest_kept, float(huge[part][kept].abs().min()))
        largest_dropped = max(largest_dropped, float(huge[part][~kept].abs().max()))
    assert kept_count == COUNT - int(0.9 * COUNT)
    assert largest_dropped <= smallest_kept
    assert bool((y[2**31:] != 0).any())  # past 2**31, kept values land where they were


def test_int8_stays_within_a_step_past_two_to_the_31(huge):
    stage = actcomp.parse("int8")
    packed = stage.compress(huge)
    y = stage.decompress(packed)
    offset, scale, codes = packed.tensors

    assert codes.numel() == COUNT and offset.numel() == scale.numel() == -(-COUNT // 256)
    worst = 0.0
    for part in slices():
        start, stop = part.start, part.stop
        step = scale[start // 256:-(-stop // 256)].float().repeat_interleave(256)[:stop - start]
        error = (y[part].float() - huge[part].float()).abs()
        # A step, plus bf16's rounding of the rebuilt value (under an ulp of |x| + a step: 2**-8 of it).
        worst = max(worst, float((error - step - (huge[part].float().abs() + step) * 2**-8).max()))
    assert worst <= 0
