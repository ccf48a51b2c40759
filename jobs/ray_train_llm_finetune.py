"""Gemma 4 supervised fine-tune with Ray Train and FSDP2, one worker per TPU device.

Run it on the slice (from the working directory `jobs/`):

    ray job submit --address http://localhost:8265 --working-dir jobs -- \\
        python ray_train_llm_finetune.py --topology 4x4 --accelerator-type TPU-V6E \\
        --storage-path gs://BUCKET/ray_train_torchtpu

On CPU with the tiny offline assets (python jobs/tiny_assets.py --out .local/assets):

    python jobs/ray_train_llm_finetune.py --backend cpu --num-workers 2 --epochs 2 \\
        --model .local/assets/model --dataset .local/assets/dolly.jsonl --split train \\
        --seq-len 128 --lr 1e-3 --storage-path .local/ray_results

The walkthrough's flag names work too (--model-id, --dataset-split, --num-epochs,
--batch-size-per-device; --storage-path defaults to $STORAGE_PATH). Records are packed into
full rows by default; --no-packing pads one record per row, exactly as the walkthrough does.
CPU runs compute in fp32, TPU and CUDA in bf16 (--dtype overrides).

Re-running with the same --run-name and --storage-path resumes exactly where the latest
checkpoint left off: weights, AdamW moments, RNG and data order. Inside one job, Ray Train
restarts a failed worker group from that checkpoint up to --max-failures times.
Each epoch every rank writes its own shard (torch.distributed.checkpoint, in the background);
after the last epoch the run gets one from_pretrained directory, <run>/model (checkpoints.py
shows the layout). --no-sharded-checkpoints keeps the walkthrough's per-epoch full gather.
The run's directory also gets metrics.jsonl and loss.png at the end.
The last line is `JOB_RESULT_JSON: {...}` with the checkpoint path(s) and final metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from backend import (
    ACCELERATOR_TYPES,
    BACKENDS,
    DTYPES,
    JobInputError,
    connect_ray,
    exit_code,
    get_backend,
    resolve_num_workers,
    worker_print,
)
from checkpoints import (
    EXPORT_DIR,
    ShardedCheckpointer,
    committer,
    epoch_dir_name,
    export_pretrained,
    is_sharded,
    read_state,
    uri,
    write_state,
)
from sft_data import examples, is_local, load_instructions, model_inputs, pack_rows, tokenize_records
from utilisation import describe, mfu, model_flops_per_token

METRICS_FILE, LOSS_PLOT = "metrics.jsonl", "loss.png"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Short flags, with the walkthrough's names as aliases (--model-id, --num-epochs, ...)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", "--model-id", default="google/gemma-4-E2B-it", help="hub id or local directory")
    p.add_argument("--tokenizer", default=None, help="hub id or local directory (default: --model)")
    p.add_argument(
        "--dataset", default="databricks/databricks-dolly-15k", help="hub id or a local json/jsonl/csv/parquet"
    )
    p.add_argument("--split", "--dataset-split", default="train[:1024]")
    p.add_argument("--epochs", "--num-epochs", type=int, default=3)
    p.add_argument("--batch-size", "--batch-size-per-device", type=int, default=4, help="rows per device")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row")
    p.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack whole records into full rows, each attending only to itself (default); "
        "--no-packing pads one record per row, as the walkthrough does",
    )
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: the backend's)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per device, for MFU off TPU")
    p.add_argument("--topology", default="4x4")
    p.add_argument("--accelerator-type", default="TPU-V6E", help=f"one of {', '.join(ACCELERATOR_TYPES)}")
    p.add_argument("--backend", default="tpu", help=f"one of {', '.join(BACKENDS)}")
    p.add_argument("--num-workers", type=int, default=None, help="off TPU: how many workers")
    p.add_argument(
        "--storage-path",
        default=os.environ.get("STORAGE_PATH") or str(Path.home() / "ray_results"),
        help="local path or gs://BUCKET/prefix (default: $STORAGE_PATH, else ~/ray_results)",
    )
    p.add_argument("--run-name", default=None, help="default: torchtpu_gemma4_fsdp2_sft_<unix time>")
    p.add_argument(
        "--sharded-checkpoints",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per epoch, every rank writes its shard of model and optimizer (default); "
        "--no-sharded-checkpoints: rank 0 gathers and writes the full model, as the walkthrough does",
    )
    p.add_argument(
        "--async-checkpoint",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the sharded checkpoint while the next epoch trains (default)",
    )
    p.add_argument(
        "--max-failures", type=int, default=3, help="worker-group restarts from the latest checkpoint, per job"
    )
    return p.parse_args(argv)


# ---- model ------------------------------------------------------------------------------------


def load_model(ref: str, dtype: str = "bfloat16"):
    """In the compute dtype (so the unsharded per-layer table matches), eager attention, text only, no KV cache."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    token = os.environ.get("HF_TOKEN")
    config = AutoConfig.from_pretrained(ref, token=token)
    for tower in ("vision_config", "audio_config"):
        if hasattr(config, tower):
            setattr(config, tower, None)
    model = AutoModelForCausalLM.from_pretrained(
        ref, config=config, dtype=getattr(torch, dtype), attn_implementation="eager", token=token
    )
    model.config.use_cache = False
    return model


