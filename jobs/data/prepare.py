"""Preparing the training data once: read, checked, rendered, tokenized and laid out in rows, then stored
under <storage>/prepared/<key>/ for every run, resume and restart with the same inputs (jobs/data/prepared.py
reads it back).

- **Once.** The key hashes everything that shapes the rows: the data's content (file bytes, or a
  gs:// object's checksum and generation, or the hub dataset's fingerprint), the tokenizer and its
  chat template, the recipe keys that change rendering or packing, --seq-len, --overlong and
  --seed. The driver (or --preflight, on the head before the slice is asked for) prepares; a
  second run with the same inputs finds `DONE` and renders nothing.
- **In parallel.** The records are cut into chunks (--prepare-chunk); with more than one chunk's
  work, Ray Data maps them onto every CPU of the driver's node (one task per chunk, each writing its
  own files), or, with no CPU there (a head with num-cpus 0) or no Ray cluster, the driver runs them
  itself. Megatron-LM's indexed dataset is the
  model: per chunk, the tokens (int32) and which of them are trained (uint8), and each record's
  length (int32); for the split, the rows as lists of records.
- **Bounded memory.** No process holds every record's tokens: a task holds one chunk, the driver
  only the lengths.
- **Every bad record found**, the first MAX_ERRORS of them in file order, each named by file and
  line, before anything is written.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from data.labels import IGNORE
from data.media import MediaCheck, data_file, media_refs, text_view, undecoded_rows
from data.media_records import prepare_media_record
from data.media_rows import media_arrays, media_processor_of, media_report, split_modality
from data.prepared import SPLITS, Prepared
from data.prepared_key import data_key
from data.render import (
    RecordError,
    conversation,
    detect_format,
    load_tokenizer,
    render,
    require_chat_template,
    tokenize,
)
from data.sft_data import MAX_ERRORS, FileRecords, Source, bad_lines_message, load_splits, pack_rows
from runtime.outcome import JobInputError
from runtime.storage import filesystem

PREPARED_DIR = "prepared"


# ---- what a chunk is and does -----------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    split: str  # train or eval
    index: int  # its number within the split: files and record order follow it
    source: str  # the loaded split it reads (datasets' name: train, test, ...)
    start: int
    stop: int


@dataclass(frozen=True)
class SourceFiles:
    """What a task needs to reopen a loaded split without loading it again: datasets' Arrow cache files
    (memory-mapped), the column renames, and which file each record came from (for error messages)."""

    ref: str
    cache_files: tuple[str, ...]
    files: tuple[FileRecords, ...]
    renames: tuple[tuple[str, str], ...]


def _reopen(source: SourceFiles) -> Source:
    """Not cached: a task unmaps the files once its chunk is done, so its resident memory does not grow with
    the pages of every chunk it read."""
    from datasets import Dataset, concatenate_datasets

    parts = [Dataset.from_file(f) for f in source.cache_files]
    data = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    return Source(source.ref, data.rename_columns(dict(source.renames)), list(source.files))


_tokenizer = cache(load_tokenizer)  # one per task process


@dataclass
class ChunkStats:
    read: int = 0
    used: int = 0
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    predicted: int = 0
    longest: tuple[int, str] = (0, "")
    formats: set[str] = field(default_factory=set)
    media: int = 0  # records used that hold pictures or sound
    images: int = 0
    clips: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0
    longest_clip_frames: int = 0
    unreadable_by_model: str = ""  # why the run cannot read the chunk's pictures or sound, if it cannot
    errors: list[tuple[tuple[int, int], str]] = field(default_factory=list)  # ((file, line), message), first MAX_ERRORS


def render_chunk(chunk: Chunk, source: Source, tokenizer, settings) -> tuple[list, list, ChunkStats, list]:
    """The chunk's records as (token ids, trained flags) each, truncated or dropped at --seq-len, and each used
    record's pictures and sound (a media_records.MediaRecord, or None for a text record)."""
    stats, ids_out, trained_out, media_out = ChunkStats(), [], [], []
    fmt = detect_format(source.data.column_names)
    stats.formats.add(fmt)
    columns = undecoded_rows(source.data, chunk.start, chunk.stop)  # one Arrow slice, not a lookup per record
    records = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    media = MediaCheck()
    for row, record in enumerate(records, chunk.start):
        held = None
        try:
            if refs := media_refs(record) if fmt == "messages" else []:
                if (held := media_record(record, refs, data_file(source, row), media, tokenizer, settings,
                                         stats)) is None:  # fmt: skip
                    continue
                ids, labels = held.ids, held.labels
            else:
                turns = conversation(record, fmt)
                ids, labels = tokenize(render(turns, tokenizer, settings.chat_template), tokenizer,
                                       settings.prompt_loss)  # fmt: skip
        except RecordError as err:
            if len(stats.errors) < MAX_ERRORS:
                stats.errors.append((source.position(row), f"{source.where(row)}: {err}"))
            continue
        stats.read += 1
        if len(ids) > stats.longest[0]:
            stats.longest = (len(ids), source.where(row))
        if len(ids) > settings.seq_len:
            # a record's pictures and sound are never cut: one whose soft tokens do not all fit is dropped
            if settings.overlong == "drop" or (held and held.media_end > settings.seq_len):
                stats.dropped += 1
                continue
            stats.truncated += 1
            ids, labels = ids[: settings.seq_len], labels[: settings.seq_len]
        ids_out.append(ids)
        trained_out.append([label != IGNORE for label in labels])
        media_out.append(held)
        stats.used += 1
        stats.tokens += len(ids)
        stats.predicted += sum(trained_out[-1][1:])
        if held:
            stats.media += 1
            stats.images, stats.clips = stats.images + len(held.pixels), stats.clips + len(held.clip_frames)
            stats.image_tokens += held.image_tokens
            stats.audio_tokens += held.audio_tokens
            stats.longest_clip_frames = max([stats.longest_clip_frames, *held.clip_frames])
    return ids_out, trained_out, stats, media_out


