"""The before/after evaluation (jobs/evaluation.py): the held-out task the job writes, scored by the job's own
model through lm-eval, agrees with lm-eval's own Hugging Face backend on the same weights and task YAML."""

from __future__ import annotations

import json

import pytest

from tests.inprocess import build, settings


@pytest.fixture
def task(tiny_assets, tmp_path):
    """The held-out task of the tiny data's 5 held-out records, written as a run writes it."""
    from evaluation import write_task
    from render import load_tokenizer

    config = settings(tiny_assets, "--eval-limit", "4")
    return config, write_task(config, load_tokenizer(config.tokenizer_ref), str(tmp_path / "run"))


def test_the_held_out_task_asks_in_the_chat_template_and_stops_at_the_end_of_turn(task):
    import yaml

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


@pytest.mark.slow
def test_the_job_model_scores_as_lm_evals_own_hf_backend(task, tiny_assets, gloo_rank):
    """The base model, FSDP-wrapped as the job trains it, against `lm_eval --model hf` on its directory."""
    import lm_eval
    from evaluation import TASK, score
    from lm_eval.tasks import TaskManager

    config, directory = task
    trainee, _ = build(config)
    ours = score(trainee, directory, batch_size=2)
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tiny_assets['model']},dtype=float32", tasks=[TASK], device="cpu",
        task_manager=TaskManager(include_path=directory), batch_size=2, bootstrap_iters=0,
    )["results"][TASK]  # fmt: skip
    assert set(ours) == {"exact_match", "rouge_l", "chrf"}
    assert ours == {name: pytest.approx(float(theirs[f"{name},none"]), abs=1e-9) for name in ours}
    assert 0 < ours["rouge_l"] < 1 and ours["chrf"] > 0  # something was answered


class Recorder:
    """An evaluation hook (evaluation.BeforeAfter's two calls) that records what the run asks of it."""

    def __init__(self):
        self.scored, self.finished = 0, []

    def score(self, trainee) -> dict:
        self.scored += 1
        return {"rouge_l": float(self.scored)}

    def finish(self, base, tuned) -> None:
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
    from evaluation import write_task
    from render import load_tokenizer

    tokenizer = load_tokenizer(tiny_assets["model"])
    for flags in (("--recipe", "walkthrough"), ("--eval-tasks", "none")):
        assert write_task(settings(tiny_assets, *flags), tokenizer, str(tmp_path / "run")) is None
    assert not (tmp_path / "run").exists()