def language_model(model):
    return model.model.language_model


def freeze_per_layer_embeddings(model):
    """The per-layer embedding table is huge and trained no further: frozen, and kept out of FSDP."""
    table = language_model(model).embed_tokens_per_layer.weight
    table.requires_grad_(False)
    return table


def apply_fsdp(model, mesh, ignored: set, dtype: str = "bfloat16"):
    """FSDP2: each decoder layer's MLP, then the root; params in the compute dtype, fp32 gradient reduction."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    for layer in language_model(model).layers:
        fully_shard(layer.mlp, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    return model


# ---- the per-worker loop ----------------------------------------------------------------------


def peak_flops_per_device(config: dict) -> float | None:
    """The MFU denominator: --peak-tflops if given, else the TPU's table value; none off TPU."""
    if config["peak_tflops"]:
        return config["peak_tflops"] * 1e12
    if config["backend"] == "tpu":
        return ACCELERATOR_TYPES[config["accelerator_type"]].peak_flops_per_device
    return None


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    backend = get_backend(config["backend"])
    backend.prepare()
    dtype = config["dtype"] or backend.compute_dtype
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = backend.device()
    torch.manual_seed(config["seed"])

    restored = ray.train.get_checkpoint()
    model, tokenizer, optimizer = build(config, backend, dtype, world, restored)
    checkpointer = ShardedCheckpointer(model, optimizer, rank, config["async_checkpoint"])
    state = resume(restored, checkpointer, config["storage_path"], rank, world)
    frozen = language_model(model).embed_tokens_per_layer.weight
    frozen_name = next(n for n, p in model.named_parameters() if p is frozen)
    flops_per_token = model_flops_per_token(*describe(model), config["seq_len"])

    data = load_instructions(config["dataset"], config["split"])
    rows = examples(data, tokenizer, config["seq_len"], config["packing"], config["seed"])
    # The order is a function of (seed, epoch): restoring the epoch restores it.
    sampler = torch.utils.data.DistributedSampler(
        rows, num_replicas=world, rank=rank, shuffle=True, seed=config["seed"], drop_last=True
    )
    loader = torch.utils.data.DataLoader(rows, batch_size=config["batch_size"], sampler=sampler, drop_last=True)

    model.train()
    for epoch in range(state["epoch"], config["epochs"]):
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        loss, real_tokens, steps = train_epoch(model, optimizer, loader, config["packing"], device)
        # gloo has no AVG: sum over ranks, then divide.
        stats = torch.stack([loss, real_tokens])
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        elapsed = time.perf_counter() - started
        metrics = epoch_metrics(config, epoch + 1, stats[0].item() / world, stats[1].item(), steps, elapsed, world)
        model_flops_per_device = flops_per_token * stats[1].item() / elapsed / world
        metrics |= {
            "model_tflops_per_s_per_device": model_flops_per_device / 1e12,
            "mfu": mfu(model_flops_per_device, peak_flops_per_device(config)),
            "dtype": dtype,
            "attempt": state["attempt"],
        }
        # The checkpoints serialise `state` once their stall is in `metrics`.
        state |= {"epoch": epoch + 1, "history": [*state["history"], metrics]}
        if config["sharded_checkpoints"]:
            save_sharded(checkpointer, config, metrics, state)
        else:
            save_full(model, tokenizer, frozen_name, frozen, metrics, state)
        if rank == 0:
            worker_print(json.dumps({"rank": 0, **metrics}))
    checkpointer.close()
    if config["sharded_checkpoints"]:
        storage = ctx.get_storage()
        target = f"{storage.experiment_fs_path}/{EXPORT_DIR}"
        export_pretrained(model, tokenizer, frozen_name, frozen, storage.storage_filesystem, target)


