"""A by-hand run with no cluster to join starts a Ray of its own; Ctrl-C ends it and all of that Ray (apart from
test_jobs.py's README run on the shared head, so that xdist can give the two files to different workers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parent.parent / "jobs"


def by_hand_run(tiny_assets, tmp_path, extra: list[str], stale_address: bool = False) -> tuple[subprocess.Popen, Path]:
    """The fine-tune started by hand on tiny assets with no cluster to join (its own Ray, in a temp dir of its
    own, so that what it leaves behind can be looked for), in a session of its own as a terminal gives it; with
    `stale_address`, next to the address file of a head that is gone (as a killed `make local` leaves it)."""
    import os
    import tempfile

    from infra.job_modules import backend

    ray_tmp = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: Ray's socket paths live below it
    if stale_address:
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{backend.free_port()}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(ray_tmp)}
    argv = [sys.executable, str(JOBS / "ray_train_llm_finetune.py"), "--model", tiny_assets["model"], "--dataset",
            tiny_assets["dataset"], "--split", "train[:80]", "--seq-len", "128", "--storage-path", str(tmp_path),
            "--eval-tasks", "none", *extra]  # fmt: skip
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    return process, ray_tmp


def processes_under(ray_tmp: Path) -> str:
    return subprocess.run(["pgrep", "-af", str(ray_tmp)], capture_output=True, text=True).stdout


@pytest.fixture
def ended():
    """Ends what a by-hand run left, whatever the test found: its process group, then every process of its Ray."""
    import os
    import signal

    runs = []
    yield runs.append
    for process, ray_tmp in runs:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", str(ray_tmp)], capture_output=True)


@pytest.mark.e2e
def test_ctrl_c_ends_a_by_hand_run_in_seconds_and_leaves_no_ray_behind(tiny_assets, tmp_path, ended):
    """A by-hand run next to a killed head's address file says it ignores that address and starts a Ray of its
    own; Ctrl-C mid-run ends it within 30 s and nothing of that Ray is left."""
    import os
    import signal
    import time

    process, ray_tmp = by_hand_run(tiny_assets, tmp_path, ["--backend", "cpu", "--num-workers", "1", "--epochs", "50",
                                                            "--log-every", "1"], stale_address=True)  # fmt: skip
    ended((process, ray_tmp))
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "step 2/" in line:
            break
    assert any(line.startswith("ignoring the stale Ray address 127.0.0.1:") for line in lines)  # then its own Ray
    interrupted = time.monotonic()
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches its whole foreground group
    process.communicate(timeout=60)
    assert time.monotonic() - interrupted < 30
    deadline = time.monotonic() + 10  # (its Ray's last processes exit just after the driver)
    while processes_under(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_under(ray_tmp) == ""
