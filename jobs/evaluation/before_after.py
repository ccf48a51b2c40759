"""Before and after: the base model and the fine-tune scored with lm-evaluation-harness, on the user's held-out
records and on lm-eval tasks by name (--eval-tasks heldout,gsm8k).

- **The held-out tasks** are made by the driver from the held-out records (the eval split): each prompt is the
  conversation up to its last assistant turn in the model's chat template (with the generation prompt), its
  reference that turn's text. `heldout` generates the answers (greedy, up to the samples' length, stopped at
  the end of turn): exact_match (lm-eval's), ROUGE-L F1 (rouge_score, an lm-eval dependency) and chrF
  (lm-eval's). `heldout_loss` scores the references' log-likelihood, per answer token (with the end of turn, as
  trained). Both are written into the run (`<run>/heldout/`: the records, the two YAMLs, `heldout_utils.py`),
  so an export can be re-scored anywhere with lm-eval's own Hugging Face backend:

      lm_eval --model hf --model_args pretrained=<run>/model --include_path <run>/heldout --tasks heldout,heldout_loss

- **lm-eval tasks by name** are scored as `lm_eval --tasks NAME --limit {eval_limit}` scores them, in the chat
  template where the run trains in it (--apply_chat_template); their data comes from the Hub as lm-eval fetches
  it. The names are checked against the installed lm-eval's index before anything starts (eval_tasks.py).
- **In the job** every task runs through lm-eval's `HFLM` over the job's own model: lm-eval takes an
  already-built model as a single process (models/huggingface.py: rank 0 of 1), so every rank scores every
  request in the same order and the FSDP forward passes stay in lockstep; rank 0 keeps the scores. With LoRA the
  adapters are live in the forward: the merged export's function, up to rounding. The base model is scored
  before the first step, the fine-tune after the last, on the same requests; a resumed run reads the base scores
  back from its state.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from config.eval_tasks import HELDOUT, HELDOUT_TASKS, named, parse
from config.modality import towers_of
from evaluation.heldout_task import LOSS_TASK, TASK, TASK_DIR
from runtime.log_lines import evaluation_table
from training.samples import root_first

PAIRS_TASK = "heldout_pairs"  # a DPO run's held-out pairs: how often the chosen answer is the likelier
EVALUATION_FILE = "evaluation.json"


@dataclass(frozen=True)
class Plan:
    """What is scored: the held-out tasks' directory (local or gs://; None: not asked or no held-out records),
    lm-eval tasks by name (in the chat template where the run trains in it), `limit` documents of each."""

    task_dir: str | None
    named: tuple[str, ...]
    chat_template: bool
    limit: int | None
    base_model: str = ""  # the model the run starts from (rescore.py --base)
    pairs: bool = False  # a DPO run's held-out pairs (dpo.held_out_scores), as the task heldout_pairs
    media: bool = False  # held-out records with pictures and sound (media_scores), as the task heldout_media
    include_path: str | None = None  # task YAMLs to look in besides lm-eval's own (lm_eval --include_path)

    @classmethod
    def of(cls, settings, task_dir: str | None) -> Plan | None:
        pairs = settings.objective == "dpo" and settings.eval_split != "none" and bool(parse(settings.eval_tasks))
        media = bool(towers_of(settings.modality)) and settings.eval_split != "none"
        plan = cls(task_dir, named(settings.eval_tasks), bool(settings.chat_template), settings.eval_limit or None,
                   settings.model, pairs, media and HELDOUT in parse(settings.eval_tasks))  # fmt: skip
        return plan if plan.task_dir or plan.named or plan.pairs or plan.media else None

    def commands(self) -> list[str]:
        """How to score an export as the job did: the project's command (jobs/rescore.py, which also copies a gs://
        run down), then lm-eval's own command lines with its Hugging Face backend."""
        model = "lm_eval --model hf --model_args pretrained=<run>/model --batch_size 8"
        commands = ["python jobs/rescore.py <run>"]
        if self.task_dir:
            commands.append(f"{model} --include_path <run>/{TASK_DIR} --tasks {','.join(HELDOUT_TASKS)}")
        if self.named:
            limit = f" --limit {self.limit}" if self.limit else ""
            template = " --apply_chat_template" if self.chat_template else ""
            commands.append(f"{model} --tasks {','.join(self.named)}{limit}{template}")
        return commands


