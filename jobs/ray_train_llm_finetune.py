"""Gemma 4 supervised fine-tune with Ray Train and FSDP2, one worker per TPU device.

Run it on the slice (from the working directory `jobs/`):

    ray job submit --address http://localhost:8265 --working-dir jobs -- \\
        python ray_train_llm_finetune.py --topology 4x4 --accelerator-type TPU-V6E \\
        --storage-path gs://BUCKET/ray_train_torchtpu

On N slices (a RayCluster whose TPU group has N replicas), add --num-slices N: the model is sharded within
each slice and replicated across them (HSDP, model.device_mesh); on CPU, groups of workers stand in.

On CPU with the tiny offline assets (python jobs/tiny_assets.py --out .local/assets):

    python jobs/ray_train_llm_finetune.py --backend cpu --num-workers 2 --epochs 2 \\
        --model .local/assets/model --dataset .local/assets/dolly.jsonl --split 'train[:80]' \\
        --seq-len 128 --lr 1e-3 --storage-path .local/ray_results

The default recipe is what a user would ship: each record in the model's chat template with
the prompt masked (the answer and its end-of-turn marker are trained), records packed into
full rows, one global batch per optimizer step (the loss divided by the global count of
predicted tokens; --grad-accum for a bigger one), linear warmup then cosine decay, gradient
clipping, a held-out eval after every epoch and every --eval-every steps (by default 1/16 of the
training slice's count, after it or, for a file, from its end) with greedy answers to --eval-samples of
its prompts, a chunked cross-entropy, sharded checkpoints written in the background every --save-every
steps and at each epoch's end, and the held-out task scored with lm-evaluation-harness on the base model
before the first step and on the fine-tune after the last (--eval-tasks; <run>/evaluation.json,
evaluation.py). --max-steps runs that many steps instead of --epochs.
`--recipe walkthrough` is the walkthrough's instead (padded `Instruction: ... Response: ...`
rows with the prompt in the loss, constant lr, no clipping, no eval, full logits, rank 0's full
checkpoint per epoch); single flags override either recipe. The walkthrough's flag names work
too (--model-id, --dataset-split, --num-epochs, --batch-size-per-device; --storage-path
defaults to $STORAGE_PATH). CPU runs compute in fp32, TPU and CUDA in bf16 (--dtype overrides).

Every record is read, checked, rendered and laid out in rows once, before any worker starts, under
<storage>/prepared/<key> (jobs/data/prepare.py; on a cluster's CPUs with Ray Data), for every later run with
the same inputs; bad records fail the job naming their file and line. --preflight stops there.

The same --run-name and --storage-path resume exactly where the latest checkpoint left off, mid-epoch
too (training_run.py). Ray Train restarts a failed worker group from it up to --max-failures times; a
worker sent SIGTERM first saves its step (stopping.py). The run ends with one from_pretrained
directory, <run>/model (checkpoints.py), with the tokenizer and its chat template.
Progress lines go to the log about ten times an epoch and to TensorBoard (<run>/tensorboard), the evals'
answers to <run>/samples.jsonl; metrics.jsonl and loss.png come at the end, then a summary and the last
line, `JOB_RESULT_JSON: {...}`, with the checkpoint path(s) and final metrics.
"""

from __future__ import annotations

import os
import sys
import time

from config.command_line import for_this_machine, from_args, parse_args
from config.setting_checks import check, worker_count
from config.settings import DEFAULT_RUN_PREFIX, FinetuneSettings
from data.prepared import data_report, print_data_report, with_modality
from data.render import load_tokenizer
from evaluation.before_after import before_after, read_evaluation
from evaluation.heldout_task import write_task
from runtime.backend import RESOURCES_PER_WORKER, connect_ray, get_backend, worker_print
from runtime.log_lines import (
    HARMLESS_RAY_LINE,
    closing_summary,
    devices_used,
    epoch_line,
    one_line,
    quiet_ray_reports,
    scored,
)
from runtime.outcome import JobInputError, exit_code
from runtime.run_files import (
    LOSS_PLOT,
    METRICS_FILE,
    REWARD_PLOT,
    SAMPLES_FILE,
    TENSORBOARD_DIR,
    last_samples,
    run_dir,
    sample_log,
    take_input_error,
    tensorboard,
    write_data_report,
    write_input_error,
    write_run_report,
)
from runtime.storage import probe, ray_storage, uri
from training import stopping
from training.checkpoints import (
    EXPORT_DIR,
    ShardedCheckpointer,
    export_pretrained,
    read_state,
)
from training.objectives import prepare_data, training_data
from training.recipe import Schedule
from training.rewards import RewardError
from training.training_run import Hooks, Progress, TrainingRun, log_every
from training.worker_hooks import epoch_metrics, model_sizes, resume, save_full, save_sharded, utilisation

