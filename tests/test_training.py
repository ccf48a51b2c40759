"""The job resource's code, for real, against the local Ray head: submit, attach, retry, stop, diff."""

from __future__ import annotations

import datetime
import re
import threading
import time
from pathlib import Path

import pytest
from pulumi.runtime.rpc import UNKNOWN
from ray.exceptions import AuthenticationError

from infra import ROOT, local_run
from infra.runner import job_client, ray_jobs
from infra.runner.resilience import FixedToken, GoogleTokens, RetryPolicy, Unreachable
from infra.runner.slice_scaler import SliceNotReady
from infra.training import _TrainingJobsProvider, diff_props, local_target, training_props
from tests.apiserver_standin import FakeSlice, ServiceProxyStandin
from tests.stack_harness import run_program, stack_config


def local_props(head, tiny_assets, storage, stack="t", collectives_workers: int | None = None, **settings) -> dict:
    """The job resource's inputs as `make local` builds them (Pulumi.local.yaml), on the tiny assets; `settings`
    replace some of the fine-tune's."""
    props = training_props(local_cfg(tiny_assets, storage, stack), local_target(head.dashboard_url), "local", "local")
    props["settings"].update(settings)
    props["collectives_workers"] = collectives_workers or props["collectives_workers"]
    props["poll_s"] = 1
    return props


def local_cfg(tiny_assets, storage, stack: str):
    return local_run.local_config(
        stack=stack, model=tiny_assets["model"], dataset=tiny_assets["dataset"], datasetSplit="train[:80]", epochs="1",
        seqLen="64", localStoragePath=str(storage), jobTimeoutMinutes="10", evalSamples="1", evalTasks="none",
        finetuneWorkers="1",  # (the job resource's path is the point; the ranks' is test_jobs' and test_slices')
        collectivesWorkers="2",  # (and make local's four workers the README's collectives check's)
    )  # fmt: skip


def jobs_on_head(head, prefix: str) -> list:
    client = job_client.connect(local_target(head.dashboard_url))
    return sorted(
        (j.submission_id, str(j.status)) for j in client.list_jobs() if (j.submission_id or "").startswith(prefix)
    )


def test_a_failing_check_stops_the_pipeline_then_retries_as_a_new_attempt_and_scales_down_once(
    ray_head, tiny_assets, tmp_path
):
    # 3 workers cannot split the 512-wide tensor-parallel layer: the check fails on the head.
    props = local_props(ray_head, tiny_assets, tmp_path, stack="fail", collectives_workers=3)
    with pytest.raises(ray_jobs.JobFailed) as err:
        _TrainingJobsProvider().create(props)
    message = str(err.value)
    assert "[collectives] job fail-collectives-" in message and "-a1 ended FAILED" in message
    assert "must divide by the 3 workers" in message  # the job's own log tail
    assert [s for _, s in jobs_on_head(ray_head, "fail-")] == ["FAILED"]  # the fine-tune never went in
    # the next `up`, on GKE with a slice to scale: a new attempt, and the slice back to 0 after it failed
    tpu = FakeSlice("ray-torchtpu-cluster", "v6e-16", hosts=4)
    with standin(ray_head, fake_slice=tpu) as proxy:
        props["target"], props["slice"] = gke_target(proxy), slice_props(tpu)
        with pytest.raises(ray_jobs.JobFailed) as again:
            ray_jobs.run_pipeline(props, log=lambda _: None, tokens=FixedToken("k8s-bearer"))
    assert "-a2 ended FAILED" in str(again.value) and tpu.patches == [1, 0]
    ids = [i for i, _ in jobs_on_head(ray_head, "fail-collectives-")]
    assert len(ids) == 2 and ids[0].endswith("-a1") and ids[1].endswith("-a2")


def test_delete_stops_a_running_job(ray_head):
    client = job_client.connect(local_target(ray_head.dashboard_url))
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


