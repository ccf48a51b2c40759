"""More than one slice: HSDP over a ("dp_replicate", "dp_shard") mesh trains what FSDP over the same
devices trains. Four gloo ranks in processes, without Ray: two "slices" of two against one of four."""

from __future__ import annotations

import pytest
import torch

from tests.inprocess import settings, train_each

FLAGS = ("--num-workers", "4", "--batch-size", "1", "--max-steps", "6", "--eval-split", "none", "--eval-samples", "0")


@pytest.fixture(scope="module")
def layouts(tiny_assets) -> dict:
    one, two = train_each([settings(tiny_assets, *FLAGS, "--num-slices", n) for n in ("1", "2")], 4)
    return {"one": one, "two": two}


def test_two_slices_of_two_train_what_one_slice_of_four_does(layouts):
    """Every step's loss and gradient norm, and the weights at the end: the replicated dimension sums the
    gradients as the sharded one does (an average there would halve the norm; Adam alone would hide it)."""
    one, two = layouts["one"], layouts["two"]
    assert len(one["losses"]) == len(two["losses"]) == 6
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-3)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], abs=1e-3)
    assert min(one["grad_norms"]) > 0.1
    for name, tensor in one["model"].items():
        torch.testing.assert_close(two["model"][name], tensor, rtol=0, atol=1e-4, msg=name)


def test_the_slices_must_divide_the_workers_before_any_starts(tiny_assets):
    from backend import JobInputError
    from flags import check_inputs

    assert check_inputs(settings(tiny_assets, "--num-workers", "4", "--num-slices", "2"))[1] == 4
    with pytest.raises(JobInputError, match=r"--num-slices 3 does not divide --num-workers 4.*one of 1, 2, 4"):
        check_inputs(settings(tiny_assets, "--num-workers", "4", "--num-slices", "3"))
    with pytest.raises(JobInputError, match="--num-slices must be a positive integer"):
        check_inputs(settings(tiny_assets, "--num-workers", "4", "--num-slices", "0"))
    tpu = settings(tiny_assets, "--backend", "tpu", "--num-workers", "16", "--num-slices", "2")
    with pytest.raises(
        JobInputError, match=r"--num-workers 16 does not match --num-slices 2 x --topology 4x4.*pass 32"
    ):
        check_inputs(tpu)


def _collectives_rank(rank: int, world: int, rendezvous: str, slices: int, out: str) -> None:
    from tests.inprocess import _join

    _join(rank, world, rendezvous)
    import ray_core_collectives as job
    import torch.distributed as dist
    from backend import get_backend

    args = vars(job.parse_args(["--backend", "cpu", "--num-workers", str(world), "--num-slices", str(slices)]))
    result = job.check_rank(get_backend("cpu"), rank, world, args | {"reference_seed": 42})
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def test_the_collectives_check_covers_each_slice_and_the_network_between_them():
    """Two "slices" of one rank: the block sharded within each, the all-reduce over both ranks, and the one
    across the slices (slice 1 + slice 2 = 3 on each)."""
    import ray_core_collectives as job

    from tests.inprocess import _spawn

    results = _spawn(_collectives_rank, 2, 2)
    assert [(r["sum"], r["slices_sum"]) for r in results] == [(3.0, 3.0), (3.0, 3.0)]
    summary = job.summarise(results, 2, "cpu", 2)
    assert summary["ok"] and summary["slices"] == 2
    assert "across 2 slices ok" in job.verdict(summary)
    broken = job.summarise([results[0], results[1] | {"slices_sum_ok": False}], 2, "cpu", 2)
    assert not broken["ok"] and "across 2 slices BROKEN" in job.verdict(broken)


def test_each_collectives_worker_gets_the_multislice_variables_ray_train_gives_the_fine_tune():
    import ray_core_collectives as job
    from ray._private.accelerators.tpu import DEFAULT_MEGASCALE_PORT
    from ray.util.tpu import get_tpu_coordinator_env_vars

    assert str(job.MEGASCALE_PORT) == DEFAULT_MEGASCALE_PORT
    ray_train = get_tpu_coordinator_env_vars(f"host-0:{DEFAULT_MEGASCALE_PORT}", 2, 1)
    # ray.train.torch.config._set_tpu_multislice_env_vars: each local rank its own port above the base
    assert job.megascale_env("host-0", 2, 1, 3) == ray_train | {"MEGASCALE_PORT": str(int(DEFAULT_MEGASCALE_PORT) + 3)}
