"""The Gemma 4 table and the memory plan: every row is transformers' own Gemma 4 on the published
config; the plan's arithmetic by hand for one row; what fits on each slice, and the advice when not."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from infra.cloud.models import MODELS, known_model
from infra.cloud.tpu import GENERATIONS, TpuSlice
from runtime.memory_plan import GIB, HEADROOM, Workload, plan, remedy, shape_of


def layer_types(layers: int, every: int) -> list[str]:
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]


# The published text configs (the hub's config.json, as public ports restate them; see infra/cloud/models.py).
CONFIGS = {
    "E2B": dict(hidden_size=1536, num_hidden_layers=35, intermediate_size=6144, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
                hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=20,
                use_double_wide_mlp=True, layer_types=layer_types(35, 5)),
    "E4B": dict(hidden_size=2560, num_hidden_layers=42, intermediate_size=10240, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512,
                hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=18,
                layer_types=layer_types(42, 6)),
    "26B-A4B": dict(hidden_size=2816, num_hidden_layers=30, intermediate_size=2112, num_attention_heads=16,
                    num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256, global_head_dim=512,
                    sliding_window=1024, hidden_size_per_layer_input=0, attention_k_eq_v=True, enable_moe_block=True,
                    num_experts=128, top_k_experts=8, moe_intermediate_size=704, layer_types=layer_types(30, 6)),
    "31B": dict(hidden_size=5376, num_hidden_layers=60, intermediate_size=21504, num_attention_heads=32,
                num_key_value_heads=16, num_global_key_value_heads=4, head_dim=256, global_head_dim=512,
                sliding_window=1024, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                layer_types=layer_types(60, 6)),
    # gemma4_unified (infra/cloud/models.py): ggml-org's conversion's shape; K = V and 4 KV heads on the global layers
    "12B": dict(hidden_size=3840, num_hidden_layers=48, intermediate_size=15360, num_attention_heads=16,
                num_key_value_heads=8, num_global_key_value_heads=4, head_dim=256, global_head_dim=512,
                sliding_window=1024, attention_k_eq_v=True, layer_types=layer_types(48, 6)),
}  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
def test_each_row_is_transformers_gemma4_on_its_published_config(name):
    import torch
    from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4UnifiedConfig

    text = CONFIGS[name] | {"vocab_size": 262144, "final_logit_softcapping": 30.0}
    kind = Gemma4UnifiedConfig if name == "12B" else Gemma4Config
    with torch.device("meta"):  # shapes only: no memory
        model = AutoModelForCausalLM.from_config(kind(text_config=text, vision_config=None, audio_config=None))
    assert asdict(shape_of(model, name)) == asdict(MODELS[name])  # (infra reads jobs/ as the package `jobs`)


def test_12b_is_the_model_cards_11_95b_and_its_embedders_are_transformers_own():
    """The 12B row's decoder is the card's 11.95B parameters; its picture and sound embedders (TOWERS) are what
    transformers 5.23 builds on Gemma4Unified's own defaults, with the 12B's text config; shape_of leaves them out."""
    import torch
    from transformers import AutoModelForImageTextToText, Gemma4UnifiedConfig
    from transformers.models.gemma4_unified.configuration_gemma4_unified import (
        Gemma4UnifiedAudioConfig,
        Gemma4UnifiedVisionConfig,
    )

    from infra.cloud.models import TOWERS

    assert round(MODELS["12B"].params / 1e9, 2) == 11.95
    text = CONFIGS["12B"] | {"vocab_size": 262144, "final_logit_softcapping": 30.0}
    config = Gemma4UnifiedConfig(text_config=text, vision_config=Gemma4UnifiedVisionConfig().to_dict(),
                                 audio_config=Gemma4UnifiedAudioConfig().to_dict())  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in model.model.named_children()}
    assert (counts["embed_vision"], counts["embed_audio"]) == (TOWERS["12B"].image, TOWERS["12B"].audio)
    assert asdict(shape_of(model, "12B")) == asdict(MODELS["12B"])


def test_hub_ids_find_their_row_and_nothing_else_does():
    assert known_model("google/gemma-4-E2B-it") is MODELS["E2B"]
    assert (
        known_model("google/gemma-4-31b") is MODELS["31B"] and known_model("google/gemma-4-26B-A4B-it").experts == 128
    )
    assert known_model("./my-model") is None and known_model("google/gemma-3-27b-it") is None


def test_the_plan_of_e2b_on_a_v6e_slice_by_hand():
    """The walkthrough's run: E2B, 16 devices, 4 rows x 512 tokens, bf16, the default chunked loss."""
    e2b, devices, tokens = MODELS["E2B"], 16, 4 * 512
    got = plan(e2b, Workload(devices=devices, batch=4, seq_len=512), hbm_gib=32)
    sharded = 4628569344 - 2348810240  # everything but the per-layer table
    by_hand = {
        "weights": sharded * 2 / 16,
        "gradients": sharded * 2 / 16,
        "optimizer": sharded * 4 / 16,
        "frozen_tables": 2348810240 * 2,  # 262,144 x 35 x 256, on every device
        "gathered": (402653184 + 2 * 70000640) * 2 * 2,  # embedding + two layers, weights and gradients
        # per token and layer: 2 x (8 x 1536 + 2 x 2457 + 2 x 131 + 4 x 9654) plus 8 heads x 512 x (2 + 4 + 2)
        "activations": tokens * 35 * (2 * (12288 + 4914 + 262 + 38616) + 8 * 512 * 8),
        "logits": 256 * 262144 * 12,  # one chunk's three fp32 buffers
    }
    assert got.parts == pytest.approx({k: v / GIB for k, v in by_hand.items()})
    assert got.total_gib == pytest.approx(17.9, abs=0.05) and got.fits  # under 32 x 0.9 GiB
    assert got.usable_gib == 32 * (1 - HEADROOM)


