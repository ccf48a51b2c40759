"""The fine-tune's per-worker parts without Ray: one rank in this process, or several through
torch.multiprocessing, each on a gloo group over a rendezvous file.

Settings come from the job's own flag parser and recipe resolution, so a test trains exactly what
`ray_train_llm_finetune.py FLAGS` would, minus Ray Train's machinery (which the e2e tests cover).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def tiny_of_size(size: str, assets: dict, out: Path) -> dict:
    """The tiny model at another of jobs/tiny_assets.py's sizes, with the same tokenizer and data."""
    import shutil

    from transformers import AutoTokenizer

    from tiny_assets import make_model

    shutil.copytree(assets["model"], out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    make_model(out, vocab_size=len(AutoTokenizer.from_pretrained(assets["model"])), size=size)
    return {"model": str(out), "dataset": assets["dataset"]}


def settings(assets: dict, *flags: str):
    """The job's settings (a settings.FinetuneSettings) for `flags`, after the tiny model, its data and the CPU
    backend."""
    from config.command_line import from_args, parse_args

    base = ["--backend", "cpu", "--num-workers", "1", "--model", assets["model"], "--dataset", assets["dataset"],
            "--seq-len", "128", "--lr", "1e-3", "--split", "train[:80]"]  # fmt: skip
    return from_args(parse_args([*base, *flags]))


def build(settings, world: int = 1, restored=None):
    """model.build_model and its optimizer, on CPU in fp32: (trainee, optimizer)."""
    from runtime.backend import get_backend
    from training.model import adamw, build_model

    trainee = build_model(settings, get_backend("cpu"), "float32", world, restored)
    return trainee, adamw(trainee, settings)


class DirectorySaver:
    """TrainingRun's `save` hook for a test: every rank's shards and rank 0's train_state.json under
    `root`/<checkpoint name>, synchronously (a Ray Train run reports them instead)."""

    def __init__(self, checkpointer, root: str, rank: int):
        self.checkpointer, self.root, self.rank, self.saved = checkpointer, root, rank, []

    def __call__(self, name: str, metrics: dict, state: dict, wait: bool) -> None:  # state: RunState.to_json()
        import json

        self.checkpointer.save(f"{self.root}/{name}").result()
        if self.rank == 0:
            Path(self.root, name, "train_state.json").write_text(json.dumps(state))
        self.saved.append(name)


def run(settings, rank: int = 0, world: int = 1, epochs: int | None = None, on_step=None, root: str | None = None,
        resume_from: str | None = None, evaluation=None, samples=None):  # fmt: skip
    """The per-worker loop as train_loop_per_worker runs it (build, TrainingData, training_run.TrainingRun),
    without Ray: checkpoints under `root` (if given), resumed from `resume_from` (a checkpoint directory
    under it); `epochs` stops after that many epochs of the planned run; `on_step(step, result)` sees each
    step; `samples.add(step, samples)` each eval's (as run_files.SampleLog). Returns (trainee, final RunState).
    Needs an initialised process group."""
    import json

    import torch

    from training import stopping
    from training.checkpoints import ShardedCheckpointer
    from training.objectives import training_data
    from training.recipe import Schedule
    from training.training_run import Hooks, Progress, TrainingRun, resumed_state

    torch.manual_seed(settings.seed)
    if settings.sharded_checkpoints:
        stopping.listen()
    trainee, optimizer = build(settings, world)
    checkpointer = ShardedCheckpointer(trainee.model, optimizer, rank, use_async=False)
    saved = json.loads(Path(resume_from, "train_state.json").read_text()) if resume_from else {}
    if resume_from:
        checkpointer.load(resume_from, same_world=saved["world_size"] == world)
    state = resumed_state(saved, world)
    data = training_data(settings, trainee.tokenizer, rank, world)
    schedule = Schedule.planned(settings, data.steps)
    save = DirectorySaver(checkpointer, root, rank) if root else (lambda *_: None)
    hooks = Hooks(save, lambda _epoch, trained, held_out, _elapsed: trained | held_out,
                  Progress(10**9, schedule.total_steps, rank), samples, on_step=on_step, evaluation=evaluation)  # fmt: skip
    try:
        run_ = TrainingRun(trainee, optimizer, data, schedule, settings, torch.device("cpu"), rank, world, hooks)
        state = run_.run(state, epochs)
    finally:
        stopping.stop_listening()
    return trainee, state


def train(settings, rank: int = 0, world: int = 1, epochs: int | None = None, on_step=None, samples=None):
    """`run` without checkpoints: (trainee, history), each epoch's training and eval results."""
    trainee, state = run(settings, rank, world, epochs, on_step, samples=samples)
    return trainee, list(state.history)


def full_state(model) -> dict:
    """Every parameter, whole, on rank 0 (empty on the others)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _join(rank: int, world: int, rendezvous: str) -> None:
    """This process as rank `rank` of a gloo group, with the job's modules importable."""
    import sys

    import torch
    import torch.distributed as dist

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))  # (the fork server's children start in the test's directory)
    import infra.job_modules  # noqa: F401  (the one door to jobs/)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if world > 1:
        torch.set_num_threads(1)  # as Ray starts its workers (OMP_NUM_THREADS=1): ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


