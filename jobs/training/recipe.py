"""The fine-tune's recipe: the learning-rate schedule, the loss and its normalisation, clipping.

Small functions with no state, in the spirit of torchtitan's components, so each can be tested
alone. The recipes' defaults are the settings' (jobs/config/settings.py); the chunked cross-entropy has a
module of its own (jobs/training/chunked_loss.py).

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
from dataclasses import dataclass

FINAL_LR_RATIO = 0.1  # cosine decays to this share of --lr


# ---- schedule ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """The learning rate of each of a run's planned steps: --max-steps, or --epochs' steps (max_steps overrides
    epochs, as transformers' does: the run stops there, within an epoch or after more of them)."""

    lr: float  # the peak (the fields keep the settings' names)
    lr_schedule: str
    warmup_ratio: float
    total_steps: int

    @classmethod
    def planned(cls, settings, steps_per_epoch: int) -> Schedule:
        total = settings.max_steps or steps_per_epoch * settings.epochs
        return cls(settings.lr, settings.lr_schedule, settings.warmup_ratio, total)

    def at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        return lr_at(step, self.total_steps, self.lr, self.lr_schedule, self.warmup_ratio)


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


def token_loss_sum(hidden, weight, labels, softcap: float | None, chunk: int = 0):
    """The sum over predicted tokens of -log p(token), from the final hidden states and the LM head.

    hidden [rows, seq, d] and labels [rows, seq]; weight is the (tied) output embedding [vocab, d].
    chunk 0 computes the logits of every position at once, as the model's own forward does. A chunk
    of N computes them N positions at a time (ChunkedLinearCrossEntropy): at most one chunk of
    [N, vocab] logits is alive, and the FLOPs are the full path's. Shapes stay the same every step
    (no selection of the predicted positions), so XLA compiles once; IGNORE positions add nothing.
    """
    import torch

    from training.chunked_loss import chunked_loss_sum, full_loss_sum

    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    if chunk <= 0:
        return full_loss_sum(h, weight, targets, softcap)
    return chunked_loss_sum(h, weight, targets, softcap, chunk, torch.is_grad_enabled())


def clip_grad_norm(parameters, max_norm: float):
    """The global gradient norm (over every rank's shards), a device tensor (read only where a line prints it);
    gradients are scaled down to `max_norm` when it is exceeded and max_norm > 0, on the device. As torchtitan
    does it: DTensor norms are made whole first."""
    import torch

    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
