"""Gemma 4 supervised fine-tune with Ray Train and FSDP2, one worker per TPU device.

Run it on the slice (from the working directory `jobs/`):

    ray job submit --address http://localhost:8265 --working-dir jobs -- \\
        python ray_train_llm_finetune.py --topology 4x4 --accelerator-type TPU-V6E \\
        --storage-path gs://BUCKET/ray_train_torchtpu

On CPU with the tiny offline assets (python jobs/tiny_assets.py --out .local/assets):

    python jobs/ray_train_llm_finetune.py --backend cpu --num-workers 2 --epochs 2 \\
        --model .local/assets/model --dataset .local/assets/dolly.jsonl --split 'train[:80]' \\
        --seq-len 128 --lr 1e-3 --storage-path .local/ray_results

The default recipe is what a user would ship: each record in the model's chat template with
the prompt masked (the answer and its end-of-turn marker are trained), records packed into
full rows, one global batch per optimizer step (the loss divided by the global count of
predicted tokens; --grad-accum for a bigger one), linear warmup then cosine decay, gradient
clipping, a held-out eval after every epoch (by default the records after the training slice),
a chunked cross-entropy, and sharded checkpoints written in the background.
`--recipe walkthrough` is the walkthrough's instead (padded `Instruction: ... Response: ...`
rows with the prompt in the loss, constant lr, no clipping, no eval, full logits, rank 0's full
checkpoint per epoch); single flags override either recipe. The walkthrough's flag names work
too (--model-id, --dataset-split, --num-epochs, --batch-size-per-device; --storage-path
defaults to $STORAGE_PATH). CPU runs compute in fp32, TPU and CUDA in bf16 (--dtype overrides).

Every record is read, checked and rendered by the driver before any worker starts: a bad one
fails the job naming its file and row. --preflight stops there (the job resource runs it on the
head before it scales the slice up). The run's directory gets data_report.json.

Re-running with the same --run-name and --storage-path resumes exactly where the latest
checkpoint left off: weights, AdamW moments, RNG and data order. Inside one job, Ray Train
restarts a failed worker group from that checkpoint up to --max-failures times. After the last
epoch the run gets one from_pretrained directory, <run>/model (checkpoints.py shows the layout),
with the tokenizer and its chat template. Progress lines go to the log about ten times an epoch
and to TensorBoard under <run>/tensorboard; metrics.jsonl and loss.png come at the end.
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
from types import MethodType

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
from data_formats import DEFAULT_DATASET, OVERLONG
from loop import Progress, Schedule, evaluate, log_every, steps_per_epoch, train_epoch
from lora import apply_lora, trainable_and_total
from memory_plan import Recipe as MemoryRecipe
from memory_plan import plan, shape_of
from recipe import RECIPES, SCHEDULES, token_loss_sum, with_recipe
from render import end_of_turn_id, parse_columns, require_chat_template
from sft_data import Docs, examples, is_local, render_ranges, splits
from utilisation import describe, mfu, model_flops_per_token

METRICS_FILE, LOSS_PLOT, DATA_REPORT, TENSORBOARD_DIR = "metrics.jsonl", "loss.png", "data_report.json", "tensorboard"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Short flags, with the walkthrough's names as aliases (--model-id, --num-epochs, ...).
    Flags a --recipe sets default to None here and are filled in by `resolve`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    switch = argparse.BooleanOptionalAction
    p.add_argument("--recipe", choices=RECIPES, default="default", help="the defaults below marked (recipe)")
    p.add_argument("--model", "--model-id", default="google/gemma-4-E2B-it", help="hub id or local directory")
    p.add_argument("--tokenizer", default=None, help="hub id or local directory (default: --model)")
    p.add_argument("--dataset", default=DEFAULT_DATASET,
                   help="hub id; or a json/jsonl/csv/parquet file, directory or glob, local or gs://")  # fmt: skip
    p.add_argument("--dataset-config", default=None, help="the hub dataset's configuration name")
    p.add_argument("--columns", default=None, help="rename columns: NEW=OLD[,NEW=OLD], e.g. prompt=question")
    p.add_argument("--split", "--dataset-split", default="train[:1024]")
    p.add_argument("--eval-split", default=None,
                   help="(recipe) held-out split; auto: the records after --split's slice; none: no eval")  # fmt: skip
    p.add_argument("--overlong", choices=OVERLONG, default=OVERLONG[0], help="records longer than --seq-len")
    p.add_argument("--epochs", "--num-epochs", type=int, default=3)
    p.add_argument("--batch-size", "--batch-size-per-device", type=int, default=4, help="rows per device")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row")
    p.add_argument("--packing", action=switch, default=None, help="(recipe) pack whole records into full rows")
    p.add_argument("--chat-template", action=switch, default=None, help="(recipe) render with the chat template")
    p.add_argument("--prompt-loss", action=switch, default=None, help="(recipe) train on the prompt tokens too")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate")
    p.add_argument("--lr-schedule", choices=SCHEDULES, default=None, help="(recipe) after the warmup")
    p.add_argument("--warmup-ratio", type=float, default=None, help="(recipe) share of the steps warming up")
    p.add_argument("--max-grad-norm", type=float, default=None, help="(recipe) clip to this norm; 0: no clipping")
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="(recipe) tokens per chunk of the cross-entropy; 0: the full logits at once")  # fmt: skip
    p.add_argument(
        "--activation-checkpointing",
        action=switch,
        default=False,
        help="recompute each decoder layer's activations in the backward pass (memory for compute)",
    )
    p.add_argument("--lora", action=switch, default=False, help="train LoRA adapters only, the base frozen")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-every", type=int, default=None, help="steps between progress lines (default ~10/epoch)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: the backend's)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per device, for MFU off TPU")
    p.add_argument("--topology", default="4x4")
    p.add_argument("--accelerator-type", default="TPU-V6E", help=f"one of {', '.join(ACCELERATOR_TYPES)}")
    p.add_argument("--backend", default="tpu", help=f"one of {', '.join(BACKENDS)}")
    p.add_argument("--num-workers", type=int, default=None, help="off TPU: how many workers")
    p.add_argument("--storage-path", default=os.environ.get("STORAGE_PATH") or str(Path.home() / "ray_results"),
                   help="local path or gs://BUCKET/prefix (default: $STORAGE_PATH, else ~/ray_results)")  # fmt: skip
    p.add_argument("--run-name", default=None, help="default: torchtpu_gemma4_fsdp2_sft_<unix time>")
    p.add_argument("--sharded-checkpoints", action=switch, default=None,
                   help="(recipe) per epoch every rank writes its shard; off: rank 0 writes the full model")  # fmt: skip
    p.add_argument("--async-checkpoint", action=switch, default=True, help="write shards while training goes on")
    p.add_argument("--max-failures", type=int, default=3, help="worker-group restarts from the latest checkpoint")
    p.add_argument("--preflight", action="store_true", help="check and render the data, write its report, stop")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> dict:
    """The run's settings: the flags, with what a flag left unset taken from --recipe."""
    settings = with_recipe(vars(args), args.recipe)
    settings["columns"] = parse_columns(args.columns)
    return settings


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
    return getattr(model.model, "language_model", model.model)


