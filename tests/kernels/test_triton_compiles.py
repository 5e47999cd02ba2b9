"""Every Triton kernel specialization the codecs launch compiles for a GPU (sm_90), on a machine
without one.

Triton's interpreter, which the other kernel tests run under, accepts code a GPU compile refuses:
the H100 run of stop 42 found a module global read inside a kernel and a constexpr reassigned in
an unrolled loop, both of which passed every interpreter test. So this test runs every codec with
a Triton kernel (fp32, bf16 and fp16; odd sizes; with the finite flag and without) under the
interpreter, records each launch's kernel, argument types and constexprs, and compiles each
distinct one in a fresh process without the interpreter with
``triton.compile(..., target=GPUTarget("cuda", 90, 32))``: Triton's own front end, optimizer and
the ptxas it ships, down to a cubin. Nothing runs.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import actcomp
from actcomp.core import chain
from actcomp.core.backends import use_backend
from actcomp.kernels import triton_runtime

pytestmark = pytest.mark.skipif(not triton_runtime.runs_on(torch.device("cpu")),
                                reason="Triton's interpreter is off (TRITON_INTERPRET=1 turns it on)")

# The specs whose stages, together, launch every Triton kernel the codecs register.
SPECS = ["int8", "int4", "int2", "fp8", "fp16", "bf16", "mink0.9", "smink0.9", "dropit0.9", "random0.9",
         "channel0.5", "rchannel0.5", "mink0.9+int8", "smink0.9+int4"]
CODECS = ["relu-mask", "leaky-relu-mask", "clamp-mask", "dropout-mask", "pool-offsets", "fewbit"]
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
          torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def argument_type(value) -> tuple[str, object]:
    """(signature type, constexpr value or None) of one launch argument, as a GPU launch sees it:
    an int argument equal to 1 is specialized into a constant there."""
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype], None
    if isinstance(value, bool):
        return "i1", None
    if isinstance(value, int):
        if value == 1:
            return "constexpr", 1
        return ("i32" if -2**31 <= value < 2**31 else "i64"), None
    if isinstance(value, float):
        return "fp32", None
    if value is None:
        return "constexpr", None
    raise TypeError(f"unexpected launch argument {value!r}")


def recorded_launches() -> list[dict]:
    launches: dict[str, dict] = {}

    def recording(kernel, grid, args, meta):
        function = kernel.fn
        names = list(inspect.signature(function).parameters)
        signature, constexprs = {}, {}
        for name, value in zip(names, args):
            signature[name], constant = argument_type(value)
            if signature[name] == "constexpr":
                constexprs[name] = constant
        for name, value in meta.items():
            signature[name], constexprs[name] = "constexpr", value
        entry = {"module": function.__module__, "kernel": function.__name__, "signature": signature,
                 "constexprs": constexprs}
        launches[json.dumps(entry, sort_keys=True)] = entry

    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(37, 131, generator=generator) * 3]
    inputs += [inputs[0].bfloat16(), inputs[0].half(), inputs[0][:3, :7].contiguous()]
    with triton_runtime.recording(recording), use_backend("triton"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a stage without a Triton kernel says so once
        for x in inputs:
            for spec in SPECS:
                pipeline = actcomp.parse(spec)
                pipeline.decompress(pipeline.compress(x, channel_dim=-1))
                # Without the finite flag: the kernels that write or apply it, specialized without.
                stages = pipeline.stages
                chain.unpack(stages, spec, chain.pack(stages, spec, x, channel_dim=-1, flag_non_finite=False))
            for name in CODECS:
                codec = actcomp.core.registry.codec_class(name)()
                value = (x > 0).to(x.dtype) * 2 if name == "dropout-mask" else x
                if name == "pool-offsets":
                    continue  # needs a pooling's settings: below
                codec.decompress(codec.compress(value))
        # The sparsifiers past one vector of blocks (their offsets from a torch.cumsum).
        from actcomp.kernels import triton_select

        scan, triton_select._SCAN = triton_select._SCAN, 2
        try:
            for spec in ("mink0.9", "mink0.5", "smink0.9", "random0.9"):
                pipeline = actcomp.parse(spec)
                pipeline.decompress(pipeline.compress(torch.randn(20000, generator=generator)))  # Elias-Fano: 3 blocks
        finally:
            triton_select._SCAN = scan
        pool = actcomp.core.registry.codec_class("pool-offsets")(
            kernel=(2, 2), stride=(2, 2), padding=(0, 0), dilation=(1, 1), width=8, out_size=(4, 4))
        pool.decompress(pool.compress(torch.randint(0, 64, (2, 3, 4, 4))))
    return list(launches.values())


COMPILER = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

failures = []
for entry in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(entry["module"]), entry["kernel"])
    try:
        triton.compile(ASTSource(kernel, entry["signature"], entry["constexprs"]), target=GPUTarget("cuda", 90, 32))
    except Exception as error:  # noqa: BLE001 - report them all
        lines = [line for line in str(error).splitlines() if line.strip() and set(line.strip()) != {"^"}]
        said = next((line for line in lines if "Error" in line), lines[-1] if lines else type(error).__name__)
        cause = f" ({repr(error.__cause__)[:300]})" if error.__cause__ is not None else ""
        failures.append(f"{entry['kernel']} {entry['constexprs']}: {said.strip()}{cause}")
print(json.dumps(failures))
"""


def test_every_kernel_the_codecs_launch_compiles_for_a_gpu():
    launches = recorded_launches()
    kernels = {entry["kernel"] for entry in launches}
    assert {"_quantize_kernel", "_dequantize_kernel", "_finite_kernel", "_encode_kernel"} <= kernels, kernels
    environment = {key: value for key, value in os.environ.items() if key != triton_runtime.INTERPRETER}
    result = subprocess.run([sys.executable, "-c", COMPILER], input=json.dumps(launches), capture_output=True,
                            text=True, env=environment, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(failures)
