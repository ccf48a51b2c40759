"""What a slice costs: public prices per chip-hour, the estimate `pulumi preview` shows, the cost of a run.

Prices are data, one row per (generation, capacity kind), each with where it was read and when.
Where no public figure exists the row is absent, not guessed, and the estimate says so;
`pricePerChipHour` (stack config) replaces the table with a user's own rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infra.cloud.models import TOWERS, known_model
from infra.job_modules import data_formats, eval_tasks, memory_plan, modality, samples, splits
from infra.resources.dataset import records_in

if TYPE_CHECKING:  # the estimate reads the stack's config; the facts it needs are in their own tables
    from infra.config.stack import StackConfig


@dataclass(frozen=True)
class Price:
    usd_per_chip_hour: float
    source: str
    read: str  # when


CATALOG = "Cloud Billing catalog captures (third party), us regions"
PRICES: dict[tuple[str, str], Price] = {
    ("v6e", "onDemand"): Price(2.70, f"{CATALOG}; SkyPilot's catalog: tpu-v6e-16 43.20/h", "2026-08"),
    ("v6e", "flexStart"): Price(1.35, f"{CATALOG}: 'DWS Defined Duration V6e'", "2026-08"),
    # Spot prices move: 1.40 in us-east5 that day, 0.65 to 1.89 across regions and captures.
    ("v6e", "spot"): Price(1.40, f"{CATALOG}: us-east5", "2026-08-07"),
    # tpu7x: the only SKU seen ("TPU7x running in Americas", 12.00/h) does not say per chip or per
    # host, and no Spot or flex-start SKU was seen; a reservation bills at its own committed rate.
}


@dataclass(frozen=True)
class Fee:
    usd_per_hour: float
    source: str
    read: str


# What bills from `pulumi up` until `pulumi destroy`, whether or not a run is going (besides the slice, which
# scales to zero between runs by default).
CLUSTER_FEE = Fee(0.10, "GKE pricing page: $0.10 per cluster-hour, Standard and Autopilot; a monthly credit "
                  "covers one zonal or Autopilot cluster per billing account", "2026-12")  # fmt: skip
VM_PRICING = "https://cloud.google.com/compute/vm-instance-pricing"


def always_on(cfg: StackConfig) -> dict:
    """The parts of the stack that bill by the hour until destroy: GKE's cluster fee (from the table) and the
    Ray head's node or pod, whose Compute Engine price this table does not hold (no sourced figure)."""
    head = (f"the Ray head's {cfg.head_machine_type} node: its Compute Engine price is not in this table "
            f"({VM_PRICING})" if cfg.mode == "standard" else "the Ray head pod's CPU and memory (Autopilot bills "
            "pods by their requests; https://cloud.google.com/kubernetes-engine/pricing)")  # fmt: skip
    return {
        "cluster_fee_usd_per_hour": CLUSTER_FEE.usd_per_hour,
        "cluster_fee_source": CLUSTER_FEE.source,
        "cluster_fee_read": CLUSTER_FEE.read,
        "head": head,
        "bucket": "the checkpoint bucket, per GB-month stored (kept until destroy; bucketForceDestroy)",
        "note": "these bill from pulumi up until pulumi destroy, whether or not a run is going",
    }


# The walkthrough's published throughput (epochs 2-3, E2B, 4 rows x 512 tokens a device, padding
# counted), on its slices of 16 devices: ../shared/SPEC.md.
WALKTHROUGH_TOKENS_PER_S = {"v6e": 20_300.0, "tpu7x": 31_000.0}
WALKTHROUGH_DEVICES = 16
E2B_COMPUTE = known_model("google/gemma-4-E2B-it")
DOLLY_REAL_SHARE = 0.37  # of a padded 512-token row: dolly-15k with the Gemma tokenizer (README, make bench)
# Minutes the slice exists besides training: nodes added and the image pulled, the model loaded and
# compiled, then the autoscaler's wait before it removes idle nodes.
OVERHEAD_MINUTES = (12.0, 35.0)
WALKTHROUGH_EXTRA_MINUTES = (15.0, 30.0)  # an always-on slice: pool creation to the jobs, the jobs to destroy


def price_of(cfg: StackConfig) -> Price | None:
    if cfg.price_per_chip_hour is not None:
        return Price(cfg.price_per_chip_hour, "pricePerChipHour (stack config)", "")
    return PRICES.get((cfg.slice.generation.name, cfg.capacity.kind))


