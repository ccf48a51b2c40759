"""Before and after: the base model and the fine-tune scored on the user's held-out task, with lm-evaluation-harness.

- **The held-out task** is made by the driver from the held-out records (the eval split): each prompt is
  the conversation up to its last assistant turn in the model's chat template (with the generation prompt),
  its reference that turn's text. It is written into the run as an lm-eval task (`<run>/heldout/`: the
  records, `heldout.yaml`, and `heldout_utils.py` with ROUGE-L), so an export can be re-scored anywhere with
  lm-eval's own Hugging Face backend:

      lm_eval --model hf --model_args pretrained=<run>/model --include_path <run>/heldout --tasks heldout

  Metrics: exact_match (lm-eval's), ROUGE-L F1 (rouge_score, an lm-eval dependency) and chrF (lm-eval's).
- **In the job** the same task runs through lm-eval's `HFLM` over the job's own model: lm-eval takes an
  already-built model as a single process (models/huggingface.py: rank 0 of 1), so every rank scores every
  request in the same order and the FSDP forward passes stay in lockstep; rank 0 keeps the scores. The base
  model is scored before the first step, the fine-tune after the last, on the same requests; a resumed run
  reads the base scores back from its state.
"""

from __future__ import annotations

import json
import os

from log_lines import evaluation_table
from recipe import IGNORE
from samples import NEW_TOKENS

TASK = "heldout"
TASK_DIR = "heldout"
EVALUATION_FILE = "evaluation.json"


def rouge_l(references: list[str], predictions: list[str]) -> float:
    """ROUGE-L F1 of one answer against its reference (rouge_score, stemmed): lm-eval calls it per document."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return scorer.score(references[0], predictions[0])["rougeL"].fmeasure


def task_config(records_file: str, stop: str | None) -> dict:
    """The lm-eval task, as heldout.yaml holds it (the ROUGE-L metric named there as !function). Answers are as
    long as the samples' and end at the chat template's end of turn (`stop`; Gemma 4's `<turn|>`)."""
    return {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": records_file}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{reference}}",
        "generation_kwargs": {"until": [stop] if stop else [], "do_sample": False, "max_gen_toks": NEW_TOKENS},
        "metric_list": [
            {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True},
            {"metric": "rouge_l", "aggregation": "mean", "higher_is_better": True},
            {"metric": "chrf"},
        ],
        "metadata": {"version": 1},
    }


def task_yaml(records_file: str, stop: str | None) -> str:
    import yaml

    config = task_config(records_file, stop)
    text = yaml.safe_dump(config, sort_keys=False)
    return text.replace("metric: rouge_l", "metric: !function heldout_utils.rouge_l")


def held_out_docs(settings, tokenizer) -> list[dict]:
    """The held-out records as prompt/reference pairs (the prompt in the chat template, up to the model's turn)."""
    from render import conversation, detect_format, user_text
    from sft_data import load_splits

    _, held_out, loaded = load_splits(settings)
    docs = []
    for name, start, stop in held_out:
        data = loaded[name].data.rename_columns(
            {o: n for o, n in settings.column_renames.items() if o in loaded[name].data.column_names}
        )
        fmt = detect_format(data.column_names)
        for record in data.select(range(start, stop)):
            turns = conversation(record, fmt)
            last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
            messages = [{"role": t["role"], "content": user_text(t)} for t in turns[:last]]  # (Dolly's context too)
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            docs.append({"prompt": prompt, "reference": turns[last]["content"]})
    return docs[: settings.eval_limit or None]


def write_task(settings, tokenizer, run_dir: str) -> str | None:
    """The held-out task written into `run_dir` (a local path or gs:// URI); its directory, or None when the run
    has no held-out records or asks for no evaluation."""
    from storage import filesystem

    if settings.eval_tasks == "none" or not settings.chat_template:
        return None
    docs = held_out_docs(settings, tokenizer)
    if not docs:
        return None
    directory = f"{run_dir.rstrip('/')}/{TASK_DIR}"
    fs, base = filesystem(directory)
    fs.create_dir(base, recursive=True)
    files = {
        f"{TASK}.jsonl": "".join(json.dumps(d) + "\n" for d in docs),
        f"{TASK}.yaml": task_yaml(f"{directory}/{TASK}.jsonl", end_of_turn(tokenizer)),
        "heldout_utils.py": "# written by jobs/evaluation.py: the held-out task's ROUGE-L\n" + _source(rouge_l),
    }
    for name, text in files.items():
        with fs.open_output_stream(f"{base}/{name}") as f:
            f.write(text.encode())
    return directory


def end_of_turn(tokenizer) -> str | None:
    """The text of the token an assistant turn ends with (render.end_of_turn_id), or None."""
    from render import end_of_turn_id

    token = end_of_turn_id(tokenizer)
    return None if token is None else tokenizer.convert_ids_to_tokens(token)


def _source(function) -> str:
    import inspect

    return "\n\n" + inspect.getsource(function)


def score(trainee, task_dir: str, batch_size: int) -> dict[str, float]:
    """The held-out task's metrics for the model as it is now, on every rank in lockstep (rank 0's are kept)."""
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    root = trainee.loss
    was_training = root.training
    root.eval()
    with torch.no_grad():  # FSDP2 picks its root at the first forward: the root's, before lm-eval calls the layers'
        pad = torch.tensor([[trainee.tokenizer.pad_token_id] * 2], device=next(root.parameters()).device)
        root(input_ids=pad, labels=torch.full_like(pad, IGNORE))
    root.unshard()  # the root's own parameters (embeddings, final norm, tied head), as samples.answer does
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model = HFLM(pretrained=trainee.model, tokenizer=trainee.tokenizer, batch_size=batch_size)
            results = lm_eval.simple_evaluate(
                model=model, tasks=[TASK], task_manager=TaskManager(include_path=_local(task_dir)),
                log_samples=False, bootstrap_iters=0, random_seed=None, numpy_random_seed=None,
                torch_random_seed=None, fewshot_random_seed=None,
            )  # fmt: skip
    finally:
        root.reshard()
        root.train(was_training)
    if results is None:  # lm-eval reports on the process whose LOCAL_RANK is 0 only (evaluator.py); it answered too
        return {}
    scores = results["results"][TASK]
    return {name.split(",")[0]: float(value) for name, value in scores.items() if name.endswith(",none")
            and not name.split(",")[0].endswith("_stderr")}  # fmt: skip


def _local(task_dir: str) -> str:
    """lm-eval reads task YAMLs from a local directory: a gs:// one is copied next to this process first."""
    if "://" not in task_dir:
        return task_dir
    import tempfile

    from storage import gcs

    into = tempfile.mkdtemp(prefix="heldout-")
    for name in (f"{TASK}.yaml", "heldout_utils.py"):
        gcs().get(f"{task_dir}/{name}", os.path.join(into, name))
    return into


def comparison(base: dict[str, float], tuned: dict[str, float]) -> dict:
    """evaluation.json's task entry: per metric the base, the fine-tuned and the delta."""
    return {name: {"base": base[name], "fine_tuned": tuned[name], "delta": tuned[name] - base[name]}
            for name in tuned if name in base}  # fmt: skip


def read_evaluation(run_dir: str) -> dict | None:
    """A run's evaluation.json (a local path or URI), or None when it has none."""
    import pyarrow.fs
    from storage import filesystem

    fs, path = filesystem(f"{run_dir.rstrip('/')}/{EVALUATION_FILE}")
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())