def gke_target(proxy) -> dict:
    return {
        "kind": "gke",
        "endpoint": proxy.url,
        "ca_certificate": None,
        "namespace": "default",
        "service": "ray-torchtpu-cluster-head-svc",
        "port": 8265,
    }


def slice_props(tpu: FakeSlice, ready_timeout_s: float = 60, capacity: str = "onDemand") -> dict:
    return {"ray_cluster": tpu.ray_cluster, "group": tpu.group, "hosts": tpu.hosts, "ready_timeout_s": ready_timeout_s,
            "capacity": capacity}  # fmt: skip


def standin(head, token="k8s-bearer", **faults) -> ServiceProxyStandin:
    return ServiceProxyStandin(token, "default", "ray-torchtpu-cluster-head-svc", 8265, head.dashboard_url, **faults)


class ShortLivedCredentials:
    """Google credentials as google-auth keeps them, but each token lives `lifetime_s` only."""

    def __init__(self, lifetime_s: float):
        self.lifetime, self.issued, self.token, self.expiry = lifetime_s, [], None, None

    @property
    def valid(self) -> bool:
        return self.token is not None and datetime.datetime.now(datetime.UTC).replace(tzinfo=None) < self.expiry

    def refresh(self, _request):
        now = time.time()
        self.token = f"tok-{len(self.issued)}-{now}"
        self.issued.append(self.token)
        self.expiry = datetime.datetime.fromtimestamp(now + self.lifetime, datetime.UTC).replace(tzinfo=None)


def young(lifetime_s: float):
    """The stand-in's check: a token issued by ShortLivedCredentials less than lifetime_s ago."""
    return lambda token: token.startswith("tok-") and time.time() - float(token.rsplit("-", 1)[1]) < lifetime_s