def resume(restored, checkpointer: ShardedCheckpointer, storage_path: str, rank: int, world: int) -> dict:
    """The training state to go on from: a fresh one, or the restored checkpoint's, with its
    shards (model, optimizer, RNG) loaded into place; `attempt` counts the starts."""
    # (a checkpoint from before `attempt` and `world_size` were recorded lacks them)
    state = {"epoch": 0, "history": [], "attempt": 0, "world_size": world} | (read_state(restored) if restored else {})
    if restored:
        if is_sharded(restored):
            checkpointer.load(uri(storage_path, restored.path), same_world=state["world_size"] == world)
        worker_print(
            f"[rank {rank}] resuming from {restored.path} after epoch {state['epoch']} (attempt {state['attempt'] + 1})"
        )
    return state | {"attempt": state["attempt"] + 1, "world_size": world}


def build(config: dict, backend, dtype: str, world: int, restored):
    """Model (FSDP2 over all ranks, per-layer table frozen), tokenizer and AdamW.

    Weights come from --model, or from a walkthrough-style (full) checkpoint being resumed;
    a sharded checkpoint is loaded on top afterwards.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    full = restored is not None and not is_sharded(restored)
    with restored.as_directory() if full else nullcontext(None) as restored_dir:
        source = restored_dir or config["model"]
        tokenizer = AutoTokenizer.from_pretrained(config["tokenizer"] or source, token=os.environ.get("HF_TOKEN"))
        model = load_model(source, dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    frozen = freeze_per_layer_embeddings(model)
    model.to(backend.device())
    apply_fsdp(model, init_device_mesh(backend.device_type, (world,)), ignored={frozen}, dtype=dtype)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config["lr"], weight_decay=config["weight_decay"]
    )
    return model, tokenizer, optimizer


def save_sharded(checkpointer: ShardedCheckpointer, config: dict, metrics: dict, state: dict) -> None:
    """Every rank writes its shard straight into the run's storage; all ranks report it.

    Ray registers the checkpoint once this rank's write has finished (the upload function waits
    for it, in Ray's upload thread), so a restart never resumes from a half-written one.
    """
    import ray.train
    from ray.train import CheckpointUploadMode

    storage = ray.train.get_context().get_storage()
    name = epoch_dir_name(metrics["epoch"])
    directory = f"{storage.experiment_fs_path}/{name}"
    stall_started = time.perf_counter()
    written = checkpointer.save(uri(config["storage_path"], directory))
    metrics["checkpoint_stall_s"] = time.perf_counter() - stall_started
    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint(directory, filesystem=storage.storage_filesystem),
        checkpoint_dir_name=name,
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        delete_local_checkpoint_after_upload=False,  # it is the checkpoint in storage, not a local copy
        # a snapshot of state: the commit may run while the next epoch updates it
        checkpoint_upload_fn=committer(
            written, storage.storage_filesystem, dict(state) if checkpointer.rank == 0 else None
        ),
    )


def save_full(model, tokenizer, frozen_name: str, frozen, metrics: dict, state: dict) -> None:
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
    stall_started = time.perf_counter()
    export_pretrained(model, tokenizer, frozen_name, frozen, storage.storage_filesystem, directory)
    metrics["checkpoint_stall_s"] = time.perf_counter() - stall_started
    checkpoint = None
    if ctx.get_world_rank() == 0:
        write_state(storage.storage_filesystem, directory, state)
        checkpoint = ray.train.Checkpoint(directory, filesystem=storage.storage_filesystem)
    ray.train.report(
        metrics, checkpoint=checkpoint, checkpoint_dir_name=name, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD
    )


def train_epoch(model, optimizer, loader, packing: bool, device):
    """One pass over this rank's rows: (mean loss, real tokens, steps), the first two as tensors."""
    import torch

    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    real_tokens = torch.zeros((), dtype=torch.float32, device=device)
    steps = 0
    for batch in loader:
        out = model(**model_inputs(batch, packing, device))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += out.loss.detach().float()
        real_tokens += batch[1].sum().to(device, torch.float32)
        steps += 1
    return loss_sum / max(steps, 1), real_tokens, steps