def freeze_per_layer_embeddings(model):
    """The per-layer embedding table is huge and trained no further: frozen, and kept out of FSDP."""
    table = language_model(model).embed_tokens_per_layer.weight
    table.requires_grad_(False)
    return table


def apply_fsdp(model, mesh, ignored: set, dtype: str = "bfloat16"):
    """FSDP2: each decoder layer, then the root; params in the compute dtype, fp32 gradient reduction.

    Each whole decoder layer is a unit (torchtitan's layout): only two are unsharded at a time. (The
    walkthrough shards only the MLPs, which leaves every attention projection in the root, gathered
    for the whole step: 15 GB of a 32 GB v6e chip for 31B.) Gradients are summed over ranks, not
    averaged: the loss is already divided by the global count of predicted tokens (loop.train_step),
    so an average would divide a second time.
    """
    import torch
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    for layer in language_model(model).layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # SUM, which every backend has (gloo has no AVG)
    return model


def apply_activation_checkpointing(model) -> None:
    """Recompute every decoder layer in the backward pass (transformers' non-reentrant checkpointing of
    its GradientCheckpointingLayer, applied before FSDP so the recomputation gathers the layer again,
    as torchtitan composes them)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def loss_forward(self, input_ids, labels, attention_mask=None, position_ids=None):
    """The model's forward in training: the sum of its token losses. It runs inside the FSDP root's
    forward (so the tied head is the root's unsharded weight, no copy) and never returns the logits."""
    out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    softcap = self.config.get_text_config().final_logit_softcapping
    return token_loss_sum(out.last_hidden_state, self.lm_head.weight, labels, softcap, self.loss_chunk)


def use_loss_forward(model, loss_chunk: int):
    """`model(...)` returns the summed token loss (loss_chunk tokens of logits at a time; 0: all)."""
    model.loss_chunk = loss_chunk
    model.forward = MethodType(loss_forward, model)
    return model


def stop_at_end_of_turn(model, tokenizer) -> None:
    """generate() stops at the chat template's end-of-turn token as well as at EOS."""
    end = end_of_turn_id(tokenizer)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if end is not None and end not in eos:
        model.generation_config.eos_token_id = [*eos, end]


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

    backend = get_backend(config["backend"])
    backend.prepare()
    dtype, device = config["dtype"] or backend.compute_dtype, backend.device()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(config["seed"])
    restored = ray.train.get_checkpoint()
    model, tokenizer, optimizer = build(config, backend, dtype, world, restored)
    checkpointer = ShardedCheckpointer(model, optimizer, rank, config["async_checkpoint"])
    state = resume(restored, checkpointer, config["storage_path"], rank, world)
    data = TrainingData(config, tokenizer, rank, world)
    schedule, flops_per_token = data.schedule(config), model_flops_per_token(*describe(model), config["seq_len"])
    sizes = model_sizes(model, config, world, dtype)
    progress = Progress(config["log_every"] or log_every(data.steps), schedule.total_steps, rank, device,
                        tensorboard(ctx, rank))  # fmt: skip
    for epoch in range(state["epoch"], config["epochs"]):
        data.sampler.set_epoch(epoch)  # the order is a function of (seed, epoch): restoring the epoch restores it
        backend.reset_peak_memory()
        started = time.perf_counter()
        trained = train_epoch(model, optimizer, data.loader, schedule, epoch * data.steps, config, device, progress)
        elapsed = time.perf_counter() - started
        held_out = {}
        if data.eval is not None:
            held_out = evaluate(model, data.eval, config["batch_size"], config["packing"], rank, world, device)
        metrics = epoch_metrics(config, epoch + 1, trained, held_out, elapsed, world) | {
            "mfu": mfu(flops_per_token * trained["real_tokens"] / elapsed / world, peak_flops_per_device(config)),
            "model_tflops_per_s_per_device": flops_per_token * trained["real_tokens"] / elapsed / world / 1e12,
            "peak_memory_gib": backend.peak_memory_gib(), "dtype": dtype, "attempt": state["attempt"], **sizes,
        }  # fmt: skip
        progress.epoch(metrics)
        # The checkpoints serialise `state` once their stall is in `metrics`.
        state |= {"epoch": epoch + 1, "history": [*state["history"], metrics]}
        if config["sharded_checkpoints"]:
            save_sharded(checkpointer, config, metrics, state)
        else:
            save_full(model, tokenizer, metrics, state)
        if rank == 0:
            worker_print(json.dumps({"rank": 0, **metrics}))
    checkpointer.close()
    progress.close()
    if config["sharded_checkpoints"]:
        storage = ctx.get_storage()
        export_pretrained(model, tokenizer, storage.storage_filesystem, f"{storage.experiment_fs_path}/{EXPORT_DIR}")


def model_sizes(model, config: dict, world: int, dtype: str) -> dict:
    """Parameters trained and in all, and the memory plan (jobs/memory_plan.py) for this run per device,
    to read beside the measured peak."""
    trainable, total = trainable_and_total(model)
    recipe = MemoryRecipe(
        devices=world, batch=config["batch_size"], seq_len=config["seq_len"], dtype_bytes=2 if dtype == "bfloat16" else 4,
        activation_checkpointing=config["activation_checkpointing"], lora=config["lora"],
        lora_rank=config["lora_rank"], loss_chunk=config["loss_chunk"],
    )  # fmt: skip
    return {"trainable_params": trainable, "total_params": total,
            "memory_plan_gib": round(plan(model.memory_shape, recipe).total_gib, 3)}  # fmt: skip


class TrainingData:
    """This rank's loader over the training rows (sharded, shuffled by seed and epoch), the eval rows,
    and the steps an epoch takes. Every rank renders the same records the same way."""

    def __init__(self, config: dict, tokenizer, rank: int, world: int):
        import torch

        train, held_out = prepare_docs(config, tokenizer)
        pad = tokenizer.pad_token_id
        side = getattr(tokenizer, "padding_side", "right")
        rows = examples(train.items, config["seq_len"], config["packing"], pad, config["seed"], side)
        self.sampler = torch.utils.data.DistributedSampler(
            rows, num_replicas=world, rank=rank, shuffle=True, seed=config["seed"], drop_last=True
        )
        self.loader = torch.utils.data.DataLoader(
            rows, batch_size=config["batch_size"], sampler=self.sampler, drop_last=True
        )
        self.steps = steps_per_epoch(len(self.loader), config["grad_accum"])
        self.eval = (
            examples(held_out.items, config["seq_len"], config["packing"], pad, config["seed"], side)
            if held_out.items
            else None
        )

    def schedule(self, config: dict) -> Schedule:
        return Schedule(config["lr"], config["lr_schedule"], config["warmup_ratio"], self.steps * config["epochs"])


def prepare_docs(config: dict, tokenizer) -> tuple[Docs, Docs]:
    """The training and eval records, checked, rendered and tokenized."""
    if config["chat_template"]:
        require_chat_template(tokenizer, config["tokenizer"] or config["model"])
    train, held_out, loaded = splits(config)
    return render_ranges(train, loaded, tokenizer, config), render_ranges(held_out, loaded, tokenizer, config)


def tensorboard(ctx, rank: int):
    """Rank 0's TensorBoard writer, into a local directory that Progress copies to <run>/tensorboard."""
    if rank != 0:
        return None
    import hashlib
    import shutil
    import tempfile

    from torch.utils.tensorboard import SummaryWriter

    storage = ctx.get_storage()
    target = f"{storage.experiment_fs_path}/{TENSORBOARD_DIR}"
    # One local directory per run: a restart after a lost worker clears the one its killed attempt left.
    local = Path(tempfile.gettempdir()) / f"tensorboard-{hashlib.sha256(target.encode()).hexdigest()[:16]}"
    shutil.rmtree(local, ignore_errors=True)
    writer = SummaryWriter(log_dir=str(local))
    writer.target = (storage.storage_filesystem, target)
    return writer


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
    """Model (FSDP2 over all ranks, per-layer table frozen, LoRA and activation checkpointing if asked,
    forward = summed token loss), tokenizer, AdamW over what is trainable.

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
    if config["chat_template"]:
        stop_at_end_of_turn(model, tokenizer)
    frozen = freeze_per_layer_embeddings(model)
    model.memory_shape = shape_of(model)  # before LoRA: the plan adds the adapters itself
    if config["lora"]:
        apply_lora(model, config["lora_rank"], config["lora_alpha"])
    if config["activation_checkpointing"]:
        apply_activation_checkpointing(model)
    model.to(backend.device())
    apply_fsdp(model, init_device_mesh(backend.device_type, (world,)), ignored={frozen}, dtype=dtype)
    use_loss_forward(model, config["loss_chunk"])
    model.train()  # (from_pretrained gives eval mode, where transformers skips activation checkpointing)
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


def save_full(model, tokenizer, metrics: dict, state: dict) -> None:
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
    export_pretrained(model, tokenizer, storage.storage_filesystem, directory)
    metrics["checkpoint_stall_s"] = time.perf_counter() - stall_started
    checkpoint = None
    if ctx.get_world_rank() == 0:
        write_state(storage.storage_filesystem, directory, state)
        checkpoint = ray.train.Checkpoint(directory, filesystem=storage.storage_filesystem)
    ray.train.report(
        metrics, checkpoint=checkpoint, checkpoint_dir_name=name, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD
    )


def epoch_metrics(config: dict, epoch: int, trained: dict, held_out: dict, elapsed: float, world: int) -> dict:
    positions = trained["steps"] * config["grad_accum"] * config["batch_size"] * world * config["seq_len"]
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
        "predicted_tokens": trained["predicted_tokens"],
        "steps": trained["steps"],
        "global_batch_rows": config["grad_accum"] * config["batch_size"] * world,
        "lr": trained["lr"],
        "grad_norm": trained["grad_norm"],
        "packing": config["packing"],
        "recipe": config["recipe"],
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


def check_flags(settings: dict) -> None:
    """Numbers that cannot be right, each named with its flag."""
    for flag in ("epochs", "batch_size", "seq_len", "grad_accum"):
        if settings[flag] < 1:
            raise JobInputError(f"--{flag.replace('_', '-')} must be a positive integer (got {settings[flag]})")
    if settings["max_failures"] < 0:
        raise JobInputError(f"--max-failures must be 0 or more (got {settings['max_failures']}; 0 fails at once)")
    if not 0 <= settings["warmup_ratio"] < 1:
        raise JobInputError(f"--warmup-ratio must be in [0, 1) (got {settings['warmup_ratio']})")
    if not settings["max_grad_norm"] >= 0:  # (NaN too)
        raise JobInputError(f"--max-grad-norm must be 0 (no clipping) or more (got {settings['max_grad_norm']})")
    if settings["lora_rank"] < 1 or settings["lora_alpha"] < 1:
        raise JobInputError(f"--lora-rank and --lora-alpha must be positive (got {settings['lora_rank']}, "
                            f"{settings['lora_alpha']})")  # fmt: skip
    if settings["loss_chunk"] < 0:
        raise JobInputError(f"--loss-chunk must be 0 (full logits) or more (got {settings['loss_chunk']})")
    if settings["log_every"] is not None and settings["log_every"] < 1:
        raise JobInputError(f"--log-every must be a positive integer (got {settings['log_every']})")


def check_inputs(settings: dict) -> int:
    """Everything that can be wrong before a worker starts; returns the worker count.

    Local paths become absolute: the workers do not run in this directory.
    """
    get_backend(settings["backend"])
    workers = resolve_num_workers(
        settings["backend"], settings["topology"], settings["accelerator_type"], settings["num_workers"]
    )
    for flag in ("model", "tokenizer"):
        ref = settings[flag]
        if ref and is_local(ref):
            if not Path(ref).expanduser().is_dir():
                raise JobInputError(f"--{flag} {ref!r} does not exist (give a directory or a hub id)")
            settings[flag] = str(Path(ref).expanduser().resolve())
    if is_local(settings["dataset"]) and not settings["dataset"].startswith("gs://"):
        settings["dataset"] = str(Path(settings["dataset"]).expanduser().resolve())
    if "://" not in settings["storage_path"]:
        settings["storage_path"] = str(Path(settings["storage_path"]).expanduser().resolve())
    check_flags(settings)
    return workers


def data_report(settings: dict, workers: int) -> dict:
    """Reads, checks and renders every record (errors name the file and row), on this machine's CPU,
    and says what the run will train on; fails if the data does not fill one global batch."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        settings["tokenizer"] or settings["model"], token=os.environ.get("HF_TOKEN")
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train, held_out = prepare_docs(settings, tokenizer)
    rows = len(
        examples(train.items, settings["seq_len"], settings["packing"], tokenizer.pad_token_id, settings["seed"])
    )
    needed = workers * settings["batch_size"] * settings["grad_accum"]
    if rows < needed:
        kind = "packed rows" if settings["packing"] else "records"
        raise JobInputError(f"{rows} {kind} are fewer than one global batch ({workers} workers x "
                            f"{settings['batch_size']} rows x {settings['grad_accum']} accumulation = {needed})")  # fmt: skip
    report = {
        "dataset": settings["dataset"],
        "split": settings["split"],
        "eval_split": settings["eval_split"],
        "chat_template": settings["chat_template"],
        "overlong": settings["overlong"],
        "train": train.report(),
        "eval": held_out.report() if held_out.read else None,
        "train_rows": rows,
        "steps_per_epoch": rows // needed,
    }
    return report


def print_data_report(report: dict) -> None:
    t = report["train"]
    print(
        f"data: {t['records_read']} training records ({t['format']}) from {report['dataset']} ({report['split']}), "
        f"{t['records_used']} used ({t['truncated']} truncated, {t['dropped']} dropped at --seq-len); "
        f"{t['tokens']:,} tokens, {t['predicted_share']:.1%} of them trained on; longest "
        f"{t['longest_record_tokens']} tokens ({t['longest_record']}); {report['train_rows']} rows, "
        f"{report['steps_per_epoch']} steps an epoch",
        flush=True,
    )
    e = report["eval"]
    print(f"eval: {e['records_used']} held-out records, {e['predicted_tokens']:,} tokens scored"
          if e else "eval: none", flush=True)  # fmt: skip


def write_run_files(storage_path: str, run_name: str, files: dict[str, bytes]) -> dict[str, str]:
    import pyarrow.fs

    fs, base = pyarrow.fs.FileSystem.from_uri(storage_path)
    run_dir = f"{base.rstrip('/')}/{run_name}"
    fs.create_dir(run_dir, recursive=True)
    for name, payload in files.items():
        with fs.open_output_stream(f"{run_dir}/{name}") as f:
            f.write(payload)
    return {name: uri(storage_path, f"{run_dir}/{name}") for name in files}


def loss_plot(run_name: str, history: list[dict]) -> bytes:
    """Training and eval loss, and real tokens/s, per epoch."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, loss_ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    loss_ax.plot(epochs, [h["loss"] for h in history], "o-", color="tab:blue", label="train")
    if any(h.get("eval_loss") is not None for h in history):
        loss_ax.plot(epochs, [h.get("eval_loss") for h in history], "^-", color="tab:green", label="eval")
    loss_ax.set(xlabel="epoch", ylabel="loss per predicted token", title=run_name)
    loss_ax.legend(loc="upper left")
    speed_ax = loss_ax.twinx()
    speed_ax.plot(epochs, [h["real_tokens_per_s"] for h in history], "s--", color="tab:orange")
    speed_ax.set_ylabel("real tokens/s", color="tab:orange")
    loss_ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return png.getvalue()


def write_run_report(storage_path: str, run_name: str, history: list[dict]) -> dict[str, str]:
    """metrics.jsonl and loss.png in the run's directory."""
    return write_run_files(storage_path, run_name, {
        METRICS_FILE: "".join(json.dumps(h, sort_keys=True) + "\n" for h in history).encode(),
        LOSS_PLOT: loss_plot(run_name, history),
    })  # fmt: skip


def scaling_config(settings: dict, workers: int):
    from ray.train import ScalingConfig

    if settings["backend"] == "tpu":
        return ScalingConfig(
            num_workers=workers,
            use_tpu=True,
            topology=settings["topology"],
            accelerator_type=settings["accelerator_type"],
            resources_per_worker={"TPU": 1},
        )
    return ScalingConfig(num_workers=workers, use_gpu=settings["backend"] == "cuda", resources_per_worker={"CPU": 1})


def run(settings: dict) -> dict:
    workers = check_inputs(settings)
    report = data_report(settings, workers)
    print_data_report(report)
    run_name = settings["run_name"] or f"torchtpu_gemma4_fsdp2_sft_{int(time.time())}"
    check_storage(settings["storage_path"])
    files = write_run_files(settings["storage_path"], run_name, {DATA_REPORT: json.dumps(report, indent=1).encode()})
    if settings["preflight"]:
        return {"run_name": run_name, "data_report": report, "data_report_file": files[DATA_REPORT]}
    connect_ray(workers)
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=settings,
        scaling_config=scaling_config(settings, workers),
        torch_config=TorchConfig(backend=get_backend(settings["backend"]).dist_backend),
        run_config=RunConfig(
            name=run_name,
            storage_path=settings["storage_path"],
            checkpoint_config=CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute="loss", checkpoint_score_order="min"
            ),
            # A dead worker (a preempted host, a crash) restarts the group from the latest checkpoint.
            failure_config=FailureConfig(max_failures=settings["max_failures"]),
        ),
    )
    result = trainer.fit()
    best = [uri(settings["storage_path"], c.path) for c, _ in (result.best_checkpoints or [])]
    final = result.checkpoint
    history = read_state(final)["history"] if final else []
    report_files = write_run_report(settings["storage_path"], run_name, history) if history else {}
    if settings["sharded_checkpoints"]:
        loadable = f"{settings['storage_path'].rstrip('/')}/{run_name}/{EXPORT_DIR}"
    else:
        loadable = uri(settings["storage_path"], final.path) if final else None
    return {
        "run_name": run_name,
        "checkpoint": loadable,
        "checkpoints": best,
        "metrics": dict(result.metrics or {}),
        "history": history,
        "loss_curve": report_files.get(LOSS_PLOT),
        "metrics_log": report_files.get(METRICS_FILE),
        "data_report": report,
        "tensorboard": f"{settings['storage_path'].rstrip('/')}/{run_name}/{TENSORBOARD_DIR}",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_code(lambda: run(resolve(args)))


if __name__ == "__main__":
    sys.exit(main())
