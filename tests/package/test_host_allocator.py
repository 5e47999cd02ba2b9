"""Freed buffers go back to the OS after a conversion (actcomp.host_allocator), and the switches
that leave glibc's allocator alone."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

import actcomp
from actcomp import host_allocator

# A fresh process frees an 8 MiB buffer (glibc's dynamic threshold then rises past 2 MiB), then
# allocates 64 buffers of 2 MiB with a 128 KiB one after each (so the heap cannot shrink from its
# top), frees the large ones and prints how many MiB stayed resident.
_KEPT_AFTER_FREE = r"""
import sys, torch
from actcomp.host_allocator import return_freed_memory
def resident_mib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS:")).split()[1]) // 1024
if sys.argv[1] == "remedy":
    assert return_freed_memory() == "set"
del_me = torch.ones(8 << 18)
del del_me
before = resident_mib()
blocks, pins = [], []
for _ in range(64):
    blocks.append(torch.ones(1 << 19))
    pins.append(torch.ones(1 << 15))
del blocks
print(resident_mib() - before - 8)  # the pins hold 8 MiB
"""


def _kept_mib(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _KEPT_AFTER_FREE, mode], capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.full
@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_buffers_stay_resident_as_glibc_comes_and_go_back_with_the_remedy():
    assert _kept_mib("as it comes") >= 100  # the 128 MiB freed stay in the heap
    assert _kept_mib("remedy") <= 8


def test_the_switch_in_the_environment_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.setenv(host_allocator.SWITCH, "0")
    monkeypatch.setattr(host_allocator, "_glibc", lambda: pytest.fail("the allocator was touched"))
    assert host_allocator.return_freed_memory() == "disabled by ACTCOMP_RETURN_FREED_MEMORY=0"


def test_a_users_own_threshold_is_kept(monkeypatch):
    monkeypatch.delenv(host_allocator.SWITCH, raising=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setattr(host_allocator, "_glibc", lambda: pytest.fail("the allocator was touched"))
    assert host_allocator.return_freed_memory() == "left to MALLOC_MMAP_THRESHOLD_"


@pytest.mark.parametrize("rest", [None, "8bit"])
@pytest.mark.parametrize("option, calls", [({}, 1), ({"return_freed_memory": False}, 0)])
def test_to_compressed_returns_freed_memory_at_the_first_eager_step_unless_told_not_to(monkeypatch, option, calls,
                                                                                     rest):
    seen = []
    monkeypatch.setattr(host_allocator, "return_freed_memory", lambda: seen.append(1) or "set")
    monkeypatch.setattr(host_allocator, "_requested", False)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    actcomp.to_compressed(net, "int8", first_layer=None, rest=rest, **option)
    assert seen == []  # asked for, not yet set: nothing has been compressed
    for _ in range(2):
        net(torch.randn(4, 8)).sum().backward()
    assert len(seen) == calls  # set once, at the first step


class _GeluMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_a_converted_model_only_ever_compiled_leaves_the_allocator_alone(monkeypatch):
    # Inside a compiled graph Inductor plans the buffers; the threshold's page faults took a
    # compiled ViT-S step from 1.04-1.09x to 1.41x plain's (stop 59).
    monkeypatch.setattr(host_allocator, "return_freed_memory", lambda: pytest.fail("the allocator was touched"))
    monkeypatch.setattr(host_allocator, "_requested", False)
    compiled = torch.compile(actcomp.to_compressed(_GeluMLP(), "int8", rest="8bit"))  # Inductor: in the graph
    for _ in range(2):
        compiled(torch.randn(64, 64)).square().mean().backward()
    assert host_allocator._requested  # still asked for, should the model run eagerly


def test_a_conversion_that_changes_nothing_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.setattr(host_allocator, "return_freed_memory", lambda: pytest.fail("the allocator was touched"))
    with pytest.warns(UserWarning, match="unchanged"):
        actcomp.to_compressed(torch.nn.Sequential(torch.nn.ReLU()), "int8")


@pytest.mark.parametrize("threshold", [0, -1, 1 << 40])
def test_a_threshold_a_c_int_cannot_hold_is_an_error(threshold):
    with pytest.raises(actcomp.ActcompError, match=r"not in 1 .. 2\*\*31 - 1"):
        host_allocator.return_freed_memory(threshold=threshold)


# A fresh process (the threshold is the process's) allocates an 8 MiB buffer for writing and
# prints the VmFlags of the mapping that holds its middle: "hg" is MADV_HUGEPAGE's mark.
_ADVISED = r"""
import sys, torch
from actcomp import host_allocator
if sys.argv[1] == "remedy":
    assert host_allocator.return_freed_memory() == "set"
out = host_allocator.empty_for_writing(2 << 20, torch.float32)
middle = out.data_ptr() + out.numel() * 2
flags, inside = "", False
for line in open("/proc/self/smaps"):
    if "-" in line.split()[0] and not line.startswith("VmFlags"):
        low, high = (int(part, 16) for part in line.split()[0].split("-"))
        inside = low <= middle < high
    elif line.startswith("VmFlags") and inside:
        flags = line.split(":")[1].strip()
