"""The before/after evaluation (jobs/evaluation/before_after.py): the held-out task the job writes, scored by the job's own
model through lm-eval, agrees with lm-eval's own Hugging Face backend on the same weights and task YAML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.inprocess import build, settings


@pytest.fixture
def task(tiny_assets, tmp_path):
    """The held-out task of the tiny data's 5 held-out records, written as a run writes it."""
    from data.render import load_tokenizer
    from evaluation.heldout_task import write_task

    config = settings(tiny_assets, "--eval-limit", "4")
    return config, write_task(config, load_tokenizer(config.tokenizer_ref), str(tmp_path / "run"))


def test_the_held_out_task_asks_in_the_chat_template_and_stops_at_the_end_of_turn(task):
    import yaml

    from data.render import load_tokenizer

    config, directory = task
    docs = [json.loads(line) for line in open(f"{directory}/heldout.jsonl")]
    assert len(docs) == 4 and all(d["reference"] and d["prompt"].startswith("<bos><|turn>user\n") for d in docs)
    assert all(d["prompt"].endswith("<|turn>model\n") for d in docs)  # the generation prompt: the model answers
    records = [json.loads(line) for line in open(config.dataset)][80:84]  # the held-out ones: train[80:85]
    assert [d["reference"] for d in docs] == [r["response"] for r in records]
    assert all(r["instruction"] in d["prompt"] and (r["context"] or "") in d["prompt"] for d, r in zip(docs, records,
                                                                                                 strict=True))  # fmt: skip
    assert any(r["context"] for r in records)  # (a Dolly context is part of the question)
    text = open(f"{directory}/heldout.yaml").read()
    assert "!function heldout_utils.rouge_l" in text
    loaded = yaml.safe_load(text.replace("!function ", ""))
    assert loaded["generation_kwargs"]["until"] == ["<turn|>"] and loaded["output_type"] == "generate_until"
    # generate() itself stops there too, whatever the scored directory's generation config says (EOS, <turn|>)
    tokenizer = load_tokenizer(config.tokenizer_ref)
    assert loaded["generation_kwargs"]["eos_token_id"] == [1, tokenizer.convert_tokens_to_ids("<turn|>")]


def test_the_answer_loss_task_scores_the_reference_with_its_end_of_turn(task):
    import yaml

    config, directory = task
    loaded = yaml.safe_load(open(f"{directory}/heldout_loss.yaml").read().replace("!function ", ""))
    assert loaded["output_type"] == "loglikelihood" and loaded["target_delimiter"] == ""
    assert loaded["doc_to_target"] == "{{reference}}<turn|>"  # the end of turn is trained: it is scored too
    assert loaded["process_results"] == "heldout_utils.answer_loss"
    docs = [json.loads(line) for line in open(f"{directory}/heldout.jsonl")]
    assert all(0 < d["answer_tokens"] < len(d["reference"]) + 2 for d in docs)


def hf_backend(model: str, tasks: list[str], include_path: str, batch_size: int = 2, results_only: bool = True,
               **kwargs) -> dict:  # fmt: skip
    """lm-eval's own Hugging Face backend (`lm_eval --model hf`) on a model directory: the results per task (or
    all it returns, the samples too with log_samples)."""
    import lm_eval

    from evaluation.before_after import HELDOUT_TASKS, task_manager

    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={model},dtype=float32", tasks=tasks, device="cpu", batch_size=batch_size,
        task_manager=task_manager(include_path, named=set(tasks) != set(HELDOUT_TASKS)), bootstrap_iters=0, **kwargs,
    )  # fmt: skip
    return out["results"] if results_only else out


@pytest.mark.slow
def test_the_job_model_scores_as_lm_evals_own_hf_backend(task, tiny_assets, gloo_rank):
    """The base model, FSDP-wrapped as the job trains it, against `lm_eval --model hf` on its directory: the
    answers' metrics equal, the answers' loss (log-likelihoods) within 1e-4."""
    from evaluation.before_after import HELDOUT_TASKS, Plan, score

    config, directory = task
    trainee, _ = build(config)
    ours = score(trainee, Plan(directory, (), True, None), batch_size=2)
    theirs = hf_backend(tiny_assets["model"], list(HELDOUT_TASKS), directory)
    assert set(ours["heldout"]["metrics"]) == {"exact_match", "rouge_l", "chrf"} and ours["heldout"]["samples"] == 4
    assert ours["heldout"]["metrics"] == {n: pytest.approx(theirs["heldout"][f"{n},none"], abs=1e-9)
                                          for n in ours["heldout"]["metrics"]}  # fmt: skip
    assert 0 < ours["heldout"]["metrics"]["rouge_l"] < 1 and ours["heldout"]["metrics"]["chrf"] > 0
    loss = ours["heldout_loss"]["metrics"]["loss"]
    assert loss == pytest.approx(theirs["heldout_loss"]["loss,none"], abs=1e-4) and 2 < loss < 20


