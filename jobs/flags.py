"""The fine-tune's command line: its flags, the walkthrough's aliases, their checks, and the one
typed object they become.

infra/runner/ray_jobs.job_specs writes these flags from the stack's config; this file reads them. The
flags a --recipe sets default to None in the parser and are filled in by `resolve`, so a flag given
on its own wins over the recipe.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from pathlib import Path

from backend import ACCELERATOR_TYPES, BACKENDS, DTYPES, JobInputError, get_backend, resolve_num_workers
from data_formats import DEFAULT_DATASET, OVERLONG
from recipe import RECIPES, SCHEDULES, with_recipe
from render import parse_columns
from sft_data import is_local

DEFAULT_RUN_PREFIX = "torchtpu_gemma4_fsdp2_sft_"


@dataclass(frozen=True)
class FinetuneSettings:
    """Everything the run was asked to do, built once by the driver and handed to every worker."""

    recipe: str
    model: str
    tokenizer: str | None
    dataset: str
    dataset_config: str | None
    columns: dict[str, str]  # old column name -> record-format name (parsed --columns)
    split: str
    eval_split: str
    overlong: str
    epochs: int
    batch_size: int
    grad_accum: int
    seq_len: int
    packing: bool
    chat_template: bool
    prompt_loss: bool
    lr: float
    lr_schedule: str
    warmup_ratio: float
    max_grad_norm: float
    loss_chunk: int
    save_every: int
    eval_every: int
    eval_samples: int
    max_steps: int  # 0: no cap
    activation_checkpointing: bool
    lora: bool
    lora_rank: int
    lora_alpha: int
    weight_decay: float
    seed: int
    log_every: int | None
    dtype: str | None
    peak_tflops: float | None
    topology: str
    accelerator_type: str
    backend: str
    num_workers: int | None
    num_slices: int  # TPU slices (HSDP across them: model.device_mesh)
    storage_path: str
    run_name: str | None
    sharded_checkpoints: bool
    async_checkpoint: bool
    max_failures: int
    preflight: bool
    prepare_chunk: int  # records per task of the data's preparation

    @property
    def tokenizer_ref(self) -> str:
        return self.tokenizer or self.model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Short flags, with the walkthrough's names as aliases (--model-id, --num-epochs, ...)."""
    p = argparse.ArgumentParser(description="Gemma 4 supervised fine-tune with Ray Train and FSDP2.")
    _data_flags(p)
    _recipe_flags(p)
    _run_flags(p)
    return p.parse_args(argv)


def _data_flags(p: argparse.ArgumentParser) -> None:
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


def _recipe_flags(p: argparse.ArgumentParser) -> None:
    switch = argparse.BooleanOptionalAction
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
    p.add_argument("--max-steps", type=int, default=0,
                   help="run this many optimizer steps, however many epochs that takes (overrides --epochs; the "
                        "schedule is planned for them); 0: --epochs decides")  # fmt: skip
    p.add_argument("--save-every", type=int, default=None,
                   help="(recipe) optimizer steps between checkpoints, besides each epoch's end; 0: epoch ends only")  # fmt: skip
    p.add_argument("--eval-every", type=int, default=None,
                   help="(recipe) optimizer steps between held-out evals, besides each epoch's end; 0: epoch ends only")  # fmt: skip
    p.add_argument("--eval-samples", type=int, default=None,
                   help="(recipe) held-out prompts answered greedily at each eval (samples.jsonl); 0: none")  # fmt: skip
    p.add_argument("--activation-checkpointing", action=switch, default=False,
                   help="recompute each decoder layer's activations in the backward pass (memory for compute)")  # fmt: skip
    p.add_argument("--lora", action=switch, default=False, help="train LoRA adapters only, the base frozen")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)


