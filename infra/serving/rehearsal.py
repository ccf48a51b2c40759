"""Serving rehearsed on CPU: a run's export behind the Serve application the RayService runs (infra/serving/app.py's
serve_application, the same function), on a Ray of its own started from the serving venv (.venv-serve), asked a chat
completion, and its held-out tasks scored through the endpoint with lm-eval's local-completions beside the run's own
scores (jobs/rescore.py --endpoint). `make local` ends with it; by hand, after make local:

    python -m infra.serving.rehearsal .local/ray_results/RUN        # the run directory make local printed

The wait for the endpoint is the stack's (wait_until_ready): bounded, with progress lines, and a server that never
answers fails naming the wait and showing the end of the server's log; the server and its Ray are stopped whatever
happens (nothing of it is left running).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from infra import ROOT
from infra.job_modules import backend, endpoint
from infra.runner import ray_jobs
from infra.serving.app import ServeConfig, serve_application, served_model_name

ServerNotReady, chat, wait_until_ready = endpoint.ServerNotReady, endpoint.chat, endpoint.wait_until_ready

SERVE_PYTHON = ROOT / ".venv-serve" / "bin" / "python"
READY_TIMEOUT_S = 600  # the tiny model on CPU: about a minute; a busy machine several
MAX_MODEL_LEN = 512


def log_tail(path: Path) -> str:
    return ray_jobs.tail(path.read_text(errors="replace")) if path.exists() else "(no log)"


@dataclass(frozen=True)
class LocalEndpoint:
    url: str  # the endpoint's /v1
    pid: int  # the server's process, whose descendants are its Ray (head_memory_mi)


@contextmanager
def local_endpoint(export_dir: str, name: str, log_path: Path, timeout_s: float = READY_TIMEOUT_S,
                   say: Callable[[str], None] = print) -> Iterator[LocalEndpoint]:  # fmt: skip
    """`export_dir` served as `name` by infra/serving/serve_local.py in the serving venv, on a Ray of its own; yields the
    endpoint once it answers, and stops the server and every process of its Ray on the way out."""
    if not SERVE_PYTHON.exists():
        raise FileNotFoundError(
            f"{SERVE_PYTHON} is missing: `make local` makes the serving venv (requirements-serve.txt)"
        )
    serve = ServeConfig("finetuned", None, MAX_MODEL_LEN, 1, 1, "onDemand", int(timeout_s // 60))
    port, ray_tmp = backend.free_port(), Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # short: Ray's socket paths
    app_file = log_path.with_suffix(".app.json")
    app_file.write_text(json.dumps(serve_application(serve, name, export_dir), indent=2))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VIRTUAL_ENV")} | {
        "RAY_TMPDIR": str(ray_tmp)
    }
    say(f"serving: {name} from {export_dir} on a Ray of its own (the app: {app_file}; log: {log_path})")
    with open(log_path, "w") as log:
        server = subprocess.Popen([str(SERVE_PYTHON), "-m", "infra.serving.serve_local", "--app", str(app_file), "--port",
                                   str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until_ready(url, name, timeout_s, alive=lambda: server.poll() is None, log_tail=lambda: log_tail(log_path),
                         say=say)  # fmt: skip
        yield LocalEndpoint(url, server.pid)
    finally:
        stop(server, ray_tmp)


# What runs on the RayService's CPU head, as Ray names its processes: Ray's own (GCS, raylet, dashboard, its agents),
# Serve's controller and HTTP proxy, and the OpenAI ingress (its router). Not the LLMServer replica and its vLLM
# engine, which run on the TPU host.
HEAD_PROCESSES = ("gcs_server", "raylet", "dashboard", "agent", "ServeController", "ProxyActor", "OpenAiIngress",
                  "LLMRouter", "log_monitor", "monitor.py")  # fmt: skip


def head_memory_mi(server_pid: int) -> dict[str, int]:
    """The resident memory (MiB) of a running rehearsal's processes that the serving head holds on GKE, by kind:
    what the head's 6 Gi must take (measured here, on CPU: the ingress imports vLLM's protocol models as it would
    there)."""
    import psutil

    found: dict[str, int] = {}
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
            kind = next((k for k in HEAD_PROCESSES if k in line), None)
            if kind is not None and "LLMServer" not in line:
                found[kind] = found.get(kind, 0) + proc.memory_info().rss // 2**20
        except psutil.Error:  # (gone meanwhile)
            continue
    return found


def stop(server: subprocess.Popen, ray_tmp: Path) -> None:
    """SIGTERM to the server (it shuts Serve and its Ray down), then whatever of its Ray is left, by its temp dir."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    subprocess.run(["pkill", "-9", "-f", str(ray_tmp)], capture_output=True)


