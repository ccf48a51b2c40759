"""How much of the hardware a fine-tune uses: model FLOPs per real token, and MFU.

MFU = model FLOPs done per second per device / the device's peak bf16 FLOP/s. Model FLOPs
count useful work only, for real (non-padding) tokens: padding, filler and the masked-out
part of attention are not counted, nor is recomputation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtime.memory_plan import in_a_tower


@dataclass(frozen=True)
class AttentionLayer:
    heads: int  # query heads
    head_dim: int
    window: int | None  # sliding window, or None for full attention


def causal_context(seq_len: int, window: int | None) -> float:
    """Mean number of keys a query attends to in a causal row of seq_len tokens (window-limited)."""
    span = seq_len if window is None else min(window, seq_len)
    # positions 1..span see themselves and everything before; later ones see `span` keys
    return (span * (span + 1) / 2 + (seq_len - span) * span) / seq_len


def model_flops_per_token(
    trainable_matmul_params: int, frozen_matmul_params: int, attention: Sequence[AttentionLayer], seq_len: int
) -> float:
    """Training FLOPs (forward + backward) per token.

    - 6 x each trainable matmul weight (2 forward, 2 for the input gradient, 2 for the weight gradient);
    - 4 x each frozen matmul weight (no weight gradient);
    - 0 for embedding lookups (the token and per-layer tables), norms and elementwise work;
    - attention: per layer 12 x heads x head_dim x context (QK^T and AV, 2 FLOPs per
      multiply-add, x3 for the backward), where context is the causal-discounted mean number of
      keys over a row of seq_len (`causal_context`), limited by the layer's sliding window.
    """
    attention_flops = sum(12 * a.heads * a.head_dim * causal_context(seq_len, a.window) for a in attention)
    return 6 * trainable_matmul_params + 4 * frozen_matmul_params + attention_flops


def describe(model) -> tuple[int, int, list[AttentionLayer]]:
    """(trainable matmul params, frozen matmul params, attention layers) of a loaded, unsharded model.

    Matmul weights are those of nn.Linear modules, the LM head included (tied to the token
    embedding, whose lookup itself costs nothing). The vision and audio towers are left out: their work is per
    picture or clip, not per token (MFU counts the language model's).
    """
    import torch

    trainable = frozen = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not in_a_tower(name):
            if module.weight.requires_grad:
                trainable += module.weight.numel()
            else:
                frozen += module.weight.numel()
    text = model.config.get_text_config()
    attention = [
        AttentionLayer(text.num_attention_heads, m.head_dim, m.sliding_window)
        for name, m in model.named_modules()
        if name.endswith("self_attn") and hasattr(m, "head_dim") and not in_a_tower(name)
    ]
    return trainable, frozen, attention


def mfu(model_flops_per_s_per_device: float, peak_flops_per_device: float | None) -> float | None:
    return model_flops_per_s_per_device / peak_flops_per_device if peak_flops_per_device else None
