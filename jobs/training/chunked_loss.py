"""The cross-entropy's sum over predicted tokens, from the final hidden states and the (tied) LM head, with
Gemma 4's final-logit soft-cap: whole, or a chunk of positions at a time (a custom autograd function, so that
only one chunk of [chunk, vocabulary] logits is ever alive). recipe.token_loss_sum chooses between them.
"""

from __future__ import annotations

from functools import cache

from data.labels import IGNORE


def capped_logits(hidden, weight, softcap: float | None):
    import torch

    logits = (hidden @ weight.T).float()
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def full_loss_sum(hidden, weight, targets, softcap: float | None):
    import torch

    logits = capped_logits(hidden, weight, softcap)
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


@cache
def _chunked_loss_class():
    import torch

    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        """sum(CE(softcap(h @ W^T), y)) a chunk of positions at a time. Each chunk's gradients with
        respect to h and W are taken while its logits exist, in the forward pass, so only one chunk
        of [chunk, vocab] logits is ever alive and nothing is recomputed (Cut Cross Entropy's idea,
        with Gemma's soft-cap in the chain rule); the backward pass only scales them."""

        @staticmethod
        def forward(ctx, hidden, weight, targets, softcap, chunk, with_grads):
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.zeros_like(hidden) if with_grads and hidden.requires_grad else None
            grad_weight = None  # in the weight's dtype: the buffer becomes the weight's gradient itself
            if with_grads and weight.requires_grad:
                grad_weight = torch.zeros_like(weight)
            for start in range(0, targets.numel(), chunk):
                h, y = hidden[start : start + chunk], targets[start : start + chunk]
                capped = capped_logits(h, weight, softcap)
                log_probs = torch.log_softmax(capped, dim=-1)
                kept = y != IGNORE
                safe = torch.where(kept, y, 0)
                total -= (log_probs.gather(1, safe[:, None])[:, 0] * kept).sum()
                if grad_hidden is None and grad_weight is None:
                    continue
                # d(sum CE)/d(capped) = softmax - onehot on predicted positions; then through the cap
                grad = log_probs.exp_()
                grad[torch.arange(len(y), device=y.device), safe] -= 1
                grad *= kept[:, None]
                if softcap:
                    grad *= 1 - (capped / softcap) ** 2
                grad = grad.to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[start : start + chunk] = grad @ weight
                if grad_weight is not None:
                    grad_weight.addmm_(grad.T, h)
            ctx.save_for_backward(grad_hidden, grad_weight)
            return total

        @staticmethod
        def backward(ctx, grad_total):
            # scaled in place (by 1 / the global token count): no second head-sized buffer
            grads = [g.mul_(grad_total.to(g.dtype)) if g is not None else None for g in ctx.saved_tensors]
            return *grads, None, None, None, None

    return ChunkedLinearCrossEntropy


def chunked_loss_sum(hidden, weight, targets, softcap: float | None, chunk: int, with_grads: bool):
    """sum(CE(softcap(hidden @ weight^T), targets)), `chunk` positions at a time (ChunkedLinearCrossEntropy)."""
    return _chunked_loss_class().apply(hidden, weight, targets, softcap, chunk, with_grads)


@cache
def _row_logps_class():
    import torch

    class ChunkedRowLogProbs(torch.autograd.Function):
        """Each row's sum of log p(target), a chunk of positions at a time. A row's weight in the loss (DPO's) is
        known only once every row's sum is, so nothing can be folded in during the forward pass as
        ChunkedLinearCrossEntropy does: the forward keeps no logits, and the backward makes each chunk's again
        (the head's FLOPs twice, one chunk of [chunk, vocab] logits alive at a time)."""

        @staticmethod
        def forward(ctx, hidden, weight, targets, row_of, rows, softcap, chunk):
            totals = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
            for start in range(0, targets.numel(), chunk):
                h, y = hidden[start : start + chunk], targets[start : start + chunk]
                log_probs = torch.log_softmax(capped_logits(h, weight, softcap), dim=-1)
                kept = y != IGNORE
                picked = log_probs.gather(1, torch.where(kept, y, 0)[:, None])[:, 0] * kept
                totals.index_add_(0, row_of[start : start + chunk], picked)
            ctx.save_for_backward(hidden, weight, targets, row_of)
            ctx.softcap, ctx.chunk = softcap, chunk
            return totals

        @staticmethod
        def backward(ctx, grad_rows):
            hidden, weight, targets, row_of = ctx.saved_tensors
            grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
            grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
            for start in range(0, targets.numel(), ctx.chunk):
                h, y = hidden[start : start + ctx.chunk], targets[start : start + ctx.chunk]
                capped = capped_logits(h, weight, ctx.softcap)
                kept = y != IGNORE
                safe = torch.where(kept, y, 0)
                # d(log p(y))/d(capped) = onehot - softmax, scaled by the row's gradient; then through the cap
                grad = -torch.softmax(capped, dim=-1)
                grad[torch.arange(len(y), device=y.device), safe] += 1
                grad *= (kept * grad_rows[row_of[start : start + ctx.chunk]])[:, None]
                if ctx.softcap:
                    grad *= 1 - (capped / ctx.softcap) ** 2
                grad = grad.to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[start : start + ctx.chunk] = grad @ weight
                if grad_weight is not None:
                    grad_weight.addmm_(grad.T, h)
            return grad_hidden, grad_weight, None, None, None, None, None

    return ChunkedRowLogProbs


def row_log_probs(hidden, weight, labels, softcap: float | None, chunk: int = 0):
    """Each row's sum of log p(label) over its labelled positions (DPO's sequence log-probability): hidden
    [rows, seq, d], labels [rows, seq] (IGNORE where nothing is scored). chunk 0: the logits all at once, through
    autograd; N: N positions at a time (ChunkedRowLogProbs)."""
    import torch

    rows, seq = labels.shape
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    row_of = torch.arange(rows, device=labels.device).repeat_interleave(seq - 1)
    if chunk <= 0:
        log_probs = torch.log_softmax(capped_logits(h, weight, softcap), dim=-1)
        kept = targets != IGNORE
        picked = log_probs.gather(1, torch.where(kept, targets, 0)[:, None])[:, 0] * kept
        return torch.zeros(rows, dtype=torch.float32, device=h.device).index_add(0, row_of, picked)
    return _row_logps_class().apply(h, weight, targets, row_of, rows, softcap, chunk)


def token_log_probs(hidden, weight, labels, softcap: float | None, temperature: float = 1.0):
    """Each position's log p(label) under softcap(logits) / temperature ([rows, seq - 1], 0 where the label is
    IGNORE): GRPO's per-token log-probabilities, scaled as TRL scales them (trl 1.16.0, kernels/chunked_logprob.py:
    the soft-cap, then the temperature). The logits of every position at once, through autograd."""
    import torch

    targets = labels[:, 1:]
    kept = targets != IGNORE
    logits = capped_logits(hidden[:, :-1], weight, softcap) / temperature
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.where(kept, targets, 0)[..., None])[..., 0]
    return picked * kept