# How far a served score may be from the job's own before it is a problem: on CPU both are fp32 over the same
# tokens, so only the order of float sums differs (measured: equal to 6 decimals).
SERVED_REL_TOL = 1e-4


def rescore_module():
    """jobs/rescore.py (imported when used: it brings lm-eval's modules with it)."""
    import infra.job_modules  # noqa: F401  (jobs/ on the path, as the job modules are imported)
    import rescore

    return rescore


def served_scores(run_dir: str, url: str, name: str) -> list[tuple]:
    """jobs/rescore.py's rows for the run's tasks through the endpoint: (task, metric, the job's score of the
    fine-tune, the served one's)."""
    return rescore_module().rescore(run_dir, "", "cpu", "float32", 8, url, name)


def rehearse(run_dir: str, say: Callable[[str], None] = print, while_up: Callable[[str, str], object] | None = None
             ) -> dict:  # fmt: skip
    """The run's export served, a chat completion, its held-out tasks scored through the endpoint; `while_up(url,
    name)`, if given, also runs while it is up (its result under "while_up")."""
    export = str(Path(run_dir) / "model")
    name = served_model_name(export, "finetuned")
    logs = ROOT / ".local" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with local_endpoint(export, name, logs / "serve.log", say=say) as served:
        url = served.url
        answer = chat(url, name, "Say hello.")
        say(f"serving: chat completion from {name}: {answer!r}")
        rows = served_scores(run_dir, url, name)
        head = head_memory_mi(served.pid)  # (after the scoring: the ingress has served every request)
        say(f"serving: the serving head's processes hold {sum(head.values())} MiB here "
            f"({', '.join(f'{k} {v}' for k, v in sorted(head.items()))})")  # fmt: skip
        also = while_up(url, name) if while_up else None
    return {"url": url, "model": name, "answer": answer, "scores": rows, "problems": served_problems(rows),
            "while_up": also, "head_memory_mi": head}  # fmt: skip


def served_problems(rows: list[tuple]) -> list[str]:
    """The served scores that disagree with the job's beyond SERVED_REL_TOL, named."""
    disagree = rescore_module().disagreements(rows, SERVED_REL_TOL)
    return [f"the served score disagrees with the in-job one: {d}" for d in disagree]


def print_served(served: dict) -> None:
    rescore = rescore_module()
    print(
        f"\nServed ({served['model']} at {served['url']}, now stopped; the job's score `run`, the endpoint's `here`):"
    )
    print(f"  chat:        {served['answer']!r}")
    for row in served["scores"]:
        print(f"  {rescore.line(row)}")
    for problem in served["problems"]:
        print(f"  problem: {problem}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run directory: its model/ (the export), evaluation.json and heldout/")
    args = parser.parse_args(argv)
    missing = [name for name in ("model/config.json", "evaluation.json") if not (Path(args.run) / name).is_file()]
    if missing:
        parser.error(f"{args.run} has no {' and no '.join(missing)}: give the directory a fine-tune printed before "
                     "/model (its run), once the run has ended with an evaluation (--eval-tasks not none)")  # fmt: skip
    served = rehearse(args.run)
    print_served(served)
    if served["problems"]:
        raise SystemExit(1)


def cli(argv: list[str] | None = None) -> None:
    """main, with Ctrl-C said in a line (local_endpoint has stopped the server and its Ray by then), not a traceback."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print("\ninterrupted: the server and its Ray are stopped; nothing of them is left running", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    cli()