def test_gke_path_survives_token_expiry_and_a_flaky_proxy_while_make_local_attaches(
    ray_head, tiny_assets, tmp_path, capsys
):
    """Through the service proxy: tokens that live 4 s, a run of much longer, a fifth of the requests
    answered 503 or dropped, and the first submit's answer lost after the job went in. Meanwhile a
    second `up` (make local's own path, straight to the head) attaches to the same jobs."""
    props = local_props(ray_head, tiny_assets, tmp_path, stack="gke")
    quick_retries = RetryPolicy(budget_s=props["retry_budget_s"], base_s=0.1)  # the same retries, sooner
    credentials = ShortLivedCredentials(lifetime_s=4)
    tokens = GoogleTokens(margin_s=2.5, credentials=credentials)  # wide: a loaded machine delays requests
    logged: list[str] = []
    outputs: dict[str, dict] = {}
    tpu = FakeSlice("ray-torchtpu-cluster", "v6e-16", hosts=4)
    with standin(
        ray_head, young(4), fault_share=0.2, max_faults=40, seed=3, drop_first_submit=True, fake_slice=tpu
    ) as proxy:
        props["target"], props["slice"] = gke_target(proxy), slice_props(tpu)
        started = time.monotonic()
        first = threading.Thread(
            target=lambda: outputs.update(gke=ray_jobs.run_pipeline(props, logged.append, tokens, quick_retries))
        )
        first.start()
        deadline = time.monotonic() + 120
        while not any(s in ("RUNNING", "PENDING") for _, s in jobs_on_head(ray_head, "gke-collectives-")):
            assert time.monotonic() < deadline and first.is_alive()
            time.sleep(0.5)
        outputs["local"] = local_run.run_jobs(local_cfg(tiny_assets, tmp_path, "gke"), ray_head.dashboard_url)
        first.join(600)
        took = time.monotonic() - started
    assert not first.is_alive()
    a, b = outputs["gke"], outputs["local"]
    assert (a["checkpoint"], a["metrics"]) == (b["checkpoint"], b["metrics"])
    assert a["job_ids"] == b["job_ids"] | {"preflight": a["job_ids"]["preflight"]}  # the same jobs (+ the data check)
    assert a["collectives"]["ok"] and a["collectives"]["world_size"] == 2 and a["metrics"]["epoch"] == 1
    # `checkpoint` is the from_pretrained export; `checkpoints` the Ray Train (sharded) ones
    assert Path(a["checkpoint"]).name == "model" and (Path(a["checkpoint"]) / "model.safetensors").exists()
    assert Path(a["checkpoint"]).is_relative_to(tmp_path)
    assert [Path(c).name for c in a["checkpoints"]] == ["checkpoint_epoch_0001"]
    assert a["samples"] == b["samples"] and len(Path(a["samples"]).read_text().splitlines()) == 1  # evalSamples 1
    assert re.search(
        r"\[collectives\] gke-collectives-\S+-a1 is already (PENDING|RUNNING); attaching to it", capsys.readouterr().out
    )
    local_run.print_outputs(b)
    printed = capsys.readouterr().out
    assert f"checkpoint:  {b['checkpoint']}" in printed and "collectives: ok=True world_size=2" in printed
    assert took > 4 * 3 and len(credentials.issued) >= 3  # the run outlived several tokens
    # the slice came up host by host before the jobs, and went back to 0 once, after them
    assert tpu.patches == [1, 0] and 0 < a["slice_hours"] < 4 * took / 3600 + 1e-3
    progress = [line for line in logged if line.startswith("TPU slice: ")]
    assert progress[:3] == [
        "TPU slice: scaling worker group v6e-16 to 1 (4 hosts)",
        "TPU slice: 1/4 hosts ready (GKE is adding nodes)",
        "TPU slice: 2/4 hosts ready (GKE is adding nodes)",
    ]
    assert logged.index("TPU slice: 4/4 hosts ready") < next(
        i for i, line in enumerate(logged) if "[collectives] submitting" in line
    )
    # the data was read and rendered on the head before the slice was asked for
    checked = next(
        i for i, line in enumerate(logged) if line.startswith("[preflight] ") and line.endswith(": SUCCEEDED")
    )
    assert checked < logged.index("TPU slice: scaling worker group v6e-16 to 1 (4 hosts)")
    assert any("[preflight] data: 80 training records (instruction/context/response)" in line for line in logged)
    assert (
        set(a["job_ids"]) == {"preflight", "collectives", "finetune"}
        and a["data_report"]["train"]["records_used"] == 80
    )
    # the preflight prepared the data (in its own process: one chunk's work); the fine-tune read what it wrote
    assert any(line.startswith("[preflight] preparing 85 records in 2 chunks in this process") for line in logged)
    assert a["data_report"]["prepared_reused"] is True
    assert [r for r in proxy.refused if r[2] == 401] == []  # refreshed before expiry, never after
    assert sum(1 for r in proxy.refused if r[2] in (0, 503)) >= 10  # the faults did happen...
    assert any("retrying in" in line for line in logged)
    assert any("the submit of gke-" in line and "did reach the head" in line for line in logged)
    jobs = jobs_on_head(ray_head, "gke-")
    assert [s for _, s in jobs] == ["SUCCEEDED"] * 3, jobs  # ...and still one job each
    paths = [path for _, path, _ in proxy.requests]
    assert all(
        p.startswith("/api/v1/namespaces/default/services/ray-torchtpu-cluster-head-svc:8265/proxy/") for p in paths
    )
    assert any("/api/packages/" in p for p in paths)  # jobs/ went up through the proxy
    assert any("/api/v0/logs/file?node_id=" in p and "&lines=1000" in p for p in paths)  # bounded tails
    assert not any(p.endswith("/logs") for p in paths)  # never the whole log


