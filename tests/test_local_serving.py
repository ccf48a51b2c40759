"""Serving's wait and checks, against stand-in servers on 127.0.0.1: a replica slow to come, one that never comes, a
server that ends; the served scores' agreement with the job's; the rehearsal's application is the RayService's."""

from __future__ import annotations

import http.server
import json
import threading
import time
from contextlib import contextmanager

import pytest

from infra.serving.rehearsal import ServerNotReady, wait_until_ready


@contextmanager
def stand_in(model: str, ready_after_s: float | None):
    """An OpenAI-compatible stand-in: /v1/models lists `model` at once (the ingress is up), /v1/completions answers
    503 until `ready_after_s` (the replica's cold start; None: never)."""
    started = time.monotonic()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/api/serve/applications/":  # the serving Ray's dashboard: Serve's own account
                deployment = {"status": "UNHEALTHY", "message": "replica failed: no TPU"}
                self.reply(
                    200, {"applications": {"llm": {"status": "DEPLOYING", "deployments": {"LLMServer": deployment}}}}
                )
                return
            self.reply(200, {"data": [{"id": model}]} if self.path == "/v1/models" else {})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            up = ready_after_s is not None and time.monotonic() - started >= ready_after_s
            self.reply(200, {"choices": [{"text": "!"}]}) if up else self.reply(503, {"error": "no replica yet"})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_the_wait_ends_once_a_slow_replica_answers_and_says_how_it_goes():
    said: list[str] = []
    with stand_in("m-finetuned", ready_after_s=1.0) as url:
        waited = wait_until_ready(url, "m-finetuned", 30, say=said.append, every_s=0.1, report_every_s=0.3)
    assert 1.0 <= waited < 10
    assert any(s.startswith(f"serving: waiting for m-finetuned at {url} (") for s in said)  # progress while it waits
    assert said[-1].startswith(f"serving: m-finetuned answers at {url} after")


def test_a_replica_that_never_comes_fails_in_bounded_time_with_the_servers_log():
    """The ingress lists the model, but no replica ever answers: the wait ends at its bound, with the log's end."""
    with stand_in("m", ready_after_s=None) as url:
        started = time.monotonic()
        with pytest.raises(ServerNotReady, match=r"m did not answer at .* within 1s .*\nvLLM: out of memory"):
            wait_until_ready(url, "m", 1.0, log_tail=lambda: "vLLM: out of memory", say=lambda _: None, every_s=0.1)
        assert time.monotonic() - started < 5


def test_a_server_that_ends_fails_the_wait_at_once():
    with stand_in("other", ready_after_s=0) as url:  # (a server that lists another model: never ready for this one)
        started = time.monotonic()
        with pytest.raises(ServerNotReady, match=r"the server for m ended after \d+s .*\nTraceback: no weights"):
            wait_until_ready(url, "m", 60, alive=lambda: False, log_tail=lambda: "Traceback: no weights",
                             say=lambda _: None)  # fmt: skip
        assert time.monotonic() - started < 5


def test_a_served_score_off_by_more_than_the_noise_is_named():
    import infra.job_modules  # noqa: F401
    import rescore
    from infra.serving.rehearsal import SERVED_REL_TOL, served_problems

    rows = [("heldout", "rouge_l", 0.083008, 0.083008), ("heldout_loss", "loss", 4.479853, 4.479853 + 1e-5)]
    assert served_problems(rows) == []
    off = [*rows, ("heldout_loss", "loss", 4.479853, 4.479853 * (1 + 10 * SERVED_REL_TOL))]
    assert served_problems(off) == [
        "the served score disagrees with the in-job one: heldout_loss loss: 4.484333 here, 4.479853 in the run"
    ]
    assert rescore.disagreements([("heldout", "chrf", 21.1, None)], 1e-4) == [
        "heldout chrf: - here, 21.100000 in the run"
    ]


def test_the_rehearsal_serves_the_ray_services_application_on_cpu():
    """The same function, the same app: only what vLLM runs on differs (CPU: fp32 as the job's scores, one CPU
    bundle; TPU: bf16, tensor parallel over the host, its accelerator type)."""
    from infra.cloud.tpu import serving_hosts
    from infra.job_modules import tpu_generations
    from infra.serving.app import ServeConfig, serve_application

    host = serving_hosts(tpu_generations.GENERATIONS["v6e"])[0]
    cpu = serve_application(ServeConfig("finetuned", None, 512, 1, 1, "onDemand", 10), "m", "/run/model")
    tpu = serve_application(ServeConfig("finetuned", host, 512, 1, 1, "onDemand", 10), "m", "/run/model")
    (cpu_llm,), (tpu_llm,) = cpu["args"].pop("llm_configs"), tpu["args"].pop("llm_configs")
    assert (
        cpu == tpu == {"name": "llm", "route_prefix": "/", "import_path": "ray.serve.llm:build_openai_app", "args": {}}
    )
    common = ("model_loading_config", "deployment_config")
    assert {k: cpu_llm[k] for k in common} == {k: tpu_llm[k] for k in common}
    assert cpu_llm["engine_kwargs"]["hf_overrides"] == tpu_llm["engine_kwargs"]["hf_overrides"]
    assert (cpu_llm["engine_kwargs"]["dtype"], tpu_llm["engine_kwargs"]["dtype"]) == ("float32", "bfloat16")
    assert cpu_llm["placement_group_config"] == {"bundles": [{"CPU": 1}]} and "accelerator_type" not in cpu_llm


