"""Hours-long runs lose minutes, not epochs: checkpoints every --save-every steps, an exact resume from
the middle of an epoch, a save on SIGTERM whose request rides on the step's count all-reduce, and
--max-steps. Two gloo ranks in processes of their own, without Ray, every attempt in the same two
processes (the e2e test in test_jobs.py sends the signal through Ray and the pods' preStop hook)."""

from __future__ import annotations

import pytest
import torch

from tests.inprocess import attempts, settings

FLAGS = ("--max-steps", "9", "--save-every", "4", "--eval-every", "5", "--eval-samples", "0", "--num-workers", "2")


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory) -> dict:
    """9 steps (6 an epoch): uninterrupted; lost after step 5 (both ranks, as Ray Train ends a group), then
    on from the latest save; rank 1 sent SIGTERM after step 2, then on from the latest save."""
    roots = {name: str(tmp_path_factory.mktemp(name)) for name in ("straight", "lost", "stopped", "preempted")}
    plan = [
        {"root": roots["straight"]},
        {"root": roots["lost"], "stop": {0: (5, "crash"), 1: (5, "crash")}},
        {"root": roots["lost"], "resume": True},
        {"root": roots["stopped"], "stop": {1: (2, "sigterm")}},
        {"root": roots["stopped"], "resume": True},
        # Ray Train's watcher marks every worker, each when its call arrives: rank 1 after step 2, rank 0 after 3
        {"root": roots["preempted"], "stop": {1: (2, "preempt"), 0: (3, "preempt")}},
        {"root": roots["preempted"], "resume": True},
    ]
    straight, lost, after_loss, stopped, after_stop, preempted, after_notice = attempts(
        settings(tiny_assets, *FLAGS), 2, plan
    )
    return {"straight": straight, "lost": lost, "after_loss": after_loss, "stopped": stopped,
            "after_stop": after_stop, "preempted": preempted, "after_notice": after_notice, "roots": roots}  # fmt: skip


def same_run(resumed: dict, straight: dict) -> None:
    assert resumed["ended"] == "done" and resumed["state"]["step"] == 9
    for name, tensor in straight["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    for key in ("history", "evals"):
        got, want = resumed["state"][key], straight["state"][key]
        assert [sorted(g) for g in got] == [sorted(w) for w in want], key
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=1e-6), key


@pytest.mark.slow  # (the two ranks' attempts, one after another: tens of seconds)
def test_the_run_stops_at_max_steps_past_the_epochs_and_saves_every_n_steps(runs):
    from pathlib import Path

    straight = runs["straight"]
    state = straight["state"]
    assert straight["ended"] == "done" and straight["seen"] == list(range(1, 10))
    assert [h["step"] for h in state["history"]] == [6, 9] and [h["steps"] for h in state["history"]] == [6, 3]
    assert [e["step"] for e in state["evals"]] == [5, 6, 9]  # every 5 steps and each epoch's end
    saved = sorted(d.name for d in Path(runs["roots"]["straight"]).iterdir())
    assert saved == ["checkpoint_epoch_0001", "checkpoint_step_0000004", "checkpoint_step_0000008",
                     "checkpoint_step_0000009"]  # fmt: skip


@pytest.mark.slow  # (the two ranks' attempts, one after another: tens of seconds)
def test_a_lost_worker_goes_on_from_the_last_save_mid_epoch_to_the_same_weights(runs):
    """The sampler's position, the schedule's, the epoch's running sums and the progress line's come back
    from step 4's save, in the middle of epoch 1."""
    assert runs["lost"]["ended"] == "ConnectionError" and runs["lost"]["seen"] == [1, 2, 3, 4, 5]
    resumed = runs["after_loss"]
    assert resumed["from"] == "checkpoint_step_0000004" and resumed["seen"] == [5, 6, 7, 8, 9]  # 1 step again
    same_run(resumed, runs["straight"])


@pytest.mark.slow  # (the two ranks' attempts, one after another: tens of seconds)
def test_sigterm_on_one_rank_saves_the_next_step_on_every_rank_and_nothing_is_redone(runs):
    """Rank 1 is sent SIGTERM after step 2; the request reaches rank 0 through step 3's count all-reduce:
    both finish step 3, save it and stop; the next attempt goes on from step 3."""
    assert runs["stopped"]["ended"] == "StopRequested" and runs["stopped"]["seen"] == [1, 2, 3]
    resumed = runs["after_stop"]
    assert resumed["from"] == "checkpoint_step_0000003" and resumed["seen"] == [4, 5, 6, 7, 8, 9]
    same_run(resumed, runs["straight"])


def test_a_restart_keeps_the_answers_up_to_its_step_and_refuses_a_checkpoint_without_steps(tmp_path):
    import json

    import pyarrow.fs

    from runtime.run_files import SampleLog, last_samples
    from training.training_run import resumed_state

    path = tmp_path / "samples.jsonl"
    answer = {"prompt": "p", "completion": "c", "reference": "r"}
    first = SampleLog(pyarrow.fs.LocalFileSystem(), str(path), resumed_step=0)
    first.add(5, [answer])
    first.add(10, [answer, answer])  # answered, then lost with the steps after the save at 8
    again = SampleLog(pyarrow.fs.LocalFileSystem(), str(path), resumed_step=8)
    again.add(10, [answer | {"completion": "again"}])
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [5, 10]
    assert last_samples(str(path)) == [{"step": 10, **answer, "completion": "again"}]

    fresh = resumed_state({}, 2)
    assert (fresh.epoch, fresh.step, fresh.history, fresh.evals, fresh.attempt, fresh.world_size) == (
        0,
        0,
        (),
        (),
        1,
        2,
    )
    assert resumed_state({"epoch": 1, "step": 6, "attempt": 2, "world_size": 4}, 2).attempt == 3
    with pytest.raises(RuntimeError, match="did not record its step; start a new run"):
        resumed_state({"epoch": 1, "history": [], "attempt": 1, "world_size": 2}, 2)


@pytest.mark.slow  # (the two ranks' attempts, one after another: tens of seconds)
def test_a_preemption_notice_saves_the_next_step_on_every_rank_then_waits_for_ray_trains_restart(runs):
    """Rank 1's notice rides on step 3's count all-reduce: both ranks save step 3, then wait for Ray Train to
    restart them at the drain's deadline, not raising (a worker error would be charged to maxFailures);
    without a Ray Train here they give up at the deadline. The restart goes on from step 3."""
    preempted = runs["preempted"]
    assert preempted["ended"] == "StopRequested" and preempted["seen"] == [1, 2, 3]
    assert "preempted after step 3 (its checkpoint is saved), and not restarted by Ray Train" in preempted["why"]
    resumed = runs["after_notice"]
    assert resumed["from"] == "checkpoint_step_0000003" and resumed["seen"] == [4, 5, 6, 7, 8, 9]
    same_run(resumed, runs["straight"])
