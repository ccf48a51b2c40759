"""A media split's pictures and sound in the prepared data (issue 46): written a chunk at a time by the preparation
(jobs/data/prepare.py), read back by record for a row (prepared.PreparedRows), and joined into a batch.

Per chunk, record after record: each record's count of pictures (`images`) and clips (`clips`), the pictures' bytes
(`pixels`, media_records.pixel_values restores the processor's floats) and patch positions (`patches`), each clip's
frame count (`clip_frames`), and the clips' log-mel frames and masks end to end (`features`, `frame_mask`); and each
record's files as it names them (`files.json`, for the samples). The split's `media.json` is its media report, whose
longest clip every clip of a batch is padded to.
"""

from __future__ import annotations

import json
import os
from functools import cache

from config.modality import modality_of
from runtime.outcome import JobInputError


@cache
def media_processor_of(model: str):
    """The model's processor (its image processor and audio feature extractor), loaded when a record needs it;
    raises JobInputError for a model without one (a text-only checkpoint)."""
    from data.media_processor import load_media_processor
    from runtime.storage import model_directory

    try:
        return load_media_processor(model_directory(model))
    except OSError as err:
        raise JobInputError(f"records hold pictures or sound, but --model {model} has no processor to read them "
                            f"({str(err).splitlines()[0][:160]}): use a Gemma 4 checkpoint with its processor "
                            "(preprocessor_config.json), such as google/gemma-4-E2B-it") from None  # fmt: skip


def media_arrays(media: list) -> dict:
    """A chunk's pictures and sound, record after record (prepared.PreparedRows reads them back): per record its
    pictures and clips, per clip its frames, and their arrays end to end."""
    import numpy as np

    held = [m for m in media if m is not None]
    shape = next((m.pixels.shape[1:] for m in held if len(m.pixels)), (0, 0))
    bins = held[0].features.shape[1]
    return {
        "images": np.array([len(m.pixels) if m else 0 for m in media], dtype=np.int32),
        "pixels": np.concatenate([m.pixels for m in held if len(m.pixels)] or [np.zeros((0, *shape), np.uint8)]),
        "patches": np.concatenate(
            [m.patches for m in held if len(m.patches)] or [np.zeros((0, shape[0], 2), np.int32)]
        ),  # fmt: skip
        "clips": np.array([len(m.clip_frames) if m else 0 for m in media], dtype=np.int32),
        "clip_frames": np.array([n for m in held for n in m.clip_frames], dtype=np.int32),
        "features": np.concatenate([m.features for m in held] or [np.zeros((0, bins), np.float32)]),
        "frame_mask": np.concatenate([m.frame_mask for m in held]).astype(np.uint8),
    }


def media_report(results: list[dict]) -> dict:
    """The split's pictures and sound: records holding any, their count, their soft tokens (in the sequence length),
    and the longest clip in feature frames (every clip of a batch is padded to it)."""
    total = {k: sum(r[k] for r in results) for k in ("media", "images", "clips", "image_tokens", "audio_tokens")}
    return {"records": total.pop("media"), **total,
            "longest_clip_frames": max(r["longest_clip_frames"] for r in results)}  # fmt: skip


BLANK = "blank_"  # a row's blank pictures and clips, which join_media puts after every real one


