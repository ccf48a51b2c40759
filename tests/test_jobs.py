"""The two jobs for real on CPU: real Ray, torch.distributed on gloo, DTensor, FSDP2, Gemma 4."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from backend import RESULT_PREFIX

from infra.ray_jobs import parse_result

JOBS = Path(__file__).resolve().parent.parent / "jobs"


def run_job(head, script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(JOBS / script), *args],
        env=head.client_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_collectives_fail_on_a_broken_reference(ray_head):
    done = run_job(
        ray_head, "ray_core_collectives.py", "--backend", "cpu", "--num-workers", "4", "--reference-seed", "7"
    )
    assert done.returncode == 1
    result = parse_result(done.stdout)
    assert result["ok"] is False and result["parity_ok"] is False and result["sums_ok"] is True
    assert "FAIL" in done.stdout and "parity BROKEN" in done.stdout


@pytest.fixture(scope="module")
def dolly288(tmp_path_factory) -> str:
    """Three times the tiny data: epochs of ~1.5 s, long enough to lose a worker in the middle of one."""
    from tiny_assets import make_dataset

    return str(make_dataset(tmp_path_factory.mktemp("data") / "dolly288.jsonl", rows=288))


def finetune_args(tiny_assets, dataset: str, storage: Path, run_name: str) -> list[str]:
    return [
        "--backend", "cpu", "--num-workers", "2", "--model", tiny_assets["model"], "--dataset", dataset,
        "--split", "train", "--seq-len", "128", "--lr", "1e-3", "--storage-path", str(storage), "--run-name", run_name,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finetune(ray_head, tiny_assets, dolly288, tmp_path_factory):
    """The uninterrupted run the resumed and the restarted ones must match: 3 epochs."""
    storage = tmp_path_factory.mktemp("ckpt")
    done = run_job(ray_head, "ray_train_llm_finetune.py", *finetune_args(tiny_assets, dolly288, storage, "tiny"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"result": parse_result(done.stdout), "storage": storage, "run_dir": storage / "tiny"}


def test_finetune_reports_falling_loss_throughputs_and_utilisation(finetune):
    history = finetune["result"]["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3] and [h["attempt"] for h in history] == [1, 1, 1]
    assert history[2]["loss"] < history[1]["loss"] < history[0]["loss"]
    metrics = finetune["result"]["metrics"]
    assert metrics["epoch"] == 3 and history[-1] == metrics
    assert 0 < metrics["real_tokens_per_s"] <= metrics["tokens_per_s"]
    assert metrics["real_token_share"] > 0.9  # packed rows are nearly all text
    assert metrics["model_tflops_per_s_per_device"] > 0 and metrics["checkpoint_stall_s"] > 0
    assert metrics["mfu"] is None  # no peak is known for a CPU unless --peak-tflops says it
    assert (metrics["packing"], metrics["dtype"]) == (True, "float32")  # CPU computes in fp32


def test_finetune_writes_its_loss_curve_and_metrics_log(finetune):
    result, run_dir = finetune["result"], finetune["run_dir"]
    assert result["loss_curve"] == str(run_dir / "loss.png")
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines == result["history"]


def test_each_epoch_every_rank_writes_only_its_own_shard(finetune):
    """No rank gathers the model at an epoch boundary: rank 0 writes about half of a 2-rank checkpoint."""
    (kept,) = finetune["result"]["checkpoints"]
    kept = Path(kept)
    assert kept == finetune["run_dir"] / "checkpoint_epoch_0003"
    shards = {f.name: f.stat().st_size for f in kept.glob("*.distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"]
    assert shards["__0_0.distcp"] < 0.6 * sum(shards.values())
    assert not list(kept.glob("*.safetensors")) and (kept / ".metadata").exists()
    state = json.loads((kept / "train_state.json").read_text())
    assert (state["epoch"], state["world_size"]) == (3, 2)


def test_the_run_ends_with_one_loadable_model_holding_the_trained_weights(finetune, tiny_assets):
    """The export is from_pretrained-ready, includes the frozen per-layer table, and equals the last shards."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = Path(finetune["result"]["checkpoint"])
    assert export == finetune["run_dir"] / "model"
    model = AutoModelForCausalLM.from_pretrained(export)
    AutoTokenizer.from_pretrained(export)
    base = AutoModelForCausalLM.from_pretrained(tiny_assets["model"])
    trained, untouched = model.state_dict(), base.state_dict()
    table = "model.language_model.embed_tokens_per_layer.weight"
    assert torch.equal(trained[table], untouched[table])  # frozen, and back in the export
    dcp_to_torch_save(finetune["run_dir"] / "checkpoint_epoch_0003", finetune["storage"] / "last.pt")
    shards = torch.load(finetune["storage"] / "last.pt", weights_only=False)["model"]
    assert shards.keys() == trained.keys() - {table}
    for name, tensor in shards.items():
        assert torch.equal(tensor.to(trained[name].dtype), trained[name]), name
    assert not torch.equal(trained["model.language_model.layers.0.mlp.up_proj.weight"],
                           untouched["model.language_model.layers.0.mlp.up_proj.weight"])  # fmt: skip


