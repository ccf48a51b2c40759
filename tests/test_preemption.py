"""A preemption handled through Ray 2.60's own drain: the pods' preStop hook drains the pod's Ray node, Ray
Train's preemption watcher tells every worker, every rank saves the step it is in, and at the drain's
deadline Ray Train restarts the run from that save on a node that is not draining, charged to
max_preemption_failures and not to maxFailures.

The end-to-end test drains one node of a real multi-node Ray cluster on this machine (tests/ray_nodes.py)
with the manifest's own preStop command; the others show the hook's fallback and the sizes GKE grants."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infra.resources import stop_hook
from tests.ray_nodes import RayNodes

JOBS = Path(__file__).resolve().parent.parent / "jobs"
DRAIN_S = 10  # the drain's deadline: long enough for the notice, the step and its save on a loaded 2-core machine
# (at 6 s, one CI run's save on the notice was cut off by the deadline: rank 1's shard never came)
STEPS = 24


def processes_under(root: int) -> list[int]:
    return [pid for pid in stop_hook._under(root) if stop_hook._cmdline(pid).startswith(stop_hook.WORKER_TITLE)]


def wait_for_workers(raylets: list[int], other_than: set[int], timeout_s: float = 60) -> dict[int, list[int]]:
    """{raylet: its RayTrainWorker pids} once some worker not in `other_than` lives under one of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {raylet: processes_under(raylet) for raylet in raylets}
        if any(set(pids) - other_than for pids in found.values()):
            return found
        time.sleep(0.2)
    raise AssertionError(f"no Ray Train workers started under {raylets}")


@pytest.fixture(scope="module")
def drained(tiny_assets, tmp_path_factory) -> dict:
    """2 training workers on one of two worker nodes (2 CPUs each; the head has none), 24 steps. After step 4
    the manifest's preStop command runs for that node ("its pod"), as the kubelet runs it on a Spot
    preemption; the run goes on to its end."""
    storage = tmp_path_factory.mktemp("runs")
    flags = ["--backend", "cpu", "--num-workers", "2", "--model", tiny_assets["model"], "--dataset",
             tiny_assets["dataset"], "--split", "train[:80]", "--seq-len", "128", "--lr", "1e-3", "--storage-path",
             str(storage), "--run-name", "drained", "--max-steps", str(STEPS), "--log-every", "1", "--eval-samples",
             "0", "--max-failures", "0", "--eval-tasks", "none"]  # fmt: skip
    with RayNodes(nodes=2, cpus=2) as nodes:
        driver = subprocess.Popen([sys.executable, str(JOBS / "ray_train_llm_finetune.py"), *flags], env=nodes.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        lines, hook, before = [], None, {}
        for line in driver.stdout:
            lines.append(line)
            if hook is None and re.search(r"step 4/\d+ \(", line):
                before = wait_for_workers(nodes.raylets, set())
                pod = next(raylet for raylet, pids in before.items() if pids)
                command = stop_hook.command(DRAIN_S)
                hook = subprocess.Popen([sys.executable, *command[1:], str(pod)], env=nodes.env,
                                        stdout=subprocess.PIPE, text=True)  # fmt: skip
                after = {}
            if hook is not None and not after and "resuming from" in line:
                after = wait_for_workers(nodes.raylets, {p for pids in before.values() for p in pids})
        driver.wait(timeout=240)
        hook_output = hook.communicate(timeout=60)[0]
    return {"logs": "".join(lines), "returncode": driver.returncode, "pod": pod, "before": before, "after": after,
            "hook": hook_output, "run_dir": storage / "drained", "export": storage / "drained" / "model"}  # fmt: skip


@pytest.mark.e2e
def test_a_drained_node_saves_the_step_and_ray_train_moves_the_run_off_it(drained):
    logs = drained["logs"]
    assert drained["returncode"] == 0, logs[-4000:]
    assert f"drained this pod's Ray node with a {DRAIN_S} s deadline; 2 Ray Train workers here" in drained["hook"]
    assert "PreemptionWatcher: preemption detected" in logs
    # charged to the preemptions (unlimited), not to maxFailures, which is 0 here
    assert "Source: preemption" in logs and "Training was interrupted by node preemption" in logs
    saved = int(re.search(r"preemption notice: step (\d+) saved", logs)[1])
    # (named by its step, or by its epoch when the notice came at an epoch's last step)
    resumed = int(re.search(r"resuming from \S+checkpoint_(?:step|epoch)_\d+ after step (\d+)", logs)[1])
    assert resumed == saved
    first = re.search(r"\(RayTrainWorker pid=(\d+)\)[^\n]*step 1/", logs)[1]
    trained_before = [int(s) for s in re.findall(rf"\(RayTrainWorker pid={first}\)[^\n]*step (\d+)/\d+ \(", logs)]
    assert max(trained_before) - resumed <= 1  # at most one step done again
    assert 4 <= saved < STEPS
    # the new group went to the node that was not draining
    (other,) = set(drained["before"]) - {drained["pod"]}
    assert drained["after"][drained["pod"]] == [] and len(drained["after"][other]) == 2


@pytest.mark.e2e
def test_each_checkpoint_holds_every_ranks_own_shard(drained):
    """No rank gathers the model to save: through Ray Train's report, rank 0 writes about half of a 2-rank
    checkpoint (the notice's save and the last)."""
    import json

    # a checkpoint is a directory with train_state.json, written once every shard is in (checkpoints.committer)
    saves = sorted(p.parent for p in drained["run_dir"].glob("checkpoint_*/train_state.json"))
    assert saves
    for save in saves:
        shards = {f.name: f.stat().st_size for f in save.glob("*.distcp")}
        assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"], save
        assert shards["__0_0.distcp"] < 0.6 * sum(shards.values())
        assert not list(save.glob("*.safetensors")) and (save / ".metadata").exists()
        assert json.loads((save / "train_state.json").read_text())["world_size"] == 2


@pytest.mark.e2e
def test_the_drained_run_exports_the_weights_of_a_straight_one(drained, tiny_assets):
    from safetensors.torch import load_file

    from tests.inprocess import settings, train_each

    config = settings(tiny_assets, "--num-workers", "2", "--max-steps", str(STEPS), "--eval-samples", "0")
    (straight,) = train_each([config], world=2)
    exported = load_file(drained["export"] / "model.safetensors")
    assert exported.keys() <= straight["model"].keys() and len(exported) > 10
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, straight["model"][name], rtol=1e-4, atol=1e-4, msg=name)


