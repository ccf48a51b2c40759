"""The training loop's parts: this rank's data, one optimizer step, one epoch, the held-out eval, and
progress.

They take a model whose forward returns the sum of its token losses (model.TokenLoss) and a
torch.distributed process group; no Ray, so the tests run them in one process (or two, for the
collectives).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from functools import cache

from backend import worker_print
from recipe import IGNORE, clip_grad_norm, lr_at, predicted_tokens
from sft_data import model_inputs


@dataclass(frozen=True)
class Schedule:
    peak_lr: float
    kind: str
    warmup_ratio: float
    total_steps: int

    def lr(self, step: int) -> float:
        return lr_at(step, self.total_steps, self.peak_lr, self.kind, self.warmup_ratio)


def steps_per_epoch(batches_per_rank: int, grad_accum: int) -> int:
    return batches_per_rank // grad_accum


class TrainingData:
    """This rank's loader over the training rows (sharded, shuffled by seed and epoch), the eval rows,
    and the steps an epoch takes, read from the prepared data (jobs/prepared.py) at `prepared`; without
    one (a test in one process), the data is prepared here first, into this machine's temp dir."""

    def __init__(self, settings, tokenizer, rank: int, world: int, prepared: str | None = None):
        import torch
        from prepared import PreparedRows, local_directory, prepare

        if prepared is None:
            import fcntl

            scratch = os.path.join(tempfile.gettempdir(), "gemma-tpu-scratch")
            os.makedirs(scratch, exist_ok=True)
            with open(os.path.join(scratch, ".lock"), "w") as lock:  # ranks in processes of one machine: one prepares
                fcntl.flock(lock, fcntl.LOCK_EX)
                prepared = prepare(replace(settings, storage_path=scratch), tokenizer).uri
        directory = local_directory(prepared)
        left = not settings.packing and getattr(tokenizer, "padding_side", "right") == "left"
        shape = (settings.seq_len, tokenizer.pad_token_id, settings.packing, left)
        rows = PreparedRows(directory, "train", *shape)
        self.sampler = resumable_sampler()(rows, num_replicas=world, rank=rank, shuffle=True, seed=settings.seed,
                                           drop_last=True)  # fmt: skip
        self.loader = torch.utils.data.DataLoader(rows, batch_size=settings.batch_size, sampler=self.sampler,
                                                  drop_last=True)  # fmt: skip
        self.rows_per_step = settings.batch_size * settings.grad_accum
        self.steps = steps_per_epoch(len(self.loader), settings.grad_accum)
        has_eval = os.path.exists(os.path.join(directory, "eval", "rows.npy"))
        self.eval = PreparedRows(directory, "eval", *shape) if has_eval else None

    def schedule(self, settings) -> Schedule:
        """Planned for the steps that will run: --epochs' steps, or --max-steps, which overrides --epochs (as
        transformers' max_steps does: the run stops there, within an epoch or after more of them)."""
        total = settings.max_steps or self.steps * settings.epochs
        return Schedule(settings.lr, settings.lr_schedule, settings.warmup_ratio, total)

    def start(self, epoch: int, step_in_epoch: int) -> None:
        """The loader from `step_in_epoch` of `epoch`: the order is a function of (seed, epoch), so a run
        that goes on mid-epoch sees the very rows an unbroken one would."""
        self.sampler.set_epoch(epoch)
        self.sampler.skip = step_in_epoch * self.rows_per_step


@cache
def resumable_sampler() -> type:
    """(A class made on first use: torch is imported where the loop runs, not where this module is.)"""
    import torch

    class ResumableSampler(torch.utils.data.DistributedSampler):
        """A DistributedSampler that can start past the first `skip` indices of its epoch's order."""

        skip = 0

        def __iter__(self):
            return iter(list(super().__iter__())[self.skip :])

        def __len__(self) -> int:
            return self.num_samples - self.skip

    return ResumableSampler


def train_step(model, optimizer, micro_batches: list, lr: float, max_grad_norm: float, packing: bool, device,
               stop: bool = False, preempted: bool = False) -> dict:  # fmt: skip
    """One optimizer step over one global batch (this rank's micro-batches, and every other rank's).

    The loss is the sum of every predicted token's loss over the global batch divided by their
    global count, which one all-reduce gives before any backward pass; FSDP sums the gradients
    over ranks (apply_fsdp), so nothing divides twice. The same all-reduce carries this rank's
    request to stop (`stop`: SIGTERM) and its preemption notice (`preempted`), from stopping.py:
    "stop" and "preempted" in the result say whether any rank had one. Returns tensors (no device sync).
    """
    import torch
    import torch.distributed as dist

    counts = torch.tensor(
        [sum(int(predicted_tokens(b[2])) for b in micro_batches), sum(int(b[1].sum()) for b in micro_batches),
         float(stop), float(preempted)],
        dtype=torch.float32,
        device=device,
    )  # fmt: skip
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # [predicted, real, stops, notices] over the global batch
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for batch in micro_batches:
        summed = model(**model_inputs(batch, packing, device))
        (summed / counts[0].clamp(min=1)).backward()
        loss_sum += summed.detach().float()
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = clip_grad_norm(trainable, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss_sum": loss_sum, "predicted": counts[0], "real": counts[1], "grad_norm": grad_norm, "lr": lr,
            "stop": counts[2], "preempted": counts[3]}  # fmt: skip