REPORT_POLL_S = 0.5  # (the driver's settings reach the controller: Ray Train propagates them,
PREEMPTION_POLL_S = 1.0  # ray/train/v2/_internal/constants.py, ENV_VARS_TO_PROPAGATE)

__all__ = ["main", "run", "train_loop_per_worker"]


# ---- the per-worker loop ----------------------------------------------------------------------


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import torch

    from training.model import adamw, build_model

    settings: FinetuneSettings = config["settings"]  # and config["data"]: the prepared data's URI
    backend = get_backend(settings.backend)
    backend.prepare()
    quiet_ray_reports()
    dtype, device = settings.dtype or backend.compute_dtype, backend.device()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(settings.seed)
    if settings.sharded_checkpoints:
        stopping.listen()  # SIGTERM: finish the step, save it, stop (a full checkpoint could not go on from it)
    restored = ray.train.get_checkpoint()
    trainee = build_model(settings, backend, dtype, world, restored)
    optimizer = adamw(trainee, settings)
    checkpointer = ShardedCheckpointer(trainee.model, optimizer, rank, settings.async_checkpoint)
    state = resume(restored, checkpointer, settings.storage_path, rank, world)
    data = training_data(settings, trainee.tokenizer, rank, world, config["data"])
    schedule = Schedule.planned(settings, data.steps)
    progress = Progress(settings.log_every or log_every(data.steps), schedule.total_steps, rank, tensorboard(ctx, rank),
                        data.steps)  # fmt: skip
    sizes = model_sizes(trainee, settings, world, dtype)

    def epoch_metrics_of(epoch: int, trained: dict, held_out: dict, elapsed: float) -> dict:
        metrics = epoch_metrics(settings, epoch, trained, held_out, elapsed, world) | sizes
        return metrics | utilisation(trainee, settings, trained["real_tokens"] / elapsed / world) | {
            "peak_memory_gib": backend.peak_memory_gib(), "dtype": dtype, "attempt": state.attempt}  # fmt: skip

    def save(name: str, metrics: dict, at: dict, wait: bool) -> None:
        if settings.sharded_checkpoints:
            save_sharded(checkpointer, settings, metrics, at, name, wait)
        else:
            save_full(trainee, metrics, at)
        if "epoch_time_s" in metrics:  # an epoch's end: its peak is in its metrics
            if rank == 0:
                worker_print(epoch_line(metrics))
            backend.reset_peak_memory()

    hooks = Hooks(save, epoch_metrics_of, progress, sample_log(ctx, rank, state.step),
                  evaluation=before_after(ctx.get_storage(), settings, rank, progress.board))  # fmt: skip
    backend.reset_peak_memory()
    try:
        TrainingRun(trainee, optimizer, data, schedule, settings, device, rank, world, hooks).run(state)
    except RewardError as err:  # on every rank together (grpo_iteration.agreed): the driver raises it, once
        checkpointer.close()
        progress.close()
        write_input_error(ctx, rank, str(err))
        return
    finally:
        stopping.stop_listening()  # Ray ends its workers with SIGTERM too (2.60)
    checkpointer.close()
    progress.close()
    if settings.sharded_checkpoints:
        storage = ctx.get_storage()
        export_pretrained(trainee.model, trainee.tokenizer, storage.storage_filesystem,
                          f"{storage.experiment_fs_path}/{EXPORT_DIR}", trainee.lora)  # fmt: skip


# ---- the driver -------------------------------------------------------------------------------


def scaling_config(settings: FinetuneSettings, workers: int):
    from ray.train import ScalingConfig

    per_worker = RESOURCES_PER_WORKER[settings.backend]  # (what backend.await_workers checks the cluster for)
    if settings.backend == "tpu":
        return ScalingConfig(num_workers=workers, use_tpu=True, topology=settings.topology,
                             accelerator_type=settings.accelerator_type, resources_per_worker=per_worker)  # fmt: skip
    return ScalingConfig(num_workers=workers, use_gpu=settings.backend == "cuda", resources_per_worker=per_worker)


def trainer(settings: FinetuneSettings, workers: int, run_name: str, data: str, held_out: bool):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # Ray Train's controller takes the workers' reports (and so registers their checkpoints) when it
    # polls them, every 2 s by default; a worker lost just after a save would go back one more save.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(REPORT_POLL_S))
    # Its preemption watcher polls Ray's draining nodes every 5 s by default: a notice then reaches the
    # workers well inside the pods' grace (infra/cloud/capacity.py) rather than up to 5 s into it.
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", str(PREEMPTION_POLL_S))
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"settings": settings, "data": data},
        scaling_config=scaling_config(settings, workers),
        torch_config=TorchConfig(backend=get_backend(settings.backend).dist_backend),
        run_config=RunConfig(
            name=run_name,
            **ray_storage(settings.storage_path),  # gs:// with its retries bounded (storage.py)
            # The latest checkpoint is always kept besides (Ray Train resumes from it); the best by the
            # held-out loss when there is an eval, else by the training loss.
            checkpoint_config=CheckpointConfig(
                num_to_keep=1,
                checkpoint_score_attribute="eval_loss" if held_out else "loss",
                checkpoint_score_order="min",
            ),  # fmt: skip
            # A dead worker (a crash, a lost host) restarts the group from the latest checkpoint, at most
            # max_failures times. A preemption Ray saw coming (a drained node: the pods' preStop hook) is
            # counted apart, without limit: each restart goes on from the step saved at its notice.
            failure_config=FailureConfig(max_failures=settings.max_failures, max_preemption_failures=-1),
        ),
    )