def media_record(record: dict, refs: list, file: str, media: MediaCheck, tokenizer, settings, stats: ChunkStats):
    """A record with pictures or sound, checked (raises RecordError naming its broken files) and prepared; None when
    the run cannot read pictures or sound at all (stats.unreadable_by_model says why, once, after the records'
    own errors). Relative paths are from `file`, the data file's."""
    conversation(text_view(record), "messages")  # the turns' roles, an assistant turn
    if problems := media.problems(refs, file):
        raise RecordError("; ".join(problems))
    if stats.unreadable_by_model:
        return None
    try:
        processor = media_processor_of(settings.model)
        if not settings.chat_template:
            raise JobInputError("records hold pictures or sound, which only the chat template renders: drop "
                                "--no-chat-template (the walkthrough recipe's text has no place for them)")  # fmt: skip
    except JobInputError as err:
        stats.unreadable_by_model = str(err)
        return None
    return prepare_media_record(record, refs, media.contents(refs, file), tokenizer, processor,
                                settings.prompt_loss)  # fmt: skip


def _npy(array) -> bytes:
    import numpy as np

    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def run_chunk(chunk: Chunk, source: SourceFiles, settings, target: str) -> dict:
    """One task: render the chunk and write its three arrays under `target` (a URI); returns its stats."""
    import numpy as np

    ids, trained, stats, media = render_chunk(chunk, _reopen(source), _tokenizer(settings.tokenizer_ref), settings)
    if not stats.errors:
        fs, base = filesystem(target)
        directory = f"{base}/{chunk.split}"
        fs.create_dir(directory, recursive=True)
        arrays = {
            "tokens": np.fromiter((t for r in ids for t in r), dtype=np.int32, count=stats.tokens),
            "trained": np.fromiter((t for r in trained for t in r), dtype=np.uint8, count=stats.tokens),
            "lengths": np.array([len(r) for r in ids], dtype=np.int32),
        } | (media_arrays(media) if stats.media else {})
        for name, array in arrays.items():
            with fs.open_output_stream(f"{directory}/{chunk.index:05d}.{name}.npy") as f:
                f.write(_npy(array))
        if stats.media:
            with fs.open_output_stream(f"{directory}/{chunk.index:05d}.files.json") as f:
                f.write(json.dumps([m.files if m else [] for m in media]).encode())
    return {"split": chunk.split, "index": chunk.index, **vars(stats), "formats": sorted(stats.formats),
            "lengths": [len(r) for r in ids]}  # fmt: skip


