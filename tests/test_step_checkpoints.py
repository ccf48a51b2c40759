"""Hours-long runs lose minutes, not epochs: checkpoints every --save-every steps, an exact resume from
the middle of an epoch, a save on SIGTERM whose request rides on the step's count all-reduce, and
--max-steps. In processes of their own on gloo, without Ray (the e2e test in test_jobs.py sends the
signal through Ray and the pods' preStop hook)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.inprocess import attempt, settings

FLAGS = ("--max-steps", "9", "--save-every", "4", "--eval-every", "5", "--eval-samples", "1", "--num-workers", "2")


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory) -> dict:
    """The uninterrupted run: 9 steps on 2 ranks (6 steps an epoch), saves at 4, 6 (an epoch's end) and 8."""
    root = tmp_path_factory.mktemp("straight")
    return attempt(settings(tiny_assets, *FLAGS), 2, str(root)) | {"root": root}


def step_of(checkpoint: Path) -> int:
    return json.loads((checkpoint / "train_state.json").read_text())["step"]


def go_on(config, root: Path) -> dict:
    """A new attempt from the latest checkpoint under `root`, as Ray Train's restart takes it."""
    latest = max((d for d in root.iterdir() if (d / "train_state.json").exists()), key=step_of)
    return attempt(config, 2, str(root), resume_from=str(latest)) | {"from": step_of(latest)}


def same_run(resumed: dict, straight: dict) -> None:
    assert resumed["ended"] == "done" and resumed["state"]["step"] == 9
    for name, tensor in straight["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    for key in ("history", "evals"):
        got, want = resumed["state"][key], straight["state"][key]
        assert [sorted(g) for g in got] == [sorted(w) for w in want], key
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=1e-6), key


def test_the_run_stops_at_max_steps_past_the_epochs_and_saves_every_n_steps(straight):
    state = straight["state"]
    assert straight["ended"] == "done" and straight["seen"] == list(range(1, 10))
    assert [h["step"] for h in state["history"]] == [6, 9] and [h["steps"] for h in state["history"]] == [6, 3]
    assert [e["step"] for e in state["evals"]] == [5, 6, 9]  # every 5 steps and each epoch's end
    saved = sorted(d.name for d in straight["root"].iterdir())
    assert saved == ["checkpoint_epoch_0001", "checkpoint_step_0000004", "checkpoint_step_0000008",
                     "checkpoint_step_0000009"]  # fmt: skip


def test_a_lost_worker_goes_on_from_the_last_save_mid_epoch_to_the_same_weights(tiny_assets, straight, tmp_path):
    """Rank 0 is lost after step 5; the next attempt goes on from step 4's save, in the middle of epoch 1:
    the sampler's position, the schedule's, the epoch's running sums and the progress line's come back."""
    config = settings(tiny_assets, *FLAGS)
    lost = attempt(config, 2, str(tmp_path), stop={0: (5, "crash")})
    resumed = go_on(config, tmp_path)
    assert lost["ended"] == "ConnectionError" and resumed["from"] == 4
    assert resumed["seen"] == [5, 6, 7, 8, 9]  # one step done again
    same_run(resumed, straight)


def test_sigterm_on_one_rank_saves_the_next_step_on_every_rank_and_nothing_is_redone(tiny_assets, straight, tmp_path):
    """Rank 1 is sent SIGTERM after step 2; the request reaches rank 0 through step 3's count all-reduce:
    both finish step 3, save it and stop; the next attempt goes on from step 3."""
    config = settings(tiny_assets, *FLAGS)
    stopped = attempt(config, 2, str(tmp_path), stop={1: (2, "sigterm")})
    assert stopped["ended"] == "StopRequested" and stopped["seen"] == [1, 2, 3]
    assert sorted(d.name for d in tmp_path.iterdir()) == ["checkpoint_step_0000003"]
    resumed = go_on(config, tmp_path)
    assert resumed["from"] == 3 and resumed["seen"] == [4, 5, 6, 7, 8, 9]
    same_run(resumed, straight)