def training_records(cfg: StackConfig) -> int | None:
    """Records the split names when its bounds are absolute (train[:1024], train[100:1124]), or, for a datasetFile
    this machine can count (jsonl, json), as many of its records as the split takes (all of them by default);
    else unknown."""
    bounds = splits.absolute_slice(cfg.job.split)
    if bounds is None:
        return None
    total = records_in(cfg.dataset_file) if cfg.dataset_file else None
    end = bounds[2] if total is None else min(bounds[2], total)
    return int(max(0, end - bounds[1])) if end != math.inf else None


def training_minutes(cfg: StackConfig) -> tuple[float, float] | None:
    """(low, high) minutes of training, from the walkthrough's throughput scaled by devices (of every slice:
    data-parallel scaling, which the gradient all-reduce between slices only approaches) and compute per
    token; None when the record count or the model's size is unknown before the run."""
    records, model = training_records(cfg), known_model(cfg.job.model)
    base = WALKTHROUGH_TOKENS_PER_S.get(cfg.slice.generation.name)
    if (records is None and not cfg.job.max_steps) or model is None or base is None:
        return None
    tokens_per_s = base * cfg.devices / WALKTHROUGH_DEVICES * E2B_COMPUTE.active_params / model.active_params
    if cfg.job.activation_checkpointing:
        tokens_per_s /= 4 / 3  # every layer's forward runs twice
    if cfg.job.lora:
        tokens_per_s *= 6 / 4  # frozen weights take no weight gradient: 4 FLOPs a parameter, not 6
    if cfg.job.objective == "grpo":
        return grpo_minutes(cfg, records, tokens_per_s)
    share = (DOLLY_REAL_SHARE, 1.0) if cfg.job.packing else (1.0, 1.0)  # rows per record: packed or padded
    # the held-out share, forward only
    eval_share = 1 + (1 / data_formats.EVAL_SHARE) / 3 if cfg.job.eval_split != "none" else 1
    # DPO: a pair is two padded rows (never packed), and its reference log-probabilities one forward pass over them
    # before training (a third of a training step's compute)
    sequences = memory_plan.sequences_per_record(cfg.job.objective)
    reference = records * sequences * cfg.job.seq_len / 3 if cfg.job.objective == "dpo" and records else 0.0
    if cfg.job.max_steps:  # the steps decide: each one global batch of full rows
        rows = cfg.job.max_steps * cfg.job.batch_size * cfg.devices * cfg.job.grad_accum * sequences
        minutes = [(rows * cfg.job.seq_len * eval_share + reference) / tokens_per_s / 60] * 2
    else:
        minutes = [(records * s * sequences * cfg.job.epochs * cfg.job.seq_len * eval_share + reference)
                   / tokens_per_s / 60 for s in share]  # fmt: skip
    return minutes[0], minutes[1] * (1 + towers_share(cfg, model))


def grpo_minutes(cfg: StackConfig, prompts: int | None, tokens_per_s: float) -> tuple[float, float]:
    """GRPO's (low, high) minutes: each prompt is numGenerations padded rows, each trained once (a training token
    a position), its completion sampled by the learner first (docs/grpo.md) and, with beta, scored by the reference
    (a forward pass: a third of a training token). A sampled token is a forward pass with the KV cache: a third of a
    training token's compute at the low end; decoding is bound by memory, not compute, so the high end counts it as
    a whole training token (not measured on TPU yet)."""
    job = cfg.job
    if job.max_steps:
        rows = job.max_steps * job.batch_size * cfg.devices * job.grad_accum
    else:
        rows = prompts * job.num_generations * job.epochs
    reference = job.seq_len / 3 if job.beta else 0.0
    return tuple(rows * (job.seq_len + job.max_completion_length * f + reference) / tokens_per_s / 60
                 for f in (1 / 3, 1.0))  # fmt: skip


# Inputs a soft token costs its tower: a picture's soft token pools 3 x 3 patches of the vision tower (Gemma 4's
# pooling_kernel_size); a clip's is one step of the audio tower after its 4x subsampling of 10 ms frames (40 ms a
# token: transformers 5.23's Gemma4Processor).
TOWER_INPUTS_PER_TOKEN = {"image": 9, "audio": 1}