class BeforeAfter:
    """TrainingRun's evaluation hook: the held-out task scored before the first step and after the last, and
    evaluation.json written into the run by rank 0 (with the table in the log)."""

    def __init__(self, task_dir: str, run_fs, run_path: str, rank: int, batch_size: int):
        self.task_dir, self.run_fs, self.run_path, self.rank, self.batch_size = (
            task_dir,
            run_fs,
            run_path,
            rank,
            batch_size,
        )

    def score(self, trainee) -> dict[str, float]:
        return score(trainee, self.task_dir, self.batch_size)

    def finish(self, base: dict | None, tuned: dict[str, float]) -> dict:
        """evaluation.json: per metric base, fine-tuned and delta (the fine-tuned alone if the base was not
        recorded: a run resumed from a checkpoint older than its evaluation)."""
        import lm_eval

        metrics = comparison(base, tuned) if base else {m: {"fine_tuned": v} for m, v in tuned.items()}
        evaluation = {"tasks": {TASK: metrics}, "lm_eval_version": lm_eval.__version__, "task_dir": self.task_dir}
        if self.rank == 0:
            from backend import worker_print

            with self.run_fs.open_output_stream(f"{self.run_path}/{EVALUATION_FILE}") as f:
                f.write(json.dumps(evaluation, indent=2).encode())
            for line in evaluation_table(evaluation):
                worker_print(line)
        return evaluation


def before_after(storage, settings, rank: int) -> BeforeAfter | None:
    """The hook for this run (Ray Train's StorageContext `storage`), if the driver wrote its held-out task."""
    import pyarrow.fs
    from checkpoints import uri

    path = f"{storage.experiment_fs_path}/{TASK_DIR}"
    if storage.storage_filesystem.get_file_info(f"{path}/{TASK}.yaml").type != pyarrow.fs.FileType.File:
        return None
    return BeforeAfter(uri(settings.storage_path, path), storage.storage_filesystem, storage.experiment_fs_path,
                       rank, settings.batch_size)  # fmt: skip