def chunk_row(result: dict) -> dict:
    """A task's result as Ray Data rows hold it (Arrow columns: no mixed tuples)."""
    longest = result.pop("longest")
    errors = [{"at": list(at), "message": message} for at, message in result.pop("errors")]
    return result | {"longest_tokens": longest[0], "longest_where": longest[1], "errors": errors}


def node_cpus() -> int:
    """The CPUs Ray offers on this process's node (a head started with num-cpus 0 offers none)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return next((int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["NodeID"] == here and n["Alive"]), 0)


def run_chunks(chunks: list[Chunk], sources: dict[str, SourceFiles], settings, target: str) -> list[dict]:
    """Every chunk, on Ray Data across this node's CPUs when this process is connected to a Ray cluster and
    there is more than one chunk's work (a pool of workers costs seconds to start); else here, one after
    another. Results in chunk order."""
    import ray

    def one(item: dict) -> dict:
        chunk = Chunk(**item)
        return chunk_row(run_chunk(chunk, sources[chunk.source], settings, target))

    items = [vars(c) for c in chunks]
    records = sum(c.stop - c.start for c in chunks)
    cpus = node_cpus() if ray.is_initialized() and records > settings.prepare_chunk else 0
    if not cpus or any(not s.cache_files for s in sources.values()):
        print(f"preparing {records:,} records in {len(chunks)} chunks in this process", flush=True)
        return [one(item) for item in items]
    print(f"preparing {records:,} records in {len(chunks)} chunks on Ray Data across {cpus} CPUs", flush=True)
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On this node: the tasks open datasets' Arrow files where the driver wrote them (its local disk).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    # each result as one JSON string: chunks without errors and chunks with some share one Arrow schema
    mapped = ray.data.from_items(items, override_num_blocks=len(items)).map(
        lambda item: {"result": json.dumps(one(item))}, num_cpus=1, scheduling_strategy=here
    )
    done = [json.loads(row["result"]) for row in mapped.take_all()]
    return sorted(done, key=lambda r: (SPLITS.index(r["split"]), r["index"]))


def source_files(source: Source, renames: dict[str, str]) -> SourceFiles:
    """The source as the preparation's tasks read it; a --columns entry naming a column the data lacks is refused
    (dropped silently, its typo would surface later as a record format not found)."""
    columns = source.data.column_names
    if absent := [(old, new) for old, new in renames.items() if old not in columns]:
        named = ", ".join(f"{new}={old}" for old, new in absent)
        raise JobInputError(f"--columns {named}: {source.ref} has no column {absent[0][0]!r}; its columns: "
                            f"{', '.join(columns)}")  # fmt: skip
    cache = tuple(f["filename"] for f in source.data.cache_files)
    return SourceFiles(source.ref, cache, tuple(source.files), tuple(renames.items()))


def plan_chunks(split: str, ranges: list[tuple[str, int, int]], size: int) -> list[Chunk]:
    chunks = []
    for name, start, stop in ranges:
        for a in range(start, stop, size):
            chunks.append(Chunk(split, len(chunks), name, a, min(a + size, stop)))
    return chunks


def bad_records(results: list[dict], unreadable: list = ()) -> JobInputError | None:
    """The first MAX_ERRORS bad records, and lines that are not records, in file order, together: one rerun of the
    preflight fixes them all."""
    found = [(tuple(e["at"]), e["message"]) for r in results for e in r["errors"]] + [
        (tuple(at), m) for at, m in unreadable
    ]
    if not found:
        return None
    return JobInputError(bad_lines_message([message for _, message in sorted(found)]))


def split_report(results: list[dict]) -> dict:
    """Docs.report()'s figures for one split, summed over its chunks."""
    total = {k: sum(r[k] for r in results) for k in ("read", "used", "truncated", "dropped", "tokens", "predicted")}
    longest = max(results, key=lambda r: r["longest_tokens"], default={"longest_tokens": 0, "longest_where": ""})
    return {
        "format": ", ".join(sorted({f for r in results for f in r["formats"]})),
        "records_read": total["read"],
        "records_used": total["used"],
        "truncated": total["truncated"],
        "dropped": total["dropped"],
        "tokens": total["tokens"],
        "predicted_tokens": total["predicted"],
        "predicted_share": total["predicted"] / total["tokens"] if total["tokens"] else 0.0,
        "longest_record_tokens": longest["longest_tokens"],
        "longest_record": longest["longest_where"],
    } | ({"media": media_report(results)} if any(r.get("media") for r in results) else {})