def towers_share(cfg: StackConfig, model) -> float:
    """The towers' compute over the language model's, were every token a soft token of the modality's costliest
    tower: the high end of the estimate (the low end: no token is). Frozen, a tower runs forward only (2 FLOPs a
    parameter and input); trained, 6; the language model 6 a parameter and token (4 under LoRA)."""
    kinds = modality.towers_of(cfg.job.modality)
    if not kinds:
        return 0.0
    towers = TOWERS[model.name]
    per_token = max(getattr(towers, k) * TOWER_INPUTS_PER_TOKEN[k] for k in kinds)
    return per_token * (6 if cfg.job.train_towers else 2) / ((4 if cfg.job.lora else 6) * model.active_params)


# Seconds a slice takes per greedy decode step of the before/after evaluation: one token for a batch of prompts,
# every layer's shards gathered again. An assumption, not measured on a slice (eager HF generate, FSDP2).
DECODE_STEP_S = (0.05, 0.25)


def evaluation_prompts(cfg: StackConfig) -> int:
    """The held-out prompts the before/after evaluation answers: evalLimit of the held-out records (evalSplit
    auto: 1/16 of the training records, at most 256; a split with absolute bounds: its size; else taken as 256)."""
    records, bounds = training_records(cfg), splits.absolute_slice(cfg.job.eval_split)
    if bounds is not None and bounds[2] != math.inf:
        held_out = int(bounds[2] - bounds[1])
    elif cfg.job.eval_split == "auto" and records is not None:
        held_out = data_formats.auto_eval_count(records)
    else:
        held_out = data_formats.EVAL_MOST
    return min(cfg.job.eval_limit or held_out, held_out)


def evaluation_minutes(cfg: StackConfig) -> tuple[float, float]:
    """(low, high) minutes of the held-out evaluation, base and fine-tune: every rank answers every prompt, a
    batch of batchSize at a time, up to the samples' answer length, at DECODE_STEP_S a token (the answers' loss,
    one forward a batch, is left out). Tasks named besides heldout are not estimated (their size is theirs)."""
    job = cfg.job
    if eval_tasks.HELDOUT not in eval_tasks.parse(job.eval_tasks) or job.eval_split == "none" or not job.chat_template:
        return 0.0, 0.0
    steps = 2 * math.ceil(evaluation_prompts(cfg) / job.batch_size) * samples.NEW_TOKENS
    return steps * DECODE_STEP_S[0] / 60, steps * DECODE_STEP_S[1] / 60


def unknown_run(cfg: StackConfig) -> str:
    """Why the run's length is not known at preview."""
    unknown = []
    if training_records(cfg) is None and not cfg.job.max_steps and cfg.dataset_file:
        unknown.append(f"the record count of datasetFile {cfg.dataset_file!r} (jsonl and json files are counted at "
                       "preview; datasetSplit with absolute bounds, such as train[:1024], or maxSteps gives it)")  # fmt: skip
    elif training_records(cfg) is None and not cfg.job.max_steps:
        unknown.append(f"the record count of datasetSplit {cfg.job.split!r} (absolute bounds, such as "
                       "train[:1024], give it; so does maxSteps)")  # fmt: skip
    if known_model(cfg.job.model) is None:
        unknown.append(f"the size of model {cfg.job.model!r} (not a Gemma 4 of infra/cloud/models.py)")
    return "unknown before the run: " + " and ".join(unknown)


def towers_said(cfg: StackConfig) -> str:
    kinds = modality.towers_of(cfg.job.modality)
    if not kinds:
        return ""
    share = towers_share(cfg, known_model(cfg.job.model))
    return (f"the {' and '.join(kinds)} towers' compute from none (no token a soft token) to {share:.0%} more (every "
            "token one); ")  # fmt: skip


def cost_estimate(cfg: StackConfig) -> dict:
    """The `costEstimate` output: the slices' price per hour and what the configured run should cost; with
    `serve`, the serving host's price per hour beside it."""
    out = training_estimate(cfg)
    if cfg.serve is not None and cfg.serve.host is not None:
        out["serving"] = serving_estimate(cfg)
    return out


# A serving replica's cold start (node, image pull, weights, XLA precompile), in minutes: published numbers (../shared
# FACTS; issue 45), not measured here. Billed like any other minute of the host.
COLD_START_MINUTES = (10.0, 25.0)


