"""The held-out tasks, written for lm-eval from the run's held-out records (jobs/evaluation/before_after.py scores
them): `heldout` (the answers generated: exact_match, ROUGE-L and chrF) and `heldout_loss` (the references'
log-likelihood per answer token), as YAML with their records and the metrics' source (`heldout_utils.py`) in
`<run>/heldout/`, so that lm-eval's own `hf` backend re-scores an export anywhere."""

from __future__ import annotations

import json
import math
import re

from config.eval_tasks import HELDOUT, HELDOUT_TASKS, parse
from config.modality import towers_of
from evaluation.metrics import rouge_l
from training.samples import NEW_TOKENS

TASK, LOSS_TASK = HELDOUT_TASKS
TASK_DIR = "heldout"


def answer_loss(doc: dict, results: list) -> dict:
    """heldout_loss's per-document result: the reference answer's log-likelihood and its token count."""
    loglikelihood, _ = results[0]
    return {"loss": (loglikelihood, doc["answer_tokens"])}


def per_token(items: list) -> float:
    """The answers' loss per token (nats): as the job's held-out loss, on the answer tokens alone."""
    return -sum(ll for ll, _ in items) / max(1, sum(n for _, n in items))


def _records_task(task: str, records_file: str, output_type: str) -> dict:
    """What both held-out tasks share: the records file (heldout.jsonl) as their one test split, prompt first."""
    return {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": records_file}},
            "test_split": "test", "output_type": output_type, "doc_to_text": "{{prompt}}"}  # fmt: skip


def task_config(records_file: str, stop: str | None, stop_ids: list[int]) -> dict:
    """heldout: the answers generated, as heldout.yaml holds it (the ROUGE-L metric named there as !function).
    Answers are as long as the samples' and end at the chat template's end of turn (`stop`; Gemma 4's
    `<turn|>`): generate() is given its id beside EOS (`stop_ids`, render.stop_token_ids), so every row ends
    there whatever the scored directory's generation config says (the job's model, an export, a base)."""
    return _records_task(TASK, records_file, "generate_until") | {
        "doc_to_target": "{{reference}}",
        "generation_kwargs": {
            "until": [stop] if stop else [],
            "do_sample": False,
            "max_gen_toks": NEW_TOKENS,
            "eos_token_id": stop_ids,
        },
        "metric_list": [
            {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True},
            {"metric": "rouge_l", "aggregation": "mean", "higher_is_better": True},
            {"metric": "chrf"},
        ],
        "metadata": {"version": 1},
    }


def loss_task_config(records_file: str, stop: str | None) -> dict:
    """heldout_loss: the reference answers' log-likelihood given their prompts (with the end of turn, as trained),
    per answer token."""
    return _records_task(LOSS_TASK, records_file, "loglikelihood") | {
        "doc_to_target": "{{reference}}" + (stop or ""),
        "target_delimiter": "",
        "process_results": "answer_loss",
        "metric_list": [{"metric": "loss", "aggregation": "per_token", "higher_is_better": False}],
        "metadata": {"version": 1},
    }


def task_yaml(config: dict) -> str:
    """A task config as YAML, its functions named as `!function heldout_utils.<name>`."""
    import yaml

    text = yaml.safe_dump(config, sort_keys=False, width=math.inf)  # a path on one line: rescore.py replaces it
    for name in ("rouge_l", "answer_loss", "per_token"):
        text = re.sub(rf"(: ){name}$", rf"\1!function heldout_utils.{name}", text, flags=re.M)
    return text


def held_out_docs(settings, tokenizer) -> list[dict]:
    """The held-out records as prompt/reference pairs (the prompt in the chat template, up to the model's turn),
    each with its answer's token count as lm-eval splits it (the pair encoded whole, less the prompt)."""
    from data.render import content_text, conversation, detect_format, user_text
    from data.sft_data import load_splits

    _, held_out, loaded = load_splits(settings)
    stop, docs = end_of_turn(tokenizer) or "", []
    for name, start, stop_at in held_out:
        data = loaded[name].data.rename_columns(
            {o: n for o, n in settings.column_renames.items() if o in loaded[name].data.column_names}
        )
        fmt = detect_format(data.column_names)
        for record in data.select(range(start, stop_at)):
            turns = conversation(record, fmt)
            last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
            messages = [{"role": t["role"], "content": user_text(t)} for t in turns[:last]]  # (Dolly's context too)
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            reference = content_text(turns[last]["content"])  # (text parts joined)
            whole, asked = (
                len(tokenizer.encode(t, add_special_tokens=False)) for t in (prompt + reference + stop, prompt)
            )
            docs.append({"prompt": prompt, "reference": reference, "answer_tokens": whole - asked})
    return docs[: settings.eval_limit or None]


def write_task(settings, tokenizer, run_dir: str) -> str | None:
    """The held-out tasks written into `run_dir` (a local path or gs:// URI); their directory, or None when the
    run has no held-out records or does not ask for them."""
    from data.render import stop_token_ids
    from runtime.storage import filesystem

    if HELDOUT not in parse(settings.eval_tasks) or not settings.chat_template or settings.objective != "sft":
        return None  # (a DPO run's held-out pairs are scored at each eval, a GRPO run's prompts by their rewards)
    if towers_of(settings.modality):
        return None  # (held-out pictures and sound are scored in the job: media_scores.py)
    docs = held_out_docs(settings, tokenizer)
    if not docs:
        return None
    directory = f"{run_dir.rstrip('/')}/{TASK_DIR}"
    fs, base = filesystem(directory)
    fs.create_dir(base, recursive=True)
    records, stop = f"{directory}/{TASK}.jsonl", end_of_turn(tokenizer)
    files = {
        f"{TASK}.jsonl": "".join(json.dumps(d) + "\n" for d in docs),
        f"{TASK}.yaml": task_yaml(task_config(records, stop, stop_token_ids(tokenizer))),
        f"{LOSS_TASK}.yaml": task_yaml(loss_task_config(records, stop)),
        "heldout_utils.py": "# written by jobs/evaluation/heldout_task.py: the held-out tasks' metrics\n"
        + "".join(_source(f) for f in (rouge_l, answer_loss, per_token)),
    }
    for name, text in files.items():
        with fs.open_output_stream(f"{base}/{name}") as f:
            f.write(text.encode())
    return directory


def end_of_turn(tokenizer) -> str | None:
    """The text of the token an assistant turn ends with (render.end_of_turn_id), or None."""
    from data.render import end_of_turn_id

    token = end_of_turn_id(tokenizer)
    return None if token is None else tokenizer.convert_ids_to_tokens(token)


def _source(function) -> str:
    import inspect

    return "\n\n" + inspect.getsource(function)
