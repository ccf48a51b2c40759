"""Capacity kinds (on-demand, Spot, flex-start, a reservation) on both flavours and modes, under the
mocks; the prices table; the cost estimate at preview and the cost of a run."""

from __future__ import annotations

import pytest

from infra.config.stack import ConfigError
from tests.stack_harness import parse_as_cli, run_program, stack_config

STACKS, MODES = ("v6e", "tpu7x"), ("standard", "autopilot")
CAPACITY = {  # the keys a user sets for each kind
    "onDemand": {},
    "spot": {"capacity": "spot"},
    "flexStart": {"capacity": "flexStart"},
    "reservation": {"reservation": "projects/shared-proj/reservations/tpu-res", "scaleToZero": "true"},
}


def snake_case(node: dict) -> dict:
    import re

    return {re.sub(r"([A-Z])", r"_\1", k).lower(): v for k, v in node.items()}


@pytest.mark.parametrize("capacity", CAPACITY)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stack", STACKS)
def test_each_capacity_kind_reaches_the_pool_or_the_pods(stack, mode, capacity):
    import pulumi_gcp as gcp

    run = run_program(stack, stack_config(stack, mode=mode, **CAPACITY[capacity]))
    hosts = {"v6e": 4, "tpu7x": 2}[stack]
    worker = run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]
    selector = worker["template"]["spec"]["nodeSelector"]
    training = run.one("pulumi-python:dynamic:Resource", "training").inputs
    assert training["slice"]["capacity"] == capacity and (worker["minReplicas"], worker["maxReplicas"]) == (0, 1)
    if mode == "autopilot":
        expected = {"onDemand": set(), "spot": {"cloud.google.com/gke-spot"},
                    "flexStart": {"cloud.google.com/gke-flex-start"},
                    "reservation": {"cloud.google.com/reservation-name", "cloud.google.com/reservation-affinity",
                                    "cloud.google.com/reservation-project"}}[capacity]  # fmt: skip
        assert set(selector) - {"cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"} == expected
        assert run.of_type("gcp:container/nodePool:NodePool") == []
        return
    assert "cloud.google.com/gke-flex-start" not in selector  # the pool is flex-start, the pods need not ask
    pool = run.one("gcp:container/nodePool:NodePool").inputs
    node = pool["nodeConfig"]
    assert pool["autoscaling"] == {"minNodeCount": 0, "maxNodeCount": hosts, "locationPolicy": "ANY"}
    assert pool["initialNodeCount"] == 0 and "nodeCount" not in pool
    assert node.get("spot", False) is (capacity == "spot")
    assert ("reservationAffinity" in node) is (capacity == "reservation")
    if capacity == "flexStart":
        assert node["flexStart"] is True and node["maxRunDuration"] == f"{(30 + 2 * 240) * 60}s"
        assert pool["management"] == {"autoRepair": False, "autoUpgrade": True}
    else:
        assert "flexStart" not in node and "maxRunDuration" not in node and "management" not in pool
    # field names and types the installed pulumi-gcp accepts (a misspelt field raises here)
    gcp.container.NodePoolNodeConfigArgs(**snake_case(node))
    if "management" in pool:
        gcp.container.NodePoolManagementArgs(**snake_case(pool["management"]))


