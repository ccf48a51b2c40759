"""After the endpoint: `up` waits for it and scores the run's tasks through it, as a job on the training cluster's
head (jobs/rescore.py --endpoint --wait-s: inside the cluster the endpoint is a plain URL, and the head has
lm-eval and the run's files). The served scores go beside the job's in the `evaluation` output, and a served score
further from the job's than the noise is named as a problem.

A Pulumi dynamic resource over infra/runner/ray_jobs.py's run_job, as the training jobs are; `make local` and the
tests call the provider's create() with the same props against a local head.
"""

from __future__ import annotations

import pulumi
import pulumi.dynamic as dynamic

from infra.config.stack import StackConfig
from infra.job_modules import endpoint, eval_tasks
from infra.resources.raycluster import DASHBOARD_PORT, head_service
from infra.runner import ray_jobs
from infra.runner.job_client import connect, default_log
from infra.runner.kube_api import KubeApi, api_server_url
from infra.runner.resilience import GoogleTokens, TokenSource
from infra.runner.serve_scaler import ServeScaler
from infra.training import RETRY_BUDGET_S, diff_props, sigterm_as_interrupt

OUTPUT_KEYS = ("scores", "problems", "job_id", "seconds")
# bf16 on the serving engine against bf16 under FSDP in the job: a different order of every sum. An assumption,
# not measured on a TPU (on CPU, both fp32, the scores agree to 6 decimals: infra/local_serving.SERVED_REL_TOL).
TPU_REL_TOL = 0.02


def scored_through_endpoint(cfg: StackConfig) -> bool:
    """Whether `up` scores the served model: the run scores tasks (its evaluation.json is the reference), and the
    endpoint serves the run's own export or its starting model (serveModel's export has another run's tasks)."""
    return cfg.serve is not None and not cfg.serve.model and bool(eval_tasks.parse(cfg.job.eval_tasks))


def served_settings(cfg: StackConfig, run_dir: pulumi.Input[str], url: str, model: str) -> dict:
    """What the scoring job is asked: the run, the endpoint (in-cluster), the name it serves, the bounded wait."""
    return {"run": run_dir, "endpoint": url, "served_model": model, "base": cfg.serve.what == "base",
            "wait_s": cfg.serve.ready_timeout_minutes * 60, "tolerance": TPU_REL_TOL,
            "serve_dashboard": f"http://{head_service(cfg.serve_name)}.{cfg.namespace}.svc.cluster.local:{DASHBOARD_PORT}"}  # fmt: skip


def served_props(cfg: StackConfig, target: dict, cluster: pulumi.Input[str], image: pulumi.Input[str],
                 settings: dict, serve_config: pulumi.Input[str] | None = None) -> dict:  # fmt: skip
    """`serve_config`: the RayService's declared serveConfigV2, which a wait that fails sets to a minimum of 0
    replicas (serveMinReplicas above 0 only: at 0 the autoscalers end an idle replica anyway)."""
    ray_service = None
    if serve_config is not None and cfg.serve.min_replicas > 0:
        ray_service = {"namespace": cfg.namespace, "name": cfg.serve_name, "serve_config": serve_config}
    return {
        "stack": cfg.stack, "cluster": cluster, "image": image, "code": ray_jobs.jobs_code_hash(),
        "settings": settings, "target": target, "timeout_s": settings["wait_s"] + cfg.job_timeout_minutes * 60,
        "poll_s": 2 if cfg.local else 15, "retry_budget_s": RETRY_BUDGET_S, "ray_service": ray_service,
    }  # fmt: skip


def rescore_spec(settings: dict) -> ray_jobs.JobSpec:
    args = [settings["run"], "--endpoint", settings["endpoint"], "--served-model", settings["served_model"],
            "--wait-s", str(settings["wait_s"]), "--tolerance", str(settings["tolerance"])]  # fmt: skip
    if settings.get("serve_dashboard"):
        args += ["--serve-dashboard", settings["serve_dashboard"]]
    return ray_jobs.JobSpec("served-evaluation", "rescore.py", tuple(args + (["--base"] if settings["base"] else [])))