def epoch_metrics(config: dict, epoch: int, loss: float, real_tokens: float, steps: int, elapsed: float, world: int):
    positions = steps * config["batch_size"] * world * config["seq_len"]
    return {
        "epoch": epoch,
        "loss": loss,
        "epoch_time_s": elapsed,
        # the walkthrough's figure: every position of every row counts, padding included
        "tokens_per_s": positions / elapsed,
        "real_tokens_per_s": real_tokens / elapsed,
        "real_token_share": real_tokens / max(positions, 1),
        "steps": steps,
        "packing": config["packing"],
    }


# ---- the driver -------------------------------------------------------------------------------


def check_storage(storage_path: str) -> None:
    import pyarrow.fs

    try:
        fs, base = pyarrow.fs.FileSystem.from_uri(storage_path)
        fs.create_dir(base, recursive=True)
        probe = f"{base.rstrip('/')}/.write_probe_{os.getpid()}"
        with fs.open_output_stream(probe) as f:
            f.write(b"ok")
        fs.delete_file(probe)
    except Exception as err:  # noqa: BLE001  (any failure to write means the same thing to the user)
        raise JobInputError(f"--storage-path {storage_path!r} cannot be written: {err}") from None


def check_inputs(args: argparse.Namespace) -> int:
    """Everything that can be wrong before a worker starts; returns the worker count.

    Local paths become absolute: the workers do not run in this directory.
    """
    get_backend(args.backend)
    workers = resolve_num_workers(args.backend, args.topology, args.accelerator_type, args.num_workers)
    for flag in ("model", "tokenizer"):
        ref = getattr(args, flag)
        if ref and is_local(ref):
            if not Path(ref).expanduser().is_dir():
                raise JobInputError(f"--{flag} {ref!r} does not exist (give a directory or a hub id)")
            setattr(args, flag, str(Path(ref).expanduser().resolve()))
    if is_local(args.dataset):
        args.dataset = str(Path(args.dataset).expanduser().resolve())
    if "://" not in args.storage_path:
        args.storage_path = str(Path(args.storage_path).expanduser().resolve())
    for flag in ("epochs", "batch_size", "seq_len"):
        if getattr(args, flag) < 1:
            raise JobInputError(f"--{flag.replace('_', '-')} must be positive (got {getattr(args, flag)})")
    if args.max_failures < 0:
        raise JobInputError(f"--max-failures must be 0 or more (got {args.max_failures}; 0 fails on the first error)")
    data = load_instructions(args.dataset, args.split)
    rows = count_rows(args, data)
    if rows < workers * args.batch_size:
        kind = "packed rows" if args.packing else "examples"
        raise JobInputError(f"{rows} {kind} are fewer than one global batch ({workers} x {args.batch_size})")
    check_storage(args.storage_path)
    return workers


