"""Gemma 4 sizes the stack knows before anything runs: one typed row each, for the memory plan.

Each row is `memory_plan.shape_of` applied to transformers 5.23's Gemma 4 model (text only) built
on the published config, on the meta device; tests/test_models.py rebuilds them that way and
checks every number. The configs (hidden size, layers, heads, head dims 256/512, intermediate
sizes, sliding windows, KV sharing, experts) are as the hub's config.json files give them, seen in
public restatements (MaxText's checkpoint-conversion configs, mlx and vLLM ports; 2026-12):

| size | layers | hidden | q/kv heads | window | notes |
|---|---|---|---|---|---|
| E2B | 35 | 1536 | 8/1 | 512 | 20 KV-shared layers, double-wide MLP on them; per-layer table 262,144 x 35 x 256 |
| E4B | 42 | 2560 | 8/2 | 512 | 18 KV-shared layers; per-layer table 262,144 x 42 x 256 |
| 26B-A4B | 30 | 2816 | 16/8 (2 global) | 1024 | 128 experts of width 704, top 8, beside a dense MLP of 2112; K = V on global layers |
| 31B | 60 | 5376 | 32/16 (4 global) | 1024 | dense, intermediate 21,504; K = V on global layers |
| 12B | 48 | 3840 | 16/8 (4 global) | 1024 | dense, intermediate 15,360; K = V on global layers; `gemma4_unified` |

The 12B (google/gemma-4-12B-it, published after the others) is transformers 5.23's `gemma4_unified`: the same
decoder, and instead of vision and audio towers two small embedders of raw patches and waveform frames
(modeling_gemma4_unified.py). Its shape is ggml-org's conversion of the hub checkpoint as Ollama's library lists
it (gemma4:12b-it-q8_0: 48 blocks, width 3840, 16 heads, 8 KV heads, feed-forward 15,360, key length 512 global /
256 sliding, window 1024, context 262,144, no per-layer input; read 2026-12); the global layers' 4 KV heads with
K = V (as 31B's) are what makes the decoder 11,954,536,192 parameters, the model card's 11.95B.

All: vocabulary 262,144, the head tied to the token embedding, final-logit soft-cap 30. Parameter
counts agree with the model cards' (E2B about 5.1B and E4B about 8B with their vision and audio
towers, which the fine-tune drops; 26B-A4B 25.2B; 31B 30.7B), and so do the active ones (E2B 2.3B
"effective", E4B 4.5B, 26B-A4B 3.8B).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from infra.job_modules import memory_plan as plans
from infra.job_modules import modality

MemoryPlan, ModelShape, Workload = plans.MemoryPlan, plans.ModelShape, plans.Workload

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("E2B", params=4628569344, per_layer_table=2348810240, embedding=402653184, largest_layer=70000640,
                   lora_in_out=1509888, layers=35, hidden=1536, mlp_width=9654, query_width=2457, kv_width=131,
                   heads=8, vocab=262144, sliding_window=512, active_params=2279759104),
        ModelShape("E4B", params=7463013376, per_layer_table=2818572288, embedding=671088640, largest_layer=106182144,
                   lora_in_out=2180096, layers=42, hidden=2560, mlp_width=10240, query_width=2389, kv_width=341,
                   heads=8, vocab=262144, sliding_window=512, active_params=4644441088),
        ModelShape("26B-A4B", params=25233141760, per_layer_table=0, embedding=738197504, largest_layer=828513408,
                   lora_in_out=1161600, layers=30, hidden=2816, mlp_width=7744, query_width=4778, kv_width=1877,
                   heads=16, vocab=262144, sliding_window=1024, active_params=3822530560, experts=128),
        ModelShape("31B", params=30697345280, per_layer_table=0, embedding=1409286144, largest_layer=534009856,
                   lora_in_out=7651840, layers=60, hidden=5376, mlp_width=21504, query_width=9557, kv_width=3754,
                   heads=32, vocab=262144, sliding_window=1024, active_params=30697345280),
        ModelShape("12B", params=11954536192, per_layer_table=0, embedding=1006632960, largest_layer=247742464,
                   lora_in_out=4110336, layers=48, hidden=3840, mlp_width=15360, query_width=4778, kv_width=2048,
                   heads=16, vocab=262144, sliding_window=1024, active_params=11954536192),
    )
}  # fmt: skip

# Each size's context in tokens: 128K for E2B and E4B, 256K for 12B, 26B-A4B and 31B (the Gemma 4 model card,
# "Context windows", read 2026-12): the longest serveMaxModelLen the stack accepts.
CONTEXT_TOKENS = {"E2B": 131_072, "E4B": 131_072, "12B": 262_144, "26B-A4B": 262_144, "31B": 262_144}


@dataclass(frozen=True)
class Towers:
    """Parameters of a size's vision and audio towers with their embedders (0: the size has none), which the
    fine-tune loads when the records hold pictures or sound (config.modality)."""

    image: int
    audio: int
    source: str
    model_type: str = "gemma4"  # transformers' (config.modality.UNBUILT: a type whose media this version cannot read)


# The model card's "Vision Encoder Parameters" and "Audio Encoder Parameters" (~150M and ~300M for E2B and E4B,
# ~550M and none for 31B; read 2026-12 as restated with the family table by public ports); 26B-A4B's vision tower
# is 31B's (27 blocks of width 1152 in both GGUF conversions) and its config.json has no audio_config; 12B's are
# its two embedders as transformers 5.23 builds them on Gemma4Unified's defaults, which are the shapes of the hub
# checkpoint's (patch projection 6912 x 3840, waveform projection 640 x 3840 in ggml-org's conversion).
TOWERS = {
    "E2B": Towers(image=150_000_000, audio=300_000_000, source="model card (~150M, ~300M)"),
    "E4B": Towers(image=150_000_000, audio=300_000_000, source="model card (~150M, ~300M)"),
    "12B": Towers(
        image=49_922_304,
        audio=2_457_600,
        source="transformers 5.23 gemma4_unified embedders",
        model_type="gemma4_unified",
    ),
    "26B-A4B": Towers(image=550_000_000, audio=0, source="31B's vision tower; config.json audio_config null"),
    "31B": Towers(image=550_000_000, audio=0, source="model card (~550M, no audio)"),
}

# google/gemma-4-E2B-it, google/gemma-4-31B (base or -it): the same weights' shapes.
_HUB_ID = re.compile(r"^google/gemma-4-(E2B|E4B|12B|26B-A4B|31B)(-it)?$", re.IGNORECASE)


def known_model(ref: str) -> ModelShape | None:
    """The table's row for a Gemma 4 hub id; None for anything else (a path, another model)."""
    m = _HUB_ID.fullmatch(ref)
    return MODELS[next(k for k in MODELS if k.lower() == m.group(1).lower())] if m else None