def losses(history: list[dict]) -> list[float]:
    return [h["loss"] for h in history]


def test_a_new_job_resumes_exactly_and_a_lost_worker_is_replaced(ray_head, tiny_assets, dolly288, finetune, tmp_path):
    """Job 1 stops after epoch 1. Job 2 (same run, --epochs 3) resumes from that checkpoint; one of its
    RayTrainWorkers is killed by pid (found through Ray's state API) once it has resumed, before epoch
    2's checkpoint is in, and Ray Train restarts the group from epoch 1's checkpoint inside the same job. Weights, AdamW
    moments, RNG and data order come back each time: the losses match the uninterrupted run."""
    import os
    import signal
    import time
    import uuid

    from ray.util.state import list_actors

    from infra import job_client
    from infra.ray_jobs import JOBS_DIR, UPLOAD_EXCLUDES
    from infra.training import local_target

    args = finetune_args(tiny_assets, dolly288, tmp_path, "resumed")
    first = run_job(ray_head, "ray_train_llm_finetune.py", *args, "--epochs", "1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    epoch_lines = [line for line in (first.stdout + first.stderr).splitlines() if '{"rank": 0, "epoch"' in line]
    assert len(epoch_lines) == 1  # printed once: a worker's print is not echoed twice

    client = job_client.connect(local_target(ray_head.dashboard_url))
    job_id = client.submit_job(
        entrypoint="python ray_train_llm_finetune.py " + " ".join([*args, "--epochs", "3"]),
        submission_id=f"resume-{uuid.uuid4().hex[:8]}",
        runtime_env={"working_dir": str(JOBS_DIR), "excludes": UPLOAD_EXCLUDES},
    )
    deadline = time.monotonic() + 120
    while "after epoch 1 (attempt 2)" not in client.get_job_logs(job_id):  # the workers are up and resumed
        assert time.monotonic() < deadline and not client.get_job_status(job_id).is_terminal()
        time.sleep(0.1)
    workers = list_actors(
        address=ray_head.dashboard_url, filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")]
    )
    assert len(workers) == 2, workers
    os.kill(workers[-1]["pid"], signal.SIGKILL)

    while not client.get_job_status(job_id).is_terminal():
        assert time.monotonic() < deadline + 120
        time.sleep(0.5)
    logs = client.get_job_logs(job_id)
    assert str(client.get_job_status(job_id)) == "SUCCEEDED", logs[-3000:]
    assert [j.submission_id for j in client.list_jobs() if (j.submission_id or "").startswith("resume-")] == [job_id]
    assert "Training failed due to worker errors" in logs  # Ray Train saw the loss and restarted the group
    history = parse_result(logs)["history"]
    assert history[0] == parse_result(first.stdout)["history"][0]  # restored, not rerun
    # both starts of job 2 went on from epoch 1's checkpoint (attempt 1), so both are attempt 2
    assert [h["attempt"] for h in history] == [1, 2, 2]
    assert losses(history) == pytest.approx(losses(finetune["result"]["history"]), rel=1e-4)


BAD_INPUTS = {
    "unknown backend": (["--backend", "xla"], "--backend 'xla' is not supported; choose one of: tpu, cpu, cuda"),
    "unknown accelerator": (
        ["--backend", "tpu", "--accelerator-type", "TPU-V9"],
        "--accelerator-type 'TPU-V9' is not supported",
    ),
    "topology vs workers": (
        ["--backend", "tpu", "--topology", "4x4", "--num-workers", "8"],
        "--num-workers 8 does not match --topology 4x4 on TPU-V6E, which has 16 devices",
    ),
    "ironwood devices": (
        ["--backend", "tpu", "--topology", "2x2x2", "--accelerator-type", "TPU-V7X", "--num-workers", "8"],
        "which has 16 devices",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
@pytest.mark.parametrize("script", ["ray_core_collectives", "ray_train_llm_finetune"])
def test_bad_flags_fail_fast(case, script, capsys):
    module = __import__(script)
    argv, message = BAD_INPUTS[case]
    assert module.main(argv) == 2
    assert message in capsys.readouterr().err


def test_finetune_bad_inputs_fail_fast(tiny_assets, tmp_path, capsys):
    import ray_train_llm_finetune as ft

    base = ["--backend", "cpu", "--num-workers", "2", "--model", tiny_assets["model"], "--split", "train"]
    no_columns = tmp_path / "bad.jsonl"
    no_columns.write_text('{"question": "q", "answer": "a"}\n' * 8)
    read_only = tmp_path / "file-not-dir"
    read_only.write_text("x")
    cases = [
        (["--dataset", str(no_columns)], "lacks column(s) instruction, response; it has question, answer"),
        (["--dataset", tiny_assets["dataset"], "--model", str(tmp_path / "nope")], "does not exist"),
        (["--dataset", tiny_assets["dataset"], "--storage-path", str(read_only / "sub")], "cannot be written"),
        (["--dataset", str(tmp_path / "missing.jsonl")], "does not exist"),
    ]
    for extra, message in cases:
        assert ft.main(base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_fsdp_shards_the_mlps_and_root_but_not_the_frozen_table(tiny_assets, tmp_path):
    """apply_fsdp on a one-rank gloo group: which parameters became DTensors, and in which dtypes."""
    import ray_train_llm_finetune as ft
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = ft.load_model(tiny_assets["model"], "bfloat16")
        table = ft.freeze_per_layer_embeddings(model)
        ft.apply_fsdp(model, init_device_mesh("cpu", (1,)), ignored={table}, dtype="bfloat16")
        params = dict(model.named_parameters())
        name = "model.language_model.embed_tokens_per_layer.weight"
        assert not isinstance(params[name], DTensor) and params[name].dtype == torch.bfloat16
        assert not params[name].requires_grad
        assert all(isinstance(p, DTensor) for n, p in params.items() if n != name)
        mlp_state = ft.language_model(model).layers[0].mlp._get_fsdp_state()
        policy = mlp_state._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    finally:
        dist.destroy_process_group()


# ---- the jobs by hand, as the README shows them -----------------------------------------------


def readme_cpu_commands() -> list[str]:
    """The README's commands for running the jobs by hand on this machine's CPU, joined across `\\`."""
    import re

    readme = (JOBS.parent / "README.md").read_text()
    block = re.split(r"# on this machine's CPU[^\n]*\n", readme, maxsplit=1)[1].split("```", 1)[0]
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


@pytest.fixture
def stale_ray_tmpdir():
    """A Ray temp dir whose address file names a GCS that is gone, as a killed head leaves it."""
    import shutil
    import tempfile

    from infra.local_ray import free_port

    tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live below it
    (tmp / "ray").mkdir()
    (tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def test_a_stale_address_file_is_no_cluster(stale_ray_tmpdir, monkeypatch):
    import backend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(stale_ray_tmpdir))
    assert backend.live_cluster_address(timeout_s=1) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert backend.live_cluster_address() == "10.0.0.1:6379"


def test_a_live_address_file_is_joined(ray_head, stale_ray_tmpdir, monkeypatch):
    import backend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(stale_ray_tmpdir))
    (stale_ray_tmpdir / "ray" / "ray_current_cluster").write_text(ray_head.address)
    assert backend.live_cluster_address() == ray_head.address


def test_readme_cpu_commands_run_verbatim(ray_head, tiny_assets, stale_ray_tmpdir, tmp_path):
    """The by-hand commands, as written: the first next to a stale address file (a killed head's,
    as `make local` could leave it), the second with a live cluster named in RAY_ADDRESS."""
    import os

    commands = readme_cpu_commands()
    assert [c.split()[1] for c in commands] == ["jobs/ray_core_collectives.py", "jobs/ray_train_llm_finetune.py"]
    # the layout the README assumes: the checkout's jobs/, .venv and .local/assets
    (tmp_path / "jobs").symlink_to(JOBS)
    (tmp_path / ".venv").symlink_to(sys.prefix)
    (tmp_path / ".local").mkdir()
    (tmp_path / ".local" / "assets").symlink_to(Path(tiny_assets["model"]).parent)
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    stale = base | {"RAY_TMPDIR": str(stale_ray_tmpdir)}
    done = {}
    for command, env in zip(commands, (stale, ray_head.client_env()), strict=True):
        done[command] = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
        )
        out = done[command].stdout
        assert done[command].returncode == 0, command + "\n" + out[-3000:] + done[command].stderr[-3000:]
        assert parse_result(out) is not None and out.strip().splitlines()[-1].startswith(RESULT_PREFIX)
        assert ("ignoring the stale Ray address" in out) is (env is stale)
    # the collectives check: every rank sums 1+2+3+4 and the sharded block matches its CPU reference
    collectives = done[commands[0]].stdout
    rank_lines = [line for line in collectives.splitlines() if line.startswith("rank=")]
    assert len(rank_lines) == 4 and all("sum=10.0" in line for line in rank_lines)
    result = parse_result(collectives)
    assert result["ok"] and result["parity_ok"] and result["sums_ok"]
    assert (result["world_size"], result["expected_sum"]) == (4, 10.0) and result["max_abs_diff"] < 1e-2


def test_a_stopped_head_forgets_its_address_but_not_anothers(stale_ray_tmpdir, monkeypatch):
    from infra.local_ray import LocalRayHead, address_file

    monkeypatch.setenv("RAY_TMPDIR", str(stale_ray_tmpdir))
    head = LocalRayHead(num_cpus=1)
    assert address_file() == stale_ray_tmpdir / "ray" / "ray_current_cluster"
    address_file().write_text("127.0.0.1:1")  # another head's
    head.forget_address()
    assert address_file().exists()
    address_file().write_text(head.address)
    head.forget_address()
    assert not address_file().exists()
