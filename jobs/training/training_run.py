"""The run, step after step across epochs, and its bookkeeping: its state, its token sums, the progress line,
and what comes after a step when it is due: an eval with sample answers, a checkpoint, a stop.

RunState is what a checkpoint's train_state.json holds, so a restart goes on from the very step: the epochs
and steps done (the schedule's position; with the epoch, the sampler's, since its order is a function of seed
and epoch), the epoch's token sums and time, the progress line's sums, the evals and the history. The model,
AdamW's moments and every rank's RNG are in the checkpoint's shards (checkpoints.ShardedCheckpointer). The
steps themselves are jobs/training/step.py. No Ray here: the tests run it in processes of their own, with a saver that
writes to a directory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from runtime.backend import worker_print
from runtime.log_lines import one_line, scored
from training import stopping
from training.checkpoints import epoch_dir_name, step_dir_name
from training.step import micro_batch_groups


@dataclass(frozen=True)
class Sums:
    """Token sums over some steps, over every rank: the summed token loss, the predicted and real tokens, the
    steps and the training seconds (evals left out)."""

    loss: float = 0.0
    predicted: float = 0.0
    real: float = 0.0
    steps: int = 0
    seconds: float = 0.0
    metrics: tuple = ()  # the objective's own sums (DPO's rewards and log-probabilities: dpo.METRICS)

    def __add__(self, other: Sums) -> Sums:
        metrics = tuple(a + b for a, b in zip(self.metrics, other.metrics, strict=True)) if self.metrics and \
            other.metrics else self.metrics or other.metrics  # fmt: skip
        return Sums(self.loss + other.loss, self.predicted + other.predicted, self.real + other.real,
                    self.steps + other.steps, self.seconds + other.seconds, metrics)  # fmt: skip

    @property
    def mean_loss(self) -> float:
        """The loss per predicted token (DPO: per pair)."""
        return self.loss / max(self.predicted, 1)

    def means(self, names: tuple[str, ...] | None = None) -> dict[str, float]:
        """The objective's metrics (`names`, its metric_names; DPO's by default) as means (per pair: TRL's
        rewards/accuracies, ...; GRPO: per step)."""
        from training.dpo import METRICS

        return {m: v / max(self.predicted, 1) for m, v in zip(names or METRICS, self.metrics, strict=False)}


@dataclass(frozen=True)
class RunState:
    """Where the run is. `epoch_sums` are the epoch's so far, `line_sums` those since the last progress line;
    `attempt` counts the starts (a restart's is one more)."""

    epoch: int = 0  # epochs done
    step: int = 0  # optimizer steps done
    epoch_sums: Sums = Sums()
    line_sums: Sums = Sums()
    history: tuple = ()
    evals: tuple = ()
    attempt: int = 1
    world_size: int = 1
    base_scores: dict | None = None  # the held-out task on the base model (evaluation.BeforeAfter), kept for a resume

    def to_json(self) -> dict:
        """train_state.json's layout (the names it has always had: `running` and `progress` for the sums)."""
        e, line = self.epoch_sums, self.line_sums
        return {"epoch": self.epoch, "step": self.step, "history": list(self.history), "evals": list(self.evals),
                "running": {"loss_sum": e.loss, "predicted": e.predicted, "real": e.real, "steps": e.steps,
                            "elapsed_s": e.seconds, "metrics": list(e.metrics)},
                "progress": {"loss_sum": line.loss, "predicted": line.predicted, "real": line.real,
                             "metrics": list(line.metrics)},
                "attempt": self.attempt, "world_size": self.world_size, "base_scores": self.base_scores}  # fmt: skip

    @classmethod
    def from_json(cls, saved: dict) -> RunState:
        running, progress = saved.get("running") or {}, saved.get("progress") or {}
        epoch_sums = Sums(running.get("loss_sum", 0.0), running.get("predicted", 0.0), running.get("real", 0.0),
                          running.get("steps", 0), running.get("elapsed_s", 0.0),
                          tuple(running.get("metrics", ())))  # fmt: skip
        line_sums = Sums(progress.get("loss_sum", 0.0), progress.get("predicted", 0.0), progress.get("real", 0.0),
                         metrics=tuple(progress.get("metrics", ())))  # fmt: skip
        return cls(saved["epoch"], saved["step"], epoch_sums, line_sums, tuple(saved.get("history", ())),
                   tuple(saved.get("evals", ())), saved.get("attempt", 1), saved.get("world_size", 1),
                   saved.get("base_scores"))  # fmt: skip


def resumed_state(saved: dict, world: int) -> RunState:
    """The state to go on from: a fresh run's, or a checkpoint's train_state.json (`saved`), one attempt more.
    A checkpoint written before steps were counted cannot say where in its epoch it was: refused (the stack's
    runs never meet one: a new version of the jobs is a new run name)."""
    if saved and "step" not in saved:
        raise RuntimeError(
            "this run's latest checkpoint was written by an older version of the fine-tune that did not record "
            "its step; start a new run (another --run-name)"
        )
    state = RunState.from_json(saved) if saved else RunState(attempt=0)
    return replace(state, attempt=state.attempt + 1, world_size=world)


class TokenSums:
    """The token loss since the last read, kept on the device (this rank's; float64 on CPU, float32 elsewhere), and
    the predicted and real tokens on the host (the steps' global counts already): adding a step reads nothing
    back. `read` sums the loss over every rank with one all-reduce and reads it (with the progress line's
    gradient norm, the only device reads, once a line or a save needs them), then starts again."""

    def __init__(self, device):
        import torch

        self.device, self.steps, self.predicted, self.real = device, 0, 0.0, 0.0
        self.dtype = torch.float64 if device.type == "cpu" else torch.float32
        self.loss = torch.zeros((), dtype=self.dtype, device=device)
        self.metrics = None  # the objective's own sums (DPO's), on the device too

    def add(self, result) -> None:
        self.loss += result.loss_sum.to(self.dtype)
        extra = getattr(result, "metric_sums", None)
        if extra is not None:
            self.metrics = extra.to(self.dtype) if self.metrics is None else self.metrics + extra.to(self.dtype)
        self.predicted += result.counts[0]
        self.real += result.counts[1]
        self.steps += 1

    def read(self, seconds: float) -> Sums:
        import torch.distributed as dist

        dist.all_reduce(self.loss, op=dist.ReduceOp.SUM)
        metrics = ()
        if self.metrics is not None:
            dist.all_reduce(self.metrics, op=dist.ReduceOp.SUM)
            metrics, self.metrics = tuple(self.metrics.tolist()), None
        sums = Sums(float(self.loss), self.predicted, self.real, self.steps, seconds, metrics)
        self.loss.zero_()
        self.steps, self.predicted, self.real = 0, 0.0, 0.0
        return sums


@dataclass
class Progress:
    """Rank 0's progress line (the step, the share of the run done, the epoch, loss, lr, grad norm, real tok/s) in
    the log and TensorBoard (`board`, a run_files.TensorBoard, if any), every `every` steps and at the last;
    the evals' losses and sample answers; each epoch's losses."""

    every: int
    total_steps: int
    rank: int
    board: object = None
    steps_per_epoch: int = 0
    metric_names: tuple[str, ...] = ()  # the objective's (objectives.*.metric_names)

    def line(self, done: int, sums: Sums, lr: float, grad_norm: float, compiles: dict | None = None) -> None:
        values = {"loss": sums.mean_loss, "lr": lr, "grad_norm": grad_norm,
                  "real_tokens_per_s": sums.real / sums.seconds if sums.seconds else 0.0} | sums.means(
                      self.metric_names or None)  # fmt: skip
        if self.rank != 0:
            return
        compiled = "".join(f"  {name.replace('_', ' ')} {count}" for name, count in (compiles or {}).items())
        preferred = "".join(f"  {m} {values[m]:.4f}" for m in ("rewards/accuracies", "rewards/margins", "reward",
                                                               "reward_std") if m in values)  # fmt: skip
        worker_print(f"{self.where(done)}  loss {values['loss']:.4f}{preferred}  lr {values['lr']:.3g}  "
                     f"grad_norm {values['grad_norm']:.3f}  real tok/s {values['real_tokens_per_s']:,.0f}{compiled}")  # fmt: skip
        if self.board is not None:
            for name, value in values.items():
                self.board.add_scalar(f"train/{name}", value, done)

    def due(self, done: int) -> bool:
        return done % self.every == 0 or done == self.total_steps

    def where(self, done: int) -> str:
        """`step 15/30 (50%)  epoch 1.50/2.00`: the step, the share of the run done and the epochs."""
        share = f"step {done}/{self.total_steps} ({100 * done / max(self.total_steps, 1):.0f}%)"
        if not self.steps_per_epoch:
            return share
        return f"{share}  epoch {done / self.steps_per_epoch:.2f}/{self.total_steps / self.steps_per_epoch:.2f}"

    def evaluated(self, step: int, held_out: dict, samples: list[dict]) -> None:
        """An eval's loss and answers: the log, TensorBoard (as scalars and text), then published."""
        if self.rank != 0:
            return
        if held_out.get("eval_loss") is not None:
            accuracy = held_out.get("eval_rewards/accuracies")
            preferred = "" if accuracy is None else f", chosen preferred {accuracy:.1%}"
            worker_print(f"eval at step {step}: loss {held_out['eval_loss']:.4f}{preferred}")
        if held_out.get("eval_reward") is not None:
            worker_print(f"eval at step {step}: mean reward {held_out['eval_reward']:.4f} (greedy, held-out prompts)")
        for i, sample in enumerate(samples):
            worker_print(f"  sample {i}{scored(sample)}: {one_line(sample['completion'], 160)}")
        if self.board is not None:
            if held_out.get("eval_loss") is not None:
                self.board.add_scalar("eval/loss", held_out["eval_loss"], step)
            for i, sample in enumerate(samples):
                self.board.add_text(f"samples/{i}", sample_markdown(sample), step)
            self.board.publish()

    def epoch(self, metrics: dict) -> None:
        """The epoch's losses into TensorBoard, whose files then go to the run's storage."""
        if self.board is None:
            return
        for name in ("loss", "eval_loss"):
            if metrics.get(name) is not None:
                self.board.add_scalar(f"epoch/{name}", metrics[name], metrics["step"])
        self.board.publish()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def sample_markdown(sample: dict) -> str:
    quote = chr(10).join("> " + line for line in sample["prompt"].splitlines())
    return f"{quote}\n\n**model:** {sample['completion']}\n\n**reference:** {sample['reference']}"


def log_every(steps_per_epoch: int, lines_per_epoch: int = 10) -> int:
    """About `lines_per_epoch` progress lines an epoch."""
    return max(1, round(steps_per_epoch / lines_per_epoch))


@dataclass
class Hooks:
    """What the run calls out to. `save(name, metrics, state_json, wait)` runs on every rank and writes a
    checkpoint (with `wait`, it returns once the checkpoint is in and registered); `epoch_metrics(epoch,
    trained, held_out, elapsed_s)` makes an epoch's metrics; `samples` (rank 0's run_files.SampleLog, or
    None) keeps the evals' answers; `on_step(step, result)` (a test's) sees each step."""

    save: Callable[[str, dict, dict, bool], None]
    epoch_metrics: Callable[[int, dict, dict, float], dict]
    progress: Progress
    samples: object = None
    on_step: Callable | None = field(default=None)
    evaluation: object = None  # evaluation.BeforeAfter, or None


def input_shapes(batch) -> tuple:
    """The shapes of what a step feeds the model (its micro-batches' tensors and the towers' inputs), nested as the
    batch is: two steps of the same shapes run one compiled program."""
    if isinstance(batch, dict):
        return tuple((name, input_shapes(value)) for name, value in sorted(batch.items()))
    if isinstance(batch, (tuple, list)):
        return tuple(input_shapes(value) for value in batch)
    return tuple(getattr(batch, "shape", ()))


class TrainingRun:
    """The run on this rank: `run(state)` goes from `state` to the last planned step (schedule.total_steps)."""

    def __init__(self, trainee, optimizer, data, schedule, settings, device, rank: int, world: int, hooks: Hooks):
        from training.objectives import objective_of

        self.trainee, self.optimizer, self.data, self.schedule = trainee, optimizer, data, schedule
        self.settings, self.device, self.rank, self.world, self.hooks = settings, device, rank, world, hooks
        self.objective = objective_of(settings)
        hooks.progress.metric_names = self.objective.metric_names
        self.at = 0  # the step being taken (GRPO's samples are seeded by it)
        self.prompts = self.objective.prompts(self) if data.eval is not None else []
        self.sums = TokenSums(device)
        self.clock = time.perf_counter()  # training time since the last read of the sums (evals left out)
        self.last = None  # the last step's StepResult
        self.compiled = None  # model.compile_counts at the first step's end
        self.shape_sets: set = set()

    def run(self, state: RunState, epochs: int | None = None) -> RunState:
        """From `state` (resumed_state's) to the last planned step, or the end of epoch `epochs` (for a test); with
        an evaluation hook, the base model scored before the first step and the fine-tune after the last."""
        evaluation = self.hooks.evaluation
        self.objective.ready(self, state)
        if evaluation is not None and state.step == 0 and state.base_scores is None:
            state = replace(state, base_scores=evaluation.score(self))
        while state.step < self.schedule.total_steps and (epochs is None or state.epoch < epochs):
            state = self.epoch(state)
        if evaluation is not None and state.step >= self.schedule.total_steps:
            evaluation.finish(state.base_scores, evaluation.score(self), state.step)
        return state

    def epoch(self, state: RunState) -> RunState:
        steps, epoch, settings = self.data.steps, state.epoch, self.settings
        self.data.start(epoch, state.step - epoch * steps)
        self.clock = time.perf_counter()
        self.shape_sets = set()  # the distinct shapes of what the epoch's steps fed the model (one: one compile)
        for group in micro_batch_groups(self.data.loader, settings.grad_accum):
            self.shape_sets.add(input_shapes(group))
            notice = stopping.preemption_notice() if settings.sharded_checkpoints else None
            self.at = state.step
            self.last = self.objective.step(self, group, self.schedule.at(state.step), stopping.requested(),
                                            notice is not None)  # fmt: skip
            self.sums.add(self.last)
            if self.compiled is None:
                from training.model import compile_counts

                self.compiled = compile_counts(settings)
            if self.hooks.on_step is not None:
                self.hooks.on_step(state.step, self.last)
            state = replace(state, step=state.step + 1)
            ended = state.step in ((epoch + 1) * steps, self.schedule.total_steps)
            stop = self.last.stop
            state = self.after_step(state, ended, stop)
            if stop == "preempted" and state.step < self.schedule.total_steps:
                stopping.await_restart(state.step, self.rank, notice or stopping.preemption_notice())
            if ended:
                break
        return state

    def read_sums(self, state: RunState) -> RunState:
        """The steps since the last read into the epoch's and the progress line's sums (one all-reduce)."""
        now = time.perf_counter()
        sums = self.sums.read(now - self.clock)
        self.clock = now
        return replace(state, epoch_sums=state.epoch_sums + sums, line_sums=state.line_sums + sums)

    def after_step(self, state: RunState, ended: bool, stop: str | None) -> RunState:
        """The progress line, the eval, the checkpoint and the stop that are due after this step. `stop`: "sigterm"
        (saved, then StopRequested) or "preempted" (saved; the restart is Ray Train's to make: `epoch` waits for
        it)."""
        step, settings, progress = state.step, self.settings, self.hooks.progress
        eval_due = ended or (settings.eval_every and step % settings.eval_every == 0)
        save_due = ended or stop or (settings.save_every and step % settings.save_every == 0)
        if progress.due(step) or eval_due or save_due:
            state = self.read_sums(state)
        if progress.due(step):
            progress.line(step, state.line_sums, self.last.lr, float(self.last.grad_norm), self.recompiles())
            state = replace(state, line_sums=Sums())
        held_out = {}
        if eval_due:
            held_out = self.evaluate(step)
            self.clock = time.perf_counter()  # the epoch's time is training time
            if held_out.get("eval_loss") is not None:
                state = replace(state, evals=(*state.evals, {"step": step, "eval_loss": held_out["eval_loss"]}))
        if save_due:
            if ended:
                state = self.end_epoch(state, held_out, bool(stop))
            else:
                self.hooks.save(step_dir_name(step), self.step_metrics(state), state.to_json(), bool(stop))
        if stop == "sigterm":
            import torch.distributed as dist

            dist.barrier()  # every rank's report is in before any rank's error reaches Ray Train
            raise stopping.StopRequested(f"stopped on request after step {step}; its checkpoint is saved")
        return state

    def end_epoch(self, state: RunState, held_out: dict, wait: bool) -> RunState:
        """The epoch's metrics into the history, then its checkpoint (a partial last epoch's is named by step)."""
        sums, epoch, step = state.epoch_sums, state.epoch + 1, state.step
        trained = {"loss": sums.mean_loss, "predicted_tokens": sums.predicted, "real_tokens": sums.real,
                   "steps": sums.steps, "lr": self.last.lr, "grad_norm": float(self.last.grad_norm)}  # fmt: skip
        metrics = self.hooks.epoch_metrics(epoch, trained, held_out, sums.seconds) | {
            "step": step, "share": step / self.schedule.total_steps,
        } | {"input_shape_sets": len(self.shape_sets)} | self.recompiles() | sums.means(self.objective.metric_names or None) | getattr(self.objective, "epoch_extras", dict)() | {k: v for k, v in held_out.items()
                                                                if k.startswith(("eval_rewards", "eval_logps", "eval_preferred"))}  # fmt: skip
        self.hooks.progress.epoch(metrics)
        state = replace(state, epoch=epoch, history=(*state.history, metrics), epoch_sums=Sums())
        whole = step == epoch * self.data.steps
        self.hooks.save(epoch_dir_name(epoch) if whole else step_dir_name(step), metrics, state.to_json(), wait)
        return state

    def step_metrics(self, state: RunState) -> dict:
        """A mid-epoch checkpoint's metrics: where the run is, and the scores Ray Train keeps checkpoints by."""
        return {
            "step": state.step,
            "epoch": state.step / self.data.steps,
            "share": state.step / self.schedule.total_steps,
            "loss": state.epoch_sums.mean_loss,
            "eval_loss": state.evals[-1]["eval_loss"] if state.evals else math.inf,  # no eval yet: the worst score
        }

    def recompiles(self) -> dict[str, int]:
        """Compiles since the first step's (model.compile_counts; none without settings.compile off TPU): a run
        whose shapes or constants change from step to step shows it here at once."""
        from training.model import compile_counts

        now = compile_counts(self.settings)
        return {name: count - self.compiled[name] for name, count in now.items()} if self.compiled else {}

    def evaluate(self, step: int) -> dict:
        """The held-out loss (if there is an eval split) and greedy answers to its first prompts, eager: under
        settings.compile, no_grad and generation's growing shapes would each compile the layers again."""
        import torch

        from training.samples import answer

        data = self.data
        held_out = {}
        with torch.compiler.set_stance("force_eager"):
            if data.eval is not None:
                held_out = self.objective.evaluate(self)
            samples = held_out.pop("samples", None)  # (GRPO's: its held-out reward's own answers)
            samples = samples or (answer(self.trainee, self.prompts, self.device, self.world) if self.prompts else [])
        if self.hooks.samples is not None and samples:
            self.hooks.samples.add(step, samples)
        self.hooks.progress.evaluated(step, held_out, samples)
        return held_out