def test_a_401_refreshes_the_token_once_then_counts(ray_head):
    revoked = ShortLivedCredentials(lifetime_s=3600)
    revoked.refresh(None)
    revoked.token = "revoked-but-unexpired"
    tokens = GoogleTokens(credentials=revoked)
    with standin(ray_head, lambda t: t.startswith("tok-")) as proxy:
        client = job_client.connect(gke_target(proxy), tokens)
        assert ray_jobs.job_status(client, "no-such-job") is None
    assert [r[2] for r in proxy.refused] == [401]  # once, then the refreshed token worked
    with standin(ray_head, "never") as proxy, pytest.raises(AuthenticationError):
        job_client.connect(gke_target(proxy), FixedToken("wrong"))
    assert [r[2] for r in proxy.refused] == [401, 401]  # one refresh-and-retry, then the answer stands


def test_a_proxy_that_stays_down_fails_after_the_budget_with_the_way_back(ray_head):
    with standin(ray_head, mode="down") as proxy:
        started = time.monotonic()
        with pytest.raises(Unreachable) as err:
            job_client.connect(gke_target(proxy), FixedToken("k8s-bearer"), RetryPolicy(budget_s=2, base_s=0.2))
    assert 2 <= time.monotonic() - started < 10
    message = str(err.value)
    assert "/api/version kept failing for 2s (last: HTTP 503)" in message
    assert "keeps running on the cluster" in message and "re-attaches" in message
    assert len(proxy.refused) >= 3


def test_a_403_fails_at_once(ray_head):
    with standin(ray_head, mode="forbidden") as proxy:
        started = time.monotonic()
        with pytest.raises(job_client.Refused, match="HTTP 403, refused: .*services proxy is forbidden"):
            job_client.connect(gke_target(proxy), FixedToken("k8s-bearer"), RetryPolicy(budget_s=60))
    assert time.monotonic() - started < 5 and len(proxy.refused) == 1


