"""The TPU worker containers' preStop hook: drain this pod's Ray node, so that Ray Train saves and moves the run.

Kubernetes runs it when the pod is to go (a Spot preemption, a scale-down, a deleted pod), before it sends
SIGTERM to the container's PID 1, `ray start --block`, and inside the pod's grace period (infra/cloud/capacity.py
sizes both per capacity kind). KubeRay adds no hook of its own (ray-project/kuberay#5004). The hook:

1. finds this pod's raylet (the process started from Ray's `raylet` binary under the container's init,
   PID 1) and reads its node id and GCS address from its command line;
2. drains that node, reason PREEMPTION, deadline `drain_s` from now: `ray drain-node` (ray/scripts/scripts.py
   in Ray 2.60; the approach of ray-project/kuberay#5005). Ray Train's preemption watcher sees the drain,
   every rank saves the step it is in (jobs/training/stopping.py), and at the deadline Ray Train restarts the group
   from that save on nodes that are not draining, charged to FailureConfig.max_preemption_failures;
3. waits, at most until the deadline and a little more, for this pod's Ray Train workers to end.

If the drain cannot be made (no raylet, the GCS unreachable, a Ray without the command), it falls back to
sending the pod's Ray Train workers SIGTERM: they save their step and stop (jobs/training/stopping.py), and Ray Train
restarts the group, charged to max_failures. `ray start`, sent SIGTERM once the hook returns, drains the
node again (already draining) and stops.

It runs in the container with Python alone (no procps in the image). `command(drain_s)` is what the
manifest runs; the tests run the same command against local Ray nodes, naming a node's `ray start` as
the root instead of PID 1.
"""

from __future__ import annotations

import inspect
import sys

WORKER_TITLE = b"ray::RayTrainWorker"
REASON = "DRAIN_NODE_REASON_PREEMPTION"
AFTER_DEADLINE_S = 8  # Ray Train's restart ends the workers a poll or two after the deadline
# How long `ray drain-node` may take: mostly its own start, a Python importing Ray's CLI (4 s of wall on an idle
# 2-core machine, 2.7 s of CPU; over 5 s under load, where a 5 s limit fell back to SIGTERM in a CI run). The
# drain's deadline counts from its request, so waiting for the CLI costs the deadline nothing; at most the
# deadline less 2 s, and 15 s, so that a GCS that does not answer leaves the SIGTERM fallback time to save.
DRAIN_CLI_S = 15


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> list[bytes]:
    """The fields after the process's name: state, parent, ... ([] once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[1].split()
    except (OSError, IndexError):
        return []


def _alive(pid: int) -> bool:
    state = _stat(pid)
    return bool(state) and state[0] != b"Z"  # a zombie has ended


def _under(root: int) -> list[int]:
    """`root` and every process below it."""
    import os

    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    parents = {pid: int(stat[1]) if (stat := _stat(pid)) else 0 for pid in pids}
    found = []
    for pid in pids:
        up, seen = pid, 0
        while up != root and up > 0 and seen < 64:
            up, seen = parents.get(up, 0), seen + 1
        if up == root:
            found.append(pid)
    return found


def _drain(raylet: bytes, drain_s: int) -> str | None:
    """Drain the raylet's node through its GCS (`ray drain-node`); None once drained, else why not."""
    import re
    import subprocess

    node, gcs = re.search(rb"--node_id=([0-9a-f]+)", raylet), re.search(rb"--gcs-address=([^\s\0]+)", raylet)
    if not (node and gcs):
        return "no raylet found in this pod"
    drain = [sys.executable, "-m", "ray.scripts.scripts", "drain-node", f"--address={gcs[1].decode()}",
             f"--node-id={node[1].decode()}", f"--reason={REASON}",
             "--reason-message=the pod is terminating (its preStop hook)", f"--deadline-remaining-seconds={drain_s}"]  # fmt: skip
    try:
        done = subprocess.run(drain, capture_output=True, text=True, timeout=min(max(5, drain_s - 2), DRAIN_CLI_S))
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return None if done.returncode == 0 else done.stderr.strip()[-500:] or f"exit status {done.returncode}"


def main(drain_s: int, root: int = 1) -> None:
    import os
    import signal
    import time

    started = time.monotonic()
    processes = _under(root)
    workers = [pid for pid in processes if _cmdline(pid).startswith(WORKER_TITLE)]
    raylet = next((c for c in map(_cmdline, processes) if c.split(b"\0")[0].endswith(b"/raylet")), b"")
    failed = _drain(raylet, drain_s)
    if failed is None:
        print(f"preStop: drained this pod's Ray node with a {drain_s} s deadline; {len(workers)} Ray Train workers "
              "here save their step and Ray Train moves the run", flush=True)  # fmt: skip
    else:
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        print(f"preStop: no drain ({failed}); asked {len(workers)} Ray Train workers to save and stop", flush=True)
    deadline = started + drain_s + AFTER_DEADLINE_S
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.5)


def command(drain_s: int) -> list[str]:
    """The hook as an exec command: this module's source, run by the image's Python."""
    source = inspect.getsource(sys.modules[__name__])
    return ["python", "-c", source, str(drain_s)]


if __name__ == "__main__":
    main(int(sys.argv[1]), *(int(a) for a in sys.argv[2:3]))
