"""What train_loop_per_worker's hooks do at an epoch's end and at a save: the epoch's metrics (losses, throughput,
MFU, model sizes), a resume's starting state, and the sharded or full checkpoint handed to Ray Train.

Called by ray_train_llm_finetune.py's train_loop_per_worker only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from runtime.backend import worker_print
from runtime.memory_plan import Workload, grpo_parts, plan, sequences_per_record
from runtime.storage import uri
from runtime.tpu_generations import by_accelerator_type
from runtime.utilisation import describe, mfu, model_flops_per_token
from training import stopping
from training.checkpoints import ShardedCheckpointer, committer, export_pretrained, is_sharded, read_state, write_state
from training.lora import trainable_and_total
from training.training_run import RunState, resumed_state

if TYPE_CHECKING:
    from concurrent.futures import Future

    from config.settings import FinetuneSettings
    from training.model import Trainee


def peak_flops_per_device(settings: FinetuneSettings) -> float | None:
    """The MFU denominator: --peak-tflops if given, else the TPU's table value; none off TPU."""
    if settings.peak_tflops:
        return settings.peak_tflops * 1e12
    if settings.backend == "tpu":
        generation = by_accelerator_type(settings.accelerator_type)
        return generation.peak_bf16_tflops_per_chip * 1e12 / generation.devices_per_chip
    return None


def utilisation(trainee: Trainee, settings: FinetuneSettings, real_tokens_per_s_per_device: float) -> dict:
    flops = model_flops_per_token(*describe(trainee.model), settings.seq_len) * real_tokens_per_s_per_device
    return {"mfu": mfu(flops, peak_flops_per_device(settings)), "model_tflops_per_s_per_device": flops / 1e12}


def model_sizes(trainee: Trainee, settings: FinetuneSettings, world: int, dtype: str) -> dict:
    """Parameters trained and in all, and the memory plan (jobs/runtime/memory_plan.py) for this run per device,
    to read beside the measured peak. The model is sharded over one slice's devices (HSDP across slices)."""
    from training.model import tower_modules

    trainable, total = trainable_and_total(trainee.model)
    workload = Workload(
        devices=world // settings.num_slices, batch=settings.batch_size, seq_len=settings.seq_len,
        dtype_bytes=2 if dtype == "bfloat16" else 4, activation_checkpointing=settings.activation_checkpointing,
        lora=settings.lora, lora_rank=settings.lora_rank, loss_chunk=settings.loss_chunk,
        sequences=sequences_per_record(settings.objective),
        tower_params=sum(p.numel() for m in tower_modules(trainee.model) for p in m.parameters()),
        train_towers=settings.train_towers, **grpo_parts(settings.objective, settings.beta),
    )  # fmt: skip
    return {"trainable_params": trainable, "total_params": total,
            "memory_plan_gib": round(plan(trainee.shape, workload).total_gib, 3)}  # fmt: skip


def epoch_metrics(settings: FinetuneSettings, epoch: int, trained: dict, held_out: dict, elapsed: float,
                  world: int) -> dict:  # fmt: skip
    rows = settings.grad_accum * settings.batch_size * world * sequences_per_record(settings.objective)
    positions = trained["steps"] * rows * settings.seq_len
    return {
        "epoch": epoch,
        "loss": trained["loss"],  # over every predicted token of the epoch, all ranks
        "eval_loss": held_out.get("eval_loss"),
        "epoch_time_s": elapsed,
        "step_time_s": elapsed / max(trained["steps"], 1),
        # the walkthrough's figure: every position of every row counts, padding included
        "tokens_per_s": positions / elapsed,
        "real_tokens_per_s": trained["real_tokens"] / elapsed,
        "real_token_share": trained["real_tokens"] / max(positions, 1),
        "predicted_tokens": trained["predicted_tokens"],  # (DPO: the pairs the loss is the mean over)
        "steps": trained["steps"],
        "global_batch_rows": rows,
        "lr": trained["lr"],
        "grad_norm": trained["grad_norm"],
        "packing": settings.packing,
        "recipe": settings.recipe,
    }


# ---- resume and save --------------------------------------------------------------------------