def test_up_s_scoring_job_fails_in_bounded_time_naming_serves_own_status(capsys, tmp_path):
    """rescore.py --endpoint --wait-s, as `up` submits it to the training head: an endpoint whose replica never
    comes fails the job at the bound, with what Ray Serve says of its deployments (its dashboard's status)."""
    import rescore

    with stand_in("m", ready_after_s=None) as url:
        dashboard = url.removesuffix("/v1")
        started = time.monotonic()
        code = rescore.main([str(tmp_path), "--endpoint", url, "--served-model", "m", "--wait-s", "1",
                             "--serve-dashboard", dashboard])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 10
    assert (
        "error: the endpoint never answered: m did not answer at" in err
        and "LLMServer: UNHEALTHY replica failed: no TPU" in err
    )


def test_an_endpoint_that_never_answers_fails_up_and_sets_the_minimum_replicas_to_0_until_the_next_up(ray_head,
                                                                                                       tmp_path):  # fmt: skip
    """serveMinReplicas 1 and a replica that never comes: `up`'s scoring job (on the head, through the API server's
    proxy) fails at its bound, and the RayService's serveConfigV2 is patched to a minimum of 0 (Serve keeps no
    replica, so no TPU host stays up); the next `up` puts the declared config back before it waits again."""
    import yaml

    from infra.runner import ray_jobs
    from infra.runner.resilience import FixedToken
    from infra.runner.serve_scaler import without_minimum
    from infra.served_evaluation import score_through_endpoint
    from infra.serving.app import ServeConfig, serve_config
    from tests.apiserver_standin import FakeRayService, ServiceProxyStandin

    declared = yaml.safe_dump(serve_config(ServeConfig("finetuned", None, 512, 1, 2, "onDemand", 1), "m", "/export"),
                              sort_keys=False)  # fmt: skip
    service = FakeRayService("ray-torchtpu-cluster-llm", declared)
    logged: list[str] = []
    with (
        stand_in("m", ready_after_s=None) as url,
        ServiceProxyStandin(
            "k8s-bearer", "default", "ray-torchtpu-cluster-head-svc", 8265, ray_head.dashboard_url, fake_service=service
        ) as proxy,
    ):
        target = {"kind": "gke", "endpoint": proxy.url, "ca_certificate": None, "namespace": "default",
                  "service": "ray-torchtpu-cluster-head-svc", "port": 8265}  # fmt: skip
        settings = {"run": str(tmp_path), "endpoint": url, "served_model": "m", "base": False, "wait_s": 1,
                    "tolerance": 0.02, "serve_dashboard": url.removesuffix("/v1")}  # fmt: skip
        props = {"stack": "never", "cluster": "c", "image": "i", "code": str(time.time()), "settings": settings,
                 "target": target, "timeout_s": 120, "poll_s": 1, "retry_budget_s": 30,
                 "ray_service": {"namespace": "default", "name": "ray-torchtpu-cluster-llm", "serve_config": declared}}  # fmt: skip
        for attempt in (1, 2):
            with pytest.raises(ray_jobs.JobFailed, match=f"-a{attempt} ended FAILED") as failed:
                score_through_endpoint(props, log=logged.append, tokens=FixedToken("k8s-bearer"))
            assert "the endpoint never answered: m did not answer at" in str(failed.value)
            assert "LLMServer: UNHEALTHY replica failed: no TPU" in str(failed.value)  # Serve's own account
    zero = without_minimum(declared)
    assert service.patches == [zero, declared, zero]  # down, back before the next wait, down again
    expected = yaml.safe_load(declared)  # the declared config but for the minimum
    expected["applications"][0]["args"]["llm_configs"][0]["deployment_config"]["autoscaling_config"]["min_replicas"] = 0
    assert yaml.safe_load(zero) == expected
    assert any("minimum replicas set to 0" in line for line in logged)
    assert any("put back as declared" in line for line in logged)


def test_the_served_scores_sit_beside_the_jobs_in_the_evaluation_output():
    from infra.served_evaluation import with_served

    evaluation = {"tasks": {"heldout_loss": {"samples": 5, "metrics": {"loss": {"base": 4.6, "fine_tuned": 4.5}}}},
                  "lm_eval_version": "0.4.13"}  # fmt: skip
    scores = [{"task": "heldout_loss", "metric": "loss", "run": 4.5, "here": 4.50001}]
    tuned = with_served(evaluation, scores, base=False)
    assert tuned["tasks"]["heldout_loss"]["metrics"]["loss"] == {"base": 4.6, "fine_tuned": 4.5,
                                                                 "served_fine_tuned": 4.50001}  # fmt: skip
    assert (
        with_served(evaluation, scores, base=True)["tasks"]["heldout_loss"]["metrics"]["loss"]["served_base"] == 4.50001
    )
    assert "served_fine_tuned" not in evaluation["tasks"]["heldout_loss"]["metrics"]["loss"]  # (a copy)
    assert with_served(None, scores, base=False) is None and with_served(evaluation, None, base=False) is evaluation


def test_serving_a_directory_that_is_not_a_run_says_so_before_anything_starts(tmp_path, capsys):
    from infra.serving import rehearsal as local_serving

    with pytest.raises(SystemExit) as ended:
        local_serving.main([str(tmp_path)])
    assert ended.value.code == 2
    assert f"{tmp_path} has no model/config.json and no evaluation.json: give the directory" in capsys.readouterr().err


def test_ctrl_c_in_the_by_hand_rehearsal_is_a_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """`python -m infra.serving.rehearsal RUN` interrupted (its server and Ray are stopped by local_endpoint on the way
    out): one line and the shell's status for Ctrl-C, 130."""
    from infra.serving import rehearsal as local_serving

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "evaluation.json").write_text("{}")

    def interrupted(run: str) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(local_serving, "rehearse", interrupted)
    with pytest.raises(SystemExit) as ended:
        local_serving.cli([str(tmp_path)])
    assert ended.value.code == 130
    assert "interrupted: the server and its Ray are stopped" in capsys.readouterr().err