def serving_estimate(cfg: StackConfig) -> dict:
    """What the endpoint bills by the hour: each replica's single TPU host at the serving capacity's price."""
    from infra.resources.serving import IDLE_TIMEOUT_S
    from infra.serving.app import DOWNSCALE_DELAY_S

    serve, host = cfg.serve, cfg.serve.host
    price = (Price(cfg.price_per_chip_hour, "pricePerChipHour (stack config)", "") if cfg.price_per_chip_hour
             is not None else PRICES.get((host.generation.name, serve.capacity)))  # fmt: skip
    out = {"host": f"{host.generation.name} {host.topology} ({host.machine_type})", "capacity": serve.capacity,
           "chips_per_replica": host.chips, "replicas": [serve.min_replicas, serve.max_replicas],
           "bills": (f"each replica's TPU host, from its node's start (a cold start of {COLD_START_MINUTES[0]:.0f}-"
                     f"{COLD_START_MINUTES[1]:.0f} minutes: node, image, weights, compile) until the autoscaler "
                     f"removes it: Serve scales the replica away {DOWNSCALE_DELAY_S // 60} minutes after the last "
                     f"request, the autoscaler the host {IDLE_TIMEOUT_S // 60} minutes after that; "
                     + ("nothing between requests (serveMinReplicas 0) but the serving head pod"
                        if serve.min_replicas == 0 else f"{serve.min_replicas} host(s) always, until destroy"))}  # fmt: skip
    if price is None:
        return out | {"usd_per_hour_per_replica": None,
                      "note": f"no public price for {host.generation.name} {serve.capacity}: set pricePerChipHour"}  # fmt: skip
    per_replica = host.chips * price.usd_per_chip_hour
    return out | {
        "usd_per_chip_hour": price.usd_per_chip_hour, "price_source": price.source, "price_read": price.read,
        "usd_per_hour_per_replica": round(per_replica, 2),
        "usd_per_hour_idle": round(per_replica * serve.min_replicas, 2),
        "usd_per_hour_at_most": round(per_replica * serve.max_replicas, 2),
        "usd_per_cold_start": [round(per_replica * m / 60, 2) for m in COLD_START_MINUTES],
    }  # fmt: skip


def training_estimate(cfg: StackConfig) -> dict:
    """The slices' price per hour and what the configured run should cost."""
    if cfg.local:
        return {"estimate": True, "usd_per_hour": None, "note": "mode local runs no TPU slice"}
    price, chips = price_of(cfg), cfg.chips
    slices = f"{cfg.num_slices} x " if cfg.num_slices > 1 else ""
    out = {"estimate": True, "slice": f"{slices}{cfg.slice.generation.name} {cfg.slice.topology}",
           "capacity": cfg.capacity.kind, "chips": chips, "slices": cfg.num_slices, "always_on": always_on(cfg)}  # fmt: skip
    if price is None:
        return out | {"usd_per_hour": None, "note": f"no public price for {cfg.slice.generation.name} "
                      f"{cfg.capacity.kind}: set pricePerChipHour to yours"}  # fmt: skip
    out |= {"usd_per_chip_hour": price.usd_per_chip_hour, "price_source": price.source, "price_read": price.read,
            "usd_per_hour": round(chips * price.usd_per_chip_hour, 2)}  # fmt: skip
    minutes = training_minutes(cfg)
    if minutes is None:
        return out | {"run": unknown_run(cfg)}
    evaluating = evaluation_minutes(cfg)
    hours = [(minutes[i] + evaluating[i] + OVERHEAD_MINUTES[i]) / 60 for i in (0, 1)]
    walkthrough = [h + WALKTHROUGH_EXTRA_MINUTES[i] / 60 for i, h in enumerate(hours)]

    def usd(h: list[float]) -> list[float]:
        return [round(x * chips * price.usd_per_chip_hour, 2) for x in h]

    if not cfg.capacity.scale_to_zero:  # the walkthrough's layout: the slice is there from pool creation to destroy
        hours = walkthrough
        out["note"] = (
            "scaleToZero: false keeps the slice from pool creation until destroy: usd assumes a destroy right after the run"
        )
    return out | {
        "training_minutes": [round(m, 1) for m in minutes],
        "evaluation_minutes": [round(m, 1) for m in evaluating],
        "slice_hours": [round(h, 2) for h in hours],
        "usd": usd(hours),
        "walkthrough_usd": usd(walkthrough),
        "assumptions": (
            f"the walkthrough's {WALKTHROUGH_TOKENS_PER_S[cfg.slice.generation.name]:,.0f} padded tokens/s on "
            f"{WALKTHROUGH_DEVICES} devices for E2B, scaled by devices (of every slice: data-parallel scaling) and by "
            "compute per token; packed rows "
            f"{DOLLY_REAL_SHARE:.0%} (Dolly) to 100% full; "
            f"the before/after evaluation {DECODE_STEP_S[0]}-{DECODE_STEP_S[1]} s a decoded token for each batch of "
            "held-out prompts, twice (assumed, not measured on a slice; named lm-eval tasks not counted); "
            f"{towers_said(cfg)}"
            f"{OVERHEAD_MINUTES[0]:.0f}-{OVERHEAD_MINUTES[1]:.0f} minutes for nodes, image, load, compile and "
            f"scale-down; the walkthrough's always-on slice {WALKTHROUGH_EXTRA_MINUTES[0]:.0f}-"
            f"{WALKTHROUGH_EXTRA_MINUTES[1]:.0f} minutes more"
        ),
    }


