"""The one place the jobs learn which device and process-group backend they run on.

`tpu` imports torch_tpu (only then) and uses `tpu_dist`; `cpu` uses `gloo`; `cuda` uses `nccl`.
Also the jobs' shared facts: TPU accelerator types, the input-error type and the result line.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

# The jobs travel alone (only jobs/ is uploaded), so these few facts are restated here;
# tests/test_config.py checks them against infra/tpu.py and infra/runner/ray_jobs.py.
RESULT_PREFIX = "JOB_RESULT_JSON: "
CHIPS_PER_HOST = 4


class TpuType(NamedTuple):
    version: str  # Ray's accelerator version
    devices_per_chip: int  # logical devices (chiplets)
    peak_bf16_flops_per_chip: float

    @property
    def peak_flops_per_device(self) -> float:
        return self.peak_bf16_flops_per_chip / self.devices_per_chip


# Ray accelerator type -> its facts
ACCELERATOR_TYPES = {"TPU-V6E": TpuType("v6e", 1, 918e12), "TPU-V7X": TpuType("v7x", 2, 2307e12)}
DTYPES = ("bfloat16", "float32")


class JobInputError(ValueError):
    """A bad flag or input, reported before any worker starts."""


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
            import torch_tpu  # noqa: F401  (registers the tpu device and the tpu_dist backend)
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
    if name not in BACKENDS:
        raise JobInputError(f"--backend {name!r} is not supported; choose one of: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def tpu_devices(topology: str, accelerator_type: str) -> int:
    """Logical TPU devices (= workers) in a slice of this topology."""
    if accelerator_type not in ACCELERATOR_TYPES:
        raise JobInputError(
            f"--accelerator-type {accelerator_type!r} is not supported; choose one of: {', '.join(ACCELERATOR_TYPES)}"
        )
    try:
        chips = math.prod(int(d) for d in topology.split("x"))
    except ValueError:
        raise JobInputError(f"--topology {topology!r} is not a topology such as 4x4 or 2x2x2") from None
    return chips * ACCELERATOR_TYPES[accelerator_type].devices_per_chip


def resolve_num_workers(backend: str, topology: str, accelerator_type: str, num_workers: int | None,
                        num_slices: int = 1) -> int:  # fmt: skip
    """On TPU the slices decide (and a given --num-workers must agree); elsewhere --num-workers does, and
    --num-slices must divide it: every slice holds as many workers as the others."""
    if num_slices < 1:
        raise JobInputError(f"--num-slices must be a positive integer (got {num_slices})")
    if backend == "tpu":
        per_slice = tpu_devices(topology, accelerator_type)
        devices = per_slice * num_slices
        if num_workers is not None and num_workers != devices:
            slice_ = f"--topology {topology} on {accelerator_type}"
            what = (f"{slice_}, which has {devices} devices" if num_slices == 1 else
                    f"--num-slices {num_slices} x {slice_} ({per_slice} devices a slice, {devices} in all)")  # fmt: skip
            raise JobInputError(
                f"--num-workers {num_workers} does not match {what}; drop --num-workers or pass {devices}"
            )
        return devices
    if num_workers is None or num_workers < 1:
        raise JobInputError(f"--num-workers must be a positive number off TPU (got {num_workers})")
    if num_workers % num_slices:
        divisors = [n for n in range(1, num_workers + 1) if num_workers % n == 0]
        raise JobInputError(
            f"--num-slices {num_slices} does not divide --num-workers {num_workers}: every slice holds as many "
            f"workers as the others; pass --num-slices one of {', '.join(map(str, divisors))}"
        )
    return num_workers


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


def connect_ray(cpus_wanted: int) -> None:
    """Join the Ray cluster this runs in (ray job submit, a live local head); else start one big enough."""
    import ray

    if ray.is_initialized():
        return
    address = live_cluster_address()
    if address:
        ray.init(address=address)
        return
    # A private single-machine Ray: keep it, and the process groups, on loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ray.init(
        address="local",  # not None: that too would follow a stale address file
        num_cpus=max(cpus_wanted, os.cpu_count() or 1),
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
    )


def worker_print(message: str) -> None:
    """Print once from a Ray Train worker. Train patches `print` to log the line and also to
    echo it when sys.stdout is wrapped, as it is in a Ray worker: every plain print showed twice."""
    print(message, file=sys.__stdout__ or sys.stdout, flush=True)


def print_result(result: dict) -> None:
    """The last line a job prints: what the job resource parses."""
    print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)


def exit_code(run: Callable[[], dict], succeeded: Callable[[dict], bool] = lambda _: True) -> int:
    """A job's exit status: 2 for bad input (message, no traceback), 1 when its checks fail."""
    try:
        result = run()
    except JobInputError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    print_result(result)
    return 0 if succeeded(result) else 1
