"""A Ray cluster of several nodes on this machine, as Ray's own tests make one (ray.cluster_utils.Cluster), in a
process of its own: a head with no CPUs (the driver's node, as the RayCluster's head runs no training) and
worker nodes of `--cpus` CPUs each, standing in for TPU hosts. It prints one JSON line,
{"address": GCS address, "raylets": [each worker node's raylet pid]}, then holds the cluster until stdin
closes. Its Ray temp dir is its own (RAY_TMPDIR), so the address file other tests' drivers follow is untouched.

    python -m tests.ray_nodes --nodes 2 --cpus 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def node_env(tmpdir: str) -> dict[str, str]:
    """The environment of the cluster's processes and of a driver joining it."""
    return {
        **os.environ,
        "RAY_TMPDIR": tmpdir,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every node on 127.0.0.1 (infra/runner/local_ray.py)
        "GLOO_SOCKET_IFNAME": "lo",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }


class RayNodes:
    """The cluster process, as a context manager: .address, .raylets, .env (for a driver)."""

    def __init__(self, nodes: int = 2, cpus: int = 2):
        self.nodes, self.cpus = nodes, cpus
        self.tmpdir = tempfile.mkdtemp(prefix="rn")  # short: Ray's socket paths live under it
        self.env = node_env(self.tmpdir)

    def __enter__(self) -> RayNodes:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.ray_nodes", "--nodes", str(self.nodes), "--cpus", str(self.cpus)],
            cwd=ROOT, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.process.stdout.readline()
        if not line:
            self.__exit__()
            raise RuntimeError("the Ray nodes did not start")
        found = json.loads(line)
        self.address, self.raylets = found["address"], found["raylets"]
        self.env = self.env | {"RAY_ADDRESS": self.address}
        return self

    def __exit__(self, *exc) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def main() -> None:
    from ray.cluster_utils import Cluster

    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=args.cpus) for _ in range(args.nodes)]
    cluster.wait_for_nodes()
    raylets = [node.all_processes["raylet"][0].process.pid for node in workers]
    print(json.dumps({"address": cluster.address, "raylets": raylets}), flush=True)
    sys.stdin.read()  # until the test closes it
    cluster.shutdown()


if __name__ == "__main__":
    main()
