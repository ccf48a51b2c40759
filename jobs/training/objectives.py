"""What is trained (--objective): for the one run loop (training_run.TrainingRun), each objective's data, its
step, its held-out eval, its sample prompts, and what must be ready before the first step.

- sft: packed (or padded) rows of rendered records, the token loss (step.py).
- dpo: preference pairs, DPO's loss against reference log-probabilities computed once (dpo.py, preferences.py).
- grpo: prompts, each step's completions sampled by the model itself and scored by the rewards (grpo.py,
  grpo_iteration.py, prompts.py; docs/grpo.md).
"""

from __future__ import annotations

from training.dpo import METRICS as DPO_METRICS


def prepare_data(settings, tokenizer, before_work):
    """The driver's preparation for the objective (prepare.prepare or preferences.prepare_pairs): a Prepared."""
    if settings.objective == "dpo":
        from training.preferences import prepare_pairs

        return prepare_pairs(settings, tokenizer, before_work)
    if settings.objective == "grpo":
        from training.prompts import prepare_prompts

        return prepare_prompts(settings, tokenizer, before_work)
    from data.prepare import prepare

    return prepare(settings, tokenizer, before_work)


def training_data(settings, tokenizer, rank: int, world: int, prepared: str | None = None):
    """This rank's data for the objective: step.TrainingData or preferences.PreferenceData."""
    if settings.objective == "dpo":
        from training.preferences import PreferenceData

        return PreferenceData(settings, tokenizer, rank, world, prepared)
    if settings.objective == "grpo":
        from training.prompts import PromptData

        return PromptData(settings, tokenizer, rank, world, prepared)
    from training.step import TrainingData

    return TrainingData(settings, tokenizer, rank, world, prepared)


class Sft:
    metric_names: tuple[str, ...] = ()

    def ready(self, run, state) -> None:
        """Nothing to compute before the first step."""

    def step(self, run, group: list, lr: float, stop: bool, preempted: bool):
        from training.step import train_step

        s = run.settings
        return train_step(run.trainee.loss, run.optimizer, group, lr, s.max_grad_norm, s.packing, run.device, stop,
                          preempted)  # fmt: skip

    def evaluate(self, run) -> dict:
        from training.step import evaluate

        s, data = run.settings, run.data
        return evaluate(run.trainee.loss, data.eval, s.batch_size, s.packing, run.rank, run.world, run.device)

    def prompts(self, run) -> list[dict]:
        from training.samples import held_out_prompts

        return held_out_prompts(run.data.eval, run.trainee.tokenizer, run.settings)


class Dpo:
    metric_names = DPO_METRICS

    def ready(self, run, state) -> None:
        """The pairs' reference log-probabilities: computed from the starting weights on a fresh run, read back on
        any other (preferences.PreferenceData.ready)."""
        dtype = str(next(run.trainee.loss.parameters()).dtype).removeprefix("torch.")
        run.data.ready(run.trainee.loss, state.step == 0, dtype, run.device)

    def step(self, run, group: list, lr: float, stop: bool, preempted: bool):
        from training.dpo import dpo_step

        s = run.settings
        return dpo_step(run.trainee.loss, run.optimizer, group, lr, s.max_grad_norm, s.dpo_beta, s.dpo_loss,
                        run.device, stop, preempted)  # fmt: skip

    def evaluate(self, run) -> dict:
        from training.dpo import held_out_scores

        return held_out_scores(run.trainee.loss, run.data, run.settings, run.rank, run.world, run.device)

    def prompts(self, run) -> list[dict]:
        """The first --eval-samples held-out prompts, the chosen answer as the reference (samples.py's layout)."""
        import numpy as np

        tokenizer, pairs = run.trainee.tokenizer, (run.data.eval or [])[: run.settings.eval_samples]
        return [{"ids": np.asarray(p.prompt_ids, dtype=np.int64),
                 "prompt": tokenizer.decode(p.prompt_ids, skip_special_tokens=True),
                 "reference": tokenizer.decode(p.chosen_ids, skip_special_tokens=True)} for p in pairs]  # fmt: skip


def objective_of(settings):
    if settings.objective == "grpo":
        from training.grpo_objective import Grpo

        return Grpo(settings)
    return Dpo() if settings.objective == "dpo" else Sft()
