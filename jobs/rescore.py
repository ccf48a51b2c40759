"""Re-score a run's export (or its base model) with lm-evaluation-harness's own Hugging Face backend, on the tasks
the run scored, and set the numbers beside the run's: the before/after evaluation checked anywhere, no Ray.

    python rescore.py RUN                      # RUN: the run's directory, local or gs://BUCKET/.../RUN
    python rescore.py RUN --base               # the model the run started from (or --model ID_OR_DIR)
    python rescore.py RUN --device cuda --dtype bfloat16

It reads RUN/evaluation.json (what was scored: the held-out tasks the run wrote into RUN/heldout, lm-eval tasks
by name, the limit and the chat template), copies the held-out tasks and a gs:// model to a temporary directory,
and runs `lm_eval.simple_evaluate(model="hf", ...)` as `lm_eval --model hf` would. Prints one line per metric:

    heldout  rouge_l  run 0.421042  here 0.421042
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from evaluation.before_after import (
    EVALUATION_FILE,
    HELDOUT_TASKS,
    PAIRS_TASK,
    TASK,
    TASK_DIR,
    read_evaluation,
    reported,
    task_manager,
    task_scores,
)
from runtime.outcome import JobInputError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("run", help="the run's directory (local or gs://): it holds evaluation.json and model/")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--base", action="store_true", help="score the model the run started from")
    which.add_argument("--model", help="score this model instead (a hub id or a directory; default: RUN/model)")
    parser.add_argument("--device", default="cpu", help="lm-eval's --device")
    parser.add_argument("--dtype", default="float32", help="the weights' dtype (the run's own, to compare exactly)")
    parser.add_argument("--batch-size", type=int, default=8)
    return parser.parse_args(argv)


def local_copy(uri: str, into: str) -> str:
    """A local path for `uri` (a directory or file): itself, or a copy under `into` for a gs:// one."""
    import pyarrow.fs

    from runtime.storage import filesystem, is_gcs

    if not is_gcs(uri):
        return uri
    fs, path = filesystem(uri)
    target = os.path.join(into, path.rstrip("/").rsplit("/", 1)[-1])
    os.makedirs(target, exist_ok=True)
    pyarrow.fs.copy_files(path, target, source_filesystem=fs)
    return target


def local_tasks(task_dir: str, into: str) -> str:
    """The held-out tasks, copied where lm-eval reads them, their records named by the copy's path."""
    local = local_copy(task_dir, into)
    for name in HELDOUT_TASKS:
        path = os.path.join(local, f"{name}.yaml")
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace(f"{task_dir.rstrip('/')}/{TASK}.jsonl", os.path.join(local, f"{TASK}.jsonl")))
    return local


def rescore(run: str, model: str, device: str, dtype: str, batch_size: int) -> list[str]:
    """The lines comparing the run's scores of `model` with lm-eval's hf backend's here."""
    import lm_eval

    evaluation = read_evaluation(run)
    if evaluation is None:
        raise JobInputError(f"{run} has no {EVALUATION_FILE}: the run scored nothing (--eval-tasks none, or it "
                            "did not finish)")  # fmt: skip
    base = model == "base"
    with tempfile.TemporaryDirectory(prefix="rescore-") as into:
        model = evaluation["base_model"] if base else model or f"{run.rstrip('/')}/model"
        model_args = f"pretrained={local_copy(model, into)},dtype={dtype}"
        runs = []
        if evaluation.get("task_dir"):
            runs.append((list(HELDOUT_TASKS), local_tasks(f"{run.rstrip('/')}/{TASK_DIR}", into), False, None))
        if evaluation.get("named_tasks"):
            runs.append((evaluation["named_tasks"], None, evaluation["chat_template"], evaluation["limit"]))
        here = {}
        for tasks, include_path, chat_template, limit in runs:
            results = lm_eval.simple_evaluate(
                model="hf", model_args=model_args, tasks=tasks, device=device, batch_size=batch_size,
                task_manager=task_manager(include_path, named=include_path is None), apply_chat_template=chat_template,
                limit=limit, bootstrap_iters=0, fewshot_random_seed=1234,
            )  # fmt: skip
            here |= {task: task_scores(results, task) for task in reported(results, tasks)}
    lines = []
    for task, entry in evaluation["tasks"].items():
        if task == PAIRS_TASK:  # a DPO run's own held-out pairs: scored by the job alone, against its reference
            continue
        for metric, v in entry["metrics"].items():
            ours = here.get(task, {}).get("metrics", {}).get(metric)
            run_value = v.get("base" if base else "fine_tuned")
            lines.append(f"{task}  {metric}  run {_number(run_value)}  here {_number(ours)}")
    return lines


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        lines = rescore(args.run, "base" if args.base else args.model, args.device, args.dtype, args.batch_size)
    except JobInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(json.dumps({"rescored": args.run}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
