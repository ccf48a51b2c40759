"""A Ray head on 127.0.0.1 for `make local` and the tests, stopped by whoever started it.

`ray start --block` runs in its own process group, so stopping it ends this head and its
workers and nothing else (unlike `ray stop`, which ends every Ray on the machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from infra.job_modules import backend


def address_file() -> Path:
    """Where `ray start` records the latest head (RAY_TMPDIR, else /tmp, then ray/ray_current_cluster)."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


class LocalRayHead:
    # 4 CPUs: the collectives check's default of 4 workers, one CPU bundle each.
    def __init__(self, num_cpus: int = 4, log_dir: Path | None = None, env: dict[str, str] | None = None):
        self.num_cpus = num_cpus
        self.port, self.dashboard_port = backend.free_port(), backend.free_port()
        self.log_dir = log_dir
        # Token auth off unless asked for: a stray ~/.ray/auth_token must not decide for us.
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray then reports 127.0.0.1 as every node's address, so gloo and Train stay on loopback.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "GLOO_SOCKET_IFNAME": "lo",
            # SIGTERM would otherwise drain the node for up to 30 s, for Serve traffic a local head never has.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            # Ray Train's controller polls its workers every 2 s by default; a few local workers can
            # be polled often, and a run then ends (or restarts after a lost worker) ~4 s sooner.
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
            # Job entrypoints say `python`: make it this interpreter, with Ray and torch.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            **(env or {}),
        }
        self.process: subprocess.Popen | None = None

    @classmethod
    def running_at(cls, port: int, dashboard_port: int, **kwargs) -> LocalRayHead:
        """A handle on a head another process started and will stop (stop() here does nothing)."""
        head = cls(**kwargs)
        head.port, head.dashboard_port = port, dashboard_port
        return head

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def client_env(self) -> dict[str, str]:
        """Environment for a driver that should join this head."""
        return {**self.env, "RAY_ADDRESS": self.address}

    def start(self, timeout_s: float = 120) -> LocalRayHead:
        ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        out = open(self.log_dir / "ray-head.log", "w") if self.log_dir else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [
                ray_bin, "start", "--head", "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={self.port}",
                f"--num-cpus={self.num_cpus}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                # Its agent's HTTP port too: at Ray's default (52365), whichever Ray on this machine starts second
                # (a by-hand run's, serving's, another checkout's) finds it taken and its agent serves no HTTP, and
                # every job submitted to that head then fails ("Agent info not found"; measured in CI).
                f"--dashboard-agent-listen-port={backend.free_port()}",
                "--disable-usage-stats",
            ],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"ray start exited with {self.process.returncode}; see {self.log_dir or 'its output'}"
                )
            # Ready once the dashboard answers and `ray start` has written its address file
            # (it does so a moment after), so that stop() finds the file to remove.
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2):
                    if self._names_this_head(address_file()):
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the local Ray dashboard did not answer on {self.dashboard_url} within {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.process is None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.process.poll() is not None:
                break
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        self.forget_address()

    def forget_address(self) -> None:
        """Remove the address file `ray start` wrote, if it still names this head (as `ray stop` does).

        Left behind, it sends every later `ray.init(address="auto")` to a dead GCS.
        """
        path = address_file()
        if self._names_this_head(path):
            path.unlink(missing_ok=True)

    def _names_this_head(self, path: Path) -> bool:
        try:
            return path.read_text().strip() == self.address
        except OSError:
            return False

    def __enter__(self) -> LocalRayHead:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