BAD = {
    "unknown kind": ({"capacity": "cheap"}, "gemma-tpu:capacity: 'cheap' is not a capacity kind; allowed: onDemand"),
    "on-demand and spot": ({"capacity": "onDemand", "spot": "true"}, "gemma-tpu:capacity: 'onDemand' contradicts"),
    "flex-start and a reservation": (
        {"capacity": "flexStart", "reservation": "r1"},
        "gemma-tpu:capacity: 'flexStart' contradicts gemma-tpu:reservation ('r1'), which means 'reservation'",
    ),
    "a reservation without one": ({"capacity": "reservation"}, "gemma-tpu:capacity: 'reservation' needs"),
    "flex-start always on": (
        {"capacity": "flexStart", "scaleToZero": "false"},
        "gemma-tpu:capacity: flexStart gets its capacity when the job resource scales the slice up; it needs",
    ),
    "flex-start on an old GKE": (
        {"capacity": "flexStart", "clusterVersion": "1.32"},
        "gemma-tpu:clusterVersion: '1.32' is too old for TPU flex-start; need 1.33.0-gke.1712000 or newer",
    ),
    "flex-start past 7 days": (
        {"capacity": "flexStart", "jobTimeoutMinutes": "6000"},
        "gemma-tpu:jobTimeoutMinutes: 6000 is too long for flex-start",
    ),
    "a price that is not one": ({"pricePerChipHour": "-1"}, "gemma-tpu:pricePerChipHour: '-1' must be a price"),
}


@pytest.mark.parametrize("case", BAD)
def test_contradictions_and_floors_fail_at_preview(case):
    overrides, message = BAD[case]
    with pytest.raises(ConfigError) as err:
        run_program("v6e", stack_config("v6e", **overrides))
    assert message in str(err.value)


def test_spot_and_reservation_keys_keep_their_meaning():
    assert run_program("v6e", stack_config("v6e", spot="true")).outputs["costEstimate"]["capacity"] == "spot"
    reserved = run_program("v6e", stack_config("v6e", reservation="r1")).outputs["costEstimate"]
    assert reserved["capacity"] == "reservation" and reserved["usd_per_hour"] is None  # its own committed rate
    assert run_program("v6e", stack_config("v6e", capacity="flexStart", clusterVersion="1.33")).outputs


@pytest.mark.parametrize(
    "stack,overrides,per_hour",
    [
        ("v6e", {}, 16 * 2.70),
        ("v6e", {"capacity": "flexStart"}, 16 * 1.35),
        ("v6e", {"capacity": "spot"}, 16 * 1.40),
        ("v6e", {"capacity": "flexStart", "pricePerChipHour": "1.10"}, 16 * 1.10),
        ("tpu7x", {}, None),  # no public per-chip price for Ironwood
        ("tpu7x", {"pricePerChipHour": "5"}, 8 * 5.0),
    ],
)
def test_the_cost_estimate_is_a_preview_output_with_the_slices_price(stack, overrides, per_hour):
    estimate = run_program(stack, stack_config(stack, **overrides)).outputs["costEstimate"]
    assert estimate["estimate"] is True and estimate["chips"] == {"v6e": 16, "tpu7x": 8}[stack]
    if per_hour is None:
        assert estimate["usd_per_hour"] is None and "no public price for tpu7x onDemand" in estimate["note"]
        return
    assert estimate["usd_per_hour"] == pytest.approx(per_hour)
    low, high = estimate["usd"]
    assert 0 < low < high and estimate["walkthrough_usd"][0] > low
    assert estimate["slice_hours"][0] < estimate["slice_hours"][1] and "assumptions" in estimate


