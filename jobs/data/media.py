"""Pictures and sound in chat records (issue 46): which files a record names, and each one opened once on the head,
before any worker starts, so that every broken one is named by file and row with the fix, beside the text checks.

A turn's content may be a list of parts, as Gemma 4's processor's chat template takes them:
`{"type": "text", "text": ...}`, `{"type": "image", "image": PATH}` and `{"type": "audio", "audio": PATH}` (`path`
or `url` also name the file). TRL's vision format is taken too: an `images` column beside `{"type": "image"}`
parts without a file, the column's entries in order (and, alike, an `audios` column for `{"type": "audio"}` parts);
an entry is a PATH or a dataset's own Image or Audio feature (a hub dataset's, or a parquet file's that `datasets`
wrote), read undecoded (sft_data.undecoded) and decoded here. A PATH is a local path (relative to the data file's folder)
or a gs:// URI.

What is checked, from the pinned transformers 5.23 (models/gemma4/feature_extraction_gemma4.py): the audio feature
extractor reads 16 kHz samples and does not resample, so another rate would be heard at the wrong speed; it cuts
every clip at 480,000 samples (30 s) without a word, so a longer one would be trained on in part. An image is
decoded whole (a truncated file fails only there); its size is free, as the image processor resizes every image to
its soft-token budget.
"""

from __future__ import annotations

import io
import os
import wave
from dataclasses import dataclass

from data.render import RecordError

MEDIA = ("image", "audio")
FILE_KEYS = ("image", "audio", "path", "url")  # where a part names its file, first found
SAMPLE_RATE = 16_000  # Gemma4AudioFeatureExtractor's sampling_rate
LONGEST_CLIP_S = 30.0  # its max_length, 480,000 samples, at that rate
SILENT_PEAK = 1e-4  # of full scale: a clip no louder than this holds nothing to hear
RESAMPLE = "ffmpeg -i CLIP -ac 1 -ar 16000 OUT.wav"


@dataclass(frozen=True)
class MediaRef:
    kind: str  # "image" or "audio"
    ref: str  # as the record writes it (a dataset's own Image or Audio entry: its path, or its column and index)
    where: str  # "turn 2's image 1"
    data: bytes | None = None  # a dataset's own entry's bytes (no file to read)


@dataclass(frozen=True)
class ImageFacts:
    width: int
    height: int


@dataclass(frozen=True)
class ClipFacts:
    sample_rate: int
    channels: int
    seconds: float
    peak: float  # of full scale


class MediaError(ValueError):
    """What is wrong with one file, and the fix."""


COLUMNS = {"image": "images", "audio": "audios"}  # the columns of files for bare parts, in order


def _entry(part: dict, kind: str, columns: dict, used: dict, where: str) -> tuple[str, bytes | None]:
    """(the ref, the bytes of a dataset's own entry or None) of a part."""
    named = next((part[k] for k in FILE_KEYS if isinstance(part.get(k), str) and part[k].strip()), None)
    if named is not None:
        return named, None
    column, entries = COLUMNS[kind], columns[kind]
    if used[kind] < len(entries):  # TRL's format: the column's entries, in order
        used[kind] += 1
        index, entry = used[kind] - 1, entries[used[kind] - 1]
        if isinstance(entry, str) and entry.strip():
            return entry, None
        if isinstance(entry, dict) and entry.get("bytes"):  # a datasets Image or Audio feature, undecoded
            return entry.get("path") or f"{column}[{index}]", entry["bytes"]
        raise RecordError(f"{where}: {column}[{index}] is {type(entry).__name__}; it must be a path, a gs:// URI or a "
                          f"datasets {kind.title()} feature")  # fmt: skip
    raise RecordError(f"{where} names no file: give it an {kind!r} (or 'path') key, or list it in the {column} column")


