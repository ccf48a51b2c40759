"""The one place the jobs learn which device and process-group backend they run on, and how a driver joins
its Ray cluster.

`tpu` imports torch_tpu (only then) and uses `tpu_dist`; `cpu` uses `gloo`; `cuda` uses `nccl`. Torch is
imported where it is used: the stack reads BACKENDS and DTYPES (jobs/config/settings.py).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass

from runtime.outcome import JobInputError

DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class Backend:
    name: str
    dist_backend: str
    device_type: str
    # bf16 where the hardware multiplies in it; fp32 on CPUs, whose matmuls in bf16 are ~5x slower
    compute_dtype: str

    def device(self):
        import torch

        if self.name == "cuda":
            # Workers on one node may all see every GPU: each takes the one of its local rank.
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        # Ray gives each TPU worker exactly one device, so it is always index 0 in-process.
        return torch.device(self.device_type)

    def reset_peak_memory(self) -> None:
        """Start a new high-water mark (for the next epoch's `peak_memory_gib`)."""
        import torch

        if self.name == "cpu":
            _clear_resident_peak()
            return
        try:
            torch.accelerator.memory.reset_peak_memory_stats()
        except (AttributeError, NotImplementedError, RuntimeError):
            pass  # the backend keeps no statistics; peak_memory_gib says None

    def peak_memory_gib(self) -> float | None:
        """This process's high-water mark of device memory since the last reset: the backend's
        allocator peak (torch.accelerator, which CUDA and registered backends such as TorchTPU
        implement); on CPU the resident set's (VmHWM), which counts everything the process holds."""
        import torch

        if self.name == "cpu":
            return _resident_peak_bytes() / 2**30
        try:
            return torch.accelerator.memory.max_memory_allocated() / 2**30
        except (AttributeError, NotImplementedError, RuntimeError):
            return None

    def prepare(self) -> None:
        """Per-process setup, before the first collective."""
        if self.name == "tpu":
            from runtime import torch_tpu_api

            torch_tpu_api.register()
        elif self.name == "cuda":
            import torch

            torch.cuda.set_device(self.device())


def _clear_resident_peak() -> None:
    """Linux resets VmHWM to the current resident size when "5" is written to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _resident_peak_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


BACKENDS = {
    "tpu": Backend("tpu", "tpu_dist", "tpu", "bfloat16"),
    "cpu": Backend("cpu", "gloo", "cpu", "float32"),
    "cuda": Backend("cuda", "nccl", "cuda", "bfloat16"),
}


def get_backend(name: str) -> Backend:
    """The backend of a checked --backend (jobs/config/settings.py refuses any other name)."""
    return BACKENDS[name]


def live_cluster_address(timeout_s: float = 3.0) -> str | None:
    """The Ray cluster to join: RAY_ADDRESS, or the last `ray start` head if its GCS still answers.

    `ray.init(address="auto")` follows the address file a head leaves in Ray's temp dir
    (RAY_TMPDIR, else /tmp/ray) even after that head was killed, and then waits for it
    forever; here a file whose GCS port is closed counts as no cluster.
    """
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    from ray._private.utils import read_ray_address

    address = read_ray_address()
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return address
    except (OSError, ValueError):
        print(f"ignoring the stale Ray address {address} (nothing answers there)", flush=True)
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PLACEMENT_WAIT_S = 300.0  # how long a joined cluster may take to hold the workers (nodes still registering)


def connect_ray(cpus_wanted: int, workers_on: str | None = None) -> None:
    """Join the Ray cluster this runs in (ray job submit, a live local head); else start one big enough. With
    `workers_on` (a backend), then wait until the cluster can hold that many workers of it (await_workers)."""
    import ray

    if ray.is_initialized():
        return
    address = live_cluster_address()
    if address:
        ray.init(address=address)
        if workers_on:
            await_workers(workers_on, cpus_wanted, PLACEMENT_WAIT_S)
        return
    # A private single-machine Ray: keep it, and the process groups, on loopback.
    num_cpus = max(cpus_wanted, os.cpu_count() or 1)
    if workers_on:  # refused before Ray starts (seconds of a user's time) when this machine cannot hold them
        refuse_unless_held(workers_on, cpus_wanted, private_ray_resources(num_cpus), "this machine's Ray would have")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ray.init(
        address="local",  # not None: that too would follow a stale address file
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        # Ray Train's PlacementGroupCleaner asks the State API, which the dashboard serves, whether the controller
        # lives; without it, it logs "Failed to query Ray Train Controller actor state" every few seconds
        # (ray/train/v2/_internal/execution/controller/placement_group_cleaner.py). On a free port: not 8265, which
        # a `ray start` head of this machine may hold.
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=free_port(),
    )
    if workers_on:
        await_workers(workers_on, cpus_wanted, 0.0)  # this Ray is all there will be


# What the fine-tune's ScalingConfig asks for each Ray Train worker (use_gpu adds a GPU on cuda).
RESOURCES_PER_WORKER = {"tpu": {"TPU": 1}, "cuda": {"CPU": 1}, "cpu": {"CPU": 1}}


def worker_resources(backend: str) -> dict[str, float]:
    """What one Ray Train worker of `backend` takes from the cluster."""
    return RESOURCES_PER_WORKER[backend] | ({"GPU": 1} if backend == "cuda" else {})


def private_ray_resources(num_cpus: int) -> dict[str, float]:
    """What a Ray started here with `num_cpus` would hold: Ray's own resolution of this node's CPUs, TPU chips
    (/dev/accel*, /dev/vfio) and GPUs, as `ray.init` runs it (ray/_private/resource_and_label_spec.py, Ray 2.60.0;
    private, so it is the pinned Ray's)."""
    from ray._private.resource_and_label_spec import ResourceAndLabelSpec

    return ResourceAndLabelSpec(num_cpus=num_cpus).resolve(is_head=True, node_ip_address="127.0.0.1").to_resource_dict()


def shortfall(backend: str, workers: int, have: dict[str, float]) -> str | None:
    """None when `have` holds `workers` workers of `backend`; else what it holds of what they need ("TPU 0")."""
    needed = {k: v * workers for k, v in worker_resources(backend).items()}
    if all(have.get(k, 0.0) >= v for k, v in needed.items()):
        return None
    return ", ".join(f"{k} {have.get(k, 0.0):g}" for k in needed)


def refuse_unless_held(backend: str, workers: int, have: dict[str, float], holder: str, waited: str = "") -> None:
    """Raise JobInputError naming what `workers` workers of `backend` need and `have` lacks."""
    held = shortfall(backend, workers, have)
    if held is None:
        return
    needed = ", ".join(f"{k} {v * workers:g}" for k, v in worker_resources(backend).items())
    raise JobInputError(
        f"--backend {backend} needs {needed} for {workers} workers; {holder} {held}{waited}. On TPU, submit the "
        "job to the RayCluster with its slice up; on this machine, use --backend cpu --num-workers N"
    )


def await_workers(backend: str, workers: int, wait_s: float) -> None:
    """Return once the Ray cluster holds `workers` workers of `backend`, or raise JobInputError naming what is
    missing. Ray Train itself would retry placing them forever (FailureConfig.controller_failure_limit is -1:
    ray/train/v2/api/config.py), a minute at a time, or ~180 times a second for a slice it cannot reserve."""
    import ray

    deadline, said = time.monotonic() + wait_s, 0.0
    while True:
        have = ray.cluster_resources()
        held = shortfall(backend, workers, have)
        if held is None:
            return
        if time.monotonic() >= deadline:
            refuse_unless_held(
                backend, workers, have, "this Ray cluster has", f" after {wait_s:.0f} s" if wait_s else ""
            )
        if time.monotonic() - said >= 30:
            print(f"waiting for the Ray cluster to hold {workers} {backend} workers (it has {held})", flush=True)
            said = time.monotonic()
        time.sleep(2)


def worker_print(message: str) -> None:
    """Print once from a Ray Train worker. Train patches `print` to log the line and also to
    echo it when sys.stdout is wrapped, as it is in a Ray worker: every plain print showed twice."""
    print(message, file=sys.__stdout__ or sys.stdout, flush=True)