def test_the_estimate_by_hand_for_the_default_v6e_run():
    """1024 Dolly records x 3 epochs, packed 37% to 100% full, at 20,300 tokens/s, plus 12-35 minutes."""
    from infra.prices import cost_estimate, estimate_line, training_minutes

    cfg = parse_as_cli({})
    low, high = training_minutes(cfg)
    per_record = 3 * 512 * (1 + 1 / 48) / 20_300 / 60  # minutes per record at 100%, with the eval
    assert (low, high) == pytest.approx((1024 * 0.37 * per_record, 1024 * per_record))
    walkthrough = parse_as_cli({"recipe": "walkthrough"})  # fmt: skip
    padded = training_minutes(walkthrough)
    assert padded[0] == padded[1] == pytest.approx(1024 * 3 * 512 / 20_300 / 60)  # 1.3 min
    big = {"model": "google/gemma-4-31B-it", "activationCheckpointing": "true"}
    full, lora = (training_minutes(parse_as_cli(big | extra)) for extra in ({}, {"lora": "true"}))  # fmt: skip
    assert full[1] == pytest.approx(1024 * per_record * (30697345280 / 2279759104) * 4 / 3)
    assert lora[1] == pytest.approx(full[1] * 4 / 6)
    unknown = parse_as_cli({"datasetSplit": "train[:90%]", "evalSplit": "train[90%:]"})
    assert training_minutes(unknown) is None
    assert cost_estimate(unknown)["run"] == ("unknown before the run: the record count of datasetSplit 'train[:90%]' "
                                             "(absolute bounds, such as train[:1024], give it; so does maxSteps)")  # fmt: skip
    # maxSteps decides the run's length (overriding epochs), known or not the record count: 16 devices x 4 rows
    for raw in ({"maxSteps": "200"}, {"maxSteps": "200", "datasetSplit": "train[:90%]", "evalSplit": "train[90%:]"}):
        assert training_minutes(parse_as_cli(raw)) == pytest.approx((200 * 64 * 512 * (1 + 1 / 48) / 20_300 / 60,) * 2)
    line = estimate_line(cost_estimate(cfg))
    assert line.startswith("cost estimate: v6e 4x4 onDemand, $43.20/h ($2.70 per chip-hour, read 2026-08); the run: $")
    assert "(the walkthrough's always-on slice: $" in line


def test_the_before_after_evaluation_is_in_the_estimate():
    """64 held-out prompts (evalLimit) in batches of 4, 128 tokens each, base and fine-tune: 4,096 decode steps at
    0.05-0.25 s; the slice's hours count them; nothing to evaluate, nothing counted."""
    from infra.prices import cost_estimate, evaluation_minutes

    default = cost_estimate(parse_as_cli({}))
    assert default["evaluation_minutes"] == [round(4096 * 0.05 / 60, 1), round(4096 * 0.25 / 60, 1)]
    without = cost_estimate(parse_as_cli({"evalTasks": "none"}))
    assert without["evaluation_minutes"] == [0, 0]
    assert default["slice_hours"][1] - without["slice_hours"][1] == pytest.approx(4096 * 0.25 / 3600, abs=0.01)
    assert evaluation_minutes(parse_as_cli({"evalLimit": "8"}))[1] == pytest.approx(2 * 2 * 128 * 0.25 / 60)
    assert evaluation_minutes(parse_as_cli({"evalLimit": "0", "datasetSplit": "train[:160]"}))[1] == pytest.approx(
        2 * 3 * 128 * 0.25 / 60)  # auto: 10 held-out records, every one  # fmt: skip
    assert evaluation_minutes(parse_as_cli({"recipe": "walkthrough"})) == (0, 0)  # no held-out records
    assert "the before/after evaluation 0.05-0.25 s a decoded token" in default["assumptions"]


def test_make_local_prints_the_estimate_of_its_settings_on_a_slice():
    from infra.local_run import local_config, local_cost_line

    line = local_cost_line(local_config(pricePerChipHour="2"))
    assert line.startswith("no TPU slice here; on v6e 4x4 onDemand, $32.00/h ($2.00 per chip-hour, read from ")
    assert line.endswith("unknown before the run: the size of model "
                         f"'{local_config().job.model}' (not a Gemma 4 of infra/cloud/models.py); until destroy, also "
                         "GKE's $0.10/h cluster fee (one cluster's is covered by a monthly credit) and the Ray head")  # fmt: skip