def _run_flags(p: argparse.ArgumentParser) -> None:
    switch = argparse.BooleanOptionalAction
    p.add_argument("--log-every", type=int, default=None, help="steps between progress lines (default ~10/epoch)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: the backend's)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per device, for MFU off TPU")
    p.add_argument("--topology", default="4x4")
    p.add_argument("--accelerator-type", default="TPU-V6E", help=f"one of {', '.join(ACCELERATOR_TYPES)}")
    p.add_argument("--backend", default="tpu", help=f"one of {', '.join(BACKENDS)}")
    p.add_argument("--num-workers", type=int, default=None, help="off TPU: how many workers")
    p.add_argument("--num-slices", type=int, default=1,
                   help="TPU slices of --topology, each a replica of the sharded model (HSDP); off TPU, groups of "
                        "--num-workers standing in for them")  # fmt: skip
    p.add_argument("--storage-path", default=os.environ.get("STORAGE_PATH") or str(Path.home() / "ray_results"),
                   help="local path or gs://BUCKET/prefix (default: $STORAGE_PATH, else ~/ray_results)")  # fmt: skip
    p.add_argument("--run-name", default=None, help=f"default: {DEFAULT_RUN_PREFIX}<unix time>")
    p.add_argument("--sharded-checkpoints", action=switch, default=None,
                   help="(recipe) per epoch every rank writes its shard; off: rank 0 writes the full model")  # fmt: skip
    p.add_argument("--async-checkpoint", action=switch, default=True, help="write shards while training goes on")
    p.add_argument("--max-failures", type=int, default=3, help="worker-group restarts from the latest checkpoint")
    p.add_argument("--preflight", action="store_true", help="check and render the data, write its report, stop")
    p.add_argument("--prepare-chunk", type=int, default=2048,
                   help="records per task of the data's preparation (in parallel once there are more than this)")  # fmt: skip


def resolve(args: argparse.Namespace) -> FinetuneSettings:
    """The run's settings: the flags, with what a flag left unset taken from --recipe."""
    values = with_recipe(vars(args), args.recipe)
    return FinetuneSettings(**values | {"columns": parse_columns(args.columns)})


def check_flags(settings: FinetuneSettings) -> None:
    """Numbers that cannot be right, each named with its flag."""
    for flag in ("epochs", "batch_size", "seq_len", "grad_accum"):
        if getattr(settings, flag) < 1:
            raise JobInputError(
                f"--{flag.replace('_', '-')} must be a positive integer (got {getattr(settings, flag)})"
            )
    if settings.max_failures < 0:
        raise JobInputError(f"--max-failures must be 0 or more (got {settings.max_failures}; 0 fails at once)")
    if not 0 <= settings.warmup_ratio < 1:
        raise JobInputError(f"--warmup-ratio must be in [0, 1) (got {settings.warmup_ratio})")
    if not settings.max_grad_norm >= 0:  # (NaN too)
        raise JobInputError(f"--max-grad-norm must be 0 (no clipping) or more (got {settings.max_grad_norm})")
    if settings.lora_rank < 1 or settings.lora_alpha < 1:
        raise JobInputError(f"--lora-rank and --lora-alpha must be positive (got {settings.lora_rank}, "
                            f"{settings.lora_alpha})")  # fmt: skip
    if settings.loss_chunk < 0:
        raise JobInputError(f"--loss-chunk must be 0 (full logits) or more (got {settings.loss_chunk})")
    if settings.prepare_chunk < 1:
        raise JobInputError(f"--prepare-chunk must be a positive integer (got {settings.prepare_chunk})")
    for flag in ("max_steps", "save_every", "eval_every", "eval_samples"):
        if getattr(settings, flag) < 0:
            raise JobInputError(f"--{flag.replace('_', '-')} must be 0 or more (got {getattr(settings, flag)})")
    if settings.save_every and not settings.sharded_checkpoints:
        raise JobInputError(
            f"--save-every {settings.save_every} needs sharded checkpoints: a full checkpoint restores the weights "
            "only, so a run could not go on from the middle of an epoch (give --sharded-checkpoints or --save-every 0)"
        )
    if settings.log_every is not None and settings.log_every < 1:
        raise JobInputError(f"--log-every must be a positive integer (got {settings.log_every})")


def check_inputs(settings: FinetuneSettings) -> tuple[FinetuneSettings, int]:
    """Everything that can be wrong before a worker starts: (the settings with local paths made absolute,
    since the workers do not run in this directory; the worker count)."""
    get_backend(settings.backend)
    workers = resolve_num_workers(settings.backend, settings.topology, settings.accelerator_type, settings.num_workers,
                                  settings.num_slices)  # fmt: skip
    absolute = {}
    for flag in ("model", "tokenizer"):
        ref = getattr(settings, flag)
        if ref and is_local(ref):
            if not Path(ref).expanduser().is_dir():
                raise JobInputError(f"--{flag} {ref!r} does not exist (give a directory or a hub id)")
            absolute[flag] = str(Path(ref).expanduser().resolve())
    if is_local(settings.dataset) and not settings.dataset.startswith("gs://"):
        absolute["dataset"] = str(Path(settings.dataset).expanduser().resolve())
    if "://" not in settings.storage_path:
        absolute["storage_path"] = str(Path(settings.storage_path).expanduser().resolve())
    settings = replace(settings, **absolute)
    check_flags(settings)
    return settings, workers
