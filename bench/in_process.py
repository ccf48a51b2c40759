"""A bench run of the job's flags on one gloo rank in this process, without Ray (`--in-process`): the job's
settings, model, data, TrainingRun, epoch metrics and checkpoint writes, minus Ray Train's workers, controller and
reports. A quick look, and the suite's smokes; the job itself on Ray is `make bench`'s default."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def one_gloo_rank():
    """This process as the only rank of a gloo group, as a Ray Train worker of a one-worker run is."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as rendezvous:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/pg", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def run_here(argv: list[str], name: str, flags: tuple[str, ...]) -> dict:
    """The job's run of `argv` (its flags, --storage-path and --run-name among them) on one gloo rank here. Each
    checkpoint is written as train_loop_per_worker writes it (worker_hooks.write_sharded, or write_full for the
    walkthrough's), under the run's directory, and a sharded run exports its model at the end: the job's result's
    {"metrics", "history", "checkpoint", "checkpoints"}."""
    import pyarrow.fs
    import torch

    from config.command_line import from_args, parse_args
    from runtime.backend import get_backend
    from training.checkpoints import EXPORT_DIR, ShardedCheckpointer, export_pretrained
    from training.model import adamw, build_model
    from training.objectives import training_data
    from training.recipe import Schedule
    from training.training_run import Hooks, Progress, TrainingRun, resumed_state
    from training.worker_hooks import epoch_metrics, write_full, write_sharded

    settings = from_args(parse_args(argv))
    run_dir = Path(settings.storage_path, settings.run_name)
    backend, local = get_backend("cpu"), pyarrow.fs.LocalFileSystem()
    print(f"running {name} ({' '.join(flags)}) in this process ...", flush=True)
    with one_gloo_rank():
        torch.manual_seed(settings.seed)
        trainee = build_model(settings, backend, "float32", 1, None)
        optimizer = adamw(trainee, settings)
        checkpointer = ShardedCheckpointer(trainee.model, optimizer, 0, settings.async_checkpoint)
        data = training_data(settings, trainee.tokenizer, 0, 1)
        schedule = Schedule.planned(settings, data.steps)
        checkpoints: list[str] = []

        def metrics(epoch: int, trained: dict, held_out: dict, elapsed: float) -> dict:
            return epoch_metrics(settings, epoch, trained, held_out, elapsed, 1) | {
                "peak_memory_gib": backend.peak_memory_gib()}  # fmt: skip

        def save(checkpoint: str, at: dict, _state: dict, _wait: bool) -> None:
            directory = str(run_dir / checkpoint)
            if settings.sharded_checkpoints:
                _, at["checkpoint_stall_s"] = write_sharded(checkpointer, directory)
            else:
                at["checkpoint_stall_s"] = write_full(trainee, local, directory)
            checkpoints.append(directory)
            backend.reset_peak_memory()

        hooks = Hooks(save, metrics, Progress(10**9, schedule.total_steps, 0))
        backend.reset_peak_memory()
        run = TrainingRun(trainee, optimizer, data, schedule, settings, torch.device("cpu"), 0, 1, hooks)
        history = list(run.run(resumed_state({}, 1)).history)
        checkpointer.close()
        export = checkpoints[-1]
        if settings.sharded_checkpoints:
            export = str(run_dir / EXPORT_DIR)
            export_pretrained(trainee.model, trainee.tokenizer, local, export, trainee.lora)
    return {"metrics": history[-1], "history": history, "checkpoint": export, "checkpoints": checkpoints}
