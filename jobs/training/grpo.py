"""Group Relative Policy Optimization: the advantages, the loss, its metrics and one optimizer step, as TRL's
GRPOTrainer computes them (trl 1.16.0, trainer/grpo_trainer.py), with TRL's names and defaults:

- advantages (`_generate_and_score_completions`, "sum_then_normalize"): each completion's reward is the weighted
  sum of its reward functions' (None skipped; all None: unscorable, advantage 0), minus its group's mean, divided
  by the group's (scale_rewards "group") or the whole batch's ("batch") standard deviation + 1e-4, or not at all
  ("none"); a group is a prompt's num_generations completions.
- the per-token loss (`_compute_loss`): -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r the probability
  ratio to the policy that sampled (token by token, or the sequence's mean log-ratio: importance_sampling_level),
  + beta KL to the starting weights when beta > 0 (the k3 estimator exp(ref - logp) - (ref - logp) - 1, times r:
  use_bias_correction_kl, TRL 1.16's default, which leaves the value alone on-policy and changes the gradient).
- its reduction (loss_type): dapo and bnpo, the sum over every completion token / the global count of completion
  tokens; grpo, each completion's token mean, averaged over the completions; dr_grpo, the sum / (completions x
  max_completion_length).

One step is one global batch however it is split, as the SFT and DPO steps are: the counts are summed over the
hosts before any backward pass, and FSDP sums the gradients (model.apply_fsdp). TRL divides per process and
averages over processes, which is the same for dapo, grpo and dr_grpo with equal shares; for bnpo, TRL's documented
"normalised over the local batch" makes its loss depend on the split (a mean of per-process token means): here it
is the global token mean, which equals TRL's on one process.

The old log-probabilities are the sampling policy's: without lag (the learner's own sampler, sync every step,
one iteration) they are the current ones, detached, so r = 1 and its gradient is the policy gradient (TRL's
`per_token_logps.detach()` in the same case).
"""

from __future__ import annotations

from dataclasses import dataclass

from config.settings import GRPO_LOSSES as LOSS_TYPES  # TRL's names (its newer cispo, sapo, luspo, vespo: not here)

STD_EPS = 1e-4  # TRL's
METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")  # TRL's names; token means