def test_the_drain_waits_for_its_cli_up_to_the_deadline_less_2_s_and_at_most_15(monkeypatch):
    """`ray drain-node`'s own start (a Python importing Ray's CLI) took over 5 s under the suite's load, and the
    hook fell back to SIGTERM: it may take the drain's deadline less 2 s (Autopilot Spot's 10 s: 8), at most 15."""
    given = []

    def run(command, **kwargs):
        given.append(kwargs["timeout"])
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    raylet = b"/ray/core/src/ray/raylet/raylet\0--node_id=ab12\0--gcs-address=10.0.0.2:6379\0"
    assert [stop_hook._drain(raylet, s) for s in (4, 10, 105)] == [None] * 3 and given == [5, 8, 15]


def test_without_a_raylet_the_hook_falls_back_to_sigterm_for_the_training_workers(tmp_path):
    """A pod whose raylet cannot be found (or drained): its RayTrainWorker processes are sent SIGTERM, which
    the training turns into save-and-stop (jobs/training/stopping.py), and the hook returns once they have ended."""
    worker = subprocess.Popen(
        [stop_hook.WORKER_TITLE.decode(), "-c",
         "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(60)"],
        executable=sys.executable,
    )  # fmt: skip
    try:
        time.sleep(0.3)
        started = time.monotonic()
        command = stop_hook.command(30)
        hook = subprocess.run([sys.executable, *command[1:], str(worker.pid)], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert "no drain (no raylet found in this pod); asked 1 Ray Train workers to save and stop" in hook.stdout
        assert worker.wait(timeout=10) == 0 and time.monotonic() - started < 10
    finally:
        worker.kill()
