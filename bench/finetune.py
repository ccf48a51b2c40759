"""`make bench`: the walkthrough's fine-tune recipe against this project's default, side by side.

Both recipes run the real job (jobs/ray_train_llm_finetune.py) on one local Ray head, with the
same random Gemma 4 (`bench` size), the same Dolly-shaped data, seed, workers and flags; only
--no-packing (the walkthrough: one record per padded row) vs --packing differs. It prints
one table: real tokens/s and their ratio, steps per epoch, the loss after each epoch (both
have then seen the same records, so the same real tokens) and the checkpoint stall.

    python -m bench.finetune                 # the full bench, a few minutes on 2 cores
    python -m bench.finetune --rows 48 --epochs 1 --size tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "ray_train_llm_finetune.py"
sys.path.insert(0, str(ROOT / "jobs"))
RECIPES = {"walkthrough (padded)": "--no-packing", "default (packed)": "--packing"}


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
    return p.parse_args(argv)


def make_assets(out: Path, size: str, rows: int) -> dict[str, str]:
    from tiny_assets import make_dataset, make_model, make_tokenizer

    model_dir, data_file = out / f"model-{size}", out / f"dolly-{rows}.jsonl"
    if not (model_dir / "config.json").exists():
        make_model(model_dir, vocab_size=len(make_tokenizer(model_dir)), size=size)
    if not data_file.exists():
        make_dataset(data_file, rows=rows, mix="dolly")
    return {"model": str(model_dir), "dataset": str(data_file)}


def real_share(assets: dict[str, str], seq_len: int) -> float:
    from sft_data import load_instructions, real_token_share, tokenize_records
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    docs = tokenize_records(load_instructions(assets["dataset"], "train"), tokenizer, seq_len)
    return real_token_share(docs, seq_len)


def run_recipe(head, assets: dict[str, str], args: argparse.Namespace, flag: str) -> dict:
    from infra.ray_jobs import parse_result

    argv = [
        "--backend", "cpu", "--num-workers", str(args.workers), "--model", assets["model"],
        "--dataset", assets["dataset"], "--split", "train", "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", args.lr, "--seed", "42",
        "--storage-path", str(args.out / "runs"), "--run-name", f"{flag.strip('-')}-{time.time_ns()}", flag,
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(JOB), *argv], env=head.client_env(), capture_output=True, text=True, timeout=1800
    )
    result = parse_result(done.stdout)
    if done.returncode != 0 or result is None:
        raise RuntimeError(f"the {flag} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return result


def table(results: dict[str, dict]) -> str:
    (walk_name, walk), (pack_name, pack) = results.items()
    rows = [("", walk_name, pack_name, "packed / padded")]

    def per_epoch(key: str, fmt: str, ratio: bool = False):
        for w, p in zip(walk["history"], pack["history"], strict=True):
            rows.append(
                (f"epoch {w['epoch']}: {key}", format(w[key], fmt), format(p[key], fmt),
                 f"{p[key] / w[key]:.2f}x" if ratio else "")
            )  # fmt: skip

    per_epoch("real_tokens_per_s", ",.0f", ratio=True)
    per_epoch("steps", "d")
    per_epoch("real_token_share", ".1%")
    per_epoch("loss", ".4f")
    per_epoch("checkpoint_stall_s", ".2f")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def main(argv: list[str] | None = None, head=None) -> dict:
    """Runs the bench and prints its table; `head` is a running LocalRayHead to use instead of a new one."""
    from contextlib import nullcontext

    from infra.local_ray import LocalRayHead

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    assets = make_assets(args.out, args.size, args.rows)
    share = real_share(assets, args.seq_len)
    print(f"data: {args.rows} Dolly-shaped records; real tokens are {share:.1%} of padded positions at {args.seq_len}")
    results = {}
    with nullcontext(head) if head else LocalRayHead(num_cpus=args.workers, log_dir=args.out) as head:
        for name, flag in RECIPES.items():
            print(f"running {name} ({flag}) ...", flush=True)
            results[name] = run_recipe(head, assets, args, flag)
    walk, pack = results.values()
    ratio = pack["metrics"]["real_tokens_per_s"] / walk["metrics"]["real_tokens_per_s"]
    print(
        f"\n{args.size} Gemma 4, {args.workers} CPU workers (fp32), batch {args.batch_size}/worker, "
        f"seq {args.seq_len}, {args.epochs} epochs, seed 42; {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}\n"
    )
    print(table(results))
    print(
        f"\nlast epoch: packed gives {ratio:.2f}x the walkthrough's real tokens/s; bench took {time.monotonic() - started:.0f}s"
    )
    return {"share": share, "ratio": ratio, "results": results}


if __name__ == "__main__":
    main()