def micro_batch_groups(loader, grad_accum: int):
    """The loader's batches, grad_accum at a time; a last incomplete group is dropped (as drop_last)."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == grad_accum:
            yield group
            group = []


def global_sum(*values: float, device=None) -> list[float]:
    """Sums over ranks (gloo has no AVG: sum, then divide where a mean is wanted)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64 if device is None or device.type == "cpu" else torch.float32)
    t = t.to(device) if device is not None else t
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def eval_rows(dataset, rank: int, world: int):
    """This rank's share of the eval rows, padded with empty rows (nothing to predict) so that every
    rank runs the same number of forward passes: FSDP's all-gathers need every rank in each one."""
    import torch

    mine = range(rank, len(dataset), world)
    missing = math.ceil(len(dataset) / world) - len(mine)
    first = dataset[0][0]
    blank = [torch.zeros((missing, len(first)), dtype=torch.long) for _ in range(4)]
    blank[0] += first[0]  # a real token id: the filler is never predicted
    blank[2] += IGNORE
    blank[3] += torch.arange(len(first))
    return torch.utils.data.ConcatDataset(
        [torch.utils.data.Subset(dataset, list(mine)), torch.utils.data.TensorDataset(*blank)]
    )


def evaluate(model, dataset, batch_size: int, packing: bool, rank: int, world: int, device) -> dict:
    """The loss over every predicted token of the eval rows (token-weighted, all ranks); no gradients."""
    import torch

    loader = torch.utils.data.DataLoader(eval_rows(dataset, rank, world), batch_size=batch_size)
    loss_sum = predicted = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in loader:
            loss_sum += float(model(**model_inputs(batch, packing, device)))
            predicted += int(predicted_tokens(batch[2]))
    model.train(was_training)
    total, count = global_sum(loss_sum, predicted, device=device)
    return {"eval_loss": total / count if count else None, "eval_tokens": count}


@dataclass
class Progress:
    """Every `every` steps, rank 0 prints one line (the step, the share of the run done, the epoch, loss,
    lr, grad norm, real tok/s) and writes the same to TensorBoard (`board`, a run_files.TensorBoard, if
    any). The loss is the global one since the last line: one small all-reduce at each printed step,
    none in between; `since` is saved with a checkpoint so a restart prints what an unbroken run does."""

    every: int
    total_steps: int
    rank: int
    device: object = None
    board: object = None
    steps_per_epoch: int = 0
    since: dict = field(default_factory=lambda: {"loss_sum": 0.0, "predicted": 0.0, "real": 0.0})
    _started: float = field(default_factory=time.perf_counter)

    def step(self, step: int, result: dict) -> None:
        self.since["loss_sum"] += float(result["loss_sum"])  # this rank's; summed over ranks below
        self.since["predicted"] += float(result["predicted"])
        self.since["real"] += float(result["real"])
        done = step + 1
        if done % self.every and done != self.total_steps:
            return
        (loss_sum,) = global_sum(self.since["loss_sum"], device=self.device)
        elapsed = time.perf_counter() - self._started
        values = {
            "loss": loss_sum / max(self.since["predicted"], 1),
            "lr": result["lr"],
            "grad_norm": float(result["grad_norm"]),
            "real_tokens_per_s": self.since["real"] / elapsed if elapsed else 0.0,
        }
        if self.rank == 0:
            worker_print(f"{self.where(done)}  loss {values['loss']:.4f}  lr {values['lr']:.3g}  "
                         f"grad_norm {values['grad_norm']:.3f}  real tok/s {values['real_tokens_per_s']:,.0f}")  # fmt: skip
            if self.board is not None:
                for name, value in values.items():
                    self.board.add_scalar(f"train/{name}", value, done)
        self.since = {"loss_sum": 0.0, "predicted": 0.0, "real": 0.0}
        self._started = time.perf_counter()

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
            worker_print(f"eval at step {step}: loss {held_out['eval_loss']:.4f}")
        for i, sample in enumerate(samples):
            worker_print(f"  sample {i}: {sample['completion'][:160]!r}")
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


def log_every(steps_per_epoch_: int, lines_per_epoch: int = 10) -> int:
    """About `lines_per_epoch` progress lines an epoch."""
    return max(1, round(steps_per_epoch_ / lines_per_epoch))