def media_refs(record: dict) -> list[MediaRef]:
    """Every image and clip the record's turns hold, in order; raises RecordError for a part that names none, or an
    `images` (`audios`) column whose length is not the number of image (audio) parts without a file."""
    columns = {kind: record.get(column) or [] for kind, column in COLUMNS.items()}
    turns, used, refs = record.get("messages") or [], dict.fromkeys(MEDIA, 0), []
    for t, turn in enumerate(turns if isinstance(turns, list) else [], 1):
        parts = turn.get("content") if isinstance(turn, dict) else None
        if not isinstance(parts, list):
            continue
        counts = dict.fromkeys(MEDIA, 0)
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA:
                counts[kind] += 1
                where = f"turn {t}'s {kind} {counts[kind]}"
                ref, data = _entry(part, kind, columns, used, where)
                refs.append(MediaRef(kind, ref, where, data))
    for kind, column in COLUMNS.items():
        if used[kind] != len(columns[kind]):
            raise RecordError(f"the {column} column holds {len(columns[kind])} entries for {used[kind]} {kind} parts "
                              f"without a file; give each {kind} part one")  # fmt: skip
    return refs


def undecoded_rows(data, start: int, stop: int) -> dict:
    """Rows [start, stop) of a datasets.Dataset as columns of Python values; its Image and Audio features (a column's
    own, or in a list) as stored, {"bytes", "path"}, undecoded (decoding audio would need soundfile or torchcodec;
    this module decodes both). A dataset without such features is sliced as it always was."""
    from datasets import Audio, Image

    media = (Image, Audio)
    if not any(isinstance(f, media) or isinstance(getattr(f, "feature", None), media) for f in data.features.values()):
        return data[start:stop]
    return data.with_format("arrow")[start:stop].to_pydict()


def text_view(record: dict) -> dict:
    """The record with each turn's list of parts as text (a picture or clip as its kind), for the text checks."""

    def text(part) -> str:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            return part.get("text") or ""
        return f"<{kind or 'part'}>"

    turns = [turn | {"content": " ".join(map(text, turn["content"])).strip()}
             if isinstance(turn, dict) and isinstance(turn.get("content"), list) else turn
             for turn in record["messages"]]  # fmt: skip
    return record | {"messages": turns}


