"""`make bench`: records with pictures and sound packed (the default) against one a row, side by side.

The job's own run of each on one gloo rank in this process (bench/in_process.py), on the tiny Gemma 4 with both
towers and mixed media records of its own (jobs/tiny_assets.py's MEDIA, `--copies` of each: pictures of three
kinds, clips of two lengths, two pictures with a second exchange, text alone), the same seed, an epoch each: real
tokens a second, steps an epoch, the share of each row that is a record's, and the loss (the same tokens: packing
leaves every record whole and masked from the others, tests/test_media_shapes.py).

    python -m bench.media_packing                      # a minute or two on 2 cores
    python -m bench.media_packing --copies 4 --steps 2   # a smoke run
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import infra.job_modules  # noqa: F401  (the one door to jobs/)
from bench.finetune import table
from bench.in_process import run_here

RUNS = {"one a row": ("--no-packing",), "packed": ("--packing",)}
ROWS = [("real_tokens_per_s", ",.0f", True), ("steps", "d", False), ("real_token_share", ".1%", False),
        ("loss", ".4f", False)]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=24, help="copies of each of the tiny media records")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the epoch)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from tiny_assets import make_media, make_media_model

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        data, model = make_media(Path(out), copies=args.copies), make_media_model(Path(out) / "model")
        results = {}
        for name, flags in RUNS.items():
            argv_run = ["--backend", "cpu", "--num-workers", "1", "--model", str(model), "--dataset", str(data),
                        "--split", "train", "--eval-split", "none", "--eval-tasks", "none", "--eval-samples", "0",
                        "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--epochs", "1",
                        "--modality", "image+audio",
                        "--storage-path", f"{out}/runs", "--run-name", name.replace(" ", "-"), "--save-every", "0",
                        *(["--max-steps", str(args.steps)] if args.steps else []), *flags]  # fmt: skip
            results[name] = run_here(argv_run, name, flags)
    print(
        f"\nmedia records packed against one a row ({len(RUNS)} runs, {args.copies} copies of 8 records, "
        f"--seq-len {args.seq_len}, {args.batch_size} rows a step, one gloo rank):"
    )
    print(table(results, ROWS))
    one, packed = (results[n]["history"][-1]["real_tokens_per_s"] for n in RUNS)
    return {"runs": results, "ratio": packed / one}


if __name__ == "__main__":
    main()