def serve_scaler(props: dict, tokens: TokenSource | None, policy, log) -> ServeScaler | None:
    """What scales the RayService's replicas after a failed wait: on GKE, with a minimum above 0."""
    service, target = props.get("ray_service"), props["target"]
    if not service or target["kind"] != "gke":
        return None
    api = KubeApi(api_server_url(target["endpoint"]), tokens or GoogleTokens(), target.get("ca_certificate"), policy,
                  log)  # fmt: skip
    return ServeScaler(api, service["namespace"], service["name"], service["serve_config"], log)


def score_through_endpoint(props: dict, log=default_log, tokens: TokenSource | None = None) -> dict:
    """The scoring job, found, attached to or submitted, and its result: {"scores", "problems", "job_id", "seconds"
    (the wait for a replica and the scoring: what the serving host ran for up)}. An endpoint that never answers
    fails it; with a minimum of replicas above 0, the RayService's minimum is then set to 0 (and put back first by
    the next `up`), so that no TPU host stays up for a replica that does not start."""
    policy = ray_jobs.retry_policy(props)
    tokens = tokens or (GoogleTokens() if props["target"]["kind"] == "gke" else None)
    client = connect(props["target"], tokens, policy, log)
    scaler = serve_scaler(props, tokens, policy, log)
    if scaler:
        scaler.put_back()
    try:
        result, job_id = ray_jobs.run_job(client, props, rescore_spec(props["settings"]), policy, lambda: None, log)
    except ray_jobs.JobFailed as err:
        if scaler and endpoint.NEVER_ANSWERED in str(err):
            scaler.to_zero()
        raise
    for problem in result["problems"]:
        log(f"[served-evaluation] problem: the served score disagrees with the run's: {problem}")
    return {"scores": result["scores"], "problems": result["problems"], "job_id": job_id, "seconds": result["seconds"]}


def with_served(evaluation: dict | None, scores: list[dict] | None, base: bool) -> dict | None:
    """The `evaluation` output with each served score beside the job's (`served_fine_tuned` or `served_base`)."""
    if not evaluation or not scores:
        return evaluation
    tasks = {task: dict(entry, metrics={m: dict(v) for m, v in entry["metrics"].items()})
             for task, entry in evaluation["tasks"].items()}  # fmt: skip
    for score in scores:
        metric = tasks.get(score["task"], {}).get("metrics", {}).get(score["metric"])
        if metric is not None:
            metric["served_base" if base else "served_fine_tuned"] = score["here"]
    return evaluation | {"tasks": tasks}


class _ServedEvaluationProvider(dynamic.ResourceProvider):
    def create(self, props: dict) -> dynamic.CreateResult:
        with sigterm_as_interrupt():
            outputs = score_through_endpoint(props)
        return dynamic.CreateResult(id_=outputs["job_id"], outs={**props, **outputs})

    def diff(self, _id, olds, news):
        return diff_props(olds, news)

    def update(self, _id, olds, news):
        return dynamic.UpdateResult(
            outs={**olds, **{k: news.get(k) for k in ("target", "timeout_s", "poll_s", "ray_service")}}
        )


class ServedEvaluation(dynamic.Resource):
    """Outputs: scores (task, metric, the run's, the endpoint's), problems, job_id, seconds."""

    scores: pulumi.Output[list]
    seconds: pulumi.Output[float]
    problems: pulumi.Output[list]
    job_id: pulumi.Output[str]

    def __init__(self, name: str, props: dict, opts: pulumi.ResourceOptions | None = None):
        props = props | dict.fromkeys(OUTPUT_KEYS)
        timeout = pulumi.CustomTimeouts(create=f"{props['timeout_s'] // 60 + 10}m")
        super().__init__(_ServedEvaluationProvider(), name, props,
                         pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(custom_timeouts=timeout)))  # fmt: skip