def run(settings: FinetuneSettings) -> dict:
    settings = for_this_machine(check(settings))
    probe(settings.storage_path)  # the pods' identity can write there, before anything else is done
    # a job on a cluster prepares the data on its CPUs (Ray Data); otherwise in this process
    on_cluster = bool(os.environ.get("RAY_ADDRESS"))
    count = worker_count(settings)
    tokenizer = load_tokenizer(settings.tokenizer_ref)
    prepared = prepare_data(settings, tokenizer, lambda: connect_ray(count) if on_cluster else None)
    report = data_report(settings, prepared, count)
    print_data_report(report)
    settings = with_modality(settings, report)
    run_name = settings.run_name or DEFAULT_RUN_PREFIX.replace("sft", settings.objective) + str(int(time.time()))
    report_file = write_data_report(settings.storage_path, run_name, report)
    if settings.preflight:
        return {"run_name": run_name, "data_report": report, "data_report_file": report_file}
    write_task(settings, tokenizer, run_dir(settings.storage_path, run_name))  # the held-out task, for lm-eval
    if settings.objective == "grpo":  # each reward loads here, before Ray: a missing file or function is named now
        from training.grpo_objective import Grpo

        Grpo(settings)
    import ray

    connect_ray(count, workers_on=settings.backend)  # fails, naming what is missing, if it can never place them
    print(HARMLESS_RAY_LINE, flush=True)
    started = time.monotonic()
    # (GRPO's eval is a mean reward, not a loss: its checkpoints are kept by the training loss)
    held_out = bool((report.get("eval") or {}).get("records_used")) and settings.objective != "grpo"
    take_input_error(settings.storage_path, run_name)  # (one an earlier driver of this run never read)
    result = trainer(settings, count, run_name, prepared.uri, held_out).fit()
    ray.shutdown()  # prints the workers' last log lines now (Ray holds repeated ones back), not after the result
    if (bad_input := take_input_error(settings.storage_path, run_name)) is not None:
        raise JobInputError(f"{bad_input} (the run stopped there and was not retried: each retry would fail the "
                            "same way; any checkpoint it saved is kept)")  # fmt: skip
    done = outputs(settings, run_name, result, report)
    print(closing_summary(done, time.monotonic() - started, *devices_used(settings, count)), flush=True)
    return done


def outputs(settings: FinetuneSettings, run_name: str, result, report: dict) -> dict:
    """The job's result line: where the checkpoint and the run's files are, and its metrics."""
    best = [uri(settings.storage_path, c.path) for c, _ in (result.best_checkpoints or [])]
    final = result.checkpoint
    history = read_state(final)["history"] if final else []
    report_files = write_run_report(settings.storage_path, run_name, history) if history else {}
    if settings.sharded_checkpoints:
        loadable = f"{run_dir(settings.storage_path, run_name)}/{EXPORT_DIR}"
    else:
        loadable = uri(settings.storage_path, final.path) if final else None
    samples_file = f"{run_dir(settings.storage_path, run_name)}/{SAMPLES_FILE}"
    samples = last_samples(samples_file)
    for s in samples:
        print(f"sample at step {s['step']}: {one_line(s['prompt'], 80)} -> {one_line(s['completion'], 160)}{scored(s)}")
    return {
        "run_name": run_name,
        "checkpoint": loadable,
        "checkpoints": best,
        "metrics": dict(result.metrics or {}),
        "history": history,
        "loss_curve": report_files.get(LOSS_PLOT),
        "reward_curve": report_files.get(REWARD_PLOT),  # (GRPO's)
        "metrics_log": report_files.get(METRICS_FILE),
        "data_report": report,
        "tensorboard": f"{run_dir(settings.storage_path, run_name)}/{TENSORBOARD_DIR}",
        "samples": samples_file if samples else None,
        "evals": read_state(final).get("evals", []) if final else [],
        "evaluation": read_evaluation(run_dir(settings.storage_path, run_name)),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_code(lambda: run(from_args(args)))


if __name__ == "__main__":
    sys.exit(main())
