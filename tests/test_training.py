"""The job resource's code, for real, against the local Ray head: submit, attach, retry, stop, diff."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from pulumi.runtime.rpc import UNKNOWN
from ray.exceptions import AuthenticationError

from infra import ray_jobs
from infra.config import parse
from infra.training import _TrainingJobsProvider, diff_props, local_target, training_props
from tests.apiserver_standin import ServiceProxyStandin
from tests.stack_harness import run_program, stack_config


def local_props(head, tiny_assets, storage, stack="t", **settings) -> dict:
    cfg = parse(
        {"mode": "local", "model": tiny_assets["model"], "dataset": tiny_assets["dataset"], "datasetSplit": "train",
         "epochs": "1", "seqLen": "64", "learningRate": "1e-3", "localStoragePath": str(storage), "jobTimeoutMinutes": "10"},
        stack=stack, project=None, region=None, zone=None, has_token=False,
    )  # fmt: skip
    props = training_props(cfg, local_target(head.dashboard_url), cluster="local", image="local")
    props["settings"].update(settings)
    props["poll_s"] = 1
    return props


def jobs_on_head(head, prefix: str) -> list:
    client = ray_jobs.connect(local_target(head.dashboard_url))
    return sorted(
        (j.submission_id, str(j.status)) for j in client.list_jobs() if (j.submission_id or "").startswith(prefix)
    )


def test_create_runs_both_jobs_and_a_second_create_attaches(ray_head, tiny_assets, tmp_path):
    props = local_props(ray_head, tiny_assets, tmp_path, stack="attach")
    outcomes: dict[str, dict] = {}
    first = threading.Thread(target=lambda: outcomes.update(first=_TrainingJobsProvider().create(props).outs))
    first.start()
    deadline = time.monotonic() + 120
    while (
        not any(s in ("RUNNING", "PENDING") for _, s in jobs_on_head(ray_head, "attach-"))
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    outcomes["second"] = _TrainingJobsProvider().create(props).outs  # while the first is waiting
    first.join(600)
    assert not first.is_alive()
    jobs = jobs_on_head(ray_head, "attach-")
    assert [s for _, s in jobs] == ["SUCCEEDED", "SUCCEEDED"], jobs  # one collectives, one fine-tune: nothing twice
    a, b = outcomes["first"], outcomes["second"]
    assert (a["checkpoint"], a["job_ids"], a["metrics"]) == (b["checkpoint"], b["job_ids"], b["metrics"])
    assert a["collectives"]["ok"] is True and a["collectives"]["world_size"] == 4
    assert a["metrics"]["epoch"] == 1 and a["checkpoints"] == [a["checkpoint"]]
    assert Path(a["checkpoint"]).is_relative_to(tmp_path) and (Path(a["checkpoint"]) / "model.safetensors").exists()
    assert set(a["job_ids"]) == {"collectives", "finetune"}


def test_failing_collectives_stop_the_pipeline_and_retry_as_new_attempts(ray_head, tiny_assets, tmp_path):
    # 3 workers cannot split the 512-wide tensor-parallel layer: the check fails on the head.
    props = local_props(ray_head, tiny_assets, tmp_path, stack="fail", collectives_workers=3)
    with pytest.raises(ray_jobs.JobFailed) as err:
        _TrainingJobsProvider().create(props)
    message = str(err.value)
    assert "[collectives] job fail-collectives-" in message and "-a1 ended FAILED" in message
    assert "must divide by the 3 workers" in message  # the job's own log tail
    assert [s for _, s in jobs_on_head(ray_head, "fail-")] == ["FAILED"]  # the fine-tune never went in
    with pytest.raises(ray_jobs.JobFailed) as again:
        _TrainingJobsProvider().create(props)
    assert "-a2 ended FAILED" in str(again.value)
    ids = [i for i, _ in jobs_on_head(ray_head, "fail-")]
    assert len(ids) == 2 and ids[0].endswith("-a1") and ids[1].endswith("-a2")


def test_delete_stops_a_running_job(ray_head):
    client = ray_jobs.connect(local_target(ray_head.dashboard_url))
    submission_id = client.submit_job(
        entrypoint="python -c 'import time; time.sleep(120)'", submission_id="del-running-a1"
    )
    deadline = time.monotonic() + 60
    while ray_jobs.job_status(client, submission_id) != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    props = {"target": local_target(ray_head.dashboard_url), "job_ids": {"finetune": submission_id}}
    _TrainingJobsProvider().delete(submission_id, props)
    deadline = time.monotonic() + 60
    while ray_jobs.job_status(client, submission_id) != "STOPPED" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_jobs.job_status(client, submission_id) == "STOPPED"


def test_gke_path_through_the_api_server_service_proxy(ray_head, tiny_assets, tmp_path):
    props = local_props(ray_head, tiny_assets, tmp_path, stack="gke")
    with ServiceProxyStandin(
        "k8s-bearer", "default", "ray-torchtpu-cluster-head-svc", 8265, ray_head.dashboard_url
    ) as proxy:
        props["target"] = {
            "kind": "gke",
            "endpoint": proxy.url,
            "ca_certificate": None,
            "namespace": "default",
            "service": "ray-torchtpu-cluster-head-svc",
            "port": 8265,
        }
        with pytest.raises(AuthenticationError):  # without the right token the proxy refuses
            ray_jobs.run_pipeline(props, token_source=lambda: "wrong")
        outputs = ray_jobs.run_pipeline(props, log=lambda _: None, token_source=lambda: "k8s-bearer")
    assert outputs["collectives"]["ok"] and outputs["metrics"]["epoch"] == 1
    paths = [path for _, path, _ in proxy.requests]
    assert all(
        p.startswith("/api/v1/namespaces/default/services/ray-torchtpu-cluster-head-svc:8265/proxy/") for p in paths
    )
    assert any("/api/packages/" in p for p in paths)  # jobs/ went up through the proxy
    assert any(m == "POST" and p.endswith("/api/jobs/") for m, p, _ in proxy.requests)


def test_ray_token_goes_in_the_header_ray_reads_behind_proxies(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ray_jobs.ray_auth_headers() == {}
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-file\n")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert ray_jobs.ray_auth_headers() == {"X-Ray-Authorization": "Bearer from-file"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert ray_jobs.ray_auth_headers() == {"X-Ray-Authorization": "Bearer from-env"}


def test_code_hash_follows_the_uploaded_job_code(tmp_path):
    import shutil

    jobs = tmp_path / "jobs"
    shutil.copytree(ray_jobs.JOBS_DIR, jobs, ignore=shutil.ignore_patterns("__pycache__"))
    before = ray_jobs.jobs_code_hash(jobs)
    (jobs / "tiny_assets.py").write_text("# not uploaded, so not part of a run's definition\n")
    assert ray_jobs.jobs_code_hash(jobs) == before
    with (jobs / "backend.py").open("a") as f:
        f.write("# an edit\n")
    assert ray_jobs.jobs_code_hash(jobs) != before


BASE = {
    "stack": "s",
    "cluster": "c",
    "image": "i@sha256:1",
    "code": "abc",
    "settings": {"epochs": 3},
    "target": {"kind": "local", "address": "a"},
    "timeout_s": 60,
    "poll_s": 1,
}


@pytest.mark.parametrize(
    "change,replaces",
    [
        ({"code": "def"}, ["code"]),
        ({"settings": {"epochs": 4}}, ["settings"]),
        ({"image": "i@sha256:2"}, ["image"]),
        ({"settings": UNKNOWN}, ["settings"]),
        ({"image": UNKNOWN, "cluster": UNKNOWN}, ["cluster", "image"]),
        ({"settings": {"epochs": UNKNOWN}}, ["settings"]),
    ],
)
def test_diff_replaces_when_what_defines_the_run_changes(change, replaces):
    result = diff_props({**BASE, "checkpoint": "/x"}, {**BASE, **change})
    assert result.changes is True and sorted(result.replaces) == replaces and result.delete_before_replace


def test_diff_ignores_provider_code_and_outputs():
    olds = {**BASE, "__provider": "old-pickled-provider", "checkpoint": "/x", "metrics": {"loss": 1}}
    result = diff_props(olds, {**BASE, "__provider": "new-pickled-provider"})
    assert result.changes is False and result.replaces == []


def test_diff_updates_in_place_for_reach_and_patience():
    result = diff_props(BASE, {**BASE, "timeout_s": 120, "target": {"kind": "local", "address": "b"}})
    assert result.changes is True and result.replaces == []
    news = {**BASE, "timeout_s": 120, "checkpoint": None, "metrics": None}  # as the resource declares them
    outs = _TrainingJobsProvider().update("id", {**BASE, "checkpoint": "/x", "metrics": {"loss": 1}}, news).outs
    assert outs["checkpoint"] == "/x" and outs["metrics"] == {"loss": 1} and outs["timeout_s"] == 120


def test_local_stack_declares_only_the_jobs():
    run = run_program(
        "local", stack_config("local", **{"gcp:project": None, "gcp:region": None, "gcp:zone": None, "hfToken": None})
    )
    assert run.types == ["pulumi-python:dynamic:Resource"]
    training = run.one("pulumi-python:dynamic:Resource", "training").inputs
    assert training["settings"]["backend"] == "cpu"
    assert training["settings"]["collectives_workers"] == 4 and training["settings"]["finetune_workers"] == 2
    assert training["settings"]["model"].endswith("/.local/assets/model")
    assert training["target"] == {"kind": "local", "address": "http://127.0.0.1:8265"}
    assert "checkpoint" in run.outputs


@pytest.mark.parametrize("provider", ["infra.training:_TrainingJobsProvider", "infra.crd_wait:_CrdEstablishedProvider"])
def test_serialized_provider_loads_in_a_fresh_host(provider):
    """Pickled as Pulumi stores it; loaded as its provider host does: a new interpreter in the project directory."""
    import importlib
    import subprocess
    import sys

    from pulumi.dynamic.dynamic import serialize_provider

    from infra.config import ROOT

    module, name = provider.split(":")
    blob = serialize_provider(getattr(importlib.import_module(module), name)())
    load = f"import base64, dill; p = dill.loads(base64.b64decode({blob!r})); print(type(p).__name__, hasattr(p, 'create'))"
    # `python -m pulumi.dynamic` puts the working directory first on sys.path
    host = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, ''); {load}"], cwd=ROOT, capture_output=True, text=True
    )
    assert host.returncode == 0, host.stderr[-2000:]
    assert host.stdout.split() == [name, "True"]
    elsewhere = subprocess.run([sys.executable, "-c", load], cwd="/", capture_output=True, text=True)
    assert elsewhere.returncode != 0 and "No module named 'infra'" in elsewhere.stderr  # the check bites