def ranges_text(ranges: list[tuple[str, int, int]]) -> str:
    """Resolved record ranges as a split expression: [("train", 0, 188)] -> train[0:188]."""
    return "+".join(f"{name}[{start}:{stop}]" for name, start, stop in ranges)


# ---- preparing --------------------------------------------------------------------------------


def exists(uri: str) -> bool:
    import pyarrow.fs

    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound


def write_object(uri: str, payload: bytes) -> None:
    fs, path = filesystem(uri)
    with fs.open_output_stream(path) as f:
        f.write(payload)


def found_prepared(target: str) -> Prepared | None:
    """The data prepared at `target` by an earlier run (its DONE written last), or None."""
    if not exists(f"{target}/DONE"):
        return None
    fs, path = filesystem(f"{target}/report.json")
    with fs.open_input_stream(path) as f:
        return Prepared(target, json.loads(f.read()), reused=True)


def done(target: str, report: dict) -> Prepared:
    """The report, then DONE: a preparation cut short is made again, not reused."""
    write_object(f"{target}/report.json", json.dumps(report).encode())
    write_object(f"{target}/DONE", b"")
    return Prepared(target, report, reused=False)


def write_rows(target: str, split: str, results: list[dict], settings) -> int:
    """The split's rows as records (packed best-fit by --seed, or one record each); returns their count."""
    import numpy as np

    lengths = [n for r in results for n in r["lengths"]]
    media = any(r.get("media") for r in results)
    # (records with pictures and sound are packed as text ones are: each whole in a row, masked from the others,
    # its towers' inputs in the row's record order: data/media_rows.RecordMedia, training/model.packed_media_masks)
    layout = (
        pack_rows(lengths, settings.seq_len, settings.seed) if settings.packing else [[i] for i in range(len(lengths))]
    )
    offsets = np.zeros(len(layout) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(row) for row in layout])
    records = np.fromiter((i for row in layout for i in row), dtype=np.int32, count=int(offsets[-1]))
    write_object(f"{target}/{split}/rows.npy", _npy(records))
    write_object(f"{target}/{split}/row_offsets.npy", _npy(offsets))
    write_object(f"{target}/{split}/chunks.json", json.dumps([r["used"] for r in results]).encode())
    if media:
        write_object(f"{target}/{split}/media.json", json.dumps(media_report(results)).encode())
    return len(layout)


def prepare(settings, tokenizer, before_work: Callable[[], None] = lambda: None) -> Prepared:
    """The prepared data for `settings`: found under its key, or made now (module docstring); `before_work`
    runs only when there is work (the driver joins its Ray cluster then)."""
    import pyarrow

    if settings.chat_template:
        require_chat_template(tokenizer, settings.tokenizer_ref)
    target = f"{settings.storage_path.rstrip('/')}/{PREPARED_DIR}/{data_key(settings, tokenizer)}"
    if earlier := found_prepared(target):
        return earlier
    before_work()
    train, held_out, loaded = load_splits(settings)
    pyarrow.default_memory_pool().release_unused()  # what converting the files to Arrow took
    sources = {name: source_files(s, settings.column_renames) for name, s in loaded.items()}
    chunks = plan_chunks("train", train, settings.prepare_chunk) + plan_chunks("eval", held_out, settings.prepare_chunk)
    results = run_chunks(chunks, sources, settings, target)
    if error := bad_records(results, [u for s in loaded.values() for u in s.unreadable]):
        raise error
    if refused := next((r["unreadable_by_model"] for r in results if r["unreadable_by_model"]), None):
        raise JobInputError(refused)
    report = {f"{split}_records": ranges_text(ranges) for split, ranges in zip(SPLITS, (train, held_out), strict=True)}
    for split in SPLITS:
        mine = [r for r in results if r["split"] == split]
        report[split] = split_report(mine) if mine else None
        report[f"{split}_rows"] = write_rows(target, split, mine, settings) if mine else 0
    report["modality"] = split_modality(report)
    return done(target, report)
