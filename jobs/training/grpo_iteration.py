"""One GRPO iteration on every rank: sample this rank's prompts' groups (sampler.py), score them (rewards.py),
gather every rank's rewards (a group's advantage needs its group, "batch" scaling the whole batch), take this
rank's advantages, the reference's log-probabilities when beta > 0, and one optimizer step (grpo.grpo_step).

Its metrics are TRL's names where TRL has one (reward, reward_std, rewards/<function>/mean and /std,
frac_reward_zero_std, completions/mean_length, /min_length, /max_length, /clipped_ratio, kl, clip_ratio/...) and
the sampler's: seconds in generation, in the weights' sync (0: the sampler is the learner) and in the step, and
the sampler's tokens a second over every rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """What one step samples: num_generations completions of each of its prompts."""

    num_generations: int
    max_completion_length: int
    temperature: float
    scale_rewards: str = "group"


def gather_rows(values: list) -> list:
    """Every rank's `values` (plain lists, on the hosts' group), in rank order, one list."""
    import torch.distributed as dist

    from training.step import host_group

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, values, group=host_group())
    return [v for rank in everyone for v in rank]


def agreed(scoring):
    """`scoring()`'s table, or, where it raised a RewardError on any rank, that error on every rank together (a
    rank left waiting in the next gather would hang the group), before anything is trained on the step."""
    from training.rewards import RewardError

    try:
        table, failure = scoring(), None
    except RewardError as err:
        table, failure = [], str(err)
    if failures := [f for f in gather_rows([failure]) if f]:
        raise RewardError(failures[0])
    return table


def reward_metrics(table: list, rewards, names: list[str], zero_std, num_generations: int) -> dict:
    import torch

    from training.grpo import nanstd

    t = torch.as_tensor(table, dtype=torch.float64)
    out = {"reward": float(torch.nanmean(rewards)), "reward_std": float(nanstd(rewards)),
           "frac_reward_zero_std": float(zero_std.float().view(-1, num_generations)[:, 0].mean())}  # fmt: skip
    for j, name in enumerate(names):
        out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = float(torch.nanmean(t[:, j])), float(nanstd(t[:, j]))
    return out


def iteration(trainee, optimizer, reference, prompts: list, group: Group, rewards, weights, knobs, lr: float,
              max_grad_norm: float, step: int, device, rank: int, world: int, seed: int, stop=False,
              preempted=False, micro_rows: int | None = None):  # fmt: skip
    """One step on this rank's `prompts` ([{"ids", "prompt", "columns", "where"}]), its completions in micro-batches
    of `micro_rows` (all at once: None): (step.StepResult, metrics)."""
    import numpy as np
    import torch

    from training.grpo import METRICS, advantages, completion_log_probs, grpo_rows, grpo_step
    from training.rewards import score
    from training.sampler import sample

    tokenizer = trainee.tokenizer
    samples = sample(trainee, [p["ids"] for p in prompts], group.num_generations, group.max_completion_length,
                     group.temperature, device, world, seed + 1_000_003 * step + rank)  # fmt: skip
    each = [p for p in prompts for _ in range(group.num_generations)]
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in samples.completions]
    completions = [[{"role": "assistant", "content": t}] if isinstance(p["prompt"], list) else t
                   for p, t in zip(each, texts, strict=True)]  # fmt: skip
    columns = {k: [p["columns"][k] for p in each] for k in (prompts[0]["columns"] if prompts else {})}
    table = agreed(lambda: score(rewards, [p["prompt"] for p in each], completions, samples.completions, columns,
                                 step, [p["where"] for p in each]))  # fmt: skip
    everyone = gather_rows(table)
    counts = gather_rows([len(table)])
    mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    advantage, reward, zero_std = advantages(everyone, weights, group.num_generations, group.scale_rewards)
    batches, rows, ours = [], micro_rows or len(each), advantage[mine].numpy()
    for start in range(0, len(each), rows):
        batch = grpo_rows([p["ids"] for p in each[start : start + rows]], samples.completions[start : start + rows],
                          tokenizer.pad_token_id)  # fmt: skip
        batch["advantages"] = ours[start : start + rows]
        if reference is not None:
            with torch.no_grad():
                tensors = {k: torch.as_tensor(v).to(device) for k, v in batch.items()}
                batch["ref_logps"] = completion_log_probs(reference, tensors, knobs.temperature).float().cpu().numpy()
        batches.append(batch)
    started = time.perf_counter()
    result = grpo_step(trainee.loss, optimizer, batches, lr, max_grad_norm, knobs, device, stop, preempted)
    lengths = gather_rows([len(c) for c in samples.completions])
    sums = gather_rows([float(v) for v in result.metric_sums.cpu()])
    token_sums = [sum(sums[i :: len(METRICS)]) for i in range(len(METRICS))]
    seconds = gather_rows([samples.seconds])
    clipped = gather_rows([len(c) == group.max_completion_length and not _ended(c, tokenizer)
                           for c in samples.completions])  # fmt: skip
    metrics = reward_metrics(everyone, reward, [r.name for r in rewards], zero_std, group.num_generations) | {
        "completions/mean_length": float(np.mean(lengths)), "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)), "completions/clipped_ratio": float(np.mean(clipped)),
        "generation_s": max(seconds), "sync_s": 0.0, "step_s": time.perf_counter() - started,
        "sampler_tokens_per_s": sum(lengths) / max(max(seconds), 1e-9),
    } | {m: v / max(result.counts[1], 1.0) for m, v in zip(METRICS, token_sums, strict=True)}  # fmt: skip
    if knobs.beta == 0.0:
        metrics.pop("kl")
    return result, {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}


def _ended(completion: list[int], tokenizer) -> bool:
    from data.render import stop_token_ids

    return bool(completion) and completion[-1] in set(stop_token_ids(tokenizer))


def held_out_reward(run, objective) -> dict:
    """The held-out prompts' mean reward (eval_reward; each function's too), one greedy completion each, every rank
    its share in one batch (a rank without one samples the first prompt and drops it: FSDP needs every rank); the
    first --eval-samples of them, in the records' order, as `samples` (samples.jsonl) with their rewards."""
    import numpy as np

    from training.rewards import score
    from training.sampler import sample

    prompts, tokenizer = run.data.eval, run.trainee.tokenizer
    mine = prompts[run.rank :: run.world]
    asked = mine or prompts[:1]
    samples = sample(run.trainee, [p["ids"] for p in asked], 1, objective.group.max_completion_length, 0.0,
                     run.device, run.world, run.settings.seed)  # fmt: skip
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in samples.completions]
    completions = [[{"role": "assistant", "content": t}] if isinstance(p["prompt"], list) else t
                   for p, t in zip(asked, texts, strict=True)]  # fmt: skip
    columns = {k: [p["columns"][k] for p in asked] for k in asked[0]["columns"]}
    table = agreed(lambda: score(objective.rewards, [p["prompt"] for p in asked], completions, samples.completions,
                                 columns, run.at, [p["where"] for p in asked]))  # fmt: skip
    scored = sorted(gather_rows([(run.rank + k * run.world, texts[k], row) for k, row in enumerate(table)]
                                if mine else []))  # fmt: skip
    everyone = np.asarray([row for *_, row in scored], dtype=np.float64).reshape(-1, len(objective.rewards))
    weighted = np.nansum(everyone * np.asarray(objective.weights)[None], axis=1)
    out = {"eval_reward": float(weighted.mean()), "eval_loss": None}
    out |= {f"eval_rewards/{r.name}": float(np.nanmean(everyone[:, j])) for j, r in enumerate(objective.rewards)}
    shown = scored[: run.settings.eval_samples or 0]
    return out | {"samples": [scored_sample(prompts[i], text, row, weighted[n], objective, tokenizer)
                              for n, (i, text, row) in enumerate(shown)]}  # fmt: skip


def scored_sample(prompt: dict, completion: str, row: list, weighted: float, objective, tokenizer) -> dict:
    """A held-out prompt's line in samples.jsonl: SFT's keys (the reference is the columns the rewards read) and the
    weighted reward with each function's (None where a function did not apply)."""
    return {
        "prompt": tokenizer.decode(prompt["ids"], skip_special_tokens=True),
        "completion": completion.strip(),
        "reference": "; ".join(f"{k}: {v}" for k, v in prompt["columns"].items()),
        "reward": float(weighted),
        "rewards": {r.name: None if math.isnan(v) else float(v) for r, v in zip(objective.rewards, row, strict=True)},
    }
