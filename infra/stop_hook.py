"""The TPU worker containers' preStop hook: a save before the pod goes.

Without it no Ray Train worker sees a pod's termination in time to save. Kubernetes sends SIGTERM
to the container's PID 1, `ray start --block` (bash execs it: ray-project/ray#64454), whose handler
kills the raylet with a 1 s grace, and the raylet kills its workers; KubeRay adds no preStop hook and
no grace period of its own (ray-project/kuberay#5004). So this hook, which the kubelet runs before
that SIGTERM, sends SIGTERM to the pod's Ray Train workers itself (jobs/stopping.py turns it into
"finish this step, save it, stop") and waits, at most `wait_s`, for them to end, which they do once
their checkpoint is registered.

It runs in the container with Python alone (no procps in the image), finding the workers by the
process title Ray gives them. `command(wait_s)` is what the manifest runs; a test runs the same
command against a local Ray's training workers.
"""

from __future__ import annotations

import inspect
import sys

TITLE = b"ray::RayTrainWorker"


def main(wait_s: float) -> None:
    import os
    import signal
    import time

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().split(b") ", 1)[1][:1] != b"Z"  # a zombie has ended
        except (OSError, IndexError):
            return False

    workers = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if name.isdigit() and f.read().startswith(TITLE):
                    workers.append(int(name))
        except OSError:
            continue
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    print(f"preStop: asked {len(workers)} Ray Train workers to save and stop", flush=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(alive(pid) for pid in workers):
        time.sleep(0.5)


def command(wait_s: int) -> list[str]:
    """The hook as an exec command: this module's source, run by the image's Python."""
    source = inspect.getsource(sys.modules[__name__])
    return ["python", "-c", source, str(wait_s)]


if __name__ == "__main__":
    main(float(sys.argv[1]))
