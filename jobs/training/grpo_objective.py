"""--objective grpo for the run loop (training_run.TrainingRun, as objectives.Sft and Dpo): its rewards and the
reference weights made ready, a step (grpo_iteration.iteration over the step's prompts), the held-out prompts'
mean reward at each eval, whose greedy answers are the run's samples (samples.jsonl) with their rewards.

A step's loss is already the global batch's (grpo.py), so it enters the run's sums counted as one: the progress
line's and the epoch's loss are the mean over their steps, as are the metrics (LINE_METRICS, rank 0's: every rank
has computed the same gathered values)."""

from __future__ import annotations

from dataclasses import replace

LINE_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "completions/clipped_ratio", "kl", "clip_ratio/region_mean", "generation_s", "sync_s", "step_s",
                "sampler_tokens_per_s")  # fmt: skip


def reward_file(path: str) -> str:
    """A FILE.py on gs:// copied once a machine (runtime.storage); a local path as it is."""
    import hashlib
    import os

    from runtime.storage import gcs, is_gcs, once_per_machine

    if not is_gcs(path):
        return path
    key = hashlib.sha256(path.encode()).hexdigest()[:16]

    def fill(partial: str) -> None:
        os.makedirs(partial)
        gcs().get(path, os.path.join(partial, "rewards.py"))

    return os.path.join(once_per_machine(f"rewards-{key}", fill), "rewards.py")


class Grpo:
    def __init__(self, settings):
        from training.grpo import GrpoLoss
        from training.grpo_iteration import Group
        from training.rewards import load_rewards

        s = settings
        self.rewards, self.weights = load_rewards(s.rewards, s.reward_weights, reward_file)
        self.knobs = GrpoLoss(s.loss_type, s.beta, s.epsilon, s.epsilon_high,
                              max_completion_length=s.max_completion_length, temperature=s.temperature)  # fmt: skip
        self.group = Group(s.num_generations, s.max_completion_length, s.temperature, s.scale_rewards)
        self.reference = None
        self.metric_names = LINE_METRICS if s.beta else tuple(m for m in LINE_METRICS if m != "kl")
        self.curve: list[float] = []  # this epoch's mean reward at each step (rank 0's)

    def ready(self, run, state) -> None:
        """With beta > 0, the starting weights (--model) beside the learner's, sharded the same way, frozen."""
        if self.knobs.beta == 0.0:
            return
        from runtime.backend import get_backend
        from training.model import build_model

        dtype = str(next(run.trainee.loss.parameters()).dtype).removeprefix("torch.")
        reference = build_model(replace(run.settings, lora=False, compile=False), get_backend(run.settings.backend),
                                dtype, run.world, None)  # fmt: skip
        reference.loss.eval().requires_grad_(False)
        self.reference = reference.loss

    def step(self, run, group: list, lr: float, stop: bool, preempted: bool):
        import torch

        from training.grpo_iteration import iteration

        s = run.settings
        result, metrics = iteration(run.trainee, run.optimizer, self.reference, [p for b in group for p in b],
                                    self.group, self.rewards, self.weights, self.knobs, lr, s.max_grad_norm, run.at,
                                    run.device, run.rank, run.world, s.seed, stop, preempted,
                                    micro_rows=s.batch_size)  # fmt: skip
        names = self.metric_names
        values = [float(metrics.get(m) or 0.0) for m in names] if run.rank == 0 else [0.0] * len(names)
        self.curve.append(metrics["reward"])
        return replace(result, counts=(1.0, *result.counts[1:]), metric_sums=torch.tensor(values).to(run.device))

    def epoch_extras(self) -> dict:
        """The epoch's reward at each step (run_files.reward_plot draws the run's), then a new epoch's."""
        curve, self.curve = self.curve, []
        return {"reward_curve": curve}

    def evaluate(self, run) -> dict:
        """The held-out prompts' mean reward, one greedy completion each, every rank its share."""
        from training.grpo_iteration import held_out_reward

        return held_out_reward(run, self)

    def prompts(self, run) -> list[dict]:
        return []
