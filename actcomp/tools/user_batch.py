"""One batch of the user's, run through copies of their model: gradients, kept bytes, step time.

:func:`actcomp.check` and :func:`actcomp.plan_budget` measure the same way: a deep copy of the
model per configuration (the user's model is never touched), the same loss and seed in every run.

>>> import torch
>>> net = torch.nn.Linear(4, 2)
>>> run = UserBatch(torch.randn(8, 4))
>>> round(gradient_cosine(run.gradients(copy_model(net)), run.gradients(net)), 12)
1.0
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from actcomp.errors import ActcompError
from actcomp.tools.memory import MemoryReport, forward_and_report, memory_report

T = TypeVar("T")


class UserBatch:
    """The user's batch, loss and seed: gradients, memory and step time of one model.

    ``batch`` is a tensor, a tuple of the forward's positional arguments, or a dict of its keyword
    arguments; the loss is ``loss_fn(output)``, else the output's ``.loss``, else a fixed random
    projection of its first float tensor; every step seeds torch with ``seed`` first.

    >>> import torch
    >>> run = UserBatch(torch.ones(2, 3))
    >>> sorted(run.gradients(torch.nn.Linear(3, 1)))
    ['bias', 'weight']
    """

    def __init__(self, batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None, seed: int = 0):
        self.inputs, self.kwargs = ((), dict(batch)) if isinstance(batch, Mapping) else (
            tuple(batch) if isinstance(batch, (tuple, list)) else (batch,), {})
        self.loss_fn, self.seed = loss_fn, seed

    @property
    def rows(self) -> int:
        """The rows of the batch: its first tensor argument's first dimension (0: none)."""
        first = next((value for value in (*self.inputs, *self.kwargs.values())
                      if isinstance(value, torch.Tensor) and value.dim()), None)
        return 0 if first is None else first.shape[0]

    def first_rows(self, count: int) -> UserBatch | None:
        """The batch's first ``count`` rows: every tensor argument whose first dimension is the
        batch's (the first tensor argument's) cut to ``count``, the rest as they are; None where
        there is no tensor argument or it has no more rows than that. The loss function is not
        carried (it may hold labels of the whole batch): the result serves forwards that only
        count what is saved (:meth:`memory`).

        >>> UserBatch({"x": torch.ones(8, 3), "mask": torch.ones(3)}).first_rows(2).kwargs["x"].shape
        torch.Size([2, 3])
        """
        rows = self.rows
        if rows <= count:
            return None

        def cut(value: Any) -> Any:
            return value[:count] if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows else value

        return UserBatch({name: cut(value) for name, value in self.kwargs.items()} if self.kwargs else
                         tuple(cut(value) for value in self.inputs), None, self.seed)

    @property
    def tokens(self) -> int:
        """A language model's sequence length: the second dimension of a 2-D integer
        ``input_ids`` keyword argument (0: none)."""
        ids = self.kwargs.get("input_ids")
        return ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point() else 0

    def first_tokens(self, count: int) -> UserBatch | None:
        """A language model's batch cut to its first ``count`` tokens: every keyword tensor
        whose second dimension is ``input_ids``' length (the labels, the attention mask, the
        position ids) cut there, the rest as they are; None where there is no ``input_ids`` or
        no more tokens than that. A causal model computes the first tokens of a sequence as it
        computes them in the whole sequence, so this is a shorter batch of the same data. The
        loss function is not carried, as in :meth:`first_rows`.

        >>> ids = torch.arange(16).reshape(2, 8)
        >>> UserBatch({"input_ids": ids, "labels": ids}).first_tokens(3).kwargs["labels"].tolist()
        [[0, 1, 2], [8, 9, 10]]
        """
        tokens = self.tokens
        if tokens <= count:
            return None

        def cut(value: Any) -> Any:
            long = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == tokens
            # Contiguous, as a batch of that length would be (BERT's loss views its labels flat).
            return value[:, :count].contiguous() if long else value

        return UserBatch({name: cut(value) for name, value in self.kwargs.items()}, None, self.seed)

    def step(self, model: nn.Module) -> None:
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)
        _loss(model(*self.inputs, **self.kwargs), self.loss_fn, self.seed).backward()

    def gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        self.step(model)
        return _gradients(model)

    def over_backwards(self, model: nn.Module, count: int, select: Callable[[int], None],
                       measure: Callable[[nn.Module], T] | None = None) -> list[T]:
        """One forward of :meth:`step`'s, then ``count`` backwards over it: before backward ``i``
        ``select(i)`` (what the saved tensors unpack as), after it ``measure(model)`` (by default
        the gradients as :meth:`gradients` gives them), each backward's measure in a list.

        >>> net = torch.nn.Linear(3, 1)
        >>> found = UserBatch(torch.ones(2, 3)).over_backwards(net, 2, lambda index: None)
        >>> torch.equal(found[0]["weight"], found[1]["weight"])
        True
        """
        measure = _gradients if measure is None else measure
        model.train()
        torch.manual_seed(self.seed)
        loss = _loss(model(*self.inputs, **self.kwargs), self.loss_fn, self.seed)
        found = []
        for index in range(count):
            model.zero_grad(set_to_none=True)
            select(index)
            loss.backward(retain_graph=index < count - 1)
            found.append(measure(model))
        return found

    def memory(self, model: nn.Module) -> MemoryReport:
        torch.manual_seed(self.seed)
        return memory_report(model, *self.inputs, **self.kwargs)

    def gradients_and_memory(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], MemoryReport]:
        """:meth:`gradients` and :meth:`memory` from one step: the forward that counts the bytes
        is the one the backward runs through (the same seed, so the same dropout masks and
        rounding noise: both equal the separate calls', ``tests/tools/test_user_batch.py``)."""
        model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)
        output, report = forward_and_report(model, *self.inputs, **self.kwargs)
        _loss(output, self.loss_fn, self.seed).backward()
        return _gradients(model), report

    def step_time(self, plain: nn.Module, converted: nn.Module, rounds: int) -> float:
        """Median over ``rounds`` of converted's step time over plain's, each round one step of
        each in turn (after one untimed step of each)."""
        ratios = []
        for round_ in range(rounds + 1):
            seconds = []
            for model in (plain, converted):
                started = time.perf_counter()
                self.step(model)
                seconds.append(time.perf_counter() - started)
            if round_:
                ratios.append(seconds[1] / seconds[0])
        return statistics.median(ratios)


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as a flat float64 copy, by name (those that got one)."""
    return {name: p.grad.detach().to(torch.float64, copy=True).reshape(-1)
            for name, p in model.named_parameters() if p.grad is not None}


def copy_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` to measure, or an error that says what to do when it cannot be copied:
    a deep copy whose parameters are new ``nn.Parameter`` objects over the original's storage.

    The copy's modules, buffers (BatchNorm's running statistics, which a training step updates)
    and gradients are its own; its parameters' values are shared, since measuring only reads
    them (no optimizer steps a copy, and no conversion writes a weight). Deep copies of the
    values were a sixth of a budget search on a small Llama, and 17 copies of ViT-S's 88 MB,
    each page-faulted afresh once freed memory goes back to the system, 0.4 of a training step.
    A parameter of a subclass (a quantized or sharded type) is copied as ``copy.deepcopy`` does.

    >>> net = torch.nn.Linear(2, 2)
    >>> copied = copy_model(net)
    >>> copied.weight is net.weight, copied.weight.data_ptr() == net.weight.data_ptr()
    (False, True)
    """
    shared = {id(p): nn.Parameter(p.data, p.requires_grad) for p in model.parameters() if type(p) is nn.Parameter}
    try:
        return copy.deepcopy(model, shared)
    except Exception as error:  # noqa: BLE001 - any failure to copy has the same remedy
        raise ActcompError(f"actcomp measures deep copies of the model and copy.deepcopy failed "
                           f"({type(error).__name__}: {error}); build the model twice and compare by hand, or make it "
                           "copyable") from error


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Inside, Python's garbage collector leaves the objects made before alone (``gc.freeze``),
    and collects those made inside as usual; after, it sees them all again. Unless the process
    froze some itself (``gc.get_freeze_count()``), which is then left as it is.

    A full collection walks every object of the process (the libraries', your model's): one ran
    in each budget search of ViT-S or the small Llama and took 175-190 ms, two plain steps of the
    Llama. Reference cycles made inside are still collected; those among older objects wait
    until after.

    >>> import gc
    >>> with old_objects_frozen():
    ...     frozen = gc.get_freeze_count() > 0
    >>> frozen, gc.get_freeze_count()
    (True, 0)
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _loss(output: Any, loss_fn: Callable | None, seed: int) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output)
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensor = _first_float_tensor(output)
    if tensor is None:
        raise ActcompError(f"the model's output ({type(output).__name__}) holds no float tensor to take a loss of; "
                           "pass loss_fn=lambda output: ...")
    # A fixed random direction: every output element gets a gradient, the same in every run.
    weights = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed)).to(tensor.device)
    return (tensor.float() * weights).sum()