def score(trainee, plan: Plan, batch_size: int) -> dict[str, dict]:
    """Each task's metrics for the model as it is now, on every rank in lockstep (rank 0's are kept; {} on the
    others): {task: {"metrics": {name: value}, "samples": documents scored, "version": the task's}}."""
    import torch
    from lm_eval.models.huggingface import HFLM

    root = trainee.loss
    was_training = root.training
    root.eval()
    root_first(trainee)
    root.unshard()  # the root's own parameters (embeddings, final norm, tied head), as samples.answer does
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model = HFLM(pretrained=trainee.model, tokenizer=trainee.tokenizer, batch_size=batch_size)
            scores = {}
            if plan.task_dir:  # the prompts are in the chat template already
                scores |= _evaluate(model, list(HELDOUT_TASKS), task_manager(_local(plan.task_dir)), False, None)
            if plan.named:
                scores |= _evaluate(model, list(plan.named), task_manager(plan.include_path, named=True),
                                    plan.chat_template, plan.limit)  # fmt: skip
    finally:
        root.reshard()
        root.train(was_training)
    return scores


@functools.cache
def task_manager(include_path: str | None, named: bool = False):
    """lm-eval's task index: the held-out tasks' own directory alone, or with lm-eval's built-in tasks when tasks
    are named (indexing those ~14,700 YAML files takes seconds of CPU each time: 5.5 s here), once a process:
    the base's scores and the fine-tune's read the same index."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=named)


def _evaluate(model, tasks: list[str], manager, chat_template: bool, limit: int | None) -> dict:
    import lm_eval

    results = lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=manager,
        apply_chat_template=chat_template, limit=limit, log_samples=False, bootstrap_iters=0,
        random_seed=None, numpy_random_seed=None, torch_random_seed=None,  # the training's own generators untouched
        fewshot_random_seed=1234,  # (lm-eval's default: the same few-shot examples on every rank, before and after)
    )  # fmt: skip
    if results is None:  # lm-eval reports on the process whose LOCAL_RANK is 0 only (evaluator.py); it answered too
        return {}
    return {task: task_scores(results, task) for task in reported(results, tasks)}


def reported(results: dict, tasks: list[str]) -> list[str]:
    """The entries to report for the names asked: each task or group itself; for a tag (which has no score of its
    own), the tasks it stood for."""
    asked = [n for n in tasks if n in results["results"]]
    if len(asked) == len(tasks):
        return asked
    inside = {t for subtasks in results.get("group_subtasks", {}).values() for t in subtasks}
    return asked + [n for n in results["results"] if n not in inside and n not in asked]


def task_scores(results: dict, task: str) -> dict:
    """A task's entry: its metrics as `metric` (lm-eval's filter `none`) or `metric/filter` (gsm8k's strict-match)."""
    metrics = {}
    for key, value in results["results"][task].items():
        metric, _, kept = key.partition(",")
        if kept and not metric.endswith("_stderr") and isinstance(value, (int, float)):
            metrics[metric if kept == "none" else f"{metric}/{kept}"] = float(value)
    samples = results.get("n-samples", {}).get(task, {}).get("effective")
    return {"metrics": metrics, "samples": samples, "version": results.get("versions", {}).get(task)}


def _local(task_dir: str) -> str:
    """lm-eval reads task YAMLs from a local directory: a gs:// one is copied next to this process first."""
    if "://" not in task_dir:
        return task_dir
    import tempfile

    from runtime.storage import gcs

    into = tempfile.mkdtemp(prefix="heldout-")
    for name in (f"{TASK}.yaml", f"{LOSS_TASK}.yaml", "heldout_utils.py"):
        gcs().get(f"{task_dir}/{name}", os.path.join(into, name))
    return into


def comparison(base: dict | None, tuned: dict[str, dict]) -> dict:
    """evaluation.json's tasks: per task its documents, version and, per metric, the base, the fine-tuned and the
    delta (the fine-tuned alone where no base was recorded: a run resumed from a checkpoint older than its
    evaluation)."""
    tasks = {}
    for task, scored in tuned.items():
        before = ((base or {}).get(task) or {}).get("metrics", {})
        tasks[task] = {"samples": scored["samples"], "version": scored["version"], "metrics": {
            m: {"base": before[m], "fine_tuned": v, "delta": v - before[m]} if m in before else {"fine_tuned": v}
            for m, v in scored["metrics"].items()}}  # fmt: skip
    return tasks


def read_evaluation(run_dir: str) -> dict | None:
    """A run's evaluation.json (a local path or URI), or None when it has none."""
    import pyarrow.fs

    from runtime.storage import filesystem

    fs, path = filesystem(f"{run_dir.rstrip('/')}/{EVALUATION_FILE}")
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())


