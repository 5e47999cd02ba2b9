"""The device path run end to end without a GPU: whole training steps of resnet18, ViT-tiny and a
tiny Llama, converted with ``"mink0.9+int8", rest="8bit"``, run with the Triton kernels
(``use_backend("triton")``; on this machine under Triton's interpreter, tests/conftest.py) give
the reference backend's gradients bit for bit, read nothing back to the host that the plain
model does not, and do launch Triton kernels (a codec without one runs its reference, said once).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_host_reads import MODELS, host_reads_of_a_step, training_step

import actcomp
from actcomp.core.backends import use_backend
from actcomp.kernels import triton_runtime

# CPU tensors through the Triton kernels: under the interpreter only (on a GPU machine,
# tests/core/test_cuda_sync.py runs the steps on CUDA tensors).
pytestmark = pytest.mark.skipif(not triton_runtime.runs_on(torch.device("cpu")),
                                reason="Triton's interpreter is off (TRITON_INTERPRET=1 turns it on)")


def gradients(model: torch.nn.Module, batch: dict, backend: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with use_backend(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warning of codecs without a Triton kernel
        training_step(model, batch)
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


def plain_and_converted(model_id: str) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    entry = MODELS[model_id]
    torch.manual_seed(0)
    plain = entry.build()
    converted = actcomp.to_compressed(copy.deepcopy(plain), "mink0.9+int8", rest="8bit", return_freed_memory=False)
    return plain, converted.train(), entry.batch()


@pytest.mark.parametrize("model_id", sorted(MODELS))
def test_a_training_step_on_the_triton_kernels_gives_the_reference_gradients(model_id):
    _, converted, batch = plain_and_converted(model_id)

    expected = gradients(converted, batch, "eager")
    launched = sum(triton_runtime.LAUNCHES.values())
    got = gradients(converted, batch, "triton")

    assert sum(triton_runtime.LAUNCHES.values()) > launched, "no Triton kernel ran"
    assert got.keys() == expected.keys()
    different = [name for name in got if not torch.equal(got[name], expected[name])]
    assert not different, f"gradients differ from the reference backend's: {different[:5]}"


@pytest.mark.parametrize("model_id", sorted(MODELS))
def test_a_training_step_on_the_triton_kernels_reads_nothing_back(model_id):
    plain, converted, batch = plain_and_converted(model_id)
    plain_reads = host_reads_of_a_step(plain, batch)
    with use_backend("triton"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted_reads = host_reads_of_a_step(converted, batch)
    assert converted_reads == plain_reads, f"actcomp adds host reads: {dict(converted_reads - plain_reads)}"