def test_an_interrupt_leaves_job_and_slice_up_and_the_next_up_attaches(ray_head, tiny_assets, tmp_path):
    """The provider process gets SIGINT while it waits: the job runs on and the slice stays up; a new
    create attaches without scaling anything, and scales down only once the job has ended."""
    import json
    import signal
    import subprocess
    import sys

    # 16 workers on the 8-CPU head: the check waits for its reservation, RUNNING, for as long as we like
    props = local_props(ray_head, tiny_assets, tmp_path, stack="intr", collectives_workers=16)
    tpu = FakeSlice("ray-torchtpu-cluster", "v6e-16", hosts=4)
    with standin(ray_head, fake_slice=tpu) as proxy:
        props["target"], props["slice"] = gke_target(proxy), slice_props(tpu)
        (tmp_path / "props.json").write_text(json.dumps(props))
        # The provider as Pulumi's host runs it, with the stand-in's token for Google's. Ctrl-C's
        # handler is set again: a test run started in the background (`make test &`) inherits SIGINT ignored.
        runner = (
            "import json, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "import infra.runner.ray_jobs as rj; from infra.runner.resilience import FixedToken; "
            "rj.GoogleTokens = lambda: FixedToken('k8s-bearer'); "
            "from infra.training import _TrainingJobsProvider as P; P().create(json.load(sys.stdin))"
        )
        out = (tmp_path / "provider.log").open("w")
        provider = subprocess.Popen(
            [sys.executable, "-c", runner], cwd=ROOT, stdin=(tmp_path / "props.json").open(), stdout=out,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while [s for _, s in jobs_on_head(ray_head, "intr-collectives-")] != ["RUNNING"]:
            assert time.monotonic() < deadline and provider.poll() is None
            time.sleep(0.5)
        while ": RUNNING" not in (tmp_path / "provider.log").read_text():  # the provider is in its wait loop
            assert time.monotonic() < deadline and provider.poll() is None
            time.sleep(0.2)
        provider.send_signal(signal.SIGINT)
        assert provider.wait(timeout=60) != 0
        output = (tmp_path / "provider.log").read_text()
        [(job_id, status)] = jobs_on_head(ray_head, "intr-collectives-")
        assert f"interrupted: job {job_id} keeps running on the cluster; `pulumi up` re-attaches to it" in output
        assert status == "RUNNING" and tpu.patches == [1]  # nothing stopped, nothing scaled down

        second: dict = {}
        logged: list[str] = []

        def create_again():
            try:
                ray_jobs.run_pipeline(props, log=logged.append, tokens=FixedToken("k8s-bearer"))
            except ray_jobs.JobFailed as err:
                second["error"] = err

        attach = threading.Thread(target=create_again)
        attach.start()
        deadline = time.monotonic() + 60
        while f"[collectives] {job_id} is already RUNNING; attaching to it" not in logged:
            assert time.monotonic() < deadline and attach.is_alive(), logged
            time.sleep(0.2)
        assert tpu.patches == [1]  # the slice was up: no scale-up, and no scale-down under the job
        job_client.connect(local_target(ray_head.dashboard_url)).stop_job(job_id)
        attach.join(60)
    assert "ended STOPPED" in str(second["error"]) and tpu.patches == [1, 0]


def test_ray_token_goes_in_the_header_ray_reads_behind_proxies(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert job_client.ray_auth_headers() == {}
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-file\n")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert job_client.ray_auth_headers() == {"X-Ray-Authorization": "Bearer from-file"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert job_client.ray_auth_headers() == {"X-Ray-Authorization": "Bearer from-env"}


def test_code_hash_follows_the_uploaded_job_code(tmp_path):
    import shutil

    jobs = tmp_path / "jobs"
    shutil.copytree(ray_jobs.JOBS_DIR, jobs, ignore=shutil.ignore_patterns("__pycache__"))
    before = ray_jobs.jobs_code_hash(jobs)
    (jobs / "tiny_assets.py").write_text("# not uploaded, so not part of a run's definition\n")
    assert ray_jobs.jobs_code_hash(jobs) == before
    with (jobs / "runtime" / "backend.py").open("a") as f:
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
    "max_failures": 3,
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
    changed = {"timeout_s": 120, "max_failures": 5, "target": {"kind": "local", "address": "b"}}
    result = diff_props(BASE, {**BASE, **changed})
    assert result.changes is True and result.replaces == []
    news = {**BASE, **changed, "checkpoint": None, "metrics": None}  # as the resource declares them
    outs = _TrainingJobsProvider().update("id", {**BASE, "checkpoint": "/x", "metrics": {"loss": 1}}, news).outs
    assert outs["checkpoint"] == "/x" and outs["metrics"] == {"loss": 1}
    assert (outs["timeout_s"], outs["max_failures"]) == (120, 5)


def test_local_stack_declares_only_the_jobs():
    run = run_program(
        "local", stack_config("local", **{"gcp:project": None, "gcp:region": None, "gcp:zone": None, "hfToken": None})
    )
    assert run.types == ["pulumi-python:dynamic:Resource"]
    training = run.one("pulumi-python:dynamic:Resource", "training").inputs
    assert training["settings"]["backend"] == "cpu"
    assert training["collectives_workers"] == 4 and training["settings"]["num_workers"] == 2
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

    from infra.config.stack import ROOT

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


class TailOnlyClient:
    """Answers the log API with the last `lines` lines of a growing log, as Ray's dashboard does."""

    def __init__(self):
        self.log = ""

    def _do_request(self, method, path, budget_s=None):
        lines = int(path.rsplit("lines=", 1)[1])
        tail = "".join(self.log.splitlines(keepends=True)[-lines:])
        return type("R", (), {"status_code": 200, "content": tail.encode()})()


def test_job_logs_stream_as_utf8(ray_head):
    """Progress bars, non-ASCII records and answers come through the job client intact (the log API sends UTF-8
    with no charset, for which requests' `.text` guesses ISO-8859-1: `━` became `â\x94\x81`)."""
    import shlex
    import uuid

    client = job_client.connect(local_target(ray_head.dashboard_url))
    text = "Grüße, naïve café: 日本語の答え ✓ ━━━━━ 100%"
    entrypoint = shlex.join(["python", "-c", f"print({ascii(text)})"])  # (an ASCII command; its output is not)
    deadline = time.monotonic() + 120
    while True:  # a fresh head answers 500 "No available agent to submit job" for its first seconds
        submission_id = f"utf8-{uuid.uuid4().hex[:8]}"
        try:
            client.submit_job(entrypoint=entrypoint, submission_id=submission_id)
            break
        except job_client.SubmitUncertain:
            assert time.monotonic() < deadline
            time.sleep(1)
    while not client.get_job_status(submission_id).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    printed = []
    follower = job_client.LogFollower(client, submission_id, "[j]", printed.append)
    follower.poll(client.get_job_info(submission_id).driver_node_id, final=True)
    assert f"[j] {text}" in printed
    assert text in client.get_job_logs(submission_id)


def test_the_log_follower_prints_each_line_once_from_bounded_tails():
    client, printed = TailOnlyClient(), []
    follower = job_client.LogFollower(client, "job-a1", "[j]", printed.append, lines=10)
    assert follower.poll(None) == "" and printed == []  # no driver yet, no request
    client.log = "same\nloading 0%\rloading 100%\n"
    follower.poll("node")
    assert printed == ["[j] same", "[j] loading 0%\rloading 100%"]  # a progress bar's \r ends no line
    printed.clear()
    client.log = "same\nsame\nsame\n"  # (a fresh log for the follower below)
    follower.count, follower.shown = 0, []
    follower.poll("node")
    client.log += "same\nnew 1\nhalf a li"
    follower.poll("node")
    assert printed == ["[j] same"] * 4 + ["[j] new 1"]  # repeated lines counted right; the partial one held back
    follower.lines = 8  # from here on the log is longer than a window: anchors decide
    client.log += "ne\n" + "".join(f"step {i}\n" for i in range(3))
    follower.poll("node")
    assert printed[5:] == ["[j] half a line", "[j] step 0", "[j] step 1", "[j] step 2"]
    client.log += "".join(f"burst {i}\n" for i in range(9))  # more than a window since the last poll
    follower.poll("node")
    assert printed[9].startswith("[j] ... (more than 8 new lines") and printed[10:] == [
        f"[j] burst {i}" for i in range(1, 9)
    ]
    client.log += "JOB_RESULT_JSON: {}"
    assert follower.poll("node", final=True).endswith("JOB_RESULT_JSON: {}")
    assert printed[-1] == "[j] JOB_RESULT_JSON: {}"


# ---- scale to zero around the jobs ---------------------------------------------------------------


def scaled_run(head, tiny_assets, tmp_path, stack: str, tpu: FakeSlice, ready_timeout_s=60, timeout_s=600,
               capacity="onDemand", price=None, **settings):  # fmt: skip
    """The pipeline through the stand-in with a slice to scale; returns (error, log lines)."""
    props = local_props(head, tiny_assets, tmp_path, stack=stack, **settings)
    logged: list[str] = []
    with standin(head, fake_slice=tpu) as proxy:
        props["target"], props["slice"] = gke_target(proxy), slice_props(tpu, ready_timeout_s, capacity)
        props["timeout_s"], props["price"] = timeout_s, price
        try:
            ray_jobs.run_pipeline(props, log=logged.append, tokens=FixedToken("k8s-bearer"))
        except Exception as err:  # noqa: BLE001
            return err, logged
    return None, logged


def test_a_timed_out_job_is_stopped_and_the_slice_never_asked_for(ray_head, tiny_assets, tmp_path):
    """The first job, the data check on the head, outlives its 2 s: stopped, nothing else submitted, and
    the slice left at 0 (a job that fails after the slice is up scales it down: the failing-check test)."""
    tpu = FakeSlice("ray-torchtpu-cluster", "v6e-16", hosts=4)
    err, logged = scaled_run(ray_head, tiny_assets, tmp_path, "stime", tpu, timeout_s=2)
    assert isinstance(err, ray_jobs.JobFailed) and "has been stopped" in str(err) and "[preflight]" in str(err)
    assert tpu.patches == [] and not any(line.startswith("TPU slice") for line in logged)
    deadline = time.monotonic() + 60  # stopping takes a moment
    while [s for _, s in jobs_on_head(ray_head, "stime-")] != ["STOPPED"]:
        assert time.monotonic() < deadline, jobs_on_head(ray_head, "stime-")
        time.sleep(0.5)


def test_bad_data_fails_on_the_head_before_the_slice_is_asked_for(ray_head, tiny_assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Describe bees.", "completion": "Bees are warm."}\n{"prompt": "x", "completion": ""}\n')
    tpu = FakeSlice("ray-torchtpu-cluster", "v6e-16", hosts=4)
    err, logged = scaled_run(ray_head, tiny_assets, tmp_path, "sbad", tpu, dataset=str(bad), split="train",
                             eval_split="none")  # fmt: skip
    assert isinstance(err, ray_jobs.JobFailed) and "[preflight] job sbad-preflight-" in str(err)
    assert "bad.jsonl, line 2: completion is empty; it must be non-empty text" in str(err)
    assert tpu.patches == [] and not any(line.startswith("TPU slice") for line in logged)  # no slice-hours
    assert [s for _, s in jobs_on_head(ray_head, "sbad-")] == ["FAILED"]  # nothing else was submitted


def test_a_slice_that_never_comes_up_fails_with_the_reason_and_goes_back_to_zero(ray_head, tiny_assets, tmp_path):
    tpu = FakeSlice("ray-torchtpu-cluster", "tpu7x-16", hosts=2, never_ready=True)
    price = {"usd_per_chip_hour": 1.35, "chips_per_host": 4, "chips": 8}
    err, logged = scaled_run(ray_head, tiny_assets, tmp_path, "snever", tpu, ready_timeout_s=1, capacity="flexStart",
                             price=price)  # fmt: skip
    assert isinstance(err, SliceNotReady)
    message = str(err)
    assert "was not ready within" in message and "scaled back to 0" in message
    assert "NotTriggerScaleUp: pod didn't trigger scale-up" in message and "GCE quota exceeded" in message
    assert "quota" in message and "stockout" in message and "reservation" in message
    assert tpu.patches == [1, 0]  # back to 0 exactly once
    assert "TPU slice: 0/2 hosts ready (waiting for flex-start capacity)" in logged  # a flex-start slice
    assert [line for line in logged if line.startswith("cost: $")]  # what the failed wait cost, printed anyway
    assert [s for i, s in jobs_on_head(ray_head, "snever-") if "-preflight-" not in i] == []  # nothing else submitted


def test_delete_scales_the_slice_down(ray_head):
    tpu = FakeSlice("ray-torchtpu-cluster", "v6e-16", hosts=4)
    tpu.replicas = 1
    with standin(ray_head, fake_slice=tpu) as proxy:
        props = {"target": gke_target(proxy), "slice": slice_props(tpu), "poll_s": 1, "job_ids": {}}
        ray_jobs.stop_active(props, {}, tokens=FixedToken("k8s-bearer"))
        ray_jobs.release_slice(props, tokens=FixedToken("k8s-bearer"))
        assert tpu.patches == [0]
        logged: list[str] = []
        props["slice"]["ray_cluster"] = "deleted-by-hand"  # destroy must not stall on it
        ray_jobs.release_slice(props, log=logged.append, tokens=FixedToken("k8s-bearer"))
    assert logged[-1] == "TPU slice: nothing to scale down: RayCluster default/deleted-by-hand does not exist"
