"""What the records hold, and so which of Gemma 4's towers the fine-tune loads (issue 46): --modality, its resolution
from the data, and the towers a model's config must have for it. Torch-free: the driver and the stack read it."""

from __future__ import annotations

from runtime.outcome import JobInputError

MODALITIES = ("auto", "text", "image", "audio", "image+audio")  # --modality's choices
# a tower's kind -> its config in Gemma4Config (transformers 5.23); its modules: memory_plan.TOWER_MODULES
TOWER_CONFIGS = {"image": "vision_config", "audio": "audio_config"}
MEDIA_OF = {"image": "pictures", "audio": "sound"}
# Models whose pictures and sound this version does not read (their text is fine-tuned as any Gemma 4's)
UNBUILT = {"gemma4_unified": "Gemma 4 12B (gemma4_unified), which reads pictures and sound as raw patches and "
           "waveform frames through its own processor: not built in this version, which fine-tunes its text only; "
           "use E2B or E4B for pictures and sound"}  # fmt: skip


def towers_of(modality: str) -> tuple[str, ...]:
    """The towers a modality needs: text (or auto, which the driver resolves from the data first) none."""
    return tuple(kind for kind in TOWER_CONFIGS if kind in modality.split("+"))


def modality_of(images: int, clips: int) -> str:
    """text, image, audio or image+audio: what records holding `images` pictures and `clips` clips need."""
    return "+".join(kind for kind, n in (("image", images), ("audio", clips)) if n) or "text"


def require_towers(config, towers: tuple[str, ...], ref: str) -> None:
    """Raises JobInputError when a model's config (a transformers config) lacks a tower the data needs (Gemma 4's
    26B-A4B and 31B have no audio tower; a text-only checkpoint none)."""
    if towers and getattr(config, "model_type", "") in UNBUILT:
        raise JobInputError(f"--model {ref} is {UNBUILT[config.model_type]}")
    if missing := [kind for kind in towers if getattr(config, TOWER_CONFIGS[kind], None) is None]:
        raise JobInputError(f"--model {ref} has no {' or '.join(missing)} tower, which the records' "
                            f"{' and '.join(MEDIA_OF[k] for k in missing)} need: use a Gemma 4 size that has it (E2B "
                            "and E4B have both), or leave those records out")  # fmt: skip