# What every rank imports, once in the fork server (a name that does not import is skipped there without a word:
# tests/test_packages.py imports each). Of a rank's imports, Gemma 4's modeling is about 2.7 s of CPU, `datasets`
# and peft 1 s, ray.train 0.8 s.
FORKSERVER_PRELOAD = ["tests.inprocess", "torch", "torch.distributed.fsdp", "transformers",
                      "transformers.models.gemma4.modeling_gemma4", "datasets", "peft", "training.model",
                      "training.training_run", "training.step", "data.sft_data", "ray.train"]  # fmt: skip


def _spawn(target, world: int, *args) -> object:
    """`target(rank, world, rendezvous, *args, out)` on `world` ranks (in this process for one); what rank 0
    saved to `out`."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        full = (world, os.path.join(tmp, "rendezvous"), *args, out)
        if world == 1:
            target(0, *full)
        else:
            # Forked from a fork server that imported torch and the job's modules once, not spawned (a
            # fresh interpreter importing them again, several seconds of CPU a rank); the server itself is
            # single-threaded, so nothing this process's threads hold is inherited.
            mp.set_forkserver_preload(FORKSERVER_PRELOAD)
            mp.start_processes(target, args=full, nprocs=world, join=True, start_method="forkserver")
        return torch.load(out, weights_only=False)


def _rank_main(rank: int, world: int, rendezvous: str, config, epochs: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    _join(rank, world, rendezvous)
    try:
        trainee, history = train(config, rank, world, epochs)
        state = full_state(trainee.model)
        if rank == 0:
            torch.save({"state": state, "history": history}, out)
    finally:
        dist.destroy_process_group()


def train_ranks(config, world: int, epochs: int = 1) -> dict:
    """Train on `world` gloo ranks (processes); rank 0's {"state", "history"}."""
    return _spawn(_rank_main, world, config, epochs)


class StepRecorder:
    """An on_step hook that records every step's global loss (one more all-reduce a step) and gradient norm."""

    def __init__(self):
        self.losses, self.grad_norms = [], []

    def __call__(self, step: int, result) -> None:
        from training.step import global_sum

        (loss_sum,) = global_sum(float(result.loss_sum))
        self.losses.append(loss_sum / float(result.counts[0]))  # (the step's count is global already)
        self.grad_norms.append(float(result.grad_norm))