def count_rows(args: argparse.Namespace, data) -> int:
    """Rows an epoch draws from: one per record, or as many as packing fills."""
    if not args.packing:
        return len(data)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model, token=os.environ.get("HF_TOKEN"))
    lengths = [len(d) for d in tokenize_records(data, tokenizer, args.seq_len)]
    return len(pack_rows(lengths, args.seq_len, args.seed))


def write_run_report(storage_path: str, run_name: str, history: list[dict]) -> dict[str, str]:
    """metrics.jsonl and loss.png (loss and real tokens/s per epoch) in the run's directory."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pyarrow.fs

    epochs = [h["epoch"] for h in history]
    fig, loss_ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    loss_ax.plot(epochs, [h["loss"] for h in history], "o-", color="tab:blue")
    loss_ax.set(xlabel="epoch", ylabel="loss (mean over ranks)", title=run_name)
    speed_ax = loss_ax.twinx()
    speed_ax.plot(epochs, [h["real_tokens_per_s"] for h in history], "s--", color="tab:orange")
    speed_ax.set_ylabel("real tokens/s", color="tab:orange")
    loss_ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)

    fs, base = pyarrow.fs.FileSystem.from_uri(storage_path)
    run_dir = f"{base.rstrip('/')}/{run_name}"
    fs.create_dir(run_dir, recursive=True)
    files = {
        METRICS_FILE: "".join(json.dumps(h, sort_keys=True) + "\n" for h in history).encode(),
        LOSS_PLOT: png.getvalue(),
    }
    for name, payload in files.items():
        with fs.open_output_stream(f"{run_dir}/{name}") as f:
            f.write(payload)
    return {name: uri(storage_path, f"{run_dir}/{name}") for name in files}


def run(args: argparse.Namespace) -> dict:
    workers = check_inputs(args)
    connect_ray(workers)
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    backend = get_backend(args.backend)
    if args.backend == "tpu":
        scaling = ScalingConfig(
            num_workers=workers,
            use_tpu=True,
            topology=args.topology,
            accelerator_type=args.accelerator_type,
            resources_per_worker={"TPU": 1},
        )
    else:
        scaling = ScalingConfig(num_workers=workers, use_gpu=args.backend == "cuda", resources_per_worker={"CPU": 1})
    run_name = args.run_name or f"torchtpu_gemma4_fsdp2_sft_{int(time.time())}"
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={k: getattr(args, k) for k in vars(args)},
        scaling_config=scaling,
        torch_config=TorchConfig(backend=backend.dist_backend),
        run_config=RunConfig(
            name=run_name,
            storage_path=args.storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute="loss", checkpoint_score_order="min"
            ),
            # A dead worker (a preempted host, a crash) restarts the group from the latest checkpoint.
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    result = trainer.fit()
    best = [uri(args.storage_path, c.path) for c, _ in (result.best_checkpoints or [])]
    final = result.checkpoint
    metrics = dict(result.metrics or {})
    history = read_state(final)["history"] if final else []
    report = write_run_report(args.storage_path, run_name, history) if history else {}
    if args.sharded_checkpoints:
        loadable = f"{args.storage_path.rstrip('/')}/{run_name}/{EXPORT_DIR}"
    else:
        loadable = uri(args.storage_path, final.path) if final else None
    return {
        "run_name": run_name,
        "checkpoint": loadable,
        "checkpoints": best,
        "metrics": metrics,
        "history": history,
        "loss_curve": report.get(LOSS_PLOT),
        "metrics_log": report.get(METRICS_FILE),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_code(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
