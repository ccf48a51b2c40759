"""LoRA on the language model: adapters added before FSDP (model.apply_lora), trained alone, merged at the export.

Targets are the q/k/v/o projections and the MLP's gate/up/down of every decoder layer, whichever
exist (Gemma 4's KV-shared layers have no k_proj/v_proj, its global layers no v_proj where K = V;
a mixture of experts' stacked expert weights are not linear layers, so they stay frozen). The
adapters take the base weights' dtype: FSDP2 needs one dtype per unit. Only they (and their AdamW
moments) are trainable, so the sharded checkpoints hold only them.
"""

from __future__ import annotations

import json
import os

from runtime.memory_plan import LORA_TARGETS

TARGET_PATTERN = r".*language_model\.layers\.\d+\..*\.(" + "|".join(LORA_TARGETS) + ")"
ADAPTER_DIR = "adapter"


def split_merged(state_dict: dict, scale: float) -> tuple[dict, dict]:
    """(the base weights with B @ A x scale added, under their plain names; the adapters alone) from
    the full state of a LoRA-injected model."""
    import torch

    adapters = {k: v for k, v in state_dict.items() if ".lora_A." in k or ".lora_B." in k}
    merged = {}
    for key, value in state_dict.items():
        if key in adapters:
            continue
        if key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = adapters[f"{stem}.lora_A.default.weight"], adapters[f"{stem}.lora_B.default.weight"]
            delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
            merged[f"{stem}.weight"] = (value.to(torch.float32) + delta).to(value.dtype)
        else:
            merged[key.replace(".base_layer.", ".")] = value
    return merged, adapters


def save_adapter(adapters: dict, config, base_model: str, directory: str) -> None:
    """The adapters as peft writes them (adapter_config.json, adapter_model.safetensors): loadable with
    PeftModel.from_pretrained(base, directory)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    names = {f"base_model.model.{k.replace('.default.', '.')}": v.contiguous() for k, v in adapters.items()}
    save_file(names, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config.to_dict() | {"base_model_name_or_path": base_model, "target_modules": TARGET_PATTERN,
                                      "peft_type": "LORA"}, f, indent=1, default=str)  # fmt: skip


def trainable_and_total(model) -> tuple[int, int]:
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