def tower_params(job) -> int:
    """Parameters of the towers the job's modality loads on a size the table knows (auto: none at preview)."""
    model = known_model(job.model)
    towers = TOWERS[model.name] if model is not None else Towers(0, 0, "")
    return sum(getattr(towers, kind) for kind in modality.towers_of(job.modality))


def missing_towers(job) -> list[str]:
    """The towers the job's modality needs that its size (a known one) does not have."""
    model = known_model(job.model)
    return [k for k in modality.towers_of(job.modality) if model is not None and not getattr(TOWERS[model.name], k)]


def workload_of(job, tpu_slice) -> Workload:
    """The plan's view of the stack's job settings on a slice (bf16, as on TPU)."""
    return Workload(
        devices=tpu_slice.devices, batch=job.batch_size, seq_len=job.seq_len, dtype_bytes=2,
        activation_checkpointing=job.activation_checkpointing, lora=job.lora, lora_rank=job.lora_rank,
        loss_chunk=job.loss_chunk, sequences=plans.sequences_per_record(job.objective),
        tower_params=tower_params(job), train_towers=job.train_towers, **plans.grpo_parts(job.objective, job.beta),
    )  # fmt: skip


def memory_plan(job, tpu_slice) -> MemoryPlan | None:
    """The plan per device for a model the table knows; None for another (the job plans it from config.json)."""
    model = known_model(job.model)
    return None if model is None else plans.plan(model, workload_of(job, tpu_slice), tpu_slice.hbm_gib_per_device)


def memory_remedy(job, tpu_slice) -> str | None:
    """The first setting that makes the plan fit (memory_plan.remedy's order), or None."""
    from infra.cloud.tpu import TpuSlice

    generation = tpu_slice.generation
    devices = {t: TpuSlice(generation, t).devices for t in generation.topologies}
    return plans.remedy(known_model(job.model), workload_of(job, tpu_slice), tpu_slice.hbm_gib_per_device, devices,
                  job.grad_accum)  # fmt: skip


def memory_plan_output(job, tpu_slice, num_slices: int = 1) -> dict:
    """The `memoryPlan` stack output: GiB per device by part, the total, the headroom; or why there is none.
    The model is sharded over one slice's devices whatever the number of slices (each holds a replica)."""
    planned = memory_plan(job, tpu_slice) if tpu_slice is not None else None
    if planned is None:
        return {"model": job.model, "plan": "none at preview: not a Gemma 4 size of infra/cloud/models.py; the job "
                "prints its plan from the model's config.json (memory_plan_gib, each epoch)"}  # fmt: skip
    towers = {"modality": job.modality}
    if job.modality == "auto":
        towers["towers"] = ("not counted: modality auto reads the data in the job (its memory_plan_gib counts them); "
                            "set modality to plan them here")  # fmt: skip
    return {"model": job.model, "slice": f"{tpu_slice.generation.name} {tpu_slice.topology}",
            "devices": tpu_slice.devices, "slices": num_slices, "estimate": True, **towers,
            **planned.as_output()}  # fmt: skip


def serving_plan(model_ref: str, host, max_model_len: int) -> MemoryPlan | None:
    """Serving's plan per device on a ServingHost (infra/cloud/tpu.py) for a size the table knows; None for another."""
    model = known_model(model_ref)
    return None if model is None else plans.serving_plan(model, host.devices, max_model_len, host.hbm_gib_per_device)


def smallest_serving_host(model_ref: str, generation, max_model_len: int):
    """The smallest single-host shape of `generation` whose serving plan fits (the first, for a model the table
    does not know); None when none does."""
    from infra.cloud.tpu import serving_hosts

    hosts = serving_hosts(generation)
    fitting = [h for h in hosts if (p := serving_plan(model_ref, h, max_model_len)) is None or p.fits]
    return fitting[0] if fitting else None