class BeforeAfter:
    """TrainingRun's evaluation hook: the plan's tasks scored before the first step and after the last, and on
    rank 0 evaluation.json written into the run, the table in the log and the scores in TensorBoard
    (evaluation/<task>/<metric> at step 0 and at the last step)."""

    def __init__(self, plan: Plan, run_fs, run_path: str, rank: int, batch_size: int, board=None):
        self.plan, self.run_fs, self.run_path, self.rank, self.batch_size, self.board = (
            plan, run_fs, run_path, rank, batch_size, board)  # fmt: skip

    def score(self, run) -> dict[str, dict]:
        """The plan's tasks for the run's model as it is now (training_run.TrainingRun `run`)."""
        scores = score(run.trainee, self.plan, self.batch_size) if self.plan.task_dir or self.plan.named else {}
        if self.plan.pairs and run.data.eval:
            from training.dpo import held_out_scores

            found = held_out_scores(run.trainee.loss, run.data, run.settings, run.rank, run.world, run.device)
            metrics = {"preferred": found["eval_preferred"], "loss": found["eval_loss"],
                       "rewards/margins": found["eval_rewards/margins"]}  # fmt: skip
            scores[PAIRS_TASK] = {"metrics": metrics, "samples": len(run.data.eval), "version": None}
        if self.plan.media:
            from evaluation.media_scores import media_scores

            scores |= media_scores(run, self.plan.limit, self.batch_size)
        return scores

    def finish(self, base: dict | None, tuned: dict[str, dict], step: int = 0) -> dict:
        import lm_eval

        evaluation = {"tasks": comparison(base, tuned), "lm_eval_version": lm_eval.__version__,
                      "task_dir": self.plan.task_dir, "named_tasks": list(self.plan.named), "limit": self.plan.limit,
                      "chat_template": self.plan.chat_template, "base_model": self.plan.base_model,
                      "rescore": self.plan.commands()}  # fmt: skip
        if self.rank == 0:
            from runtime.backend import worker_print

            with self.run_fs.open_output_stream(f"{self.run_path}/{EVALUATION_FILE}") as f:
                f.write(json.dumps(evaluation, indent=2).encode())
            for line in evaluation_table(evaluation):
                worker_print(line)
            for task, entry in evaluation["tasks"].items():
                for metric, v in entry["metrics"].items() if self.board else ():
                    for at, value in ((0, v.get("base")), (step, v["fine_tuned"])):
                        if value is not None:
                            self.board.add_scalar(f"evaluation/{task}/{metric}", value, at)
        return evaluation


def before_after(storage, settings, rank: int, board=None) -> BeforeAfter | None:
    """The hook for this run (Ray Train's StorageContext `storage`): the held-out tasks if the driver wrote them,
    and the lm-eval tasks named."""
    import pyarrow.fs

    from runtime.storage import uri

    path = f"{storage.experiment_fs_path}/{TASK_DIR}"
    written = storage.storage_filesystem.get_file_info(f"{path}/{TASK}.yaml").type == pyarrow.fs.FileType.File
    plan = Plan.of(settings, uri(settings.storage_path, path) if written else None)
    if plan is None:
        return None
    return BeforeAfter(plan, storage.storage_filesystem, storage.experiment_fs_path, rank, settings.batch_size,
                       board)  # fmt: skip
