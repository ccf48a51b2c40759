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

    from tiny_assets import make_model
    from transformers import AutoTokenizer

    shutil.copytree(assets["model"], out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    make_model(out, vocab_size=len(AutoTokenizer.from_pretrained(assets["model"])), size=size)
    return {"model": str(out), "dataset": assets["dataset"]}


def settings(assets: dict, *flags: str):
    """The job's resolved settings (a flags.FinetuneSettings) for `flags`, after the tiny model, its data
    and the CPU backend."""
    from flags import parse_args, resolve

    base = ["--backend", "cpu", "--num-workers", "1", "--model", assets["model"], "--dataset", assets["dataset"],
            "--seq-len", "128", "--lr", "1e-3", "--split", "train[:80]"]  # fmt: skip
    return resolve(parse_args([*base, *flags]))


def build(settings, world: int = 1, restored=None):
    """model.build_model and its optimizer, on CPU in fp32: (trainee, optimizer)."""
    from backend import get_backend
    from model import adamw, build_model

    trainee = build_model(settings, get_backend("cpu"), "float32", world, restored)
    return trainee, adamw(trainee, settings)


def train(settings, rank: int = 0, world: int = 1, epochs: int | None = None, progress=None):
    """build + TrainingData + train_epoch (+ evaluate) as train_loop_per_worker runs them;
    returns (trainee, history). Needs an initialised process group."""
    import torch
    from loop import Progress, TrainingData, evaluate, train_epoch

    torch.manual_seed(settings.seed)
    trainee, optimizer = build(settings, world)
    data = TrainingData(settings, trainee.tokenizer, rank, world)
    schedule = data.schedule(settings)
    progress = progress or Progress(10**9, schedule.total_steps, rank)
    history = []
    for epoch in range(epochs or settings.epochs):
        data.sampler.set_epoch(epoch)
        result = train_epoch(trainee.loss, optimizer, data.loader, schedule, epoch * data.steps, settings,
                             torch.device("cpu"), progress)  # fmt: skip
        if data.eval is not None:
            result |= evaluate(trainee.loss, data.eval, settings.batch_size, settings.packing, rank, world,
                               torch.device("cpu"))  # fmt: skip
        history.append(result)
    return trainee, history


def full_state(model) -> dict:
    """Every parameter, whole, on rank 0 (empty on the others)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _rank_main(rank: int, world: int, rendezvous: str, config: dict, epochs: int, out: str) -> None:
    import sys

    import torch
    import torch.distributed as dist

    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "jobs")]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if world > 1:
        torch.set_num_threads(1)  # as Ray starts its workers (OMP_NUM_THREADS=1): ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        trainee, history = train(config, rank, world, epochs)
        state = full_state(trainee.model)
        if rank == 0:
            torch.save({"state": state, "history": history}, out)
    finally:
        dist.destroy_process_group()


def train_ranks(config: dict, world: int, epochs: int = 1) -> dict:
    """Train on `world` gloo ranks (processes); rank 0's {"state", "history"}."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        args = (world, os.path.join(tmp, "rendezvous"), config, epochs, out)
        if world == 1:
            _rank_main(0, *args)
        else:
            mp.spawn(_rank_main, args=args, nprocs=world, join=True)
        return torch.load(out, weights_only=False)
