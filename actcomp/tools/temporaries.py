"""Extra peak memory of compressing and decompressing one tensor, measured in a fresh process.

What a pipeline allocates *while* it works lands in the very peak the library exists to
lower, so it is measured, not estimated: a subprocess makes the tensor, resets the kernel's
high-water mark of its resident memory (``/proc/self/clear_refs``, Linux), compresses, and
reads the mark (``VmHWM``) back. The extra peak is that mark minus the resident memory before
the call and the bytes of the result; decompressing is measured the same way. As in
:mod:`actcomp.tools.peak_rss`, ``MALLOC_MMAP_THRESHOLD_=65536`` makes every block from 64 KiB up
its own mapping, so freed temporaries leave the resident set at once.

>>> rows = extra_peak(["int8"], count=2**22, dtype="float32")  # doctest: +SKIP
>>> rows[0]["compress_extra"] < 0.5  # as a fraction of the input's bytes  # doctest: +SKIP
True
"""

from __future__ import annotations

import json

from actcomp.errors import ActcompError
from actcomp.tools.probe import run_probe

_PROBE = r"""
import json, sys, torch, actcomp
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])

def status(field):
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")

def storage_bytes(tensors, besides):
    # The result's own storages; one it shares with the input (a cast to the input's own dtype
    # keeps the input itself) costs nothing new.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    storages.pop(besides.untyped_storage().data_ptr(), None)
    return sum(storages.values())

dtype = getattr(torch, args["dtype"])
count = args["count"]
# A conv-shaped activation (N, 64, 32, 32), so channel stages have their channel axis.
x = torch.randn(count // 65536, 64, 32, 32, dtype=dtype)
if args["with_nan"]:
    x.view(-1)[0] = float("nan")
rows = []
for spec in args["specs"]:
    pipeline = actcomp.parse(spec)
    pipeline.decompress(pipeline.compress(x[:1].clone(), channel_dim=1))  # first-call setup
    reset_peak()
    before = status("VmRSS")
    packed = pipeline.compress(x, channel_dim=1)
    compress_extra = status("VmHWM") - before - storage_bytes(packed.tensors, x)
    reset_peak()
    before = status("VmRSS")
    y = pipeline.decompress(packed)
    decompress_extra = status("VmHWM") - before - storage_bytes([y], packed.tensors[-1])
    ok = bool(y.shape == x.shape and y.dtype == x.dtype)
    input_bytes = x.numel() * x.element_size()
    rows.append({"spec": spec, "input_bytes": input_bytes, "packed_bytes": packed.nbytes,
                 "compress_extra": compress_extra / input_bytes, "decompress_extra": decompress_extra / input_bytes,
                 "round_trip_ok": ok})
    del packed, y
print(json.dumps(rows))
"""


def extra_peak(specs: list[str], *, count: int, dtype: str = "float32", threads: int = 1,
               with_nan: bool = False) -> list[dict]:
    """Per spec: the extra peak of compressing and of decompressing a ``count``-element tensor
    (a multiple of 65536) of ``dtype``, as fractions of its bytes, in one fresh process.
    ``with_nan`` puts a NaN in it: the tensor then decodes to NaN (the chain's finite flag),
    which costs a whole decoded tensor beside the NaN one."""
    if count % 65536:
        raise ActcompError(f"count must be a multiple of 65536 (a (N, 64, 32, 32) tensor), got {count}")
    settings = {"specs": list(specs), "count": count, "dtype": dtype, "threads": threads, "with_nan": with_nan}
    return run_probe(["-c", _PROBE, json.dumps(settings)], env={"MALLOC_MMAP_THRESHOLD_": "65536"},
                     what=f"extra-peak probe for {specs}")
