"""A run stopped and resumed for real on the Ray head: job 1 stopped after epoch 1's checkpoint, job 2 (the same
command) resuming from it, its worker group restarted by Ray Train after a SIGTERM; the losses, the metrics, the
checkpoints and the export against the uninterrupted run's. Apart from tests/test_jobs.py so that the two share the
suite's two workers (each file goes to one)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from infra.runner.ray_jobs import parse_result


@pytest.fixture(scope="module")
def dolly432(tmp_path_factory) -> str:
    """Four and a half times the tiny data: epochs of ~1.5 s on one worker, long enough to stop a job
    after its first and to lose a worker in the middle of one."""
    from tiny_assets import make_dataset

    return str(make_dataset(tmp_path_factory.mktemp("data") / "dolly432.jsonl", rows=432))


def finetune_args(tiny_assets, dataset: str, storage: Path, run_name: str) -> list[str]:
    return [
        "--backend", "cpu", "--num-workers", "1", "--batch-size", "8", "--model", tiny_assets["model"], "--dataset",
        dataset,
        "--split", "train[:384]", "--seq-len", "128", "--lr", "1e-3", "--storage-path", str(storage),
        "--run-name", run_name, "--log-every", "1", "--eval-samples", "0",  # (the README's run has samples)
        "--eval-tasks", "none",  # (and the before/after evaluation)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_assets, dolly432) -> list[dict]:
    """The uninterrupted run the resumed one must match: the same settings on a gloo rank in a process of its
    own (the same per-worker code, without Ray), 3 epochs."""
    from tests.inprocess import settings, train_ranks

    config = settings({"model": tiny_assets["model"], "dataset": dolly432}, "--split", "train[:384]",
                      "--batch-size", "8")  # fmt: skip
    return train_ranks(config, world=1, epochs=3)["history"]


def losses(history: list[dict], key: str = "loss") -> list[float]:
    return [h[key] for h in history]


@pytest.fixture(scope="module")
def resumed(ray_head, tiny_assets, dolly432, tmp_path_factory) -> dict:
    """Job 1 is stopped (as the job resource stops one at its timeout) once epoch 1's checkpoint is in.
    Job 2, the same command, resumes from job 1's last checkpoint; once it has trained a few steps
    more, its RayTrainWorkers are sent SIGTERM (as by hand, or by a cluster without the pods' preStop
    hook, whose drain tests/test_preemption.py covers on nodes of their own: draining this shared head
    would stop every other test's jobs): they finish the step, save it and stop, and Ray Train restarts
    the group from that checkpoint inside the same job."""
    import os
    import re
    import signal
    import time
    import uuid

    from ray.util.state import list_actors

    from infra.runner import job_client
    from infra.runner.ray_jobs import JOBS_DIR, UPLOAD_EXCLUDES
    from infra.training import local_target

    storage = tmp_path_factory.mktemp("ckpt")
    client = job_client.connect(local_target(ray_head.dashboard_url))
    command = "python ray_train_llm_finetune.py " + " ".join(finetune_args(tiny_assets, dolly432, storage, "run"))

    def submit(name: str) -> str:
        return client.submit_job(entrypoint=command, submission_id=f"{name}-{uuid.uuid4().hex[:8]}",
                                 runtime_env={"working_dir": str(JOBS_DIR), "excludes": UPLOAD_EXCLUDES})  # fmt: skip

    def wait_for(done, job_id: str, deadline: float, every_s: float = 1.0) -> None:
        while not done():
            assert time.monotonic() < deadline and not client.get_job_status(job_id).is_terminal(), job_id
            time.sleep(every_s)  # (each look at the logs fetches them whole from the head: not too often)

    first = submit("stopped")
    snapshot, deadline = storage / "run" / "checkpoint_manager_snapshot.json", time.monotonic() + 120
    # (a local file: looked at often, so the stop lands in epoch 2, or at worst epoch 3, as a stop by hand would)
    wait_for(lambda: snapshot.exists() and "checkpoint_epoch_0001" in snapshot.read_text(), first, deadline, 0.1)
    client.stop_job(first)
    while not client.get_job_status(first).is_terminal():
        time.sleep(0.2)
    # The stop is graceful: on a busy machine it can land after epoch 2's checkpoint too.
    stopped_after = 2 if "checkpoint_epoch_0002" in snapshot.read_text() else 1

    second = submit("resumed")
    resumed_line = f"epoch {stopped_after} done (attempt 2)"
    wait_for(lambda: resumed_line in client.get_job_logs(second), second, time.monotonic() + 120)
    # Other tests' jobs may share the head. The driver's Ray job id can lag its logs on a busy head.
    wait_for(lambda: client.get_job_info(second).job_id, second, time.monotonic() + 60)
    job = client.get_job_info(second).job_id
    workers = list_actors(
        address=ray_head.dashboard_url,
        filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE"), ("job_id", "=", job)],
    )
    resumed_at = stopped_after * int(re.search(r"(\d+) steps an epoch", client.get_job_logs(second))[1])
    wait_for(lambda: f"step {resumed_at + 2}/" in client.get_job_logs(second), second, time.monotonic() + 120, 0.5)
    for worker in workers:
        os.kill(worker.pid, signal.SIGTERM)
    while not client.get_job_status(second).is_terminal():
        assert time.monotonic() < deadline + 240
        time.sleep(0.5)
    logs = client.get_job_logs(second)
    return {"status": str(client.get_job_status(second)), "logs": logs, "result": parse_result(logs),
            "storage": storage, "run_dir": storage / "run", "stopped_after": stopped_after,
            "workers_killed_from": len(workers), "resumed_at": resumed_at,
            "submissions": [j.submission_id for j in client.list_jobs() if (j.submission_id or "").startswith("resumed-")],
            "second": second}  # fmt: skip


def test_a_stopped_run_resumes_exactly_in_a_new_job_and_a_lost_worker_is_replaced(resumed, reference):
    """Weights, AdamW moments, RNG, data order and the schedule's step come back each time: the losses
    and eval losses match the uninterrupted run's."""
    assert resumed["workers_killed_from"] == 1
    assert resumed["status"] == "SUCCEEDED", resumed["logs"][-3000:]
    assert resumed["submissions"] == [resumed["second"]]  # one job: the group was restarted inside it
    assert "SIGTERM: this worker stops after the current step" in resumed["logs"]
    assert "StopRequested: stopped on request after step" in resumed["logs"]  # Ray Train restarted the group
    steps = [int(m) for m in re.findall(r"step (\d+)/\d+ \(", resumed["logs"].split("(attempt 2)", 1)[1])]
    assert len(steps) - len(set(steps)) <= 1 and max(steps) > resumed["resumed_at"] + 2  # at most one step again
    history = resumed["result"]["history"]
    # job 2 went on from job 1's last checkpoint (attempt 2), its restart from job 2's stop save (attempt 3); the
    # SIGTERM is sent two steps into job 2, and on a busy machine lands in the epoch after that one
    after, attempts = resumed["stopped_after"], [h["attempt"] for h in history]
    assert attempts[:after] == [1] * after and attempts[-1] == 3 and attempts == sorted(attempts), attempts
    assert set(attempts[after:]) <= {2, 3}
    assert losses(history) == pytest.approx(losses(reference), rel=1e-4)
    assert losses(history, "eval_loss") == pytest.approx(losses(reference, "eval_loss"), rel=1e-4)


def test_finetune_reports_falling_losses_throughputs_memory_and_utilisation(resumed):
    history = resumed["result"]["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[2]["loss"] < history[1]["loss"] < history[0]["loss"]
    assert history[2]["eval_loss"] < history[1]["eval_loss"] < history[0]["eval_loss"]  # held out, and better
    metrics = resumed["result"]["metrics"]
    assert metrics["epoch"] == 3 and history[-1] == metrics
    assert 0 < metrics["real_tokens_per_s"] <= metrics["tokens_per_s"]
    assert metrics["real_token_share"] > 0.9  # packed rows are nearly all text
    assert metrics["model_tflops_per_s_per_device"] > 0 and metrics["checkpoint_stall_s"] > 0
    assert metrics["mfu"] is None  # no peak is known for a CPU unless --peak-tflops says it
    assert (metrics["packing"], metrics["dtype"], metrics["recipe"]) == (True, "float32", "default")  # fp32 on CPU
    assert metrics["global_batch_rows"] == 8 and 0 < metrics["lr"] < 1e-3 and metrics["grad_norm"] > 0
    assert all(h["peak_memory_gib"] > 0 for h in history)  # the workers' resident high-water mark on CPU
    run_dir = resumed["run_dir"]
    assert resumed["result"]["loss_curve"] == str(run_dir / "loss.png")
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == history


def test_the_run_keeps_its_last_epochs_sharded_checkpoint(resumed):
    """Ray Train keeps the last epoch's checkpoint: the ranks' shards, no gathered model (2 ranks' shards through
    Ray Train: tests/test_preemption.py)."""
    (kept,) = resumed["result"]["checkpoints"]
    kept = Path(kept)
    assert kept == resumed["run_dir"] / "checkpoint_epoch_0003"
    assert sorted(f.name for f in kept.glob("*.distcp")) == ["__0_0.distcp"]
    assert not list(kept.glob("*.safetensors")) and (kept / ".metadata").exists()
    state = json.loads((kept / "train_state.json").read_text())
    assert (state["epoch"], state["world_size"]) == (3, 1)


def test_the_run_ends_with_one_loadable_model_holding_the_trained_weights(resumed, tiny_assets):
    """The export is from_pretrained-ready, includes the frozen per-layer table, equals the last shards,
    and carries the tokenizer's chat template and its end-of-turn token among the EOS ids."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = Path(resumed["result"]["checkpoint"])
    assert export == resumed["run_dir"] / "model"
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert (
        tokenizer.chat_template and tokenizer.convert_tokens_to_ids("<turn|>") in model.generation_config.eos_token_id
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_assets["model"])
    trained, untouched = model.state_dict(), base.state_dict()
    table = "model.language_model.embed_tokens_per_layer.weight"
    assert torch.equal(trained[table], untouched[table])  # frozen, and back in the export
    dcp_to_torch_save(resumed["run_dir"] / "checkpoint_epoch_0003", resumed["storage"] / "last.pt")
    shards = torch.load(resumed["storage"] / "last.pt", weights_only=False)["model"]
    buffers = {n for n, _ in base.named_buffers()} & trained.keys()  # constants: from the base model, as the table
    assert buffers and shards.keys() == trained.keys() - {table} - buffers
    for name, tensor in shards.items():
        assert torch.equal(tensor.to(trained[name].dtype), trained[name]), name
    assert not torch.equal(trained["model.language_model.layers.0.mlp.up_proj.weight"],
                           untouched["model.language_model.layers.0.mlp.up_proj.weight"])  # fmt: skip
