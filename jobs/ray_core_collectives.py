"""Collectives check for TPU slices: tensor-parallel parity and all-reduces, one Ray actor per device.

Run it on the slice (from the working directory `jobs/`):

    ray job submit --address http://localhost:8265 --working-dir jobs -- \\
        python ray_core_collectives.py --topology 4x4 --accelerator-type TPU-V6E

On CPU, with the gloo backend and a local Ray (add --num-slices 2 for two groups of 2 standing in for
two slices):

    python jobs/ray_core_collectives.py --backend cpu --num-workers 4

With --num-slices N the devices form the fine-tune's mesh, (slices, devices a slice): the tensor-parallel
block runs within each slice (its ICI), an all-reduce runs over every rank, and another over the
ranks holding the same place in each slice (the data-centre network between slices, as HSDP's
gradient all-reduce). On TPU each worker gets the MEGASCALE_* variables Ray Train gives the fine-tune's.
Exits non-zero on any mismatch; the last line is `JOB_RESULT_JSON: {...}`.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import ray

from config.command_line import add_flags
from config.setting_checks import placement, worker_count
from config.settings import PLACEMENT
from runtime.backend import connect_ray, get_backend
from runtime.outcome import JobInputError, exit_code
from runtime.tpu_generations import by_accelerator_type

TPU_MASTER_PORT = 29500
MEGASCALE_PORT = 8081  # Ray's DEFAULT_MEGASCALE_PORT (ray/_private/accelerators/tpu.py)
RENDEZVOUS_ATTEMPTS = 3  # rank 0 picks a free port, then listens on it: another process may bind it in between
RTOL, ATOL = 1e-3, 1e-2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(p, PLACEMENT)  # the fine-tune's, declared in jobs/config/settings.py
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--expansion", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--reserve-timeout-s", type=int, default=1800, help="how long to wait for the slice")
    p.add_argument("--reference-seed", type=int, default=None, help="seed of the CPU reference (default: --seed)")
    return p.parse_args(argv)


def make_ffn(hidden: int, expansion: int, seed: int):
    """The residual block x + W2·SiLU(W1·x), no biases, weights drawn from `seed` on CPU."""
    import torch
    from torch import nn

    class ResidualFFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(hidden, hidden * expansion, bias=False)
            self.w2 = nn.Linear(hidden * expansion, hidden, bias=False)

        def forward(self, x):
            return x + self.w2(torch.nn.functional.silu(self.w1(x)))

    torch.manual_seed(seed)
    return ResidualFFN()


def megascale_env(coordinator_host: str, num_slices: int, slice_id: int, local_rank: int) -> dict[str, str]:
    """What Ray 2.60's TorchTrainer gives each worker of a multi-slice run (ray/train/torch/config.py,
    `_setup_tpu_multislice`): the coordinator on rank 0's host at the base port, and a port of its own
    per local rank, so that the workers of one host do not collide."""
    return {
        "MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator_host}:{MEGASCALE_PORT}",
        "MEGASCALE_NUM_SLICES": str(num_slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
        "MEGASCALE_PORT": str(MEGASCALE_PORT + local_rank),
    }


@ray.remote
class CollectivesWorker:
    def __init__(self, backend: str, index: int, devices_per_host: int, slice_devices: int):
        self.backend = get_backend(backend)
        # The placement group's bundles are slice by slice (ray.util.tpu.SlicePlacementGroup).
        self.slice_id, in_slice = divmod(index, slice_devices)
        if self.backend.name == "tpu":
            # The host within its slice, from the layout the TPU webhook and Ray expose.
            self.worker_id = int(os.environ["TPU_WORKER_ID"])
            self.local_rank = int(ray.get_runtime_context().get_accelerator_ids()["TPU"][0])
        else:
            self.worker_id, self.local_rank = divmod(in_slice, devices_per_host)
        self.devices_per_host = devices_per_host
        self.rank = self.slice_id * slice_devices + self.worker_id * devices_per_host + self.local_rank

    def identity(self) -> dict:
        return {
            "rank": self.rank,
            "slice": self.slice_id,
            "worker_id": self.worker_id,
            "local_rank": self.local_rank,
            "node_ip": ray.util.get_node_ip_address(),
        }

    def rendezvous(self) -> tuple[str, int]:
        """Called on rank 0: the MASTER_ADDR/MASTER_PORT every rank will use."""
        if self.backend.name == "tpu":
            return os.environ["TPU_WORKER_HOSTNAMES"].split(",")[0], TPU_MASTER_PORT
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def run(self, master_addr: str, master_port: int, world: int, args: dict) -> dict:
        import torch.distributed as dist

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            WORLD_SIZE=str(world),
            RANK=str(self.rank),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.devices_per_host),
        )
        if self.backend.name == "tpu" and args["num_slices"] > 1:
            os.environ.update(megascale_env(master_addr, args["num_slices"], self.slice_id, self.local_rank))
        self.backend.prepare()
        dist.init_process_group(backend=self.backend.dist_backend, init_method="env://")
        try:
            return {**self.identity(), **check_rank(self.backend, self.rank, world, args)}
        finally:
            dist.destroy_process_group()


def check_rank(backend, rank: int, world: int, args: dict) -> dict:
    """One rank's part, in an initialised process group: the block sharded over its slice against its CPU
    reference, an all-reduce of rank + 1 over every rank, and one of slice + 1 across the slices."""
    import torch
    import torch.distributed as dist

    from training.model import apply_tp, device_mesh

    device = backend.device()
    slices = args.get("num_slices", 1)
    reference = make_ffn(args["hidden"], args["expansion"], args["reference_seed"])
    torch.manual_seed(args["seed"] + 1)
    x = torch.randn(args["batch"], args["hidden"])
    mesh = device_mesh(backend.device_type, world, slices)
    with torch.no_grad():
        expected = reference(x)
        in_slice = mesh if slices == 1 else mesh["dp_shard"]
        sharded = apply_tp(make_ffn(args["hidden"], args["expansion"], args["seed"]).to(device), in_slice)
        got = sharded(x.to(device)).cpu()
    max_diff = (got - expected).abs().max().item()
    parity = torch.allclose(got, expected, rtol=RTOL, atol=ATOL)

    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    total = t.cpu()
    across = torch.full((4,), float(rank // (world // slices) + 1), device=device)
    if slices > 1:
        dist.all_reduce(across, op=dist.ReduceOp.SUM, group=mesh["dp_replicate"].get_group())
    across = across.cpu()
    return {"sum": total[0].item(), "sum_ok": bool(torch.all(total == world * (world + 1) / 2)),
            "slices_sum": across[0].item(), "slices_sum_ok": bool(torch.all(across == slices * (slices + 1) / 2)),
            "max_diff": max_diff, "parity_ok": bool(parity)}  # fmt: skip


def reserve(args, world: int):
    """The slice as one placement group on TPU; one CPU bundle per worker elsewhere."""
    from ray.util.placement_group import placement_group

    if args.backend == "tpu":
        from ray.util.tpu import slice_placement_group

        tpu = by_accelerator_type(args.accelerator_type)
        slice_pg = slice_placement_group(args.topology, tpu.ray_version, resources_per_bundle={"TPU": 1},
                                         num_slices=args.num_slices, tpu_resource_per_chip=tpu.devices_per_chip)  # fmt: skip
        return slice_pg, slice_pg.placement_group
    pg = placement_group([{"CPU": 1}] * world, strategy="PACK")
    return None, pg


def run_check(args: argparse.Namespace) -> dict:

    world = worker_count(placement(args))
    slice_devices = world // args.num_slices
    if (args.hidden * args.expansion) % slice_devices:
        raise JobInputError(
            f"the tensor-parallel width {args.hidden}x{args.expansion} must divide by the {slice_devices} workers a slice"
        )
    tpu = by_accelerator_type(args.accelerator_type)
    devices_per_host = tpu.chips_per_host * tpu.devices_per_chip if args.backend == "tpu" else slice_devices
    connect_ray(world)
    handle, pg = reserve(args, world)
    try:
        ray.get(pg.ready(), timeout=args.reserve_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise JobInputError(
            f"could not reserve {world} workers within {args.reserve_timeout_s}s; "
            f"the cluster offers {ray.cluster_resources()}"
        ) from None
    try:
        results = with_a_free_port(lambda: run_workers(args, pg, world, devices_per_host, slice_devices))
    finally:
        if handle is not None:
            handle.shutdown()
        else:
            ray.util.remove_placement_group(pg)
    for r in results:
        print(
            f"rank={r['rank']:>3} slice={r['slice']} worker_id={r['worker_id']} local_rank={r['local_rank']} "
            f"node_ip={r['node_ip']} sum={r['sum']} slices_sum={r['slices_sum']} max_diff={r['max_diff']:.5f}",
            flush=True,
        )
    summary = summarise(results, world, args.backend, args.num_slices)
    print(verdict(summary), flush=True)
    return summary


def run_workers(args: argparse.Namespace, pg, world: int, devices_per_host: int, slice_devices: int) -> list[dict]:
    """One worker a bundle of the placement group, each rank's check, the workers gone after it."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resources = {"resources": {"TPU": 1}} if args.backend == "tpu" else {"num_cpus": 1}
    workers = [
        CollectivesWorker.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i), **resources
        ).remote(args.backend, i, devices_per_host, slice_devices)
        for i in range(world)
    ]
    try:
        ids = ray.get([w.identity.remote() for w in workers])
        rank0 = workers[min(range(world), key=lambda i: ids[i]["rank"])]
        master_addr, master_port = ray.get(rank0.rendezvous.remote())
        settings = vars(args) | {"reference_seed": args.seed if args.reference_seed is None else args.reference_seed}
        return sorted(
            ray.get([w.run.remote(master_addr, master_port, world, settings) for w in workers]),
            key=lambda r: r["rank"],
        )
    finally:
        for w in workers:
            ray.kill(w)