@pytest.fixture
def base_without_end_of_turn(tiny_assets, tmp_path) -> str:
    """A base that ends its answers with the end of turn, in a directory whose generation config stops at EOS
    alone (as a hub id's or an older export's may): only the task's own stop rule can end them there. The tiny
    base never says `<turn|>` in 128 tokens, so its row is made 1.5 times a word's it says often: where that word
    would win, the end of turn wins."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    generation = json.loads((Path(tiny_assets["model"]) / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    end_of_turn = tokenizer.convert_tokens_to_ids("<turn|>")
    assert generation["eos_token_id"] == [1, end_of_turn]  # the tiny assets stop as Gemma 4's do: EOS or <turn|>
    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)
    table = model.get_input_embeddings().weight  # (tied: the output head's rows too)
    with torch.no_grad():
        table[end_of_turn] = 1.5 * table[tokenizer.convert_tokens_to_ids("after")]
    model.generation_config.eos_token_id = 1
    base = tmp_path / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    return str(base)


@pytest.mark.slow
def test_the_base_answers_as_lm_eval_on_a_directory_whose_config_does_not_stop_at_the_end_of_turn(
    base_without_end_of_turn, tiny_assets, tmp_path, gloo_rank
):
    """The base scored in the job (its model stops at the end of turn, as the export does) and by lm-eval's hf
    backend on its directory, all 5 held-out records at the job's batch size: the same answers, word for word.
    lm-eval decodes answers without special tokens, so `until: [<turn|>]` alone never cuts them; the task's
    generate() is given the end of turn's id (render.stop_token_ids)."""
    from data.render import load_tokenizer
    from evaluation.before_after import HELDOUT_TASKS, TASK, Plan, score
    from evaluation.heldout_task import write_task
    from training.samples import NEW_TOKENS

    config = settings({"model": base_without_end_of_turn, "dataset": tiny_assets["dataset"]})
    directory = write_task(config, load_tokenizer(config.tokenizer_ref), str(tmp_path / "run"))
    trainee, _ = build(config)
    ours = score(trainee, Plan(directory, (), True, None), batch_size=config.batch_size)
    theirs = hf_backend(base_without_end_of_turn, list(HELDOUT_TASKS), directory, log_samples=True,
                        batch_size=config.batch_size, results_only=False)  # fmt: skip
    answers = [s["filtered_resps"][0] for s in sorted(theirs["samples"][TASK], key=lambda s: s["doc_id"])]
    assert ours["heldout"]["samples"] == len(answers) == 5 and all(answers)
    assert sum(len(a.split()) for a in answers) < 5 * NEW_TOKENS / 2  # the answers ended at their end of turn
    assert ours["heldout"]["metrics"] == {n: pytest.approx(theirs["results"][TASK][f"{n},none"], abs=1e-9)
                                          for n in ours["heldout"]["metrics"]}  # fmt: skip


@pytest.mark.slow
def test_a_lora_run_scores_as_its_merged_export(task, tiny_assets, tmp_path, gloo_rank):
    """LoRA's adapters are live in the job's forward pass; the export merges them: the job's scores of the trained
    adapters equal lm-eval's hf backend on the merged export (the answers' metrics, the loss within 1e-4)."""
    import pyarrow.fs

    from evaluation.before_after import HELDOUT_TASKS, Plan, score
    from tests.inprocess import run
    from training.checkpoints import export_pretrained

    _, directory = task
    trainee, _ = run(settings(tiny_assets, "--lora", "--lr", "1e-2", "--eval-samples", "0"), epochs=1)
    ours = score(trainee, Plan(directory, (), True, None), batch_size=2)
    export_pretrained(trainee.model, trainee.tokenizer, pyarrow.fs.LocalFileSystem(), str(tmp_path / "export"),
                      trainee.lora)  # fmt: skip
    theirs = hf_backend(str(tmp_path / "export"), list(HELDOUT_TASKS), directory)
    assert ours["heldout"]["metrics"] == {n: pytest.approx(theirs["heldout"][f"{n},none"], abs=1e-9)
                                          for n in ours["heldout"]["metrics"]}  # fmt: skip
    assert ours["heldout_loss"]["metrics"]["loss"] == pytest.approx(theirs["heldout_loss"]["loss,none"], abs=1e-4)


CHOICE_TASK = {
    "task": "tiny_choice", "dataset_path": "json", "test_split": "test", "output_type": "multiple_choice",
    "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
    "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}, {"metric": "brier_score"}], "metadata": {"version": 1},
}  # fmt: skip


