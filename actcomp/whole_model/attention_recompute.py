"""Fused attention kept as its compressed query, key and value: its output and log-sum-exp are
recomputed in backward from the very values the backward then reads.

Fused attention's backward recomputes the probabilities as ``exp(q.k * scale - lse)`` against
the log-sum-exp the forward saved, and subtracts ``rowsum(dO * out)`` from ``dO.v``. With a
lossy query and key, the saved log-sum-exp no longer normalizes the recomputed logits: a
trained language model's sink token (keys 100-1000x the rest) turns an 8-bit code's steps into
probabilities off by whole factors (one step's gradient cosine 0.67-0.83, which is why the
floors keep query and key in bf16). Run the forward again on the decoded query, key and value
and the backward sees the exact gradient of attention at those values: probabilities that sum
to 1, an output that matches the value it reads. Then the query and key take 8 bits, the value
the kind's spec, and the output and log-sum-exp nothing at all: on the Llama-shaped test model
with outliers built in, attention alone at 8 bits gives 0.996 (the floors: 0.993) for about half
the bytes (``benchmarks/bench_lm_quality.py``). The price is one attention forward per layer in
backward.

Whole-model mode (:mod:`~actcomp.whole_model.session`) sees the node's saves in order (inputs,
then log-sum-exp, then output): it codes each input with :func:`input_codec` and files it
under the call (:class:`AttentionCall`); the log-sum-exp and the output become
:class:`RecomputedAttention`. Only kernels named in :mod:`actcomp.torch_compat` (the CPU's flash
attention) and calls without dropout qualify; a call that turns out not to (the output's node
is another) keeps its log-sum-exp and codes its output as the floors do, and warns.

>>> import torch, torch.nn.functional as F, actcomp
>>> class Attend(torch.nn.Module):
...     def forward(self, x):
...         q, k, v = x.unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
...         return F.scaled_dot_product_attention(q, k, v, is_causal=True)
>>> net = actcomp.to_compressed(torch.nn.Sequential(torch.nn.Linear(32, 96), Attend()), "mink0", rest="8bit")
>>> report = actcomp.memory_report(net, torch.randn(2, 64, 32))
>>> [(row.codecs, round(row.plain_bytes / row.kept_bytes, 1)) for row in report.kinds if row.kind == "attention"]
[(('int8:group=16',), 3.9)]
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from actcomp.core.pipeline import Pipeline, parse
from actcomp.torch_compat import recomputable_attention, recompute_attention
from actcomp.whole_model.choosing import SDPA_INPUTS
from actcomp.whole_model.kept_forms import AsIs, Compressed
from actcomp.whole_model.policy import Lossy

# Query and key err into the logits against each other: 8 bits at least, in rows of the head
# (a sink token's row then sets no other token's steps). A 16-bit float spec is kept as it is.
_LOGITS_FLOOR, _SIXTEEN_BIT_LOGITS = parse("int8"), parse("bf16")
_SIXTEEN_BITS = frozenset({"bf16", "fp16"})


def input_codec(choice: Lossy, role: str) -> Pipeline:
    """The pipeline for ``role``'s tensor of a recomputed call under the attention ``choice``
    (before grouping by rows): the value takes the kind's pipeline; the query and key too with
    the floors off, else 8 bits at least (a 16-bit float spec as it is), and bf16 where the choice
    keeps them at 16 bits (a LoRA model's: its adapters' gradient cosine 0.9936 with 8-bit query
    and key, 0.9997 with bf16, ``bench_lora.py``).

    >>> str(input_codec(Lossy(parse("int4:group=64")), "key")), str(input_codec(Lossy(parse("int4:group=64")), "value"))
    ('int8', 'int4:group=64')
    """
    pipeline = choice.pipeline
    if role == "value" or not choice.attention_floors:
        return pipeline
    if choice.query_key_as_is:
        return _SIXTEEN_BIT_LOGITS
    stages = pipeline.stages
    if len(stages) == 1 and stages[0].name in _SIXTEEN_BITS:
        return pipeline
    return _LOGITS_FLOOR


class AttentionCall:
    """One attention call's compressed inputs, and what its backward needs to run it again.

    Filled by the pack hooks in the order the node saves (inputs, log-sum-exp, output);
    :meth:`recomputed` runs the forward once per backward and hands out its two results."""

    __slots__ = ("inputs", "settings", "logsumexp", "results", "taken")

    def __init__(self) -> None:
        self.inputs: dict[str, Compressed] = {}
        self.settings: tuple[bool, float | None, torch.Tensor | None] | None = None
        # The forward's own log-sum-exp, until the output's node shows the call can be recomputed.
        self.logsumexp: AsIs | None = None
        self.results: tuple[torch.Tensor, torch.Tensor] | None = None
        self.taken: set[int] = set()

    @property
    def complete(self) -> bool:
        return len(self.inputs) == len(SDPA_INPUTS)

    def confirm(self, output: torch.Tensor) -> bool:
        """Whether ``output``'s node is one whose forward can run again; if so, forget the
        log-sum-exp the forward computed (it is recomputed with the output)."""
        node = output.grad_fn
        self.settings = None if node is None or not self.complete else recomputable_attention(node)
        if self.settings is None:
            return False
        self.logsumexp = None
        return True

    def recomputed(self, index: int) -> torch.Tensor:
        """The forward's result ``index`` (0: output, 1: log-sum-exp) from the decoded inputs.
        Both come from one run; it is dropped once each was handed out (a second backward over
        a retained graph runs it again)."""
        if index == 1 and self.logsumexp is not None:
            return self.logsumexp.unpack()
        if self.results is None:
            if self.settings is None:
                raise RuntimeError("actcomp: an attention call's output was asked for before it was saved")
            is_causal, scale, mask = self.settings
            with torch.no_grad():
                query, key, value = (self.inputs[role].unpack() for role in SDPA_INPUTS)
                self.results = recompute_attention(query, key, value, is_causal, scale, mask)
        result = self.results[index]
        self.taken.add(index)
        if self.taken == {0, 1}:
            self.results, self.taken = None, set()
        return result


class RecomputedAttention(NamedTuple):
    """An attention call's output (``index`` 0) or log-sum-exp (1), run again in backward from the
    call's compressed inputs: nothing of its own is kept."""

    call: AttentionCall
    index: int

    def unpack(self) -> torch.Tensor:
        return self.call.recomputed(self.index)


_WARNED: set[str] = set()


def warn_not_recomputed(node_name: str) -> None:
    """Once per node kind: a call whose inputs were coded for recomputation ran a kernel that
    cannot be run again; its log-sum-exp is kept and its output coded, and its query and key err
    as their 8-bit codes do against that log-sum-exp."""
    if node_name not in _WARNED:
        _WARNED.add(node_name)
        warnings.warn(f"actcomp: fused attention ran as {node_name}, which whole-model mode cannot recompute in "
                      "backward; its query and key were already coded for it, so its gradient errs more than "
                      "with the attention floors. Please report the kernel's name.", RuntimeWarning, stacklevel=3)
