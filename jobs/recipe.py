"""The fine-tune's recipe: presets, the learning-rate schedule, the loss and its normalisation.

Small functions with no state, in the spirit of torchtitan's components, so each can be tested
alone. `RECIPES` is the one table of recipe defaults; the stack (infra/config.py) reads it too.

- One optimizer step is one global batch: every rank's rows, times --grad-accum micro-batches.
  Its loss is the sum of the token losses over every predicted token of that global batch,
  divided by the global count of predicted tokens (one all-reduce, before the backward pass).
  FSDP2 is told to sum gradients over ranks, not to average them (the count already divides).
  A row with few predicted tokens therefore weighs exactly its tokens, however the batch is split.
- The schedule: linear warmup over --warmup-ratio of the steps, then cosine decay to 10% of --lr
  (or constant). Google's Gemma SFT script, TRL and torchtune use this shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cache

IGNORE = -100  # the label of a position whose token is not trained on
SCHEDULES = ("cosine", "constant")
FINAL_LR_RATIO = 0.1  # cosine decays to this share of --lr


@dataclass(frozen=True)
class Recipe:
    """Defaults a --recipe sets; any flag given on its own still wins."""

    packing: bool
    sharded_checkpoints: bool
    chat_template: bool
    prompt_loss: bool
    lr_schedule: str
    warmup_ratio: float
    max_grad_norm: float
    eval_split: str
    loss_chunk: int
    save_every: int  # optimizer steps between checkpoints; 0: at epoch ends only
    eval_every: int  # optimizer steps between evals; 0: at epoch ends only
    eval_samples: int  # held-out prompts answered at each eval; 0: none


RECIPES = {
    # What a user would ship: packed rows, the model's own chat format with the prompt masked, a
    # held-out eval, warmup + cosine, clipping, sharded async checkpoints, a chunked loss.
    "default": Recipe(
        packing=True,
        sharded_checkpoints=True,
        chat_template=True,
        prompt_loss=False,
        lr_schedule="cosine",
        warmup_ratio=0.03,
        max_grad_norm=1.0,
        eval_split="auto",
        loss_chunk=256,
        # torchtitan's checkpoint interval and TRL's save_steps/eval_steps; what that means on a slice:
        # docs/long-runs.md.
        save_every=500,
        eval_every=500,
        eval_samples=4,
    ),
    # The walkthrough exactly: padded rows, `Instruction: ... Response: ...` with the prompt in
    # the loss, constant lr, no clipping, no eval, full logits, rank 0's full checkpoint per epoch.
    "walkthrough": Recipe(
        packing=False,
        sharded_checkpoints=False,
        chat_template=False,
        prompt_loss=True,
        lr_schedule="constant",
        warmup_ratio=0.0,
        max_grad_norm=0.0,
        eval_split="none",
        loss_chunk=0,
        save_every=0,
        eval_every=0,
        eval_samples=0,
    ),
}
RECIPE_KEYS = tuple(f.name for f in fields(Recipe))


def with_recipe(values: dict, recipe: str) -> dict:
    """`values` with every recipe key that is None taken from the named recipe. Full checkpoints (sharded
    ones turned off) cannot go on from the middle of an epoch: saves then default to epoch ends only."""
    preset = RECIPES[recipe]
    filled = values | {k: getattr(preset, k) for k in RECIPE_KEYS if values.get(k) is None}
    if values.get("save_every") is None and not filled["sharded_checkpoints"]:
        filled["save_every"] = 0
    return filled


# ---- schedule ---------------------------------------------------------------------------------


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return math.ceil(warmup_ratio * total_steps)


def lr_at(step: int, total_steps: int, peak: float, schedule: str, warmup_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) of `total_steps`.

    Warmup rises linearly to `peak` over its steps (step 0 already gets peak / warmup: no step is
    wasted at lr 0); cosine then falls from `peak` to FINAL_LR_RATIO x peak, reached at the last step.
    """
    warmup = warmup_steps(total_steps, warmup_ratio)
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    return peak * (FINAL_LR_RATIO + (1 - FINAL_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- the loss ---------------------------------------------------------------------------------


def predicted_tokens(labels):
    """How many tokens a batch predicts: the labels after the first position that are not IGNORE
    (position t's logits predict label t + 1)."""
    return (labels[..., 1:] != IGNORE).sum()


def _capped_logits(hidden, weight, softcap: float | None):
    import torch

    logits = (hidden @ weight.T).float()
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def _full_loss_sum(hidden, weight, targets, softcap: float | None):
    import torch

    logits = _capped_logits(hidden, weight, softcap)
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
                capped = _capped_logits(h, weight, softcap)
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


def token_loss_sum(hidden, weight, labels, softcap: float | None, chunk: int = 0):
    """The sum over predicted tokens of -log p(token), from the final hidden states and the LM head.

    hidden [rows, seq, d] and labels [rows, seq]; weight is the (tied) output embedding [vocab, d].
    chunk 0 computes the logits of every position at once, as the model's own forward does. A chunk
    of N computes them N positions at a time (ChunkedLinearCrossEntropy): at most one chunk of
    [N, vocab] logits is alive, and the FLOPs are the full path's. Shapes stay the same every step
    (no selection of the predicted positions), so XLA compiles once; IGNORE positions add nothing.
    """
    import torch

    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    if chunk <= 0:
        return _full_loss_sum(h, weight, targets, softcap)
    return _chunked_loss_class().apply(h, weight, targets, softcap, chunk, torch.is_grad_enabled())


def clip_grad_norm(parameters, max_norm: float) -> float:
    """The global gradient norm (over every rank's shards); gradients are scaled down to `max_norm`
    when it is exceeded and max_norm > 0. As torchtitan does it: DTensor norms are made whole first."""
    import torch

    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return float(total)