class RecordMedia:
    """A media split's pictures and sound by record (prepare.media_arrays' files): what the towers read for a row,
    every clip padded to the split's longest (media.json), so that a clip's tensor has one shape all run; and, for a
    training row, blank pictures and clips up to the most a row of the split holds, so that every batch of the run
    feeds the towers one shape (TorchTPU compiles a step once a shape: minutes on a slice).

    A blank picture is zeros with every patch position (-1, -1), padding: the vision tower runs on it beside the
    real ones (each picture attends to its own patches) and its one pooled row, which Gemma 4's pooler always
    keeps (its clamped positions), is dropped before the soft tokens are placed (training/model.py,
    image_encodings). A blank clip is silent frames all masked: the audio tower's own mask drops its outputs. Neither
    changes a loss or a gradient (tests/test_media_shapes.py)."""

    def __init__(self, folder: str, chunks: int, chunk_of, index_in_chunk):
        import numpy as np

        self.longest = json.loads(open(os.path.join(folder, "media.json")).read())["longest_clip_frames"]
        self.picture_shape, self.bins = None, None
        self.chunk_of, self.index_in_chunk, self.chunks = chunk_of, index_in_chunk, []
        for i in range(chunks):
            path = os.path.join(folder, f"{i:05d}.%s.npy")
            if not os.path.exists(path % "images"):
                self.chunks.append(None)  # a chunk of text records only
                continue
            arrays = {name: np.load(path % name, mmap_mode="r") for name in
                      ("images", "pixels", "patches", "clips", "clip_frames", "features", "frame_mask")}  # fmt: skip
            arrays["files"] = json.loads(open(os.path.join(folder, f"{i:05d}.files.json")).read())
            first_clip = np.concatenate([[0], np.cumsum(arrays["clips"])])
            arrays["first_image"] = np.concatenate([[0], np.cumsum(arrays["images"])])
            arrays["first_clip"] = first_clip
            arrays["first_frame"] = np.concatenate([[0], np.cumsum(arrays["clip_frames"])])
            self.chunks.append(arrays)
            if len(arrays["pixels"]):
                self.picture_shape = arrays["pixels"].shape[1:]
            self.bins = arrays["features"].shape[1]

    def blanks(self, images: int, clips: int) -> dict:
        """Blank pictures and clips (the class docstring), under BLANK's names; {} for none."""
        import torch

        out = {}
        if images and self.picture_shape is not None:
            patches, values = self.picture_shape
            out[f"{BLANK}pixel_values"] = torch.zeros((images, patches, values), dtype=torch.float32)
            out[f"{BLANK}image_position_ids"] = torch.full((images, patches, 2), -1, dtype=torch.int64)
        if clips:
            out[f"{BLANK}input_features"] = torch.zeros((clips, self.longest, self.bins), dtype=torch.float32)
            out[f"{BLANK}input_features_mask"] = torch.zeros((clips, self.longest), dtype=torch.bool)
        return out

    def counts(self) -> tuple:
        """Each record's pictures and clips (two int arrays by record index)."""
        import numpy as np

        per_chunk = [(a["images"], a["clips"]) if a is not None else (np.zeros(n, np.int32),) * 2
                     for a, n in zip(self.chunks, np.bincount(self.chunk_of, minlength=len(self.chunks)), strict=True)]  # fmt: skip
        return tuple(np.concatenate([c[k] for c in per_chunk]) if per_chunk else np.zeros(0, np.int32) for k in (0, 1))

    def most_a_row(self, rows, offsets) -> tuple[int, int]:
        """The most pictures and clips a row holds (rows: record indices row after row, cut at offsets)."""
        import numpy as np

        most = []
        for per_record in self.counts():
            sums = np.add.reduceat(per_record[np.asarray(rows)], offsets[:-1]) if len(rows) else np.zeros(1)
            most.append(int(sums.max(initial=0)))
        return most[0], most[1]

    def of(self, records: list[int], fixed: tuple[int, int] | None = None) -> dict:
        """The towers' inputs for these records, in order: pixel_values, image_position_ids, input_features,
        input_features_mask (transformers' names); a record without pictures or clips adds none. `fixed` (a training
        row's: the most pictures and clips a row of the split holds): blanks up to those counts."""
        import numpy as np
        import torch

        from data.media_records import pixel_values

        pixels, patches, features, masks = [], [], [], []
        for record in records:
            a = self.chunks[self.chunk_of[record]]
            if a is None:
                continue
            i = self.index_in_chunk[record]
            images = slice(a["first_image"][i], a["first_image"][i + 1])
            pixels.append(pixel_values(np.asarray(a["pixels"][images])))
            patches.append(np.asarray(a["patches"][images], dtype=np.int64))
            for clip in range(a["first_clip"][i], a["first_clip"][i + 1]):
                frames = slice(a["first_frame"][clip], a["first_frame"][clip + 1])
                feature = np.zeros((self.longest, a["features"].shape[1]), dtype=np.float32)
                mask = np.zeros(self.longest, dtype=bool)
                n = frames.stop - frames.start
                feature[:n], mask[:n] = a["features"][frames], a["frame_mask"][frames].astype(bool)
                features.append(feature[None])
                masks.append(mask[None])
        out = {}
        if pixels and sum(len(p) for p in pixels):
            out["pixel_values"] = torch.from_numpy(np.concatenate(pixels))
            out["image_position_ids"] = torch.from_numpy(np.concatenate(patches))
        if features:
            out["input_features"] = torch.from_numpy(np.concatenate(features))
            out["input_features_mask"] = torch.from_numpy(np.concatenate(masks))
        if fixed:
            out |= self.blanks(fixed[0] - sum(len(p) for p in pixels), fixed[1] - len(features))
        return out

    def files(self, record: int) -> list[str]:
        """The record's pictures and clips as it names them."""
        a = self.chunks[self.chunk_of[record]]
        return [] if a is None else a["files"][self.index_in_chunk[record]]


def join_media(media: list[dict]) -> dict:
    """Several rows' towers' inputs as one batch's, in row order (the model fills the soft tokens in that order),
    every row's blanks after every real picture and clip (so a blank's pooled row is past the real ones')."""
    import torch

    names = {k.removeprefix(BLANK) for m in media for k in m}
    return {k: torch.cat([m[k] for m in media if k in m] + [m[BLANK + k] for m in media if BLANK + k in m])
            for k in sorted(names)}  # fmt: skip


def collate_media(rows: list) -> tuple:
    """A batch of a media split's rows: the four tensors stacked, the towers' inputs joined in row order (the model
    fills the soft tokens in that order); a row without a fifth element (the eval's filler) holds none."""
    import torch

    batch = tuple(torch.stack([row[i] for row in rows]) for i in range(4))
    return (*batch, join_media([row[4] for row in rows if len(row) > 4]))


def split_modality(report: dict) -> str:
    """What a prepared data report's records hold, training and held-out (config.modality.modality_of)."""
    media = [(report.get(s) or {}).get("media", {}) for s in ("train", "eval")]
    return modality_of(sum(m.get("images", 0) for m in media), sum(m.get("clips", 0) for m in media))