def with_a_free_port(check, attempts: int = RENDEZVOUS_ATTEMPTS):
    """The check, again with new workers and a new port when rank 0's port was taken between its pick and its
    listen (EADDRINUSE: another process on the host bound it in that window)."""
    for attempt in range(1, attempts + 1):
        try:
            return check()
        except ray.exceptions.RayTaskError as err:
            if "EADDRINUSE" not in str(err) or attempt == attempts:
                raise
            print(f"rank 0's rendezvous port was taken before it listened (attempt {attempt} of {attempts}); "
                  "trying another", flush=True)  # fmt: skip


def summarise(results: list[dict], world: int, backend: str, slices: int = 1) -> dict:
    return {
        "ok": all(r["sum_ok"] and r["slices_sum_ok"] and r["parity_ok"] for r in results),
        "world_size": world,
        "slices": slices,
        "backend": backend,
        "expected_sum": world * (world + 1) / 2,
        "sums_ok": all(r["sum_ok"] for r in results),
        "slices_sum_ok": all(r["slices_sum_ok"] for r in results),
        "parity_ok": all(r["parity_ok"] for r in results),
        "max_abs_diff": max(r["max_diff"] for r in results),
    }


def verdict(summary: dict) -> str:
    across = ""
    if summary["slices"] > 1:
        across = f", across {summary['slices']} slices {'ok' if summary['slices_sum_ok'] else 'BROKEN'}"
    return (
        f"{'PASS' if summary['ok'] else 'FAIL'}: {summary['world_size']} ranks, all-reduce sum "
        f"{summary['expected_sum']} {'on every rank' if summary['sums_ok'] else 'NOT on every rank'}{across}, "
        f"tensor-parallel parity {'holds' if summary['parity_ok'] else 'BROKEN'} "
        f"(max |diff| {summary['max_abs_diff']:.5f})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_code(lambda: run_check(args), succeeded=lambda summary: summary["ok"])


if __name__ == "__main__":
    sys.exit(main())