# What fits at the walkthrough's 4 rows x 512 tokens a device: "full" training, "full+ac" with
# activation checkpointing, "lora", "lora+ac".
FITS = {
    ("v6e", "E2B"): {"full": True, "full+ac": True, "lora": True, "lora+ac": True},
    ("v6e", "E4B"): {"full": True, "full+ac": True, "lora": True, "lora+ac": True},
    ("v6e", "26B-A4B"): {"full": False, "full+ac": True, "lora": True, "lora+ac": True},
    ("v6e", "31B"): {"full": False, "full+ac": True, "lora": False, "lora+ac": True},
    **{("tpu7x", name): dict.fromkeys(("full", "full+ac", "lora", "lora+ac"), True) for name in MODELS},
}


@pytest.mark.parametrize("generation,name", FITS)
def test_what_fits_for_every_size_on_each_walkthrough_slice(generation, name):
    tpu = TpuSlice(GENERATIONS[generation], GENERATIONS[generation].topologies[0])
    got = {}
    for recipe, (lora, ac) in {"full": (0, 0), "full+ac": (0, 1), "lora": (1, 0), "lora+ac": (1, 1)}.items():
        p = plan(MODELS[name], Workload(tpu.devices, 4, 512, lora=bool(lora), activation_checkpointing=bool(ac)),
                 tpu.hbm_gib_per_device)  # fmt: skip
        got[recipe] = p.fits
        assert p.total_gib > 0 and p.parts["activations"] > 0
    assert got == FITS[generation, name]


V6E_DEVICES = {t: TpuSlice(GENERATIONS["v6e"], t).devices for t in GENERATIONS["v6e"].topologies}
# Each step of the advice, and the first case (model, rows, tokens, activation checkpointing on) it answers.
ADVICE = {
    "activation checkpointing": ("31B", 4, 512, False, "activationCheckpointing: true (26.3 GiB)"),
    "lora": ("31B", 16, 512, True, "lora: true (17.3 GiB)"),
    "lora with checkpointing": ("E4B", 8, 4096, False, "activationCheckpointing: true, lora: true (26.8 GiB)"),
    "fewer rows, more micro-batches": ("E2B", 4, 8192, False, "activationCheckpointing: true, batchSize: 2, "
                                       "gradAccum: 2 (19.6 GiB; the global batch unchanged)"),
    # the case: 31B at 4 x 4,096 tokens a device on v6e 4x4, refused before with "nothing fits"
    "a larger topology": ("31B", 4, 4096, False, "activationCheckpointing: true, batchSize: 1, gradAccum: 4, "
                          "tpuTopology: 4x8 (24.8 GiB; the global batch unchanged)"),
    "a shorter sequence, last": ("31B", 1, 8192, False, "activationCheckpointing: true, seqLen: 2048 (27.1 GiB)"),
}  # fmt: skip


@pytest.mark.parametrize("step", ADVICE)
def test_the_advice_names_the_first_setting_that_fits_in_order(step):
    name, batch, seq_len, ac, said = ADVICE[step]
    workload = Workload(16, batch, seq_len, activation_checkpointing=ac)
    assert not plan(MODELS[name], workload, 32.0).fits
    assert remedy(MODELS[name], workload, 32.0, V6E_DEVICES) == said
    # and what it names does fit: re-planned from its own words
    changes = {"activation_checkpointing": "activationCheckpointing: true" in said or ac, "lora": "lora: true" in said}
    for key, field, cast in (("batchSize", "batch", int), ("tpuTopology", "devices", V6E_DEVICES.get),
                             ("seqLen", "seq_len", int)):  # fmt: skip
        if f"{key}: " in said:
            changes[field] = cast(said.split(f"{key}: ")[1].split(",")[0].split(" ")[0])
    assert plan(MODELS[name], replace(workload, **changes), 32.0).fits


def test_the_advice_keeps_the_global_batch_and_says_nothing_when_nothing_fits():
    workload = Workload(16, 4, 8192)
    # 4 rows x 3 micro-batches = 12 a device a step: 3 rows x 4 keeps it; with 4 x 1, 3 rows could not (2 x 2)
    assert "batchSize: 3, gradAccum: 4 " in remedy(MODELS["E2B"], workload, 32.0, V6E_DEVICES, grad_accum=3)
    assert "batchSize: 2, gradAccum: 2 " in remedy(MODELS["E2B"], workload, 32.0, V6E_DEVICES, grad_accum=1)
    assert remedy(MODELS["31B"], Workload(16, 4, 512), 1.0, V6E_DEVICES) is None
