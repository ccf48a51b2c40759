"""Re-score a run's export (or its base model) with lm-evaluation-harness's own Hugging Face backend, on the tasks
the run scored, and set the numbers beside the run's: the before/after evaluation checked anywhere, no Ray.

    python rescore.py RUN                      # RUN: the run's directory, local or gs://BUCKET/.../RUN
    python rescore.py RUN --base               # the model the run started from (or --model ID_OR_DIR)
    python rescore.py RUN --device cuda --dtype bfloat16
    python rescore.py RUN --endpoint http://127.0.0.1:8000/v1 --served-model NAME   # the export as served

With --endpoint the model is scored through an OpenAI-compatible server (the stack's Ray Serve LLM endpoint, or
make local's on CPU) with lm-eval's `local-completions`: the export's tokenizer (RUN/model) encodes every request as
the job's lm-eval did (the prompts carry the chat template's BOS, so none is added: add_bos_token only where a prompt
lacks it, as lm-eval's hf backend decides), loglikelihood from `echo` + `logprobs`, answers greedy.

It reads RUN/evaluation.json (what was scored: the held-out tasks the run wrote into RUN/heldout, lm-eval tasks
by name, the limit and the chat template), copies the held-out tasks and a gs:// model to a temporary directory
(with --endpoint only the export's tokenizer and configs, never its weights), and runs
`lm_eval.simple_evaluate(model="hf", ...)` as `lm_eval --model hf` would. Prints one line per metric:

    heldout  rouge_l  run 0.421042  here 0.421042
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

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
from evaluation.endpoint import NEVER_ANSWERED, ServerNotReady, serve_status, wait_until_ready
from evaluation.media_scores import MEDIA_TASK
from runtime.outcome import JobInputError, print_result


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
    parser.add_argument("--endpoint", help="score through this OpenAI-compatible server (its /v1 URL) instead")
    parser.add_argument("--served-model", help="the name the server serves the model as (its /v1/models)")
    parser.add_argument(
        "--wait-s",
        type=float,
        default=0,
        help="with --endpoint: first wait this long for it to answer (a replica's cold start)",
    )
    parser.add_argument("--serve-dashboard", help="the serving Ray's dashboard: Serve's status if it never answers")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="with --endpoint: the relative difference from the run's score reported as a problem",
    )
    args = parser.parse_args(argv)
    if args.endpoint and not args.served_model:
        parser.error("--endpoint needs --served-model, the name the server lists in /v1/models")
    return args


def endpoint_backend(endpoint: str, served_model: str, tokenizer_dir: str, sample: str | None) -> tuple[str, dict]:
    """lm-eval's local-completions over `endpoint`, tokenizing as the job's hf backend did for prompts like `sample`
    (None: lm-eval's own chat-template rendering, which starts with the BOS): none added to a prompt that starts with
    it (lm-eval's HFLM.tok_encode, has_bos_prefix), else the tokenizer's own, as the hf backend's default."""
    from transformers import AutoTokenizer

    bos = AutoTokenizer.from_pretrained(tokenizer_dir).bos_token
    has_bos = sample is None or bool(bos and sample.startswith(bos))
    return "local-completions", {
        "base_url": f"{endpoint.rstrip('/')}/completions", "model": served_model, "tokenizer": tokenizer_dir,
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "add_bos_token": not has_bos,
        "max_retries": 1, "timeout": 300,
    }  # fmt: skip


def first_prompt(task_dir: str) -> str:
    with open(os.path.join(task_dir, f"{TASK}.jsonl")) as f:
        return json.loads(f.readline())["prompt"]


# What scoring through an endpoint reads of an export: its tokenizer and configs, never its weights (31B's are
# about 60 GB, copied while the serving host bills).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def local_copy(uri: str, into: str, weights: bool = True) -> str:
    """A local path for `uri` (a directory or file): itself, or a copy under `into` for a gs:// one; without
    `weights`, a directory's files but its weights (the tokenizer and configs: what an endpoint's scoring reads)."""
    import pyarrow.fs

    from runtime.storage import filesystem, is_gcs

    if not is_gcs(uri):
        return uri
    fs, path = filesystem(uri)
    target = os.path.join(into, path.rstrip("/").rsplit("/", 1)[-1])
    os.makedirs(target, exist_ok=True)
    if weights:
        pyarrow.fs.copy_files(path, target, source_filesystem=fs)
        return target
    for info in fs.get_file_info(pyarrow.fs.FileSelector(path)):
        if info.type == pyarrow.fs.FileType.File and not info.base_name.endswith(WEIGHT_SUFFIXES):
            pyarrow.fs.copy_files(info.path, os.path.join(target, info.base_name), source_filesystem=fs)
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


def rescore(run: str, model: str, device: str, dtype: str, batch_size: int, endpoint: str | None = None,
            served_model: str | None = None) -> list[tuple]:  # fmt: skip
    """The run's scores of `model` beside lm-eval's hf backend's here, or `endpoint`'s: (task, metric, the run's,
    here), one a metric."""
    import lm_eval

    evaluation = read_evaluation(run)
    if evaluation is None:
        raise JobInputError(f"{run} has no {EVALUATION_FILE}: the run scored nothing (--eval-tasks none, or it "
                            "did not finish)")  # fmt: skip
    base = model == "base"
    with tempfile.TemporaryDirectory(prefix="rescore-") as into:
        model = evaluation["base_model"] if base else model or f"{run.rstrip('/')}/model"
        runs = []
        if evaluation.get("task_dir"):
            runs.append((list(HELDOUT_TASKS), local_tasks(f"{run.rstrip('/')}/{TASK_DIR}", into), False, None))
        if evaluation.get("named_tasks"):
            runs.append((evaluation["named_tasks"], None, evaluation["chat_template"], evaluation["limit"]))
        # through an endpoint, the tokenizer alone (copied once); here, the whole model (copied once)
        source = local_copy(model, into, weights=not endpoint)
        backend, model_args = "hf", f"pretrained={source},dtype={dtype}"
        here = {}
        for tasks, include_path, chat_template, limit in runs:
            if endpoint:
                sample = first_prompt(include_path) if include_path else None if chat_template else ""
                backend, model_args = endpoint_backend(endpoint, served_model, source, sample)
            results = lm_eval.simple_evaluate(
                model=backend, model_args=model_args, tasks=tasks, device=device, batch_size=batch_size,
                task_manager=task_manager(include_path, named=include_path is None), apply_chat_template=chat_template,
                limit=limit, bootstrap_iters=0, fewshot_random_seed=1234,
            )  # fmt: skip
            here |= {task: task_scores(results, task) for task in reported(results, tasks)}
    return compared(evaluation["tasks"], here, base)


# Scored by the job alone: a DPO run's held-out pairs (against its reference) and held-out pictures and sound
# (lm-eval's tasks here, and an endpoint's, are text); their rows would be disagreements of nothing.
JOB_ONLY_TASKS = (PAIRS_TASK, MEDIA_TASK)


def compared(tasks: dict, here: dict, base: bool) -> list[tuple]:
    """(task, metric, the run's value, the value here) for each of the run's scores that is scored here too."""
    return [(task, metric, v.get("base" if base else "fine_tuned"), here.get(task, {}).get("metrics", {}).get(metric))
            for task, entry in tasks.items() if task not in JOB_ONLY_TASKS
            for metric, v in entry["metrics"].items()]  # fmt: skip


def line(row: tuple) -> str:
    task, metric, run_value, here_value = row
    return f"{task}  {metric}  run {_number(run_value)}  here {_number(here_value)}"


def disagreements(rows: list[tuple], rel_tol: float) -> list[str]:
    """Each score here that differs from the run's by more than `rel_tol` of it (at least `rel_tol` itself), named."""
    return [f"{task} {metric}: {_number(here_value)} here, {_number(run_value)} in the run"
            for task, metric, run_value, here_value in rows
            if run_value is None or here_value is None
            or abs(here_value - run_value) > rel_tol * max(1.0, abs(run_value))]  # fmt: skip


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"


def wait_for(endpoint_url: str, served_model: str, wait_s: float, dashboard: str | None) -> None:
    """The endpoint answering `served_model`, within `wait_s`; the server's side (Serve's status) if it never does."""
    status = (lambda: serve_status(dashboard)) if dashboard else (lambda: "(no --serve-dashboard to ask)")
    wait_until_ready(endpoint_url, served_model, wait_s, log_tail=status,
                     say=lambda text: print(text, flush=True), report_every_s=60)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args, started = parse_args(argv), time.monotonic()
    try:
        if args.endpoint and args.wait_s:
            wait_for(args.endpoint, args.served_model, args.wait_s, args.serve_dashboard)
        rows = rescore(args.run, "base" if args.base else args.model, args.device, args.dtype, args.batch_size,
                       args.endpoint, args.served_model)  # fmt: skip
    except JobInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ServerNotReady as err:
        print(f"error: {NEVER_ANSWERED}: {err}", file=sys.stderr)
        return 2
    print("\n".join(line(row) for row in rows))
    problems = disagreements(rows, args.tolerance) if args.endpoint else []
    for problem in problems:
        print(f"problem: the served score disagrees with the run's: {problem}")
    print_result({"rescored": args.run, "endpoint": args.endpoint, "problems": problems,
                  "seconds": round(time.monotonic() - started, 1),  # (the wait for a replica, and the scoring)
                  "scores": [dict(zip(("task", "metric", "run", "here"), row, strict=True)) for row in rows]})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