def _first_float_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = _first_float_tensor(value)
        if found is not None:
            return found
    return None


def gradient_cosine(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The cosine between two runs' gradients over the parameters both have, NaN where
    ``expected`` is all zeros, 0 where only ``got`` is. Scale-free: a ConvNeXt block's layer
    scale starts at 1e-6, and its layers' gradients are that small.

    >>> tiny = {"w": torch.tensor([3e-9, 4e-9], dtype=torch.float64)}
    >>> round(gradient_cosine(tiny, tiny), 12)
    1.0
    """
    names = [name for name in expected if name in got]
    if not names:
        raise ActcompError("no parameter got a gradient in both runs: does the loss depend on the parameters?")
    # Summed parameter by parameter: one concatenation of a ResNet-50's float64 gradients is
    # 200 MB to allocate and fault in, which took longer than the training step measured. The
    # sums stay tensors until the end: one host read, not three per parameter on a GPU.
    sums = sum(torch.stack([torch.dot(got[name], expected[name]), torch.dot(got[name], got[name]),
                            torch.dot(expected[name], expected[name])]) for name in names)
    dot, got_squared, expected_squared = sums.tolist()
    if not expected_squared:
        # No gradient in plain (a random-init ResNet block whose last BatchNorm starts at zero):
        # nothing to compare; NaN is under no floor.
        return float("nan")
    if not got_squared:
        return 0.0
    # No floor under the norms' product: one of 1e-8 read a ConvNeXt layer's 1e-9 gradients as
    # cosine 0 against themselves, and check flagged 36 of its 40 layers.
    return dot / (math.sqrt(got_squared) * math.sqrt(expected_squared))
