"""One optimizer step, and what it is made of: this rank's data, its micro-batches, the step itself, and the
held-out eval.

They take a model whose forward returns the sum of its token losses (model.TokenLoss) and a
torch.distributed process group; no Ray, so the tests run them in one process (or two, for the
collectives). The run around them (its state, progress, evals, checkpoints, stops) is jobs/training/training_run.py.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, replace
from functools import cache

from config.modality import towers_of
from data.labels import IGNORE, predicted_tokens
from data.sft_data import model_inputs
from training.recipe import clip_grad_norm


def steps_per_epoch(batches_per_rank: int, grad_accum: int) -> int:
    return batches_per_rank // grad_accum


class TrainingData:
    """This rank's loader over the training rows (sharded, shuffled by seed and epoch), the eval rows,
    and the steps an epoch takes, read from the prepared data (jobs/data/prepare.py) at `prepared`; without
    one (a test in one process), the data is prepared here first, into this machine's temp dir."""

    def __init__(self, settings, tokenizer, rank: int, world: int, prepared: str | None = None):
        import torch

        from data.prepared import PreparedRows, local_directory

        if prepared is None:
            from data.prepare import prepare

            prepared = scratch_prepared(settings, tokenizer, prepare)
        directory = local_directory(prepared)
        left = not settings.packing and getattr(tokenizer, "padding_side", "right") == "left"
        shape = (settings.seq_len, tokenizer.pad_token_id, settings.packing, left)
        rows = PreparedRows(directory, "train", *shape)
        if rows.media is not None and not towers_of(settings.modality):
            raise RuntimeError(f"the prepared rows hold pictures or sound, but the workers' --modality is "
                               f"{settings.modality}, which loads no tower (the driver makes auto the data's "
                               "modality: pass the one the data report names)")  # fmt: skip
        self.sampler = resumable_sampler()(rows, num_replicas=world, rank=rank, shuffle=True, seed=settings.seed,
                                           drop_last=True)  # fmt: skip
        self.loader = torch.utils.data.DataLoader(rows, batch_size=settings.batch_size, sampler=self.sampler,
                                                  drop_last=True, collate_fn=rows.collate)  # fmt: skip
        self.rows_per_step = settings.batch_size * settings.grad_accum
        self.steps = steps_per_epoch(len(self.loader), settings.grad_accum)
        has_eval = os.path.exists(os.path.join(directory, "eval", "rows.npy"))
        self.eval = PreparedRows(directory, "eval", *shape) if has_eval else None

    def start(self, epoch: int, step_in_epoch: int) -> None:
        """The loader from `step_in_epoch` of `epoch`: the order is a function of (seed, epoch), so a run
        that goes on mid-epoch sees the very rows an unbroken one would."""
        self.sampler.set_epoch(epoch)
        self.sampler.skip = step_in_epoch * self.rows_per_step


def scratch_prepared(settings, tokenizer, prepare) -> str:
    """The data prepared by `prepare` into this machine's temp dir (a test in processes of its own, without a
    driver): one rank of the machine prepares, the others wait and reuse it."""
    import fcntl

    scratch = os.path.join(tempfile.gettempdir(), "gemma-tpu-scratch")
    os.makedirs(scratch, exist_ok=True)
    with open(os.path.join(scratch, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return prepare(replace(settings, storage_path=scratch), tokenizer).uri


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


def micro_batch_groups(loader, grad_accum: int):
    """The loader's batches, grad_accum at a time; a last incomplete group is dropped (as drop_last)."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == grad_accum:
            yield group
            group = []


@dataclass
class StepResult:
    """What one optimizer step leaves: this rank's summed token loss and the gradient norm (device tensors, read
    only where a line prints them), and, on the host, the learning rate and the global batch's counts summed
    over ranks, [predicted, real, stop requests, preemption notices]."""

    loss_sum: object
    grad_norm: object
    lr: float
    counts: tuple[float, float, float, float]
    metric_sums: object = None  # the objective's own sums, a device tensor (DPO's: dpo.METRICS)

    @property
    def stop(self) -> str | None:
        """ "preempted" when a rank had Ray Train's notice, "sigterm" when one was sent SIGTERM, else None."""
        _, _, stops, notices = self.counts
        return "preempted" if notices else "sigterm" if stops else None


def host_counts(micro_batches: list) -> tuple[int, int]:
    """This rank's predicted and real tokens, counted with numpy on the CPU batch before it moves: no device
    read, and no torch op a device-read count would see."""
    predicted = sum(int((b[2].numpy()[..., 1:] != IGNORE).sum()) for b in micro_batches)
    return predicted, sum(int(b[1].numpy().sum()) for b in micro_batches)


@cache
def _gloo_beside(world) -> object:
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def host_group():
    """A gloo group over every rank, for values the hosts hold (counts, stop flags): summed over the network,
    they never touch the device. The default group where it is gloo already (on CPU)."""
    import torch.distributed as dist

    return None if dist.get_backend() == "gloo" else _gloo_beside(dist.group.WORLD)


def set_lr(optimizer, lr: float) -> None:
    """The step's learning rate into each group: written into the optimizer's tensor where it has one (model.adamw),
    a copy from the host rather than a new constant in the step's program; else the float."""
    import torch

    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].copy_(torch.tensor(lr, dtype=group["lr"].dtype))
        else:
            group["lr"] = lr


def global_counts(mine: tuple[int, int], stop: bool, preempted: bool) -> tuple[float, float, float, float]:
    """This rank's host counts (what the loss is divided by, and real tokens) with its stop request and preemption
    notice, summed over every rank on the hosts' group: one all-reduce, no device read."""
    import numpy as np
    import torch
    import torch.distributed as dist

    counts = torch.from_numpy(np.array([*mine, stop, preempted], dtype=np.float64))
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=host_group())
    return tuple(counts.numpy().tolist())


def divisor(count: float, device):
    """The global count a micro-batch's summed loss is divided by, a device tensor copied from the host (not a new
    constant in the step's program each step)."""
    import torch

    return torch.tensor(max(count, 1.0), dtype=torch.float32).to(device)


def optimizer_step(optimizer, max_grad_norm: float):
    """Clip the gradients the micro-batches left, step, clear them; the gradient norm (a device tensor)."""
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = clip_grad_norm(trainable, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train_step(model, optimizer, micro_batches: list, lr: float, max_grad_norm: float, packing: bool, device,
               stop: bool = False, preempted: bool = False) -> StepResult:  # fmt: skip
    """One optimizer step over one global batch (this rank's micro-batches, and every other rank's).

    The loss is the sum of every predicted token's loss over the global batch divided by their
    global count, which one all-reduce of the hosts' counts gives before any backward pass; FSDP sums the
    gradients over ranks (model.apply_fsdp), so nothing divides twice. The same all-reduce carries this rank's
    request to stop (`stop`: SIGTERM) and its preemption notice (`preempted`), from stopping.py. Nothing is read
    back from the device.
    """
    import torch

    total = global_counts(host_counts(micro_batches), stop, preempted)
    by = divisor(total[0], device)
    set_lr(optimizer, lr)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for batch in micro_batches:
        summed = model(**model_inputs(batch, packing, device))
        (summed / by).backward()
        loss_sum += summed.detach().float()
    return StepResult(loss_sum, optimizer_step(optimizer, max_grad_norm), lr, total)


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

    loader = torch.utils.data.DataLoader(eval_rows(dataset, rank, world), batch_size=batch_size,
                                         collate_fn=getattr(dataset, "collate", None))  # fmt: skip
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