def estimate_line(estimate: dict) -> str:
    """One line of a `costEstimate` output, for logs."""
    if estimate.get("usd_per_hour") is None:
        return f"cost estimate: {estimate['note']}{always_on_text(estimate)}"
    line = (f"cost estimate: {estimate['slice']} {estimate['capacity']}, ${estimate['usd_per_hour']:,.2f}/h "
            f"(${estimate['usd_per_chip_hour']:.2f} per chip-hour, read {estimate['price_read'] or 'from pricePerChipHour'})")  # fmt: skip
    if "usd" not in estimate:
        return f"{line}; {estimate['run']}{always_on_text(estimate)}"
    (low, high), (w_low, w_high) = estimate["usd"], estimate["walkthrough_usd"]
    return (
        f"{line}; the run: ${low:,.2f}-${high:,.2f} (the walkthrough's always-on slice: ${w_low:,.2f}-${w_high:,.2f})"
        f"{always_on_text(estimate)}"
    )


def always_on_text(estimate: dict) -> str:
    parts = estimate.get("always_on")
    if not parts:
        return ""
    return (f"; until destroy, also GKE's ${parts['cluster_fee_usd_per_hour']:.2f}/h cluster fee (one cluster's is "
            "covered by a monthly credit) and the Ray head")  # fmt: skip


def serving_cost(cfg: StackConfig, seconds: float) -> dict:
    """What the endpoint's host billed for `up`: the served evaluation's `seconds` (its wait for a replica, then the
    scoring), and with serveMinReplicas 0 Serve's downscale delay and then the autoscaler's idle timeout before the
    host goes."""
    from infra.resources.serving import IDLE_TIMEOUT_S
    from infra.serving.app import DOWNSCALE_DELAY_S

    serve = cfg.serve
    tail = DOWNSCALE_DELAY_S + IDLE_TIMEOUT_S if serve.min_replicas == 0 else 0
    hours = (seconds + tail) / 3600
    estimate = serving_estimate(cfg)
    out = {"host_hours": round(hours, 4), "chips": serve.host.chips,
           "note": ("the serving host from up's first request to its scale-down" if tail else
                    f"up's part only: {serve.min_replicas} host(s) bill until destroy (serveMinReplicas)")
           + "; requests after up bill their own hosts"}  # fmt: skip
    rate = estimate.get("usd_per_chip_hour")
    return out | {"usd": None if rate is None else round(hours * serve.host.chips * rate, 2)}


def run_cost(slice_host_hours: float, run_hours: float, cfg: StackConfig, serving_seconds: float | None = None) -> dict:
    """The `cost` output: what the run's slice cost (host-hours from the scale-up request to the scale-down),
    beside the walkthrough's always-on slice for at least the same wall time; with a served evaluation, what the
    endpoint's host cost for it."""
    if serving_seconds is not None and cfg.serve is not None and cfg.serve.host is not None:
        return run_cost(slice_host_hours, run_hours, cfg) | {"serving": serving_cost(cfg, serving_seconds)}
    price = None if cfg.local else price_of(cfg)
    always_on = run_hours * cfg.chips
    chip_hours = slice_host_hours * cfg.slice.generation.chips_per_host if cfg.capacity.scale_to_zero else always_on
    out = {"slice_host_hours": slice_host_hours, "chip_hours": round(chip_hours, 4),
           "walkthrough_chip_hours_at_least": round(always_on, 4)}  # fmt: skip
    if not cfg.local and not cfg.capacity.scale_to_zero:
        out["note"] = "scaleToZero: false: the run's wall time only; the slice bills from pool creation until destroy"
    if price is None:
        return out | {"usd": None, "note": "no TPU slice" if cfg.local else "no public price: set pricePerChipHour"}
    return out | {
        "usd_per_chip_hour": price.usd_per_chip_hour,
        "usd": round(chip_hours * price.usd_per_chip_hour, 2),
        "walkthrough_usd_at_least": round(always_on * price.usd_per_chip_hour, 2),
    }