def resume(restored, checkpointer: ShardedCheckpointer, storage_path: str, rank: int, world: int) -> RunState:
    """The training state to go on from (training_run.resumed_state): a fresh one, or the restored
    checkpoint's, with its shards (model, optimizer, RNG) loaded into place."""
    saved = read_state(restored) if restored else {}
    state = resumed_state(saved, world)
    if restored:
        if is_sharded(restored):
            checkpointer.load(uri(storage_path, restored.path), same_world=saved.get("world_size") == world)
        worker_print(f"[rank {rank}] resuming from {restored.path} after step {state.step}, epoch "
                     f"{state.epoch} done (attempt {state.attempt})")  # fmt: skip
    return state


def write_sharded(checkpointer: ShardedCheckpointer, target: str) -> tuple[Future, float]:
    """This rank's shard written under `target` (in the background when async): the write's future, and how long
    the loop waited for it (the checkpoint stall)."""
    started = time.perf_counter()
    written = checkpointer.save(target)
    return written, time.perf_counter() - started


def write_full(trainee: Trainee, filesystem, directory: str) -> float:
    """The walkthrough's checkpoint: the full model gathered on rank 0 and written as a from_pretrained directory
    at `directory` (pyarrow `filesystem`); the seconds the loop waited for all of it."""
    started = time.perf_counter()
    export_pretrained(trainee.model, trainee.tokenizer, filesystem, directory, trainee.lora)
    return time.perf_counter() - started


def save_sharded(checkpointer: ShardedCheckpointer, settings: FinetuneSettings, metrics: dict, state: dict,
                 name: str, wait: bool = False) -> None:  # fmt: skip
    """Every rank writes its shard straight into the run's storage; all ranks report it.

    Ray registers the checkpoint once this rank's write has finished (the upload function waits
    for it, in Ray's upload thread), so a restart never resumes from a half-written one. With `wait`
    (a stop), the write and the report happen before this returns, and until Ray Train's controller
    has taken the report.
    """
    import ray.train
    from ray.train import CheckpointUploadMode

    storage = ray.train.get_context().get_storage()
    directory = f"{storage.experiment_fs_path}/{name}"
    stall_started = time.perf_counter()
    written, metrics["checkpoint_stall_s"] = write_sharded(checkpointer, uri(settings.storage_path, directory))
    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint(directory, filesystem=storage.storage_filesystem),
        checkpoint_dir_name=name,
        checkpoint_upload_mode=CheckpointUploadMode.SYNC if wait else CheckpointUploadMode.ASYNC,
        delete_local_checkpoint_after_upload=False,  # it is the checkpoint in storage, not a local copy
        # a snapshot of state: the commit may run while the next steps update it
        checkpoint_upload_fn=committer(
            written, storage.storage_filesystem, dict(state) if checkpointer.rank == 0 else None
        ),
    )
    if wait:
        stopping.wait_until_taken()
        worker_print(f"[rank {checkpointer.rank}] saved {name} in {time.perf_counter() - stall_started:.1f} s")


def save_full(trainee: Trainee, metrics: dict, state: dict) -> None:
    """The walkthrough's checkpoint: the full model gathered on rank 0, written as a from_pretrained
    directory, `checkpoint_<timestamp>`, into the run's storage; all of it holds up the loop.

    Rank 0 copies it into storage itself (what Ray's synchronous upload would do inside report),
    so the stall measured is the whole wait and train_state.json can hold it.
    """
    import ray.train
    from ray.train import CheckpointUploadMode

    ctx = ray.train.get_context()
    storage = ctx.get_storage()
    name = storage.make_default_checkpoint_dir_name()
    directory = f"{storage.experiment_fs_path}/{name}"
    metrics["checkpoint_stall_s"] = write_full(trainee, storage.storage_filesystem, directory)
    checkpoint = None
    if ctx.get_world_rank() == 0:
        write_state(storage.storage_filesystem, directory, state)
        checkpoint = ray.train.Checkpoint(directory, filesystem=storage.storage_filesystem)
    ray.train.report(
        metrics, checkpoint=checkpoint, checkpoint_dir_name=name, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD
    )