@pytest.mark.parametrize("mode", ["standard", "autopilot"])
def test_the_estimate_names_what_bills_until_destroy_with_its_source(mode):
    from infra.prices import cost_estimate, estimate_line

    for overrides in ({}, {"tpuGeneration": "tpu7x", "tpuTopology": "2x2x2"}):  # priced or not, the same parts
        estimate = cost_estimate(parse_as_cli({"mode": mode} | overrides, region="us-east5"))
        parts = estimate["always_on"]
        assert parts["cluster_fee_usd_per_hour"] == 0.10 and "GKE pricing page" in parts["cluster_fee_source"]
        assert ("n2-standard-8 node" in parts["head"]) is (mode == "standard")
        assert "until pulumi destroy" in parts["note"] and "GKE's $0.10/h cluster fee" in estimate_line(estimate)


def test_a_dataset_file_counts_its_records_for_the_estimate(tmp_path):
    from infra.prices import cost_estimate, training_minutes, training_records

    jsonl, csv = tmp_path / "own.jsonl", tmp_path / "own.csv"
    jsonl.write_text('{"prompt": "a", "completion": "b"}\n\n' * 300)  # blank lines are no records
    csv.write_text("prompt,completion\na,b\n")
    assert training_records(parse_as_cli({"datasetFile": str(jsonl)})) == 300  # all of it, by default
    assert training_records(parse_as_cli({"datasetFile": str(jsonl), "datasetSplit": "train[:100]"})) == 100
    assert training_records(parse_as_cli({"datasetFile": str(jsonl), "datasetSplit": "train[:1000]"})) == 300
    assert training_minutes(parse_as_cli({"datasetFile": str(jsonl)})) is not None
    assert "the record count of datasetFile" in cost_estimate(parse_as_cli({"datasetFile": str(csv)}))["run"]


def test_the_cost_of_a_run_from_its_slice_hours():
    """The mocks' job resource reports 0.1 slice host-hours in a run of 0.5 h."""
    cost = run_program("v6e", stack_config("v6e")).outputs["cost"]
    assert cost["usd"] == pytest.approx(0.1 * 4 * 2.70) and cost["chip_hours"] == pytest.approx(0.4)
    assert cost["walkthrough_usd_at_least"] == pytest.approx(0.5 * 16 * 2.70)
    flex = run_program("v6e", stack_config("v6e", capacity="flexStart")).outputs["cost"]
    assert flex["usd"] == pytest.approx(0.1 * 4 * 1.35)
    assert run_program("tpu7x", stack_config("tpu7x")).outputs["cost"]["usd"] is None
    always_on = run_program("v6e", stack_config("v6e", scaleToZero="false")).outputs
    assert always_on["cost"]["usd"] == pytest.approx(0.5 * 16 * 2.70) and "pool creation" in always_on["cost"]["note"]
    assert always_on["costEstimate"]["usd"] == always_on["costEstimate"]["walkthrough_usd"]
    local = run_program("local", stack_config("local")).outputs
    assert local["cost"]["usd"] is None and local["costEstimate"]["usd_per_hour"] is None
    assert local["cost"]["note"] == local["costEstimate"]["note"].replace("mode local runs ", "") == "no TPU slice"
    training = run_program("v6e", stack_config("v6e")).one("pulumi-python:dynamic:Resource", "training").inputs
    assert training["price"] == {"usd_per_chip_hour": 2.70, "chips_per_host": 4, "chips": 16}


def test_the_job_resource_prints_the_cost_line():
    from infra.runner.ray_jobs import cost_line

    line = cost_line({"usd_per_chip_hour": 2.70, "chips_per_host": 4, "chips": 16}, 0.5, 0.25)
    assert line == ("cost: $5.40 for 0.50 slice host-hours at $2.70 per chip-hour (the walkthrough's always-on "
                    "slice: at least $10.80 for the same 0.25 h)")  # fmt: skip


def test_every_price_has_its_source_and_date():
    from infra.prices import PRICES

    assert {k for k in PRICES} == {("v6e", "onDemand"), ("v6e", "flexStart"), ("v6e", "spot")}
    assert all(p.source and p.read.startswith("2026") and 0 < p.usd_per_chip_hour < 10 for p in PRICES.values())