def _read(path: str) -> bytes:
    if path.startswith("gs://"):
        from runtime.storage import gcs

        with gcs().open(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def open_image(data: bytes) -> ImageFacts:
    """The image decoded whole; raises MediaError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return ImageFacts(*image.size)
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise MediaError(f"cannot be decoded as an image ({err}); export it again as PNG or JPEG") from None


def _samples(frames: bytes, width: int):
    """PCM frames as signed integers (int64), whatever their width."""
    import numpy as np

    if width == 3:  # 24-bit: widen each sample to 4 bytes, sign from the top byte
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3)
        samples = raw[:, 0].astype(np.int32) | raw[:, 1].astype(np.int32) << 8 | raw[:, 2].astype(np.int32) << 16
        samples = np.where(samples >= 1 << 23, samples - (1 << 24), samples)
    else:
        samples = np.frombuffer(frames, dtype={1: np.uint8, 2: np.int16, 4: np.int32}[width]).astype(np.int64)
        if width == 1:
            samples = samples - 128  # 8-bit WAV is unsigned
    return samples


def clip_samples(data: bytes):
    """A (checked) mono WAV file's samples as float32 in [-1, 1]: what the audio feature extractor reads."""
    import numpy as np

    with wave.open(io.BytesIO(data)) as clip:
        width, frames = clip.getsampwidth(), clip.readframes(clip.getnframes())
    return (_samples(frames, width) / float(1 << (8 * width - 1))).astype(np.float32)


def picture(data: bytes):
    """A (checked) image file as an RGB PIL image: what the image processor reads."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def _peak(frames: bytes, width: int) -> float:
    import numpy as np

    samples = _samples(frames, width)
    full_scale = float(1 << (8 * width - 1))
    return float(np.abs(samples).max()) / full_scale if samples.size else 0.0


def open_clip(data: bytes) -> ClipFacts:
    """The clip's rate, channels, length and peak, every sample read; raises MediaError for one the audio tower
    cannot hear as it is."""
    try:
        with wave.open(io.BytesIO(data)) as clip:
            rate, channels, width, count = (clip.getframerate(), clip.getnchannels(), clip.getsampwidth(),
                                            clip.getnframes())  # fmt: skip
            frames = clip.readframes(count)
    except (wave.Error, EOFError) as err:
        raise MediaError(f"cannot be read as a PCM WAV file ({err}); convert it: {RESAMPLE}") from None
    if width not in (1, 2, 3, 4):
        raise MediaError(f"has {8 * width}-bit samples; convert it to 16-bit PCM: {RESAMPLE}")
    facts = ClipFacts(rate, channels, count / rate if rate else 0.0, _peak(frames, width))
    if count == 0:
        raise MediaError("holds no samples; record it again or drop the part")
    if rate != SAMPLE_RATE:
        raise MediaError(f"is sampled at {rate} Hz; Gemma 4's feature extractor reads {SAMPLE_RATE} Hz and does "
                         f"not resample: {RESAMPLE}")  # fmt: skip
    if channels != 1:
        raise MediaError(f"has {channels} channels; Gemma 4's audio tower hears one: {RESAMPLE}")
    if facts.seconds > LONGEST_CLIP_S:
        raise MediaError(f"is {facts.seconds:.1f} s long; Gemma 4 hears the first {LONGEST_CLIP_S:.0f} s and "
                         "drops the rest: cut it, or split the record")  # fmt: skip
    if facts.peak <= SILENT_PEAK:
        raise MediaError(f"is silent (peak {facts.peak:.1e} of full scale); record it again or drop the part")
    return facts


class MediaCheck:
    """Opens each file once, however many records name it: its facts, or its MediaError's message; the last
    KEPT files' contents too (a picture as RGB, a clip as float samples), for the record being prepared."""

    KEPT = 64

    def __init__(self):
        self.seen: dict[tuple[str, str], ImageFacts | ClipFacts | str] = {}
        self.kept: dict[tuple[str, str], object] = {}

    def problems(self, refs: list[MediaRef], data_file: str) -> list[str]:
        """One message a broken file, `WHERE 'REF': what is wrong; the fix`; relative paths are from `data_file`'s
        folder."""
        found = []
        for ref in refs:
            key = self.key(ref, data_file)
            if key not in self.seen:
                self.seen[key] = self._open(ref.kind, key[1], ref.data)
            if isinstance(self.seen[key], str):
                found.append(f"{ref.where} {ref.ref!r} {self.seen[key]}")
        return found

    def contents(self, refs: list[MediaRef], data_file: str) -> list:
        """The checked files' contents, in the record's order (read again only if it fell out of the kept ones)."""
        out = []
        for ref in refs:
            key = self.key(ref, data_file)
            if key not in self.kept:
                self._open(*key, ref.data)
            out.append(self.kept[key])
        return out

    @staticmethod
    def key(ref: MediaRef, data_file: str) -> tuple[str, str]:
        """(kind, where its bytes are): a file's path, or a dataset entry's content digest."""
        if ref.data is not None:
            import hashlib

            return ref.kind, "sha256:" + hashlib.sha256(ref.data).hexdigest()
        return ref.kind, located(ref.ref, data_file)

    def _open(self, kind: str, path: str, data: bytes | None = None) -> ImageFacts | ClipFacts | str:
        try:
            data = _read(path) if data is None else data
        except FileNotFoundError:
            return f"is not there ({path}); fix the path (a relative one is from the data file's folder)"
        except OSError as err:
            return f"cannot be read ({err})"
        try:
            facts = open_image(data) if kind == "image" else open_clip(data)
        except MediaError as err:
            return str(err)
        if len(self.kept) >= self.KEPT:
            del self.kept[next(iter(self.kept))]
        self.kept[(kind, path)] = picture(data) if kind == "image" else clip_samples(data)
        return facts


def located(ref: str, data_file: str) -> str:
    """A record's file as a path or URI: absolute and gs:// ones as written, others from the data file's folder."""
    if ref.startswith("gs://") or os.path.isabs(ref):
        return ref
    if data_file.startswith("gs://"):
        return f"{data_file.rsplit('/', 1)[0]}/{ref}"
    return os.path.join(os.path.dirname(os.path.abspath(data_file)), ref)


def data_file(source, row: int) -> str:
    """The data file the split's 0-based row is in (a sft_data.Source's); "" for a hub dataset's row."""
    number, _ = source.position(row)
    return source.files[number].name if number < len(source.files) else ""