def _each_main(rank: int, world: int, rendezvous: str, configs: list, then, out: str) -> None:
    import torch
    import torch.distributed as dist

    _join(rank, world, rendezvous)
    results = []
    for config in configs:
        recorder = StepRecorder()
        trainee, _ = run(config, rank, world, on_step=recorder)
        trained = {"model": full_state(trainee.model), "losses": recorder.losses, "grad_norms": recorder.grad_norms}
        results.append(trained)
    if then is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, then(rank, world))
        results.append(gathered)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def train_each(configs: list, world: int, then=None) -> list:
    """Each of `configs` (with --max-steps) trained in turn on the same `world` gloo ranks; rank 0's
    {"model": every parameter whole, "losses" and "grad_norms": one a step} for each. Then, if given,
    `then(rank, world)` (a module-level function) on every rank: its results, one a rank, come last."""
    return _spawn(_each_main, world, configs, then)


def notice_preemption(deadline_s: float | None) -> None:
    """What Ray Train's PreemptionWatcher does to a worker when a node of its group drains
    (ray/train/v2/_internal/execution/worker_group/worker.py, mark_preempt): a PreemptionInfo in the worker's
    train context, which jobs/training/stopping.py reads. None clears it. No Ray Train restarts the group here, so the
    wait after the save gives up at the deadline (stopping.RESTART_MARGIN_S 0)."""
    import time
    import types

    from ray.train.v2._internal.execution.context import set_train_context
    from ray.train.v2._internal.execution.preemption import PreemptionContext
    from ray.train.v2.api.preemption import PreemptionInfo

    from training import stopping

    if deadline_s is None:
        set_train_context(None)
        return
    info = PreemptionInfo(deadline_ms=int((time.time() + deadline_s) * 1000), preempted_node_to_ranks={"n": [0, 1]})
    set_train_context(types.SimpleNamespace(preemption_context=PreemptionContext(info)))
    stopping.RESTART_MARGIN_S = 0.0


class Interrupter:
    """An on_step hook that, after step `at`, sends this process SIGTERM (`how` "sigterm"), fails as a lost
    worker group would (`how` "crash"), or gets Ray Train's preemption notice (`how` "preempt", a drain with
    a 1 s deadline); it records the steps it saw."""

    def __init__(self, at: int, how: str):
        self.at, self.how, self.seen = at, how, []

    def __call__(self, step: int, result) -> None:
        import signal

        self.seen.append(step + 1)
        if step + 1 == self.at and self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if step + 1 == self.at and self.how == "crash":
            raise ConnectionError(f"lost after step {self.at}")
        if step + 1 == self.at and self.how == "preempt":
            notice_preemption(1.0)


def latest_checkpoint(root: str) -> str:
    """The checkpoint under `root` with the most steps done, as Ray Train's restart takes the latest."""
    import json

    saved = [d for d in Path(root).iterdir() if (d / "train_state.json").exists()]
    return str(max(saved, key=lambda d: json.loads((d / "train_state.json").read_text())["step"]))


def _attempts_main(rank: int, world: int, rendezvous: str, config, plan: list[dict], out: str) -> None:
    """The attempts of `plan` one after the other on this rank, as Ray Train's restarts would run them."""
    import torch
    import torch.distributed as dist

    from training import stopping

    _join(rank, world, rendezvous)
    results = []
    for step in plan:
        at, how = step.get("stop", {}).get(rank, (-1, ""))
        interrupter = Interrupter(at, how)
        resume = latest_checkpoint(step["root"]) if step.get("resume") else None
        result = {"ended": "done", "from": resume and Path(resume).name}
        try:
            trainee, state = run(config, rank, world, on_step=interrupter, root=step["root"], resume_from=resume)
            result |= {"state": state.to_json(), "model": full_state(trainee.model)}
        except (stopping.StopRequested, ConnectionError) as err:
            result["ended"] = type(err).__name__
            result["why"] = str(err)
        notice_preemption(None)
        results.append(result | {"seen": interrupter.seen})
        dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def attempts(config, world: int, plan: list[dict]) -> list[dict]:
    """Runs of `config` on `world` gloo ranks in one set of processes, one attempt after another: each
    {"root": its checkpoints, "resume": go on from the latest under root, "stop": {rank: (step, "sigterm",
    "crash" or "preempt")}}. Rank 0's results: {"ended", "why", "from", "state", "model", "seen"} each."""
    return _spawn(_attempts_main, world, config, plan)
