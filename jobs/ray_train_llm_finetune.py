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

Re-running with the same --run-name and --storage-path resumes from the latest checkpoint.
Each checkpoint directory loads with AutoModelForCausalLM/AutoTokenizer.from_pretrained;
the run's directory also gets metrics.jsonl and loss.png at the end.
The last line is `JOB_RESULT_JSON: {...}` with the checkpoint path(s) and final metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
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
)
from sft_data import examples, is_local, load_instructions, model_inputs, pack_rows, tokenize_records
from utilisation import describe, mfu, model_flops_per_token

STATE_FILE = "train_state.json"
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


def save_checkpoint(model, tokenizer, frozen_name: str, frozen, directory: str, state: dict) -> None:
    """Gather the full state (all ranks), then rank 0 writes a from_pretrained-ready directory."""
    import ray.train
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state_dict = get_model_state_dict(model, options=options)
    if ray.train.get_context().get_world_rank() == 0:
        state_dict[frozen_name] = frozen.detach().cpu()
        model.save_pretrained(directory, state_dict=state_dict)
        tokenizer.save_pretrained(directory)
        Path(directory, STATE_FILE).write_text(json.dumps(state))


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
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    backend = get_backend(config["backend"])
    backend.prepare()
    dtype = config["dtype"] or backend.compute_dtype
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = backend.device()
    torch.manual_seed(config["seed"])

    start_epoch, source, history = 0, config["model"], []
    restored = ray.train.get_checkpoint()
    with restored.as_directory() if restored else tempfile.TemporaryDirectory() as restored_dir:
        if restored:
            state = json.loads(Path(restored_dir, STATE_FILE).read_text())
            start_epoch, history, source = state["epoch"], state["history"], restored_dir
            print(f"[rank {rank}] resuming from {restored.path} after epoch {start_epoch}", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(config["tokenizer"] or source, token=os.environ.get("HF_TOKEN"))
        model = load_model(source, dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    frozen = freeze_per_layer_embeddings(model)
    frozen_name = next(n for n, p in model.named_parameters() if p is frozen)
    seq_len = config["seq_len"]
    flops_per_token = model_flops_per_token(*describe(model), seq_len)
    model.to(device)
    mesh = init_device_mesh(backend.device_type, (world,))
    apply_fsdp(model, mesh, ignored={frozen}, dtype=dtype)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config["lr"], weight_decay=config["weight_decay"]
    )

    data = load_instructions(config["dataset"], config["split"])
    rows = examples(data, tokenizer, seq_len, config["packing"], config["seed"])
    sampler = torch.utils.data.DistributedSampler(
        rows, num_replicas=world, rank=rank, shuffle=True, seed=config["seed"], drop_last=True
    )
    loader = torch.utils.data.DataLoader(rows, batch_size=config["batch_size"], sampler=sampler, drop_last=True)

    model.train()
    for epoch in range(start_epoch, config["epochs"]):
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
        }
        stall_started = time.perf_counter()
        with tempfile.TemporaryDirectory() as out_dir:
            save_checkpoint(
                model, tokenizer, frozen_name, frozen, out_dir, {"epoch": epoch + 1, "history": [*history, metrics]}
            )
            checkpoint = ray.train.Checkpoint.from_directory(out_dir) if rank == 0 else None
            # The gather and the write; Ray's copy into the run's storage (inside report) comes on top.
            metrics["checkpoint_stall_s"] = time.perf_counter() - stall_started
            history.append(metrics)
            ray.train.report(metrics, checkpoint=checkpoint)
        if rank == 0:
            print(json.dumps({"rank": 0, **metrics}), flush=True)


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
    return {name: checkpoint_uri(storage_path, f"{run_dir}/{name}") for name in files}


def checkpoint_uri(storage_path: str, path: str) -> str:
    """Ray reports paths inside the filesystem; give users the full URI back."""
    scheme = storage_path.split("://", 1)[0] + "://" if "://" in storage_path else ""
    return path if path.startswith(scheme) else scheme + path


def run(args: argparse.Namespace) -> dict:
    workers = check_inputs(args)
    connect_ray(workers)
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
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
        ),
    )
    result = trainer.fit()
    best = [checkpoint_uri(args.storage_path, c.path) for c, _ in (result.best_checkpoints or [])]
    final = result.checkpoint
    metrics = dict(result.metrics or {})
    history = []
    if final is not None:
        with final.filesystem.open_input_stream(f"{final.path}/{STATE_FILE}") as f:
            history = json.loads(f.read())["history"]
    if history and history[-1]["epoch"] == metrics.get("epoch"):
        history[-1] = metrics  # the checkpoint was written before its own stall was known
    report = write_run_report(args.storage_path, run_name, history) if history else {}
    return {
        "run_name": run_name,
        "checkpoint": checkpoint_uri(args.storage_path, final.path) if final else None,
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
