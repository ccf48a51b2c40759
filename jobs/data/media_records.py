"""A chat record with pictures and sound, prepared for the fine-tune (issue 46): its tokens with each picture and clip
expanded into its soft tokens, which tokens are trained, and the arrays the towers read.

The text is rendered as a text record's is (render.render_chat: the tokenizer's chat template, which renders a
picture part as its placeholder, Gemma 4's `<|image|>`, and a clip as `<|audio|>`; the model turns and their
end-of-turn markers trained) and tokenized with offsets (render.tokenize). The processor then expands each
placeholder into its wrappers and soft tokens (transformers 5.23's Gemma4Processor.replace_image_token and
replace_audio_token: `<|image>` + n x `<|image|>` + `<image|>`), and the labels follow that expansion token for
token, every soft token and wrapper untrained. The expansion is checked against the text's own tokens, so a
tokenizer that is not the processor's fails here, naming the record, not later as a shape error in a forward.

What is kept for the towers, so that no rank or restart decodes a file again:
- a picture's pixel values as bytes: Gemma 4's image processor rescales by 1/255 and does not normalize
  (image_processing_pil_gemma4.py), so pixel x 255 is a byte and `pixel_values` restores the processor's floats to
  the bit (checked for every picture); with the patch positions ((-1, -1) for padding patches);
- a clip's log-mel frames as the feature extractor makes them for the clip alone, and its mask. Padding a clip to a
  longer one's length adds zero frames, masked, and leaves its own frames as they were (the extractor works frame
  by frame), so a batch pads every clip to the split's longest: one shape for the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from data.labels import IGNORE
from data.media import PART_KINDS, MediaRef
from data.render import ROLES, RecordError, render_chat, tokenize


@dataclass
class MediaRecord:
    ids: list[int]
    labels: list[int]  # IGNORE where not trained: the prompt, every soft token and wrapper
    pixels: object  # uint8 [pictures, patches, patch values]: the pixel values x 255
    patches: object  # int32 [pictures, patches, 2]: each patch's position, (-1, -1) for padding
    features: object  # float32 [frames, mel bins]: every clip's frames, end to end
    frame_mask: object  # bool [frames]
    clip_frames: list[int]  # frames a clip
    image_tokens: int
    audio_tokens: int
    media_end: int  # one past the last wrapper: a record cut before it would lose soft tokens
    files: list[str]  # the pictures and clips as the record names them, in order (the samples show them)


def media_turns(record: dict) -> list[dict]:
    """A (checked) messages record's turns for the processor's chat template: content parts kept in order, a picture
    or clip as a bare `{"type": kind}` part (its file is handed to the processor apart)."""

    def part(p: dict) -> dict:
        return (
            {"type": "text", "text": p.get("text") or ""}
            if p.get("type") == "text"
            else {"type": PART_KINDS.get(p["type"], p["type"])}
        )  # (OpenAI's image_url is a picture)

    return [{"role": ROLES[t["role"]], "content": [part(p) for p in t["content"] if isinstance(p, dict)]
             if isinstance(t["content"], list) else t["content"]} for t in record["messages"]]  # fmt: skip


def pixel_values(pixels):
    """The image processor's floats from the kept bytes (numpy or torch alike)."""
    return pixels.astype("float32") / 255 if hasattr(pixels, "astype") else pixels.float() / 255


def expanded_labels(ids: list[int], labels: list[int], expanded: list[int], tokenizer) -> list[int]:
    """`labels` (of the text's `ids`, one placeholder a picture or clip) laid over the processor's `expanded` ids,
    where each placeholder became its wrappers around its soft tokens: those are never trained."""

    def id_of(name: str) -> int:
        return tokenizer.convert_tokens_to_ids(getattr(tokenizer, name))

    ends = {id_of("image_token"): (id_of("boi_token"), id_of("eoi_token")),
            id_of("audio_token"): (id_of("boa_token"), id_of("eoa_token"))}  # fmt: skip
    out, at = [], 0
    for token, label in zip(ids, labels, strict=True):
        if token in ends:
            start, end = ends[token]
            if at >= len(expanded) or expanded[at] != start or end not in expanded[at:]:
                break
            stop = expanded.index(end, at) + 1
            out += [IGNORE] * (stop - at)
            at = stop
        elif at < len(expanded) and expanded[at] == token:
            out.append(label)
            at += 1
        else:
            break
    if len(out) != len(expanded):
        raise RecordError("the processor's expansion of its pictures and clips does not follow the text's tokens "
                          f"(at token {at}): the tokenizer must be the model processor's own")  # fmt: skip
    return out


def prepare_media_record(record: dict, refs: list[MediaRef], contents: list, tokenizer, processor,
                         prompt_loss: bool) -> MediaRecord:  # fmt: skip
    """The record's tokens, labels and towers' arrays; `contents` are its files' (MediaCheck.contents), in `refs`'
    order."""
    import numpy as np

    rendered = render_chat(media_turns(record), tokenizer)
    ids, labels = tokenize(rendered, tokenizer, prompt_loss)
    images = [c for r, c in zip(refs, contents, strict=True) if r.kind == "image"]
    clips = [c for r, c in zip(refs, contents, strict=True) if r.kind == "audio"]
    out = processor(text=[rendered.text], images=[images] if images else None, audio=clips or None,
                    add_special_tokens=False, return_tensors="np")  # fmt: skip
    expanded = out["input_ids"][0].tolist()
    labels = expanded_labels(ids, labels, expanded, tokenizer)
    pixels = patches = np.zeros((0, 0, 0), dtype=np.uint8)
    if images:
        floats = out["pixel_values"]
        pixels = np.rint(floats * 255).clip(0, 255).astype(np.uint8)
        if not np.array_equal(pixel_values(pixels), floats):
            raise RecordError("the image processor's pixel values are not bytes / 255 (it normalizes, or rescales "
                              "otherwise): this version keeps Gemma 4's own image processor's only")  # fmt: skip
        patches = out["image_position_ids"].astype(np.int32)
    alone = [processor.feature_extractor([clip], return_tensors="np") for clip in clips]
    bins = processor.feature_extractor.feature_size
    features = np.concatenate([a["input_features"][0] for a in alone]) if alone else np.zeros((0, bins), np.float32)
    frame_mask = np.concatenate([a["input_features_mask"][0] for a in alone]) if alone else np.zeros(0, bool)
    return MediaRecord(expanded, labels, pixels, patches, features.astype(np.float32), frame_mask.astype(bool),
                       [a["input_features"].shape[1] for a in alone],
                       expanded.count(processor.image_token_id), expanded.count(processor.audio_token_id),
                       media_end(expanded, tokenizer), [r.ref for r in refs])  # fmt: skip


def media_end(expanded: list[int], tokenizer) -> int:
    ends = {tokenizer.convert_tokens_to_ids(getattr(tokenizer, name)) for name in ("eoi_token", "eoa_token")}
    return max((i + 1 for i, t in enumerate(expanded) if t in ends), default=0)
