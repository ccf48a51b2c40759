"""`make bench`, the step as TorchTPU runs it: `--compile` against eager, and the device reads a step makes.

1. Compile: the real job (jobs/ray_train_llm_finetune.py, the default recipe) with and without --compile on
   the same model, data and seed; step time, real tokens/s and loss per epoch, and the compiles after the
   first step (on CPU inductor compiles each decoder layer; TorchTPU's compiler on a slice).
2. Device reads: the job's own step (step.train_step, the token sums, the progress line's state) run here
   in one gloo process, counting what makes a host wait for a device value (`aten._local_scalar_dense`:
   float(), int(), bool(), .item(); and Tensor.tolist). Beside it, the same steps with the reads the step
   made before issue 36 put back: the gradient norm as a float, the all-reduced counts read with tolist,
   and transformers' own packed-row check (two reads a forward). On CPU a read costs nothing; on TorchTPU's
   fused eager mode each one ends the fused program, which is why the count is the figure.

With --in-process both compile runs train on one gloo rank in this process instead (the job's settings from the
same flags, its TrainingRun and epoch metrics; no Ray, so no Ray Train workers' costs in the step): a quick look,
and the suite's smoke.

    python -m bench.step                     # about two minutes on 2 cores
    python -m bench.step --size tiny --rows 48 --epochs 1 --steps 4   # a smoke run
    python -m bench.step --size tiny --rows 48 --epochs 1 --steps 4 --in-process   # a smoke run without Ray
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.finetune import ROOT, job_argv, make_assets, run_recipe, table
from bench.in_process import one_gloo_rank, run_here

COMPILE = {"eager": ("--no-compile",), "compile": ("--compile",)}
COMPILE_ROWS = [("step_time_s", ".3f", True), ("real_tokens_per_s", ",.0f", True), ("loss", ".4f", False)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / ".local" / "bench")
    p.add_argument("--size", default="bench", help="model size from jobs/tiny_assets.py: bench or tiny")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="steps whose device reads are counted")
    p.add_argument("--in-process", action="store_true", help="the compile runs on one gloo rank here, without Ray")
    return p.parse_args(argv)


class Reads:
    """What makes a host wait for a device value, counted: `aten._local_scalar_dense` (float(), int(), bool(),
    .item() of a tensor) under a TorchDispatchMode, and Tensor.tolist, which reads without dispatching. Reading a
    CPU batch with numpy (host data) is not counted. tests/test_recipe.py uses it too."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.count, counter, self._tolist = 0, self, torch.Tensor.tolist

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        import torch

        tolist, counter = self._tolist, self

        def counted(tensor):
            counter.count += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        self.mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist


def reads_per_step(assets: dict[str, str], steps: int, put_back: bool) -> float:
    """The job's step, `steps` times, in this process (one gloo rank); with `put_back`, the reads it used to make."""
    import torch
    from transformers import masking_utils

    from config.command_line import from_args, parse_args
    from runtime.backend import get_backend
    from training.model import adamw, build_model
    from training.recipe import Schedule
    from training.step import TrainingData, micro_batch_groups, train_step
    from training.training_run import TokenSums

    settings = from_args(parse_args(["--backend", "cpu", "--num-workers", "1", "--model", assets["model"], "--dataset",
                                     assets["dataset"], "--seq-len", "256", "--batch-size", "2", "--max-steps",
                                     str(steps)]))  # fmt: skip
    trainee = build_model(settings, get_backend("cpu"), "float32", 1, None)
    found = masking_utils.find_packed_sequence_indices
    if put_back:  # transformers' own check, which model.build_model replaced
        masking_utils.find_packed_sequence_indices = getattr(found, "original", found)
    optimizer, device = adamw(trainee, settings), torch.device("cpu")
    data = TrainingData(settings, trainee.tokenizer, 0, 1)
    schedule, sums = Schedule.planned(settings, data.steps), TokenSums(device)
    data.start(0, 0)
    # the batches first: the loader's iterator reads its seed once an epoch, not a step
    groups = [g for _, g in zip(range(steps), micro_batch_groups(data.loader, settings.grad_accum), strict=False)]
    try:
        with Reads() as reads:
            for step, group in enumerate(groups):
                result = train_step(trainee.loss, optimizer, group, schedule.at(step), settings.max_grad_norm,
                                    settings.packing, device)  # fmt: skip
                sums.add(result)
                if put_back:
                    float(result.grad_norm), torch.tensor(result.counts).tolist()
        return reads.count / len(groups)
    finally:
        masking_utils.find_packed_sequence_indices = found


def count_reads(assets: dict[str, str], steps: int) -> dict[str, float]:
    with one_gloo_rank():
        return {"now": reads_per_step(assets, steps, False), "before": reads_per_step(assets, steps, True)}


def main(argv: list[str] | None = None, head=None) -> dict:
    """Runs both measurements and prints them; `head` is a running LocalRayHead to use instead of a new one."""
    from contextlib import nullcontext

    from infra.runner.local_ray import LocalRayHead

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    assets = make_assets(args.out, args.size, args.rows)
    if args.in_process:
        args.workers = 1
        runs = {name: run_here(job_argv(assets, args, name, flags), name, flags) for name, flags in COMPILE.items()}
    else:
        with nullcontext(head) if head else LocalRayHead(num_cpus=args.workers, log_dir=args.out) as head:
            runs = {name: run_recipe(head, assets, args, name, flags) for name, flags in COMPILE.items()}
    eager, compiled = runs.values()
    ratio = compiled["metrics"]["step_time_s"] / eager["metrics"]["step_time_s"]
    reads = count_reads(assets, args.steps)
    where = "one gloo rank in this process" if args.in_process else f"{args.workers} CPU workers"
    print(f"\n--compile against eager, {args.size} Gemma 4, {where} (inductor), batch "
          f"{args.batch_size}/worker, seq {args.seq_len}, packed rows\n")  # fmt: skip
    print(table(runs, COMPILE_ROWS))
    print(f"\ncompiles after the first step: {[h['recompiles'] for h in compiled['history']]} (one per epoch)")
    print(f"device reads per step, {args.steps} steps without a progress line: {reads['now']:g} now, "
          f"{reads['before']:g} with the reads issue 36 removed put back")  # fmt: skip
    print(f"\nlast epoch: a compiled step takes {ratio:.2f}x an eager one's time on this CPU")
    return {"runs": runs, "compile_ratio": ratio, "reads": reads}


if __name__ == "__main__":
    main()