@pytest.mark.slow
def test_a_named_multiple_choice_task_scores_as_lm_evals_own_hf_backend(tiny_assets, tmp_path, gloo_rank):
    """A task lm-eval knows by name (here from an include path: the Hub is out of reach), loglikelihood-based and
    in the chat template, as --eval-tasks runs hellaswag or arc_easy."""
    import yaml

    from evaluation.before_after import Plan, score

    records = tmp_path / "choice.jsonl"
    records.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in [
        ("What colour is the sky?", ["blue", "green", "a fish"], 0), ("2 + 2 =", ["3", "4", "22"], 1),
        ("The capital of France is", ["Berlin", "Paris", "Rome"], 1), ("Ice is", ["cold", "hot", "loud"], 0),
        ("A cat says", ["woof", "moo", "meow"], 2)]))  # fmt: skip
    (tmp_path / "tiny_choice.yaml").write_text(yaml.safe_dump(CHOICE_TASK | {
        "dataset_kwargs": {"data_files": {"test": str(records)}}}))  # fmt: skip
    trainee, _ = build(settings(tiny_assets))
    ours = score(trainee, Plan(None, ("tiny_choice",), True, 4, include_path=str(tmp_path)), batch_size=2)
    theirs = hf_backend(tiny_assets["model"], ["tiny_choice"], str(tmp_path), limit=4, apply_chat_template=True)
    assert ours["tiny_choice"]["samples"] == 4 and set(ours["tiny_choice"]["metrics"]) == {"acc", "acc_norm",
                                                                                          "brier_score"}  # fmt: skip
    # brier_score: the choices' softmaxed log-likelihoods against the answer, so it moves with every log-likelihood
    assert ours["tiny_choice"]["metrics"] == {n: pytest.approx(theirs["tiny_choice"][f"{n},none"], abs=1e-4)
                                              for n in ("acc", "acc_norm", "brier_score")}  # fmt: skip


class Recorder:
    """An evaluation hook (evaluation.BeforeAfter's two calls) that records what the run asks of it."""

    def __init__(self):
        self.scored, self.finished = 0, []

    def score(self, run) -> dict:
        self.scored += 1
        return {"rouge_l": float(self.scored)}

    def finish(self, base, tuned, step) -> None:
        self.finished.append((base, tuned))


def test_the_base_is_scored_before_the_first_step_and_a_resume_reads_it_back(tiny_assets, tmp_path, gloo_rank):
    from tests.inprocess import run

    config = settings(tiny_assets, "--epochs", "2", "--eval-samples", "0")
    first, second = Recorder(), Recorder()
    run(config, epochs=1, root=str(tmp_path), evaluation=first)  # stopped after epoch 1 of 2: no "after" yet
    assert (first.scored, first.finished) == (1, [])
    run(config, root=str(tmp_path), resume_from=str(tmp_path / "checkpoint_epoch_0001"), evaluation=second)
    assert second.scored == 1 and second.finished == [({"rouge_l": 1.0}, {"rouge_l": 1.0})]  # the base read back


def test_the_walkthrough_and_eval_tasks_none_write_no_task(tiny_assets, tmp_path):
    """The walkthrough's run (no held-out split, no chat template) is unchanged: nothing to score, nothing written."""
    from data.render import load_tokenizer
    from evaluation.heldout_task import write_task

    tokenizer = load_tokenizer(tiny_assets["model"])
    for flags in (("--recipe", "walkthrough"), ("--eval-tasks", "none")):
        assert write_task(settings(tiny_assets, *flags), tokenizer, str(tmp_path / "run")) is None
    assert not (tmp_path / "run").exists()


def test_the_served_evaluation_compares_only_what_an_endpoint_scores():
    """rescore.py's rows: a held-out pictures-and-sound task and a DPO run's pairs are the job's alone, so a served
    evaluation of a media run reports none of their rows as a disagreement; a text task the endpoint missed is one."""
    import rescore

    tasks = {"heldout": {"metrics": {"chrf": {"base": 10.0, "fine_tuned": 20.0}}},
             "heldout_media": {"metrics": {"chrf": {"base": 8.2, "fine_tuned": 31.0}}},
             "heldout_pairs": {"metrics": {"accuracy": {"base": 0.5, "fine_tuned": 0.9}}}}  # fmt: skip
    rows = rescore.compared(tasks, {"heldout": {"metrics": {"chrf": 20.0}}}, base=False)
    assert rows == [("heldout", "chrf", 20.0, 20.0)] and rescore.disagreements(rows, 1e-4) == []
    assert rescore.disagreements(rescore.compared(tasks, {}, base=True), 1e-4) == [
        "heldout chrf: - here, 10.000000 in the run"
    ]
