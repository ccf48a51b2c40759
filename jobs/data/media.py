"""Pictures and sound in chat records (issue 46): which files a record names, and each one opened once on the head,
before any worker starts, so that every broken one is named by file and row with the fix, beside the text checks.

A turn's content may be a list of parts, as Gemma 4's processor's chat template takes them:
`{"type": "text", "text": ...}`, `{"type": "image", "image": PATH}` and `{"type": "audio", "audio": PATH}` (`path`
or `url` also name the file). TRL's vision format is taken too: an `images` column beside `{"type": "image"}`
parts without a file, the column's entries in order (and, alike, an `audios` column for `{"type": "audio"}` parts);
an entry is a PATH or a dataset's own Image or Audio feature (a hub dataset's, or a parquet file's that `datasets`
wrote), read undecoded (sft_data.undecoded) and decoded here. A PATH is a local path (relative to the data file's folder),
a gs:// URI, an http(s) address (transformers' documented `url` form) or a `data:` URL. OpenAI's
`{"type": "image_url", "image_url": {"url": ...}}` is a picture, as transformers' processor reads it
(processing_utils.py `_normalize_conversations`). A dataset's entry with a path and no bytes is that file.

A picture is what inference sees: the file's EXIF orientation applied, then transformers' `convert_to_rgb`
(image_transforms.py: transparency laid on white), as vLLM 0.29 loads one to serve it (vllm/multimodal/image.py:
`normalize_image`, then `convert_image_mode`'s white background). transformers itself has two paths that disagree:
a PIL image handed to the image processor keeps its orientation (no EXIF) and is laid on white; a path or URL goes
through `image_utils.load_image`, which applies the EXIF orientation but then drops the alpha channel with
`convert("RGB")`, keeping the colours under it. The job takes the path that serves. A picture of more than 8 bits a
channel (PIL modes I;16, I, F: 16-bit greyscale PNGs, float TIFFs) comes out near-white on every path (the
conversion to RGB clips it), so it is refused with the fix; so is one PIL will not open for its size
(DecompressionBombError, above 2 x PIL.Image.MAX_IMAGE_PIXELS, vLLM's VLLM_MAX_IMAGE_PIXELS too).

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
from runtime.log_lines import one_line

MEDIA = ("image", "audio")
PART_KINDS = {"image": "image", "audio": "audio", "image_url": "image"}  # a part's type: what it holds (OpenAI's too)
FILE_KEYS = ("image", "audio", "path", "url")  # where a part names its file, first found
ADDRESSES = ("gs://", "http://", "https://", "data:")  # refs taken as written, not from the data file's folder
DEEP_MODES = {"I;16": "16-bit", "I;16B": "16-bit", "I;16L": "16-bit", "I;16N": "16-bit", "I": "32-bit", "F": "32-bit"}
FETCH_TIMEOUT_S = 30
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
    if part.get("type") == "image_url":  # OpenAI's: {"image_url": {"url": ...}} or {"image_url": "..."}
        inner = part.get("image_url")
        named = inner.get("url") if isinstance(inner, dict) else inner
        if not (isinstance(named, str) and named.strip()):
            raise RecordError(f"{where} names no file: give its image_url a url")
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
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and entry["path"].strip():
            return entry["path"], None  # such an entry by path alone: that file
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
            kind = PART_KINDS.get(part.get("type")) if isinstance(part, dict) else None
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
        return f"<{PART_KINDS.get(kind, kind) or 'part'}>"

    turns = [turn | {"content": " ".join(map(text, turn["content"])).strip()}
             if isinstance(turn, dict) and isinstance(turn.get("content"), list) else turn
             for turn in record["messages"]]  # fmt: skip
    return record | {"messages": turns}


class FetchError(OSError):
    """An http(s) address that gave no file; its message is the record's."""


def _fetch(url: str) -> bytes:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"User-Agent": "gemma4-finetune-data-check"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as answer:
            return answer.read()
    except urllib.error.HTTPError as err:
        raise FetchError(f"cannot be fetched (HTTP {err.code} {err.reason}); fix the address, or copy the file "
                         "beside the data and name it by its path") from None  # fmt: skip
    except (urllib.error.URLError, TimeoutError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise FetchError(f"cannot be fetched ({reason}); the address must answer from where the job runs (the "
                         "cluster's pods), or copy the file beside the data") from None  # fmt: skip


def _read(path: str) -> bytes:
    if path.startswith("gs://"):
        from runtime.storage import gcs

        with gcs().open(path, "rb") as f:
            return f.read()
    if path.startswith(("http://", "https://")):
        return _fetch(path)
    if path.startswith("data:"):
        import base64
        import binascii

        try:
            return base64.b64decode(path.split(",", 1)[1], validate=True)
        except (IndexError, binascii.Error):
            raise FetchError("is a data: URL without base64 content after its comma; write it as "
                             "data:image/png;base64,...") from None  # fmt: skip
    with open(path, "rb") as f:
        return f.read()


def open_image(data: bytes) -> ImageFacts:
    """The image decoded whole; raises MediaError for one that cannot be, or that every path reads wrong."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            mode, size = image.mode, image.size
    except Image.DecompressionBombError as err:
        raise MediaError(f"is too large to open ({err}); neither PIL nor vLLM opens it: shrink it first (the "
                         "processor resizes every picture to its soft-token budget): convert IN -resize "
                         "4096x4096 OUT.png") from None  # fmt: skip
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise MediaError(f"cannot be decoded as an image ({err}); export it again as PNG or JPEG") from None
    if mode in DEEP_MODES:
        raise MediaError(f"is a {DEEP_MODES[mode]} picture (PIL mode {mode}), which transformers' and vLLM's "
                         "conversion to RGB clips to near-white: save it with 8 bits a channel "
                         "(convert IN -depth 8 OUT.png)")  # fmt: skip
    return ImageFacts(*size)


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
    """A (checked) image file as the RGB PIL image inference sees (module docstring): upright by its EXIF
    orientation, transparency laid on white by transformers' own convert_to_rgb."""
    import contextlib

    from PIL import Image, ImageOps
    from transformers.image_transforms import convert_to_rgb

    with Image.open(io.BytesIO(data)) as image:
        upright = image
        with contextlib.suppress(Exception):  # as vLLM's normalize_image: a broken EXIF block leaves it as it is
            upright = ImageOps.exif_transpose(image)
        return Image.fromarray(convert_to_rgb(upright, return_numpy=True), "RGB")


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
                found.append(f"{ref.where} {one_line(ref.ref, 80)!r} {self.seen[key]}")  # (a data: URL cut)
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
        except FetchError as err:
            return str(err)
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
    """A record's file as a path or URI: absolute ones and addresses (gs://, http(s), data:) as written, others from
    the data file's folder."""
    if ref.startswith(ADDRESSES) or os.path.isabs(ref):
        return ref
    if data_file.startswith("gs://"):
        return f"{data_file.rsplit('/', 1)[0]}/{ref}"
    return os.path.join(os.path.dirname(os.path.abspath(data_file)), ref)


def data_file(source, row: int) -> str:
    """The data file the split's 0-based row is in (a sft_data.Source's); "" for a hub dataset's row."""
    number, _ = source.position(row)
    return source.files[number].name if number < len(source.files) else ""
