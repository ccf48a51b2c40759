"""Gemma 4 12B (google/gemma-4-12B-it, transformers 5.23's gemma4_unified): its text fine-tuned by the same job as the
other sizes, on a tiny random model of its architecture built offline; its pictures and sound refused as not built,
in the job and at preview."""

from __future__ import annotations

import pytest

from tests.inprocess import settings


@pytest.fixture(scope="module")
def unified(tmp_path_factory, tiny_assets) -> dict:
    """A tiny gemma4_unified (the 12B's class: no per-layer table; K = V on the global layer) beside the tiny
    tokenizer and Dolly records."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma4UnifiedConfig

    out = tmp_path_factory.mktemp("unified")
    shutil.copytree(tiny_assets["model"], out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors",
                                                                                                 "config.json"))  # fmt: skip
    text = dict(vocab_size=len(AutoTokenizer.from_pretrained(out)), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1,
                attention_k_eq_v=True, head_dim=32, global_head_dim=32, sliding_window=64, max_position_embeddings=1024,
                final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
                eos_token_id=1, bos_token_id=2)  # fmt: skip
    config = Gemma4UnifiedConfig(text_config=text, vision_config=None, audio_config=None, pad_token_id=0,
                                 eos_token_id=1, bos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    return {"model": str(out), "dataset": tiny_assets["dataset"]}


def test_the_12b_architecture_fine_tunes_its_text_as_the_other_sizes(unified, gloo_rank):
    from tests.inprocess import train

    config = settings(unified, "--split", "train[:32]", "--eval-split", "none", "--epochs", "2", "--eval-samples", "0",
                      "--eval-tasks", "none")  # fmt: skip
    trainee, history = train(config)
    assert type(trainee.model).__name__ == "Gemma4UnifiedForConditionalGeneration"
    assert len(history) == 2 and history[1]["loss"] < history[0]["loss"]


def test_its_pictures_and_sound_are_refused_as_not_built(unified):
    from transformers import AutoConfig

    from config.modality import require_towers
    from runtime.outcome import JobInputError

    with pytest.raises(JobInputError, match=r"is Gemma 4 12B \(gemma4_unified\).*not built in this version"):
        require_towers(AutoConfig.from_pretrained(unified["model"]), ("image",), unified["model"])
    require_towers(AutoConfig.from_pretrained(unified["model"]), (), unified["model"])  # text: fine


def test_the_stack_refuses_12b_with_pictures_at_preview():
    from infra.config.stack import ConfigError
    from tests.stack_harness import run_program, stack_config

    with pytest.raises(ConfigError, match=r"gemma-tpu:modality: image on google/gemma-4-12B-it: Gemma 4 12B"):
        run_program("v6e", stack_config("v6e", model="google/gemma-4-12B-it", modality="image"))
