"""`make bench`: the walkthrough's fine-tune recipe against this project's default, side by side.

Every run is the real job (jobs/ray_train_llm_finetune.py) on one local Ray head, with the
same seed and workers. Two comparisons:

1. Throughput: the same random Gemma 4 (`bench` size) and Dolly-shaped data under the
   walkthrough's recipe (--recipe walkthrough: one record per padded row in its text format, every
   epoch rank 0 gathers the full model and writes it) and the default (packed rows in the chat
   template, sharded checkpoints written in the background, a held-out eval). One table: real
   tokens/s, steps per epoch, the loss after each epoch (over different tokens: the default masks
   the prompt), and the checkpoint stall.
2. Checkpoint stall: how long the training loop waits for each epoch's checkpoint, full gather
   vs sharded, on a model big enough (`ckpt` size, ~120M parameters) for the write to matter;
   only --no-sharded-checkpoints vs --sharded-checkpoints differs.
3. Memory: the full [rows x seq x vocab] logits against the chunked cross-entropy (--loss-chunk 0
   vs the default), on the tiny Gemma 4 with Gemma 4's real vocabulary (262,144), 2 rows x 512
   tokens a worker: peak memory per worker, step time and loss.

    python -m bench.finetune                 # the full bench, several minutes on 2 cores
    python -m bench.finetune --rows 48 --epochs 1 --size tiny --stall-size tiny --memory-size tiny  # a smoke run
    python -m bench.finetune --rows 48 --epochs 1 --size tiny --stall-size tiny --memory-size tiny --in-process

With --in-process every run trains on one gloo rank in this process instead (bench/in_process.py: the job's
settings, TrainingRun, epoch metrics and checkpoint writes, without Ray Train's processes or reports): a quick
look, and the suite's smoke.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import infra.job_modules  # noqa: F401  (the one door to jobs/: the bench imports their modules by their own names)

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "ray_train_llm_finetune.py"
RECIPES = {
    "walkthrough": ("--recipe", "walkthrough"),
    "default": ("--recipe", "default"),
}
CHECKPOINTS = {
    "full gather": ("--packing", "--no-sharded-checkpoints"),
    "sharded, async": ("--packing", "--sharded-checkpoints"),
}
LOSSES = {"full logits": ("--loss-chunk", "0"), "chunked": ()}
GEMMA4_VOCAB = 262_144


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / ".local" / "bench")
    p.add_argument("--size", default="bench", help="model size from jobs/tiny_assets.py: bench or tiny")
    p.add_argument("--rows", type=int, default=256, help="records in the Dolly-shaped dataset")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--stall-size",
        default="ckpt",
        help="model size for the checkpoint-stall comparison; the --size runs give it when the same",
    )
    p.add_argument("--stall-rows", type=int, default=8, help="records for it: a few steps per epoch")
    p.add_argument(
        "--memory-size", default="vocab", help="model for the memory comparison: vocab (tiny, 262,144 tokens) or tiny"
    )
    p.add_argument("--memory-rows", type=int, default=24, help="records for it")
    p.add_argument("--in-process", action="store_true", help="every run on one gloo rank here, without Ray")
    args = p.parse_args(argv)
    if args.in_process:
        args.workers = 1
    return args


def make_assets(out: Path, size: str, rows: int) -> dict[str, str]:
    from infra.job_modules import tiny_assets

    model_dir, data_file = out / f"model-{size}", out / f"dolly-{rows}.jsonl"
    if not (model_dir / "config.json").exists():
        tokens = len(tiny_assets.make_tokenizer(model_dir))
        # `vocab`: the tiny shape with Gemma 4's vocabulary, whose logits dominate a step's memory
        tiny_assets.make_model(
            model_dir, vocab_size=GEMMA4_VOCAB if size == "vocab" else tokens, size="tiny" if size == "vocab" else size
        )
    if not data_file.exists():  # and 1/16 more: the default recipe's held-out eval takes them
        tiny_assets.make_dataset(data_file, rows=rows + -(-rows // 16), mix="dolly")
    return {"model": str(model_dir), "dataset": str(data_file)}


def real_share(assets: dict[str, str], seq_len: int) -> float:
    from transformers import AutoTokenizer

    from data.render import conversation, render_text, tokenize
    from data.sft_data import load_split, real_token_share

    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    records = load_split(assets["dataset"], "train").data
    turns = [conversation(r, "instruction/context/response") for r in records]
    docs = [tokenize(render_text(t), tokenizer, prompt_loss=True)[0][:seq_len] for t in turns]
    return real_token_share(docs, seq_len)


def job_argv(assets: dict[str, str], args: argparse.Namespace, name: str, flags: tuple[str, ...]) -> list[str]:
    """The job's flags for one of the bench's runs: the same model, data, seed and workers, then `flags`."""
    return [
        "--backend", "cpu", "--num-workers", str(args.workers), "--model", assets["model"],
        "--dataset", assets["dataset"], "--split", f"train[:{args.rows}]", "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", args.lr, "--seed", "42",
        "--storage-path", str(args.out / "runs"), "--run-name", f"{re.sub(r'[^a-z]+', '-', name)}-{time.time_ns()}",
        "--eval-samples", "0", "--eval-tasks", "none", *flags,  # training throughput: no answers are measured
    ]  # fmt: skip


def run_recipe(head, assets: dict[str, str], args: argparse.Namespace, name: str, flags: tuple[str, ...]) -> dict:
    """The real job on `head` with `job_argv`'s flags; its JOB_RESULT_JSON. With --in-process (no head), the same
    flags on one gloo rank here."""
    if args.in_process:
        from bench.in_process import run_here

        return run_here(job_argv(assets, args, name, flags), name, flags)
    from infra.runner.ray_jobs import parse_result

    argv = job_argv(assets, args, name, flags)
    print(f"running {name} ({' '.join(flags)}) ...", flush=True)
    done = subprocess.run(
        [sys.executable, str(JOB), *argv], env=head.client_env(), capture_output=True, text=True, timeout=1800
    )
    result = parse_result(done.stdout)
    if done.returncode != 0 or result is None:
        raise RuntimeError(f"the {name} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return result


def stall_runs(head, args: argparse.Namespace, results: dict[str, dict]) -> dict[str, dict]:
    """Full gather vs sharded on the --stall-size model: the main runs when that is their model."""
    if args.stall_size == args.size:
        return dict(zip(CHECKPOINTS, results.values(), strict=True))
    # A few short rows: the steps only have to outlast the background write they overlap.
    stall_args = argparse.Namespace(**{**vars(args), "seq_len": 128, "batch_size": 1, "rows": args.stall_rows})
    assets = make_assets(args.out, args.stall_size, args.stall_rows)
    return {name: run_recipe(head, assets, stall_args, name, flags) for name, flags in CHECKPOINTS.items()}


def memory_runs(head, args: argparse.Namespace, results: dict[str, dict]) -> dict[str, dict]:
    """Full logits vs chunked on the --memory-size model; the main runs when that is their model."""
    if args.memory_size == args.size:
        return dict(zip(LOSSES, results.values(), strict=True))
    memory_args = argparse.Namespace(**{**vars(args), "seq_len": 512, "batch_size": 2, "rows": args.memory_rows,
                                        "epochs": 1})  # fmt: skip
    assets = make_assets(args.out, args.memory_size, args.memory_rows)
    return {name: run_recipe(head, assets, memory_args, name, flags) for name, flags in LOSSES.items()}


def table(results: dict[str, dict], keys: list[tuple[str, str, bool]]) -> str:
    """One row per epoch and key (name, format, with a ratio), one column per run, then their ratio."""
    (first_name, first), (second_name, second) = results.items()
    rows = [("", first_name, second_name, f"{second_name} / {first_name}")]
    for key, fmt, ratio in keys:
        for a, b in zip(first["history"], second["history"], strict=True):
            rows.append(
                (f"epoch {a['epoch']}: {key}", format(a[key], fmt), format(b[key], fmt),
                 f"{b[key] / a[key]:.2f}x" if ratio else "")
            )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)


MEMORY_ROWS = [
    ("peak_memory_gib", ".2f", True),
    ("step_time_s", ".3f", True),
    ("loss", ".4f", True),
]
THROUGHPUT_ROWS = [
    ("real_tokens_per_s", ",.0f", True),
    ("steps", "d", False),
    ("real_token_share", ".1%", False),
    ("loss", ".4f", False),
    ("checkpoint_stall_s", ".3f", True),
]


def main(argv: list[str] | None = None, head=None) -> dict:
    """Runs the bench and prints its tables; `head` is a running LocalRayHead to use instead of a new one."""
    from contextlib import nullcontext

    from infra.runner.local_ray import LocalRayHead

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    assets = make_assets(args.out, args.size, args.rows)
    share = real_share(assets, args.seq_len)
    print(f"data: {args.rows} Dolly-shaped records; real tokens are {share:.1%} of padded positions at {args.seq_len}")
    if args.in_process or head:
        ray = nullcontext(head)  # (none in process: the runs never look at it)
    else:
        ray = LocalRayHead(num_cpus=args.workers, log_dir=args.out)
    with ray as head:
        results = {name: run_recipe(head, assets, args, name, flags) for name, flags in RECIPES.items()}
        stalls = stall_runs(head, args, results)
        memory = memory_runs(head, args, results)
    walk, pack = results.values()
    ratio = pack["metrics"]["real_tokens_per_s"] / walk["metrics"]["real_tokens_per_s"]
    full, sharded = stalls.values()
    stall_ratio = sharded["metrics"]["checkpoint_stall_s"] / full["metrics"]["checkpoint_stall_s"]
    where = "one gloo rank in this process" if args.in_process else f"{args.workers} CPU workers"
    print(
        f"\n{args.size} Gemma 4, {where} (fp32), batch {args.batch_size}/worker, "
        f"seq {args.seq_len}, {args.epochs} epochs, seed 42; {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}\n"
    )
    print(table(results, THROUGHPUT_ROWS))
    print(f"\ncheckpoint stall, {args.stall_size} Gemma 4 (model and AdamW state sharded; full: the model only)\n")
    print(table(stalls, [("checkpoint_stall_s", ".3f", True), ("epoch_time_s", ".2f", False)]))
    full, chunked = memory.values()
    memory_ratio = chunked["metrics"]["peak_memory_gib"] / full["metrics"]["peak_memory_gib"]
    print(
        f"\nmemory, {args.memory_size} Gemma 4, 2 rows x 512 tokens a worker (peak: each worker's resident high-water mark)\n"
    )
    print(table(memory, MEMORY_ROWS))
    print(
        f"\nlast epoch: the default gives {ratio:.2f}x the walkthrough's real tokens/s; the sharded save "
        f"stalls the loop {stall_ratio:.2f}x as long as the full gather (1/{1 / stall_ratio:.1f}); the chunked "
        f"loss peaks at {memory_ratio:.2f}x the full logits' memory; bench took {time.monotonic() - started:.0f}s"
    )
    return {"share": share, "ratio": ratio, "stall_ratio": stall_ratio, "memory_ratio": memory_ratio,
            "results": results, "stalls": stalls, "memory": memory}  # fmt: skip


if __name__ == "__main__":
    main()
