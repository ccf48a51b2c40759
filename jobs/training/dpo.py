"""Direct Preference Optimization: the loss, its metrics, the reference pass and one optimizer step.

The loss of a pair is TRL's (trl 1.16.0, trainer/dpo_trainer.py, `_compute_loss`), with the policy's and the
reference's summed log-probabilities of each answer given the prompt:

- sigmoid: -log sigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))
- ipo: ((chosen - ref_chosen) / chosen tokens - (rejected - ref_rejected) / rejected tokens - 1 / (2 beta))^2
  (TRL averages IPO's log-ratios per answer token, as the IPO authors did).

One optimizer step is one global batch of pairs, and its loss is the mean over every pair of it, however the
pairs are split over ranks and micro-batches: each micro-batch's summed pair losses are divided by the global
pair count (summed over the hosts before any forward), and FSDP sums the gradients over ranks (model.apply_fsdp).
A pair's chosen and rejected rows run in the same forward pass (preference_data.pair_rows), so both see the same
weights. The reference log-probabilities come from the starting weights in one pass before training
(`pair_log_probs` on the starting weights, as TRL's precompute_ref_log_probs): no second model in memory
while training.
"""

from __future__ import annotations

from config.settings import DPO_LOSSES

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)  # fmt: skip  (TRL's names)


def pair_losses(chosen, rejected, ref_chosen, ref_rejected, beta: float, loss: str, chosen_tokens=None,
                rejected_tokens=None):  # fmt: skip
    """Each pair's loss (tensors of the batch's pairs)."""
    import torch

    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if loss == "sigmoid":
        return -torch.nn.functional.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    if loss == "ipo":
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        return (delta - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss {loss!r}: one of {', '.join(DPO_LOSSES)}")


def metric_sums(chosen, rejected, ref_chosen, ref_rejected, beta: float):
    """The sums over the batch's pairs of TRL's metrics (METRICS' order), one device tensor: divided by the global
    pair count where a line shows them."""
    import torch

    chosen_reward, rejected_reward = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    return torch.stack([chosen_reward.sum(), rejected_reward.sum(), (chosen_reward > rejected_reward).float().sum(),
                        (chosen_reward - rejected_reward).sum(), chosen.sum(), rejected.sum()]).detach()  # fmt: skip


def batch_tensors(batch: dict, device) -> dict:
    """A micro-batch (pair_rows' arrays and the pairs' reference log-probabilities) on the device."""
    import torch

    return {k: torch.as_tensor(v).to(device) for k, v in batch.items()}


def sequence_log_probs(root, batch: dict):
    """(chosen, rejected): each answer's summed log-probability, chosen and rejected rows in one forward pass."""
    logps = root(input_ids=batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"],
                 per_row=True)  # fmt: skip
    return logps.chunk(2)


def dpo_step(root, optimizer, micro_batches: list[dict], lr: float, max_grad_norm: float, beta: float, loss: str,
             device, stop: bool = False, preempted: bool = False):  # fmt: skip
    """One optimizer step over one global batch of pairs (this rank's micro-batches and every other rank's): a
    step.StepResult whose loss is the summed pair losses, whose counts are [pairs, real tokens, stop requests,
    preemption notices] summed over the hosts as step.train_step's are, and whose metric_sums are TRL's metrics'."""
    import torch

    from training.step import StepResult, divisor, global_counts, optimizer_step, set_lr

    mine = (
        sum(len(b["ref_chosen"]) for b in micro_batches),
        sum(int(b["attention_mask"].sum()) for b in micro_batches),
    )
    total = global_counts(mine, stop, preempted)
    by = divisor(total[0], device)
    set_lr(optimizer, lr)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    sums = torch.zeros(len(METRICS), dtype=torch.float32, device=device)
    for batch in micro_batches:
        t = batch_tensors(batch, device)
        chosen, rejected = sequence_log_probs(root, t)
        losses = pair_losses(chosen, rejected, t["ref_chosen"], t["ref_rejected"], beta, loss, *t["tokens"].chunk(2))
        (losses.sum() / by).backward()
        loss_sum += losses.detach().sum()
        sums += metric_sums(chosen, rejected, t["ref_chosen"], t["ref_rejected"], beta)
    return StepResult(loss_sum, optimizer_step(optimizer, max_grad_norm), lr, total, sums)


def held_out_scores(root, data, settings, rank: int, world: int, device) -> dict:
    """The held-out pairs (preferences.PreferenceData's) under the model as it is: the mean pair loss (eval_loss)
    and TRL's metrics (eval_ first), every rank scoring its share together."""
    import torch

    pairs, reference = data.eval, data.reference["eval"]
    now = pair_log_probs(root, pairs, settings.seq_len, data.pad, settings.batch_size, rank, world, device)
    chosen, rejected, ref_chosen, ref_rejected = (torch.as_tensor(a, dtype=torch.float64) for a in (*now, *reference))
    tokens = [torch.tensor([max(0, min(len(p.prompt_ids) + len(getattr(p, f"{k}_ids")), settings.seq_len)
                                - len(p.prompt_ids)) for p in pairs], dtype=torch.float64)
              for k in ("chosen", "rejected")]  # fmt: skip
    losses = pair_losses(chosen, rejected, ref_chosen, ref_rejected, settings.dpo_beta, settings.dpo_loss, *tokens)
    sums = metric_sums(chosen, rejected, ref_chosen, ref_rejected, settings.dpo_beta)
    preferred = float((chosen > rejected).double().mean())  # the model's own preference, the reference aside
    return {"eval_loss": float(losses.mean()), "eval_preferred": preferred} | {
        f"eval_{m}": float(v) / len(pairs) for m, v in zip(METRICS, sums, strict=True)}  # fmt: skip


def pair_log_probs(root, pairs: list, seq_len: int, pad_id: int, batch_size: int, rank: int, world: int,
                        device):  # fmt: skip
    """(chosen, rejected) numpy arrays of every pair's summed log-probabilities under the model as it is (the
    starting weights: the reference; at an eval, the held-out pairs'): each rank scores every world-th pair, in
    batches of the same count on every rank (FSDP's gathers need all of them), and the hosts sum the results."""
    import math

    import numpy as np
    import torch
    import torch.distributed as dist

    from data.preference_data import pair_rows
    from training.step import host_group

    out = np.zeros((2, len(pairs)), dtype=np.float64)
    mine = list(range(rank, len(pairs), world))
    batches = math.ceil(math.ceil(len(pairs) / world) / batch_size)
    was_training = root.training
    root.eval()
    with torch.no_grad():
        for b in range(batches):
            index = mine[b * batch_size : (b + 1) * batch_size]
            rows = pair_rows([pairs[i] for i in index] or [pairs[0]], seq_len, pad_id)  # (a filler keeps step)
            chosen, rejected = sequence_log_probs(root, batch_tensors(rows, device))
            out[:, index] = np.stack([chosen.float().cpu().numpy(), rejected.float().cpu().numpy()])[:, : len(index)]
    root.train(was_training)
    summed = torch.from_numpy(out)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=host_group())
    return summed.numpy()[0], summed.numpy()[1]
