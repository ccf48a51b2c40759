"""The run, step by step across epochs: after each optimizer step the progress line, then an eval with
sample answers when one is due, a checkpoint when one is due, and a stop when one was asked for.

The run's state is what train_state.json holds, so a restart goes on from the very step: the epochs
done, the steps done (the schedule's position; with the epoch, the sampler's position, since its
order is a function of seed and epoch), the epoch's running loss, token counts and time, the progress
line's sums, the evals and the history. The model, AdamW's moments and every rank's RNG are in the
checkpoint's shards (checkpoints.ShardedCheckpointer). No Ray here: the tests run it in processes of
their own, with a saver that writes to a directory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import stopping
from checkpoints import epoch_dir_name, step_dir_name
from loop import Progress, evaluate, global_sum, micro_batch_groups, train_step


def resumed_state(saved: dict, world: int) -> dict:
    """The state to go on from: a fresh run's, or a checkpoint's train_state.json (`saved`); `attempt`
    counts the starts. A checkpoint written before steps were counted cannot say where in its epoch it
    was: refused (the stack's runs never meet one: a new version of the jobs is a new run name)."""
    if saved and "step" not in saved:
        raise RuntimeError(
            "this run's latest checkpoint was written by an older version of the fine-tune that did not record "
            "its step; start a new run (another --run-name)"
        )
    fresh = {"epoch": 0, "step": 0, "history": [], "evals": [], "running": {}, "progress": {}, "attempt": 0}
    state = fresh | saved
    return state | {"attempt": state["attempt"] + 1, "world_size": world}


@dataclass
class Hooks:
    """What the run calls out to. `save(name, metrics, state, wait)` runs on every rank and writes a
    checkpoint (with `wait`, it returns once the checkpoint is in and registered); `epoch_metrics(epoch,
    trained, held_out, elapsed_s)` makes an epoch's metrics; `samples` (rank 0's run_files.SampleLog, or
    None) keeps the evals' answers."""

    save: Callable[[str, dict, dict, bool], None]
    epoch_metrics: Callable[[int, dict, dict, float], dict]
    progress: Progress
    samples: object = None


class Running:
    """The current epoch so far: this rank's loss sum (a tensor: no device sync per step), the global
    token counts, the steps and the time; a restart's rank 0 starts from the saved global sums."""

    def __init__(self, saved: dict, rank: int, device):
        import torch

        dtype = torch.float64 if device.type == "cpu" else torch.float32
        self.loss_sum = torch.tensor(saved.get("loss_sum", 0.0) if rank == 0 else 0.0, dtype=dtype, device=device)
        self.predicted, self.real = saved.get("predicted", 0.0), saved.get("real", 0.0)
        self.steps, self.elapsed_before = saved.get("steps", 0), saved.get("elapsed_s", 0.0)
        self.started, self.last, self.device = time.perf_counter(), {}, device

    def add(self, result: dict) -> None:
        self.loss_sum += result["loss_sum"]
        self.predicted, self.real = self.predicted + float(result["predicted"]), self.real + float(result["real"])
        self.steps, self.last = self.steps + 1, result

    def snapshot(self, progress: Progress) -> tuple[dict, dict]:
        """(this epoch's sums, the progress line's sums), over all ranks: one all-reduce."""
        loss_sum, since_loss = global_sum(float(self.loss_sum), progress.since["loss_sum"], device=self.device)
        elapsed = self.elapsed_before + time.perf_counter() - self.started
        running = {"loss_sum": loss_sum, "predicted": self.predicted, "real": self.real, "steps": self.steps,
                   "elapsed_s": elapsed}  # fmt: skip
        return running, progress.since | {"loss_sum": since_loss}

    @staticmethod
    def trained(running: dict, last: dict) -> dict:
        return {
            "loss": running["loss_sum"] / max(running["predicted"], 1),  # every predicted token, all ranks
            "predicted_tokens": running["predicted"],
            "real_tokens": running["real"],
            "steps": running["steps"],
            "lr": last["lr"],
            "grad_norm": float(last["grad_norm"]),
        }


class TrainingRun:
    def __init__(self, trainee, optimizer, data, settings, device, rank: int, world: int, hooks: Hooks):
        from samples import held_out_prompts

        self.trainee, self.optimizer, self.data, self.settings = trainee, optimizer, data, settings
        self.device, self.rank, self.world, self.hooks = device, rank, world, hooks
        self.schedule = data.schedule(settings)
        self.prompts = held_out_prompts(data.eval, trainee.tokenizer, settings) if data.eval is not None else []

    def run(self, state: dict, epochs: int | None = None) -> dict:
        """From `state` (resumed_state's) to the last planned step (or the end of epoch
        `epochs`, for a test); the final state."""
        if state["progress"]:  # the loss sum is global: rank 0 carries it, as Running does
            self.hooks.progress.since = state["progress"] | ({} if self.rank == 0 else {"loss_sum": 0.0})
        while state["step"] < self.schedule.total_steps and (epochs is None or state["epoch"] < epochs):
            state = self.epoch(state)
        return state

    def epoch(self, state: dict) -> dict:
        steps, epoch = self.data.steps, state["epoch"]
        self.data.start(epoch, state["step"] - epoch * steps)
        running = Running(state["running"], self.rank, self.device)
        settings = self.settings
        for group in micro_batch_groups(self.data.loader, settings.grad_accum):
            step, notice = state["step"], stopping.preemption_notice()
            result = train_step(self.trainee.loss, self.optimizer, group, self.schedule.lr(step),
                                settings.max_grad_norm, settings.packing, self.device, stopping.requested(),
                                notice is not None)  # fmt: skip
            running.add(result)
            self.hooks.progress.step(step, result)
            state = state | {"step": step + 1}
            ended = state["step"] in ((epoch + 1) * steps, self.schedule.total_steps)
            stop = "preempted" if result["preempted"] else "sigterm" if result["stop"] else None
            state = self.after_step(state, running, ended, stop)
            if stop == "preempted" and state["step"] < self.schedule.total_steps:
                stopping.await_restart(state["step"], self.rank, notice or stopping.preemption_notice())
            if ended:
                break
        return state

    def after_step(self, state: dict, running: Running, ended: bool, stop: str | None) -> dict:
        """The eval, the checkpoint and the stop that are due after this step. `stop`: "sigterm" (saved, then
        StopRequested) or "preempted" (saved; the restart is Ray Train's to make: `epoch` waits for it)."""
        step, settings = state["step"], self.settings
        held_out = {}
        if ended or (settings.eval_every and step % settings.eval_every == 0):
            started = time.perf_counter()
            held_out = self.evaluate(step)
            running.started += time.perf_counter() - started  # the epoch's time is training time
            if held_out.get("eval_loss") is not None:
                state = state | {"evals": [*state["evals"], {"step": step, "eval_loss": held_out["eval_loss"]}]}
        if ended or stop or (settings.save_every and step % settings.save_every == 0):
            sums, since = running.snapshot(self.hooks.progress)
            state = state | {"running": sums, "progress": since}
            if ended:
                state = self.end_epoch(state, running.last, held_out, bool(stop))
            else:
                self.hooks.save(step_dir_name(step), self.step_metrics(state), state, bool(stop))
        if stop == "sigterm":
            import torch.distributed as dist

            dist.barrier()  # every rank's report is in before any rank's error reaches Ray Train
            raise stopping.StopRequested(f"stopped on request after step {step}; its checkpoint is saved")
        return state

    def end_epoch(self, state: dict, last: dict, held_out: dict, wait: bool) -> dict:
        """The epoch's metrics into the history, then its checkpoint (a partial last epoch's is named by step)."""
        trained = Running.trained(state["running"], last)
        epoch, step = state["epoch"] + 1, state["step"]
        metrics = self.hooks.epoch_metrics(epoch, trained, held_out, state["running"]["elapsed_s"]) | {
            "step": step, "share": step / self.schedule.total_steps,
        }  # fmt: skip
        self.hooks.progress.epoch(metrics)
        state = state | {"epoch": epoch, "history": [*state["history"], metrics], "running": {}}
        whole = step == epoch * self.data.steps
        self.hooks.save(epoch_dir_name(epoch) if whole else step_dir_name(step), metrics, state, wait)
        return state

    def step_metrics(self, state: dict) -> dict:
        """A mid-epoch checkpoint's metrics: where the run is, and the scores Ray Train keeps checkpoints by."""
        running, evals = state["running"], state["evals"]
        return {
            "step": state["step"],
            "epoch": state["step"] / self.data.steps,
            "share": state["step"] / self.schedule.total_steps,
            "loss": running["loss_sum"] / max(running["predicted"], 1),
            "eval_loss": evals[-1]["eval_loss"] if evals else math.inf,  # no eval yet: the worst score
        }

    def evaluate(self, step: int) -> dict:
        """The held-out loss (if there is an eval split) and greedy answers to its first prompts."""
        from samples import answer

        data, settings = self.data, self.settings
        held_out = {}
        if data.eval is not None:
            held_out = evaluate(self.trainee.loss, data.eval, settings.batch_size, settings.packing, self.rank,
                                self.world, self.device)  # fmt: skip
        samples = answer(self.trainee, self.prompts, self.device, self.world) if self.prompts else []
        if self.hooks.samples is not None and samples:
            self.hooks.samples.add(step, samples)
        self.hooks.progress.evaluated(step, held_out, samples)
        return held_out
