"""More than one slice: HSDP over a ("dp_replicate", "dp_shard") mesh trains what FSDP over the same
devices trains, and the collectives check covers each slice and the network between them. Four gloo
ranks in processes, without Ray: two "slices" of two against one of four, in the same processes."""

from __future__ import annotations

import pytest
import torch

from tests.inprocess import settings, train_each

FLAGS = ("--num-workers", "4", "--batch-size", "1", "--max-steps", "4", "--eval-split", "none", "--eval-samples", "0")


def _collectives_rank(rank: int, world: int) -> dict:
    """One rank of the collectives check on two "slices" of two."""
    import ray_core_collectives as job
    from runtime.backend import get_backend

    args = vars(job.parse_args(["--backend", "cpu", "--num-workers", str(world), "--num-slices", "2"]))
    return job.check_rank(get_backend("cpu"), rank, world, args | {"reference_seed": 42})


@pytest.fixture(scope="module")
def layouts(tiny_assets) -> dict:
    configs = [settings(tiny_assets, *FLAGS, "--num-slices", n) for n in ("1", "2")]
    one, two, collectives = train_each(configs, 4, then=_collectives_rank)
    return {"one": one, "two": two, "collectives": collectives}


@pytest.mark.slow  # (four ranks, both layouts)
def test_two_slices_of_two_train_what_one_slice_of_four_does(layouts):
    """Every step's loss and gradient norm, and the weights at the end: the replicated dimension sums the
    gradients as the sharded one does (an average there would halve the norm; Adam alone would hide it)."""
    one, two = layouts["one"], layouts["two"]
    assert len(one["losses"]) == len(two["losses"]) == 4
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-3)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], abs=1e-3)
    assert min(one["grad_norms"]) > 0.1
    for name, tensor in one["model"].items():
        torch.testing.assert_close(two["model"][name], tensor, rtol=0, atol=1e-4, msg=name)


def test_the_slices_must_divide_the_workers_before_any_starts(tiny_assets):
    from config.setting_checks import check, worker_count
    from runtime.outcome import JobInputError

    assert worker_count(check(settings(tiny_assets, "--num-workers", "4", "--num-slices", "2"))) == 4
    with pytest.raises(JobInputError, match=r"--num-slices 3 does not divide --num-workers 4.*one of 1, 2, 4"):
        check(settings(tiny_assets, "--num-workers", "4", "--num-slices", "3"))
    with pytest.raises(JobInputError, match="--num-slices 0 must be at least 1"):
        check(settings(tiny_assets, "--num-workers", "4", "--num-slices", "0"))
    tpu = settings(tiny_assets, "--backend", "tpu", "--num-workers", "16", "--num-slices", "2")
    with pytest.raises(
        JobInputError, match=r"--num-workers 16 does not match --num-slices 2 x --topology 4x4.*give 32"
    ):
        check(tpu)


@pytest.mark.slow  # (four ranks, both layouts)
def test_the_collectives_check_covers_each_slice_and_the_network_between_them(layouts):
    """The block sharded within each slice of two, the all-reduce over all four ranks (1+2+3+4), and the
    one across the slices (slice 1 + slice 2 on each rank)."""
    import ray_core_collectives as job

    results = layouts["collectives"]
    assert [(r["sum"], r["slices_sum"], r["parity_ok"]) for r in results] == [(10.0, 3.0, True)] * 4
    summary = job.summarise(results, 4, "cpu", 2)
    assert summary["ok"] and summary["slices"] == 2
    assert "across 2 slices ok" in job.verdict(summary)
    broken = job.summarise([*results[:3], results[3] | {"slices_sum_ok": False}], 4, "cpu", 2)
    assert not broken["ok"] and "across 2 slices BROKEN" in job.verdict(broken)


def test_each_collectives_worker_gets_the_multislice_variables_ray_train_gives_the_fine_tune():
    from ray._private.accelerators.tpu import DEFAULT_MEGASCALE_PORT
    from ray.util.tpu import get_tpu_coordinator_env_vars

    import ray_core_collectives as job

    assert str(job.MEGASCALE_PORT) == DEFAULT_MEGASCALE_PORT
    ray_train = get_tpu_coordinator_env_vars(f"host-0:{DEFAULT_MEGASCALE_PORT}", 2, 1)
    # ray.train.torch.config._set_tpu_multislice_env_vars: each local rank its own port above the base
    assert job.megascale_env("host-0", 2, 1, 3) == ray_train | {"MEGASCALE_PORT": str(int(DEFAULT_MEGASCALE_PORT) + 3)}
