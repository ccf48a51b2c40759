"""Storage that fails loudly and early: the run's storage checked as the pods' identity before any work, gcsfs
never anonymous, pyarrow's retries bounded, checkpoint shards written in parallel; the job resource's
message names the stack's ServiceAccount and principal. Google endpoints are stand-ins on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest

from tests.gcp_standins import MetadataStandin, SilentServer

JOBS = Path(__file__).resolve().parent.parent / "jobs"


def objects(emulator, bucket: str = "demo-data") -> list[str]:
    with urllib.request.urlopen(f"{emulator.url}/storage/v1/b/{bucket}/o", timeout=10) as response:
        return [item["name"] for item in json.loads(response.read()).get("items", [])]


@pytest.mark.parametrize(
    "metadata",
    ["refuses tokens", pytest.param("does not answer", marks=pytest.mark.slow)],  # (google-auth's timeouts)
)
def test_the_run_stops_before_any_work_when_the_pods_get_no_token(metadata, storage, tiny_assets):
    """Workload Identity refusing the pod a token, or GKE's metadata server not ready: the job stops at its
    storage check within about a minute, naming the bucket, and nothing reaches the bucket (gcsfs would have
    written anonymously; pyarrow would have retried for 15 minutes)."""
    server = MetadataStandin(refuse_tokens=True).start() if metadata == "refuses tokens" else SilentServer()
    env = os.environ | dict.fromkeys(("GCE_METADATA_HOST", "GCE_METADATA_ROOT", "GCE_METADATA_IP"), server.host)
    argv = ["--backend", "cpu", "--num-workers", "1", "--model", tiny_assets["model"], "--dataset",
            tiny_assets["dataset"], "--split", "train[:16]", "--storage-path", "gs://demo-data/runs"]  # fmt: skip
    started = time.monotonic()
    try:
        job = subprocess.run([sys.executable, str(JOBS / "ray_train_llm_finetune.py"), *argv], env=env,
                             capture_output=True, text=True, timeout=150)  # fmt: skip
    finally:
        (server.stop if isinstance(server, MetadataStandin) else server.close)()
    elapsed = time.monotonic() - started
    assert job.returncode == 2, job.stderr[-3000:]
    assert "error: storage check failed: --storage-path 'gs://demo-data/runs': getting Google credentials" in job.stderr
    assert "roles/storage.objectAdmin on gs://demo-data" in job.stderr and "Traceback" not in job.stderr
    assert elapsed < 75 and objects(storage) == []


def test_with_credentials_the_check_writes_reads_and_deletes_through_both_clients(storage, metadata_server):
    from runtime.storage import probe

    asked = len(metadata_server.requests)
    probe("gs://demo-data/runs/r1")
    assert objects(storage) == []  # the probe's objects are gone again
    assert any(r.endswith("/token") for r in metadata_server.requests[asked:])


def test_a_model_on_gs_an_earlier_runs_export_is_copied_down_once_and_loads(storage, metadata_server,
                                                                            tiny_assets, tmp_path):  # fmt: skip
    """DPO's usual start, `model: gs://.../<sft run>/model`: the directory copied to this machine once (a second
    load reuses the copy), then loaded as a local one, and copied again once it is written again; a gs://
    directory without a model named, not a traceback; the stack accepts the URI."""
    import filecmp

    from config.command_line import for_this_machine, from_args, parse_args
    from data.render import load_tokenizer
    from infra.config.checks import is_model_ref
    from runtime.outcome import JobInputError
    from runtime.storage import gcs, model_directory
    from training.model import load_model

    run = f"gs://demo-data/runs/sft-{tmp_path.name}"
    gcs().put(f"{tiny_assets['model']}/", f"{run}/model/", recursive=True)
    local = model_directory(f"{run}/model")
    assert filecmp.dircmp(local, tiny_assets["model"]).diff_files == [] and model_directory(f"{run}/model") == local
    assert load_tokenizer(f"{run}/model").pad_token is not None
    assert load_model(f"{run}/model", "float32").config.model_type == load_model(tiny_assets["model"]).config.model_type
    with pytest.raises(JobInputError, match="holds no model .* give the directory an earlier run exported"):
        model_directory(f"{run}/nothing")
    # the same URI written again (a run name used twice): copied again, not read from the older copy
    generation = json.loads(Path(local, "generation_config.json").read_text()) | {"eos_token_id": 1}
    with gcs().open(f"{run}/model/generation_config.json", "w") as f:
        f.write(json.dumps(generation))
    again = model_directory(f"{run}/model")
    assert again != local and json.loads(Path(again, "generation_config.json").read_text())["eos_token_id"] == 1
    settings = for_this_machine(from_args(parse_args(["--model", f"{run}/model", "--backend", "cpu"])))
    assert settings.model == f"{run}/model" and is_model_ref(settings.model)


def test_gcsfs_is_pinned_to_google_credentials_and_pyarrow_gives_up_in_a_minute():
    import pyarrow.fs

    from runtime.storage import RETRY_S, checkpoint_writer_options, filesystem, fsspec_options, gcs, ray_storage

    assert RETRY_S == 60 and gcs().credentials.method == "google_default"
    assert fsspec_options("gs://b/p") == {"token": "google_default"} and fsspec_options("/tmp/p") == {}
    fs, path = filesystem("gs://b/prefix")
    assert path == "b/prefix" and fs.__reduce__()[1][0]["retry_time_limit"] == timedelta(seconds=60)
    given = ray_storage("gs://b/prefix")
    assert given["storage_path"] == "b/prefix" and isinstance(given["storage_filesystem"], pyarrow.fs.GcsFileSystem)
    assert ray_storage("/tmp/runs") == {"storage_path": "/tmp/runs"}
    assert checkpoint_writer_options("gs://b/c") == {"thread_count": 4, "block_size": 16 << 20,
                                                     "token": "google_default"}  # fmt: skip
    assert checkpoint_writer_options("/tmp/c") == {}


def test_a_sharded_checkpoint_on_gs_is_written_by_several_threads_and_loads_back(storage, tiny_assets, gloo_rank):
    """DCP's writer gets the thread count: this rank's shard is CHECKPOINT_THREADS files, all read back."""
    import torch

    from runtime.storage import CHECKPOINT_THREADS
    from tests.inprocess import build, settings
    from training.checkpoints import ShardedCheckpointer

    trainee, optimizer = build(settings(tiny_assets))
    checkpointer = ShardedCheckpointer(trainee.model, optimizer, 0, use_async=False)
    checkpointer.save("gs://demo-data/runs/r/checkpoint_step_0000001").result()
    shards = [n for n in objects(storage) if n.endswith(".distcp")]
    assert len(shards) == CHECKPOINT_THREADS
    before = {n: p.detach().clone() for n, p in trainee.model.named_parameters()}
    with torch.no_grad():
        for p in trainee.model.parameters():
            p.add_(1.0)
    checkpointer.load("gs://demo-data/runs/r/checkpoint_step_0000001", same_world=True)
    for name, p in trainee.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), before[name], msg=name)


def test_the_job_resource_names_the_stack_s_serviceaccount_and_principal(monkeypatch):
    """A failed storage check reaches `pulumi up` with whom the stack granted the bucket to."""
    from infra.runner import ray_jobs
    from runtime.storage import PROBE_FAILED

    identity = {"namespace": "ml", "service_account": "ray-pods", "bucket": "p-v6e-checkpoints",
                "principal": "principal://iam.googleapis.com/projects/1/.../subject/ns/ml/sa/ray-pods"}  # fmt: skip
    failed = ray_jobs.JobFailed(f"[preflight] job x ended FAILED; last 50 log lines:\nerror: {PROBE_FAILED}: ...")
    monkeypatch.setattr(ray_jobs, "find_or_submit", lambda *a, **k: "x")
    monkeypatch.setattr(ray_jobs, "wait", lambda *a, **k: (_ for _ in ()).throw(failed))
    props = {"stack": "v6e", "cluster": "c", "image": "i", "code": "h", "settings": {}, "timeout_s": 1, "poll_s": 1,
             "identity": identity}  # fmt: skip
    spec = ray_jobs.JobSpec("preflight", "ray_train_llm_finetune.py", ())
    with pytest.raises(ray_jobs.JobFailed) as err:
        ray_jobs.run_job(None, props, spec, None, lambda: None, print)
    message = str(err.value)
    assert "Kubernetes ServiceAccount ml/ray-pods" in message and identity["principal"] in message
    assert "gs://p-v6e-checkpoints" in message and PROBE_FAILED in message
    other = ray_jobs.JobFailed("[finetune] job y ended FAILED: out of memory")
    monkeypatch.setattr(ray_jobs, "wait", lambda *a, **k: (_ for _ in ()).throw(other))
    with pytest.raises(ray_jobs.JobFailed, match="out of memory") as err:
        ray_jobs.run_job(None, props, spec, None, lambda: None, print)
    assert "ServiceAccount" not in str(err.value)