print(out.shape[0], out.dtype, "hg" in flags.split())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.skipif(not host_allocator._huge_pages_on_request(), reason="transparent huge pages not on request here")
def test_a_buffer_for_writing_is_advised_to_huge_pages_only_where_it_is_its_own_mapping():
    def flags(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", _ADVISED, mode], capture_output=True, text=True, check=True,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}).stdout.split()
    assert flags("remedy") == ["2097152", "torch.float32", "True"]
    # Without the threshold the buffer may sit in glibc's heap, which advice would split.
    assert flags("as it comes") == ["2097152", "torch.float32", "False"]


class _Decodes(torch.autograd.Function):
    """Asks for decode buffers in its backward, as a converted layer's unpack does, and records
    which it got."""

    seen: dict = {}

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        seen, count = _Decodes.seen, 1 << 19  # 2 MiB of float32: a size reused
        first = host_allocator.empty_for_writing(count, torch.float32)
        held = host_allocator.empty_for_writing(count, torch.float32)
        seen["a held buffer is not handed out twice"] = first.data_ptr() != held.data_ptr()
        pointer = first.data_ptr()
        del first
        again = host_allocator.empty_for_writing(count, torch.float32)
        reused = host_allocator._reused
        seen["a free one is reused"] = bool(reused) and again.data_ptr() == pointer == reused[-1].data_ptr()
        view = again[10:]
        del again
        other = host_allocator.empty_for_writing(count, torch.float32)
        seen["a view keeps it from reuse"] = other.data_ptr() not in (pointer, held.data_ptr()) and view.numel()
        as_bytes = host_allocator.empty_for_writing(4 * count, torch.uint8)
        seen["another dtype of the same bytes may reuse it"] = as_bytes.numel() == 4 * count
        return grad


def test_in_backward_a_decode_buffer_is_reused_only_once_nothing_holds_it(monkeypatch):
    monkeypatch.setattr(host_allocator, "_threshold_set", host_allocator.MMAP_THRESHOLD)
    monkeypatch.setattr(host_allocator, "_reused", [])
    _Decodes.seen = {}
    _Decodes.apply(torch.ones(3, requires_grad=True)).sum().backward()
    assert _Decodes.seen and all(_Decodes.seen.values()), _Decodes.seen
    # The backward's end forgot what it kept: nothing idle through the optimizer step.
    assert host_allocator._reused == [] and not host_allocator._forget_queued
    fresh = host_allocator.empty_for_writing(1 << 19, torch.float32)
    assert host_allocator._reused == [] and fresh.numel() == 1 << 19


class _LargeDecodes(_Decodes):
    """Asks for decode buffers of huge-page size in its backward (a ViT's MLP input, then its
    GELU input: the same size)."""

    seen: dict = {}

    @staticmethod
    def backward(ctx, grad):
        seen, count = _LargeDecodes.seen, host_allocator.ADVISE_FROM // 4
        first = host_allocator.empty_for_writing(count, torch.float32)
        pointer = first.data_ptr()
        held = host_allocator.empty_for_writing(count, torch.float32)
        seen["a held buffer is not handed out twice"] = held.data_ptr() != pointer
        del first, held
        again = host_allocator.empty_for_writing(count, torch.float32)
        seen["only the last is remembered"] = again.data_ptr() != pointer
        last = again.data_ptr()
        del again
        seen["the last, free, is reused"] = host_allocator.empty_for_writing(count, torch.float32).data_ptr() == last
        seen["another size is fresh"] = host_allocator.empty_for_writing(count + 1024, torch.float32).data_ptr() != last
        return grad


def test_one_buffer_of_huge_pages_is_reused_within_a_backward_and_let_go_at_its_end(monkeypatch):
    # Four kept idle of each size raised ViT-S's batch-32 peak by 45 MiB (stop 45): one at most.
    monkeypatch.setattr(host_allocator, "_threshold_set", host_allocator.MMAP_THRESHOLD)
    monkeypatch.setattr(host_allocator, "_reused", [])
    monkeypatch.setattr(host_allocator, "_large", None)
    _LargeDecodes.seen = {}
    _LargeDecodes.apply(torch.ones(3, requires_grad=True)).sum().backward()
    assert _LargeDecodes.seen and all(_LargeDecodes.seen.values()), _LargeDecodes.seen
    assert host_allocator._large is None and host_allocator._reused == []
    # Outside a backward every buffer is fresh and none is remembered.
    host_allocator.empty_for_writing(host_allocator.ADVISE_FROM // 4, torch.float32)
    assert host_allocator._large is None


def test_without_the_threshold_every_buffer_is_torchs_own(monkeypatch):
    monkeypatch.setattr(host_allocator, "_threshold_set", None)
    monkeypatch.setattr(host_allocator, "_reused", [])
    _Decodes.seen = {}
    _Decodes.apply(torch.ones(3, requires_grad=True)).sum().backward()
    assert _Decodes.seen["a held buffer is not handed out twice"] and host_allocator._reused == []


def test_where_torch_cannot_tell_a_backward_ended_the_next_forward_lets_go(monkeypatch):
    monkeypatch.setattr(host_allocator, "_threshold_set", host_allocator.MMAP_THRESHOLD)
    monkeypatch.setattr(host_allocator, "_reused", [])
    monkeypatch.setattr(host_allocator, "_large", None)
    monkeypatch.setattr(host_allocator, "at_backward_end", lambda callback: False)
    _LargeDecodes.seen = {}
    _LargeDecodes.apply(torch.ones(3, requires_grad=True)).sum().backward()
    assert all(_LargeDecodes.seen.values()) and host_allocator._large is not None  # kept: nothing told it
    host_allocator.empty_for_writing(1 << 19, torch.float32)  # the next forward's first decode
    assert host_allocator._large is None and host_allocator._reused == []


def test_a_copy_buffer_is_reused_only_while_nothing_holds_it_and_let_go_at_the_forwards_end(monkeypatch):
    monkeypatch.setattr(host_allocator, "_threshold_set", host_allocator.MMAP_THRESHOLD)
    monkeypatch.setattr(host_allocator, "_copy_buffer", None)
    first = host_allocator.empty_for_copying(1 << 19, torch.float32)
    pointer = first.data_ptr()
    del first
    assert host_allocator.empty_for_copying(1 << 19, torch.float32).data_ptr() == pointer  # free: handed out again
    held = host_allocator.empty_for_copying(1 << 19, torch.float32)
    assert host_allocator.empty_for_copying(1 << 19, torch.float32).data_ptr() != held.data_ptr()  # held: fresh
    assert host_allocator.empty_for_copying(1 << 19 | 1, torch.float32).data_ptr() != held.data_ptr()  # another size
    remembered = host_allocator._copy_buffer
    large = host_allocator.empty_for_copying(host_allocator.ADVISE_FROM // 4, torch.float32)
    assert host_allocator._copy_buffer is remembered and large.untyped_storage().data_ptr() != \
        remembered.untyped_storage().data_ptr()  # of ADVISE_FROM and up: fresh, never kept idle
    small = host_allocator.empty_for_copying(16, torch.float32)  # below the threshold: torch's own
    assert small.untyped_storage().data_ptr() != host_allocator._copy_buffer.untyped_storage().data_ptr()
    host_allocator.forget_copy_buffer()
    assert host_allocator._copy_buffer is None
    monkeypatch.setattr(host_allocator, "_threshold_set", None)
    host_allocator.empty_for_copying(1 << 19, torch.float32)
    assert host_allocator._copy_buffer is None  # without the threshold nothing is remembered


@pytest.mark.parametrize(("spec", "dtype"), [("int8", torch.float32), ("bf16", torch.float32), ("fp16", torch.float16)])
def test_gapped_tensors_coded_through_the_copy_buffer_keep_their_own_codes(monkeypatch, spec, dtype):
    # Attention's query, key and value of one qkv projection: slices of a wider tensor, copied
    # dense into one reused buffer before their codec reads them. Each keeps the codes a fresh
    # copy gives, and a codec that keeps its input as it is (fp16 of an fp16 tensor) keeps the
    # buffer to itself: the next copy gets a fresh one.
    from actcomp.core.pipeline import parse
    from actcomp.whole_model.choosing import CodecChoice

    monkeypatch.setattr(host_allocator, "_threshold_set", host_allocator.MMAP_THRESHOLD)
    monkeypatch.setattr(host_allocator, "_copy_buffer", None)
    torch.manual_seed(0)
    qkv = torch.randn(8, 197, 3, 6, 64).to(dtype).permute(2, 0, 3, 1, 4)  # 1.2 MB a part in fp16
    choice = CodecChoice(parse(spec))
    kept, buffers = [], []
    for part in qkv.unbind(0):
        kept.append(choice.encode(part))
        buffers.append(host_allocator._copy_buffer.data_ptr())
    # Codes of their own: one buffer for all three; the input kept as it is: one buffer each.
    assert len(set(buffers)) == (3 if spec == "fp16" else 1)
    for part, form in zip(qkv.unbind(0), kept):
        fresh = choice.codec.compress(part.permute(form.packed.layout.permutation).reshape(-1))
        assert all(torch.equal(a, b) for a, b in zip(form.packed.tensors, fresh.tensors))
        assert torch.equal(form.unpack(), choice.codec.decompress(fresh).view(part.permute(
            form.packed.layout.permutation).shape).permute(_inverse(form.packed.layout.permutation)))


def _inverse(permutation):
    return tuple(sorted(range(len(permutation)), key=permutation.__getitem__))
