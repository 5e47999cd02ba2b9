"""Cross-entropy of a linear layer's output, computed chunk by chunk: the logits never exist whole.

A language model's last step, ``F.cross_entropy(F.linear(hidden, weight).float(), target)``,
materializes a (tokens, vocabulary) tensor and keeps its log-softmax for backward: at 1024
tokens and a 32,000-word vocabulary, 125 MiB, most of what the model keeps. Here the forward
computes the logits a chunk of rows at a time, keeps only each row's log-sum-exp, and the
backward computes them again, chunk by chunk, from the hidden states and the weight (which the
layer keeps anyway). Kept for backward: the hidden states and the targets, about hidden_size /
vocabulary of plain's bytes; each row's log-sum-exp is computed again with its logits.

The values are plain PyTorch's up to float rounding (sums over rows run chunk by chunk: the loss
and the weight's gradient are summed in another order). ``ignore_index``, every ``reduction``
and Gemma-style ``softcap`` follow ``F.cross_entropy``, an all-ignored batch included (``mean``
gives NaN there, as plain does).

>>> import torch, torch.nn.functional as F
>>> hidden, weight = torch.randn(6, 4, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
>>> target = torch.tensor([1, 2, -100, 3, 9, 0])
>>> plain = F.cross_entropy(F.linear(hidden, weight), target)
>>> bool(torch.allclose(linear_cross_entropy(hidden, weight, target, chunk_rows=4), plain))
True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from actcomp.core import backends
from actcomp.core.pipeline import Packed, Pipeline
from actcomp.errors import ActcompError
from actcomp.torch_compat import assert_on_device

REDUCTIONS = ("mean", "sum", "none")
# The default chunk: rows whose float32 logits take about this many bytes, and at least
# MIN_CHUNK_ROWS rows. The chunk sets the loss's transient memory (backward holds two or three
# such buffers); fewer rows make slow matrix products (2048 x 512 hidden, 32k vocabulary, fp32,
# 2 threads, forward and backward: 6.5 s at 16 rows a chunk, 2.8 s at 65, 2.0 s at 262, 1.8 s at 1048).
CHUNK_BYTES = 32 * 2**20
MIN_CHUNK_ROWS = 128


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100, reduction: str = "mean",
                         softcap: float | None = None, chunk_rows: int | None = None,
                         hidden_codec: Pipeline | None = None) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` of
    ``logits = F.linear(hidden, weight, bias)`` taken to float32 at least (a bf16 model's as
    Hugging Face's losses take them; float64 stays float64), capped to
    ``softcap * tanh(logits / softcap)`` where ``softcap`` is given, without ever holding all the
    logits.

    ``hidden`` is (..., hidden_size), ``target`` the matching (...) class indices; ``chunk_rows``
    rows are computed at a time (default: about 32 MiB of float32 logits, at least 128 rows). ``reduction="none"``
    returns the per-token losses in ``target``'s shape, 0 where ignored.

    ``hidden_codec`` keeps the hidden states for backward in that code instead of as they are
    (a lossy conversion's: :mod:`actcomp.losses.causal_lm`); the backward recomputes each row's
    log-sum-exp from the states it decodes, so the probabilities it differentiates sum to 1.
    """
    _check(hidden, weight, target, bias, reduction, softcap, chunk_rows)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1)
    vocabulary = weight.shape[0]
    if chunk_rows is None:
        chunk_rows = max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocabulary))
    _check_targets(flat_target, vocabulary, ignore_index)
    losses = _LinearCrossEntropy.apply(flat_hidden, weight, bias, flat_target, ignore_index, softcap, chunk_rows,
                                       hidden_codec)
    if reduction == "none":
        return losses.view(target.shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    # mean over the targets that count, as F.cross_entropy: 0 / 0 = NaN when none does.
    return total / (flat_target != ignore_index).sum()


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-row losses of the capped, float32 logits; backward recomputes them chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, softcap, chunk_rows, hidden_codec=None):
        counted = target != ignore_index
        # Ignored rows read class 0: their loss and gradient are zeroed by ``counted``.
        classes = torch.where(counted, target, 0)
        rows = hidden.shape[0]
        wide = torch.promote_types(hidden.dtype, torch.float32)
        log_normalizers = torch.empty(rows, dtype=wide, device=hidden.device)
        losses = torch.empty(rows, dtype=wide, device=hidden.device)
        for start in range(0, rows, chunk_rows):
            stop = min(start + chunk_rows, rows)
            logits, _ = _logits(hidden[start:stop], weight, bias, softcap)
            log_normalizers[start:stop] = torch.logsumexp(logits, dim=1)
            picked = logits.gather(1, classes[start:stop, None]).squeeze(1)
            losses[start:stop] = torch.where(counted[start:stop], log_normalizers[start:stop] - picked, 0.0)
        ctx.softcap, ctx.chunk_rows, ctx.packed = softcap, chunk_rows, None
        # No log-sum-exp is kept: backward recomputes it from the hidden states it reads, the
        # same bits where those are the forward's (the same chunks, the same reduction), and
        # probabilities that sum to 1 where a code (this one, or whole-model mode's for a custom
        # Function's saves) made them lossy.
        if hidden_codec is None:
            ctx.save_for_backward(hidden, weight, bias, classes, counted)
        else:
            # The codes go through save_for_backward (and so through saved-tensor hooks); the
            # layout, plain values, stays on ctx.
            packed = hidden_codec.compress(hidden)
            ctx.codec, ctx.packed = hidden_codec, packed.layout
            ctx.save_for_backward(*packed.tensors, weight, bias, classes, counted)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        *kept, weight, bias, classes, counted = ctx.saved_tensors
        hidden = kept[0] if ctx.packed is None else ctx.codec.decompress(Packed(tuple(kept), ctx.packed))
        softcap, chunk_rows = ctx.softcap, ctx.chunk_rows
        # d loss_row / d logit = softmax - one_hot(class), times the row's incoming gradient.
        row_scale = torch.where(counted, grad_losses, 0.0)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # The weight's gradient sums over every chunk in the weight's own dtype, as Liger Kernel's
        # fused loss does: a float32 sum would hold 2x a bf16 weight's bytes through backward
        # (2 GiB for a 128k x 4096 head). Measured (2048 x 512 hidden, 32k vocabulary, bf16, 8
        # chunks, against a float64 reference): relative error 0.0026 against plain's 0.0016,
        # cosine 0.999997. The bias, one row, sums in float32 at least.
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.promote_types(bias.dtype, torch.float32), device=bias.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], chunk_rows):
            stop = min(start + chunk_rows, hidden.shape[0])
            part = hidden[start:stop]
            logits, capped = _logits(part, weight, bias, softcap)
            grad_logits = logits.sub_(torch.logsumexp(logits, dim=1, keepdim=True)).exp_()
            grad_logits[torch.arange(stop - start, device=part.device), classes[start:stop]] -= 1.0
            grad_logits.mul_(row_scale[start:stop, None])
            if capped is not None:  # d(c tanh(z / c)) / dz = 1 - tanh(z / c)^2
                grad_logits.mul_(capped.mul_(capped).neg_().add_(1.0))
            # In the layer's dtype, as plain's .float() hands the gradient back (no copy in fp32).
            grad_linear = grad_logits.to(part.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_linear @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_linear.t(), part)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        return (grad_hidden, grad_weight,
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits of ``hidden`` in float32 at least (capped where ``softcap`` is given), and tanh(z / c)."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, capped


def _check(hidden, weight, target, bias, reduction, softcap, chunk_rows) -> None:
    if reduction not in REDUCTIONS:
        raise ActcompError(f"linear_cross_entropy: reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ActcompError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} does not match weight "
                           f"{tuple(weight.shape)} (expected hidden (..., {weight.shape[-1] if weight.dim() else '?'}) "
                           "and weight (vocabulary, hidden_size))")
    if target.shape != hidden.shape[:-1]:
        raise ActcompError(f"linear_cross_entropy: target {tuple(target.shape)} should be hidden's shape without "
                           f"its last dimension, {tuple(hidden.shape[:-1])}")
    if target.dtype != torch.int64:
        raise ActcompError(f"linear_cross_entropy: target must hold class indices as int64 (as F.cross_entropy's "
                           f"do), got {target.dtype}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ActcompError(f"linear_cross_entropy: bias {tuple(bias.shape)} should be ({weight.shape[0]},)")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ActcompError(f"linear_cross_entropy: softcap must be a positive number, got {softcap!r}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ActcompError(f"linear_cross_entropy: chunk_rows must be a positive int, got {chunk_rows!r}")


def _check_targets(target: torch.Tensor, vocabulary: int, ignore_index: int) -> None:
    # A class out of range would read another row's logit, silently: plain raises, so do we. On
    # a CPU (one reduction read back) with the value named; on a device as plain's CUDA kernel
    # does, by an assertion on the device, which reads nothing back.
    bad = (target != ignore_index) & ((target < 0) | (target >= vocabulary))
    if not backends.takes_cpu_shortcut(target):
        assert_on_device(~bad.any(), f"linear_cross_entropy: a target is out of range for a vocabulary of "
                            f"{vocabulary} (valid: 0 to {vocabulary - 1}, or ignore_index={ignore_index})")
        return
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ActcompError(f"linear_cross_entropy: target {value} is out of range for a vocabulary of {vocabulary} "
                           f"(valid: 0 to {vocabulary - 1}, or ignore_index={ignore_index})")