@dataclass(frozen=True)
class GrpoLoss:
    """The loss's knobs, TRL's GRPOConfig names in snake case, TRL's defaults."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    importance_sampling_level: str = "token"
    max_completion_length: int = 512
    temperature: float = 1.0
    use_bias_correction_kl: bool = True  # the KL times the ratio: its value is unchanged on-policy, its gradient not

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def nanstd(x, dim=None):
    """TRL's nanstd (trainer/utils.py): the NaN-skipping standard deviation with Bessel's correction."""
    import torch

    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def advantages(table, weights, num_generations: int, scale_rewards: str = "group"):
    """(advantages, rewards, zero_std) of the global batch's completions, [completion] each, from `table`
    [completion][function] (NaN: None) grouped by num_generations consecutive completions."""
    import torch

    table = torch.as_tensor(table, dtype=torch.float32)
    weights = torch.as_tensor(weights, dtype=torch.float32)
    unscorable = torch.isnan(table).all(dim=1)
    rewards = (table * weights[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantage = rewards - mean
    if scale_rewards != "none":
        advantage = advantage / (std + STD_EPS)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantage, nan=0.0), rewards, zero_std


def per_token_terms(logps, old_logps, ref_logps, advantage, mask, knobs: GrpoLoss):
    """(per-token loss, ratio, KL or None) of a micro-batch: logps, old_logps, ref_logps, mask [rows, tokens];
    advantage [rows]."""
    import torch

    log_ratio = logps - old_logps
    if knobs.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    a = advantage[:, None]
    loss = -torch.min(ratio * a, torch.clamp(ratio, 1 - knobs.epsilon, 1 + knobs.high) * a)
    kl = None
    if knobs.beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        kl = kl * ratio if knobs.use_bias_correction_kl else kl  # (TRL 1.16's default: DeepSeek-V3.2's unbiased KL)
        loss = loss + knobs.beta * kl
    return loss, ratio, kl


def reduced(per_token, mask, knobs: GrpoLoss, rows: float, tokens: float):
    """This micro-batch's share of the global batch's loss (summed over micro-batches and ranks: the loss)."""
    masked = (per_token * mask).sum(-1)
    if knobs.loss_type == "grpo":
        return (masked / mask.sum(-1).clamp(min=1.0)).sum() / rows
    if knobs.loss_type == "dr_grpo":
        return masked.sum() / (rows * knobs.max_completion_length)
    if knobs.loss_type in ("dapo", "bnpo"):
        return masked.sum() / max(tokens, 1.0)
    raise ValueError(f"unknown GRPO loss type {knobs.loss_type!r}: one of {', '.join(LOSS_TYPES)}")


def metric_sums(ratio, kl, advantage, mask, knobs: GrpoLoss):
    """The sums over this micro-batch's completion tokens of METRICS' values (TRL's token means once divided by
    the global token count), a device tensor."""
    import torch

    a = advantage[:, None]
    low = ((ratio < 1 - knobs.epsilon) & (a < 0)).float().expand_as(mask)
    high = ((ratio > 1 + knobs.high) & (a > 0)).float().expand_as(mask)
    kl_sum = (kl * mask).sum() if kl is not None else torch.zeros((), device=mask.device)
    return torch.stack([kl_sum, (low * mask).sum(), (high * mask).sum(), (((low + high) > 0).float() * mask).sum()])


def completion_log_probs(root, batch: dict, temperature: float):
    """Each completion token's log-probability [rows, completion tokens] (grpo_rows' layout: the completion is
    the last completion_mask.shape[1] positions)."""
    logps = root(input_ids=batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"],
                 temperature=temperature)  # fmt: skip
    return logps[:, -batch["completion_mask"].shape[1] :]


def grpo_rows(prompts: list, completions: list, pad_id: int, prompt_len: int | None = None,
              completion_len: int | None = None) -> dict:  # fmt: skip
    """Prompt and completion token ids as one batch, TRL's layout: each prompt left-padded to the longest (or
    prompt_len), its completion right-padded (or to completion_len, a fixed shape for a compiled step); labels
    are the completion's tokens, IGNORE elsewhere. numpy arrays: input_ids, attention_mask, labels,
    completion_mask."""
    import numpy as np

    from data.labels import IGNORE

    p = prompt_len or max(len(x) for x in prompts)
    c = completion_len or max(1, max(len(x) for x in completions))
    rows = len(prompts)
    ids = np.full((rows, p + c), pad_id, dtype=np.int64)
    attention = np.zeros((rows, p + c), dtype=np.int64)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, p - len(prompt) : p], ids[i, p : p + len(completion)] = prompt, completion
        attention[i, p - len(prompt) : p + len(completion)] = 1
    completion_mask = attention[:, p:].copy()
    labels = np.where(attention.astype(bool), ids, IGNORE)
    labels[:, :p] = IGNORE
    return {"input_ids": ids, "attention_mask": attention, "labels": labels,
            "completion_mask": completion_mask.astype(np.float32)}  # fmt: skip


def grpo_step(root, optimizer, micro_batches: list[dict], lr: float, max_grad_norm: float, knobs: GrpoLoss,
              device, stop: bool = False, preempted: bool = False):  # fmt: skip
    """One optimizer step over one global batch of completions (this rank's micro-batches, grpo_rows' arrays with
    `advantages` [rows] and, when the sampler lags or beta > 0, `old_logps` and `ref_logps` [rows, completion
    tokens]): a step.StepResult whose loss_sum is this rank's share of the loss (summed over ranks: the loss),
    counts [completions, completion tokens, stop requests, preemption notices] summed over the hosts, and
    metric_sums METRICS' token sums."""
    import torch

    from training.dpo import batch_tensors
    from training.step import StepResult, global_counts, optimizer_step, set_lr

    mine = (sum(len(b["advantages"]) for b in micro_batches),
            sum(float(b["completion_mask"].sum()) for b in micro_batches))  # fmt: skip
    total = global_counts(mine, stop, preempted)
    set_lr(optimizer, lr)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    sums = torch.zeros(len(METRICS), dtype=torch.float32, device=device)
    for batch in micro_batches:
        t = batch_tensors(batch, device)
        logps = completion_log_probs(root, t, knobs.temperature)
        old = t["old_logps"] if "old_logps" in t else logps.detach()
        per_token, ratio, kl = per_token_terms(logps, old, t.get("ref_logps"), t["advantages"],
                                               t["completion_mask"], knobs)  # fmt: skip
        loss = reduced(per_token, t["completion_mask"], knobs, total[0], total[1])
        loss.backward()
        loss_sum += loss.detach().float()
        sums += metric_sums(ratio.detach(), None if kl is None else kl.detach(), t["advantages"],
                            t["completion_mask"], knobs)  # fmt: skip
    return StepResult(loss_sum, optimizer_step(optimizer, max_grad_norm), lr, total, sums)
