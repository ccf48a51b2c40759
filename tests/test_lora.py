"""LoRA (few parameters trained, exact resume from adapter-only checkpoints, a merged export that
needs no peft), activation checkpointing (the same losses, layers recomputed) and a mixture of
experts, all under FSDP2 on one gloo rank in this process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.inprocess import full_state, settings, train


def fsdp_step_run(config, epochs: range, restored_from: str | None = None, save_to: str | None = None):
    """Epochs `epochs` of the per-worker loop (optionally loading, then saving, sharded checkpoints)."""
    import shutil

    from tests.inprocess import run

    root = Path(save_to or restored_from).parent if (save_to or restored_from) else None
    resume = restored_from and str(root / "checkpoint_epoch_0001")
    trainee, state = run(config, epochs=epochs.stop, root=root and str(root), resume_from=resume)
    if save_to:
        shutil.copytree(root / f"checkpoint_epoch_{epochs.stop:04d}", save_to)
    return trainee.model, trainee.tokenizer, [h["loss"] for h in state.history[epochs.start :]]


def adapters(state: dict) -> dict:
    return {k: v for k, v in state.items() if ".lora_" in k}


def test_lora_trains_few_parameters_and_resumes_exactly_from_adapter_only_checkpoints(tiny_assets, tmp_path, gloo_rank):
    import json

    from training.lora import trainable_and_total

    config = settings(tiny_assets, "--lora", "--lora-rank", "2", "--lora-alpha", "4", "--epochs", "2",
                      "--eval-split", "none", "--lr", "1e-2")  # fmt: skip
    model, _, whole = fsdp_step_run(config, range(2))
    trainable, total = trainable_and_total(model)
    assert 0 < trainable < 0.05 * total  # the adapters only
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".lora_" in n)  # the base's dtype
    assert whole[1] < whole[0]

    _, _, first = fsdp_step_run(config, range(1), save_to=str(tmp_path / "epoch1"))
    resumed, _, second = fsdp_step_run(config, range(1, 2), restored_from=str(tmp_path / "epoch1"))
    assert first + second == pytest.approx(whole, rel=1e-6)
    want, got = full_state(model), full_state(resumed)
    for name in adapters(want):
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7), name
    # the checkpoint holds the adapters (and their AdamW moments), not the frozen base
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "epoch1")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.") and k.endswith(".weight")]  # (buffers ride along)
    assert weights and all(".lora_" in k for k in weights)
    assert json.dumps(sorted(saved)).count("base_layer") == 0 and "embed_tokens" not in json.dumps(sorted(saved))


def test_the_merged_export_loads_without_peft_and_equals_base_plus_adapters(tiny_assets, tmp_path, gloo_rank):
    import pyarrow.fs
    from transformers import AutoModelForCausalLM

    from training.checkpoints import export_pretrained

    config = settings(
        tiny_assets, "--lora", "--lora-rank", "2", "--epochs", "1", "--eval-split", "none", "--lr", "1e-2"
    )
    trainee, _ = train(config)
    export_pretrained(trainee.model, trainee.tokenizer, pyarrow.fs.LocalFileSystem(), str(tmp_path / "model"),
                      trainee.lora)  # fmt: skip

    peft_modules = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "peft" or k.startswith("peft.")}
    sys.modules["peft"] = None  # any attempt to import peft now fails
    try:
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    finally:
        del sys.modules["peft"]
        sys.modules.update(peft_modules)
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)  # as trained on CPU
    untouched = {k: v.clone() for k, v in base.state_dict().items()}
    reference = PeftModel.from_pretrained(base, tmp_path / "model" / "adapter").merge_and_unload().state_dict()
    assert merged.keys() == reference.keys() == untouched.keys()
    for name in merged:
        assert torch.allclose(merged[name], reference[name], rtol=1e-5, atol=1e-6), name
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], untouched[q])  # the adapters changed it


def count_layer_calls(model) -> list[int]:
    """Calls of the first decoder layer's MLP. (transformers checkpoints a layer's `forward`, keeping FSDP2's
    hooks on the layer itself outside the recomputation: its children run again, not the layer's hooks.)"""
    from training.model import language_model

    calls = [0]
    language_model(model).layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_activation_checkpointing_recomputes_each_layer_and_keeps_the_losses(tiny_assets, gloo_rank):
    from data.sft_data import model_inputs
    from tests.inprocess import build
    from training.step import TrainingData

    losses, calls = {}, {}
    for ac in (False, True):
        config = settings(tiny_assets, "--eval-split", "none", *(["--activation-checkpointing"] if ac else []))
        trainee, _ = build(config)
        counted = count_layer_calls(trainee.model)
        batch = next(iter(TrainingData(config, trainee.tokenizer, 0, 1).loader))
        loss = trainee.loss(**model_inputs(batch, True, "cpu"))
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in trainee.model.named_parameters() if p.grad is not None}
        losses[ac] = (float(loss), grads)
        calls[ac] = counted[0]
    assert calls == {False: 1, True: 2}  # the backward pass ran the layer again
    assert losses[True][0] == pytest.approx(losses[False][0], rel=1e-6)
    for name, grad in losses[False][1].items():
        assert torch.allclose(losses[True][1][name], grad, rtol=1e-5, atol=1e-7), name


@pytest.fixture(scope="module")
def tiny_moe(tiny_assets, tmp_path_factory):
    """The tiny Gemma 4 as a mixture of experts (jobs/tiny_assets.py's `moe` size), same tokenizer."""
    from tests.inprocess import tiny_of_size

    return tiny_of_size("moe", tiny_assets, tmp_path_factory.mktemp("moe") / "model")


def test_a_mixture_of_experts_trains_under_fsdp_and_lora_leaves_its_experts(tiny_moe, gloo_rank):
    from training.lora import trainable_and_total

    config = settings(tiny_moe, "--eval-split", "none", "--epochs", "2", "--lr", "1e-2")
    trainee, history = train(config)
    assert hasattr(trainee.model.model.language_model.layers[0], "experts")
    assert history[1]["loss"] < history[0]["loss"]
    lora = settings(tiny_moe, "--eval-split", "none", "--epochs", "1", "--lora", "--lora-rank", "2")
    trainee, history = train(lora)
    model = trainee.model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and not any("experts" in n for n in trainable) and history[0]["loss"] > 0
    assert trainable_and_total(model)[0] < trainable_and_total(model)[1]
