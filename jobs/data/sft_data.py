"""The fine-tune's data: load, check, split, render, then pad (the walkthrough) or pack.

Every example is four tensors of shape [seq_len]: input_ids, real (1 on document tokens,
0 on padding or filler), labels (IGNORE where nothing is trained) and position_ids.

- Padded (the walkthrough): one record per row, padded to seq_len; the model gets an
  attention_mask (= real) and default positions.
- Packed: whole records laid end to end in rows of exactly seq_len, position_ids restarting
  at 0 for each record, and no attention_mask. From those restarts transformers builds a
  block-diagonal causal mask, in full and sliding-window layers alike
  (masking_utils.find_packed_sequence_indices), so no token sees another record;
  tests/test_packing.py checks a record's logits inside a packed row against its logits alone.

Data comes from a hub id (with --dataset-config), a local file, directory or glob, or gs://
files and globs (through gcsfs, with the pod's Workload Identity). Splits use the `datasets`
grammar, resolved here to absolute record ranges so that the held-out eval split can be checked
against the training one, and every error names the file and the row.
"""

from __future__ import annotations

import bisect
import heapq
import json
import os
import random
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field

from config.data_formats import LOCAL_DATA, auto_eval_count, is_file_source
from config.splits import overlap
from data.labels import IGNORE
from runtime.outcome import JobInputError
from runtime.storage import fsspec_options, gcs

MAX_ERRORS = 10  # bad records named at once

# ---- loading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileRecords:
    """One file of a split: its records, and the lines that hold none where the file was read line by line
    (blank, or not JSON), so that a record is named by the line a person finds it on."""

    name: str
    count: int
    skipped: tuple[int, ...] = ()  # 1-based, ascending

    def line(self, index: int) -> int:
        """The 1-based line (or record number) of the file's 0-based record `index`."""
        line = index + 1
        for s in self.skipped:
            if s > line:
                break
            line += 1
        return line


@dataclass
class Source:
    """One named split of a dataset, where each of its records came from, and the lines that could not be read
    as records (the preflight names them with the bad records)."""

    ref: str
    data: object  # datasets.Dataset
    files: list[FileRecords] = field(default_factory=list)  # in order
    unreadable: list[tuple[tuple[int, int], str]] = field(default_factory=list)  # ((file number, line), message)

    def position(self, row: int) -> tuple[int, int]:
        """(file number, 1-based line or record) of the split's 0-based row: the order bad records are named in."""
        for number, f in enumerate(self.files):
            if row < f.count:
                return number, f.line(row)
            row -= f.count
        return len(self.files), row + 1

    def where(self, row: int) -> str:
        """`file, line N` (or `DATASET, row N`) for the 0-based row of the split."""
        number, line = self.position(row)
        if number == len(self.files):
            return f"{self.ref}, row {line}"
        name = self.files[number].name
        return f"{name}, {'line' if name.endswith('.jsonl') else 'record'} {line}"


def data_files(ref: str) -> list[str]:
    """The files a local or gs:// path, directory or glob names, with a known suffix, sorted."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(os.path.expanduser(ref), **fsspec_options(ref))
    with storage_errors(ref):
        if any(c in path for c in "*?["):
            found = fs.glob(path)
        elif fs.isdir(path):
            found = [p for p in fs.find(path) if os.path.splitext(p)[1] in LOCAL_DATA]
        else:
            found = [path] if fs.exists(path) else []
    if not found:
        raise JobInputError(f"--dataset {ref!r} does not exist (no such file, directory or matching files)")
    prefix = "gs://" if ref.startswith("gs://") else ""
    return sorted(prefix + p if prefix and not p.startswith(prefix) else p for p in found)


@contextmanager
def storage_errors(ref: str):
    """gcsfs's refusals (403: PermissionError, or OSError "Forbidden") and absences, said for a user."""
    try:
        yield
    except FileNotFoundError:
        raise JobInputError(f"--dataset {ref!r} does not exist") from None
    except OSError as err:
        if not isinstance(err, PermissionError) and "Forbidden" not in str(err) and "403" not in str(err):
            raise
        bucket = ref.removeprefix("gs://").split("/", 1)[0]
        raise JobInputError(
            f"--dataset {ref!r}: the pods may not read bucket {bucket} ({str(err).splitlines()[0]}). Grant their "
            f"Workload Identity roles/storage.objectViewer on it: gcloud storage buckets add-iam-policy-binding "
            f"gs://{bucket} --role=roles/storage.objectViewer --member=principal://iam.googleapis.com/projects/"
            "PROJECT_NUMBER/locations/global/workloadIdentityPools/PROJECT.svc.id.goog/subject/ns/default/sa/default"
        ) from None


def first_bad_json_line(name: str, local: str) -> str | None:
    """A .json file's first error (one document: the parser stops there)."""
    with open(local) as f:
        try:
            json.load(f)
        except json.JSONDecodeError as err:
            return f"{name}, line {err.lineno}: not JSON ({err.msg})"
    return None


def json_lines(name: str, local: str, into: str) -> tuple[str, tuple[int, ...], list[tuple[int, str]]] | None:
    """A JSON Lines file read line by line, as `datasets` cannot (it stops at the first bad line): a copy holding
    only its records, the lines that hold none (blank or not JSON), and each line that is not JSON with why;
    None when every line is JSON (what failed is something else)."""
    skipped, bad = [], []
    target = os.path.join(into, f"{len(os.listdir(into))}-records.jsonl")
    with open(local, "rb") as f, open(target, "w", encoding="utf-8") as out:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                skipped.append(number)
                continue
            try:
                line = raw.decode("utf-8")
                json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                js = isinstance(err, json.JSONDecodeError)
                why = f"not JSON ({err.msg}): {line.strip()[:80]!r}" if js else f"not UTF-8 (byte {err.start + 1})"
                skipped.append(number)
                bad.append((number, f"{name}, line {number}: {why}"))
                continue
            out.write(line if line.endswith("\n") else line + "\n")
    return (target, tuple(skipped), bad) if bad else None


def local_copy(name: str, into: str) -> str:
    """A gs:// file copied to local disk (gcsfs, the pod's credentials); a local file as it is."""
    if not name.startswith("gs://"):
        return name
    target = os.path.join(into, f"{len(os.listdir(into))}-{os.path.basename(name)}")
    with storage_errors(name):
        gcs().get(name, target)
    return target


def load_file(name: str, number: int, into: str) -> tuple[object, FileRecords, list]:
    """One file as (a Dataset, its FileRecords, its unreadable lines); a json/jsonl line that is not JSON is
    named with its line number: every such line of a .jsonl, with the file's other records still read."""
    from datasets import load_dataset

    fmt = LOCAL_DATA.get(os.path.splitext(name)[1])
    if fmt is None:
        raise JobInputError(f"--dataset {name!r}: use json, jsonl, csv or parquet files, or a hub id")
    local = local_copy(name, into)
    try:
        with datasets_quiet():  # its log names a bad line by its 0-based row; the error below names them all
            data = load_dataset(fmt, data_files=local, split="train")
        return data, FileRecords(name, len(data)), []
    except Exception as err:  # noqa: BLE001  (datasets wraps the parser's error; find the lines ourselves)
        failure = err
    lines = json_lines(name, local, into) if name.endswith(".jsonl") else None
    if lines is None:
        bad = first_bad_json_line(name, local) if name.endswith(".json") else None
        raise JobInputError(bad or f"{name}: cannot be read as {fmt}: {failure}")
    records, skipped, bad = lines
    unreadable = [((number, line), message) for line, message in bad]
    if os.path.getsize(records) == 0:
        return None, FileRecords(name, 0, skipped), unreadable
    try:
        data = load_dataset(fmt, data_files=records, split="train")
    except Exception as err:  # noqa: BLE001
        raise JobInputError(f"{bad[0][1]}; and its other lines cannot be read as {fmt}: {err}") from None
    return data, FileRecords(name, len(data), skipped), unreadable


@contextmanager
def datasets_quiet():
    import datasets

    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def load_split(ref: str, name: str, config: str | None = None) -> Source:
    """The whole split `name` (files have only `train`)."""
    from datasets import concatenate_datasets, load_dataset

    if not is_file_source(ref):
        return Source(ref, load_dataset(ref, config, split=name, token=os.environ.get("HF_TOKEN")))
    if name != "train":
        raise JobInputError(f"--dataset {ref!r} is files: their one split is `train` (got {name!r})")
    with tempfile.TemporaryDirectory(prefix="dataset-") as into:  # gs:// copies; datasets reads them into its cache
        loaded = [load_file(f, number, into) for number, f in enumerate(data_files(ref))]
    unreadable = [u for _, _, bad in loaded for u in bad]
    parts = [data for data, _, _ in loaded if data is not None]
    if not parts:
        raise JobInputError(bad_lines_message([message for _, message in unreadable]))
    try:
        data = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    except ValueError as err:
        raise JobInputError(f"--dataset {ref!r}: its files do not share their columns ({err})") from None
    return Source(ref, data, [f for _, f, _ in loaded], unreadable)


def bad_lines_message(errors: list[str]) -> str:
    """The first MAX_ERRORS bad records or lines, in file order, in one message: one rerun fixes them all."""
    if len(errors) == 1:
        return errors[0]
    more = f" (the first {MAX_ERRORS}, in file order)" if len(errors) > MAX_ERRORS else ""
    return f"{min(len(errors), MAX_ERRORS)} bad records{more}:\n  " + "\n  ".join(errors[:MAX_ERRORS])


# ---- splits -----------------------------------------------------------------------------------


def absolute(spec: str, sizes: dict[str, int]) -> list[tuple[str, int, int]]:
    from datasets import ReadInstruction

    try:
        return [(i.splitname, i.from_, i.to) for i in ReadInstruction.from_spec(spec).to_absolute(sizes)]
    except (ValueError, AssertionError) as err:
        raise JobInputError(f"split {spec!r}: {err}") from None


def default_eval(train: list[tuple[str, int, int]], sizes: dict[str, int]) -> tuple[list, list]:
    """--eval-split auto: (training ranges, held-out ranges). data_formats.auto_eval_count of the training slice's
    records: those right after it, or, where it reaches the end of its split (all of a file, by default), its own
    last ones, which are then not trained on."""
    if len(train) != 1:
        raise JobInputError("--eval-split auto needs a single training slice such as train[:1024]; name one")
    name, start, stop = train[0]
    count = auto_eval_count(stop - start)
    if stop < sizes[name]:
        return train, [(name, stop, min(sizes[name], stop + count))]
    if stop - start < 2:
        raise JobInputError(f"--eval-split auto holds out some of the training records, but {name}[{start}:{stop}] "
                            "holds fewer than 2; add records, or pass --eval-split none")  # fmt: skip
    return [(name, start, stop - count)], [(name, stop - count, stop)]


def check_disjoint(train: list, held_out: list) -> None:
    """The resolved ranges: a held-out split holds records and shares none with the training split (the same
    rule setting_checks.problems applies to the bounds the text gives, at preview)."""
    for name, a, b in held_out:
        if b <= a:
            raise JobInputError(f"the eval split holds no records ({name}[{a}:{b}])")
    if shared := overlap(held_out, train):
        (name, a, b), (_, c, d) = shared
        raise JobInputError(f"the eval split {name}[{a}:{b}] overlaps the training split {name}[{c}:{d}]: "
                            "held-out records must not be trained on")  # fmt: skip


def load_splits(settings) -> tuple[list, list, dict[str, Source]]:
    """(train ranges, eval ranges or [], the loaded splits by name) from --split and --eval-split."""
    eval_spec = settings.eval_split
    specs = [spec for spec in (settings.split, eval_spec) if spec not in ("auto", "none")]
    names = {part.split("[", 1)[0] for spec in specs for part in spec.split("+")}
    loaded = {n: load_split(settings.dataset, n, settings.dataset_config) for n in sorted(names)}
    sizes = {n: len(s.data) for n, s in loaded.items()}
    train = absolute(settings.split, sizes)
    if eval_spec == "none":
        return train, [], loaded
    if eval_spec == "auto":
        train, held_out = default_eval(train, sizes)
    else:
        held_out = absolute(eval_spec, sizes)
    check_disjoint(train, held_out)
    return train, held_out, loaded


# ---- rows -------------------------------------------------------------------------------------


def pack_rows(lengths: list[int], seq_len: int, seed: int) -> list[list[int]]:
    """Best-fit decreasing: record indices per row, every row holding at most seq_len tokens.

    Each record goes to the row with the least room that still fits it (the lowest-numbered of equals),
    else a new row. Rows are kept in buckets by the room they have left (at most seq_len buckets), so a
    million records pack in seconds. Ties between equal lengths, and the order of the rows, come from
    `seed`, so a run is reproducible and different seeds mix differently.
    """
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order.sort(key=lambda i: -lengths[i])  # stable: the shuffle breaks ties
    rows: list[list[int]] = []
    by_room: dict[int, list[int]] = {}  # room left -> a heap of the rows with exactly that room
    rooms: list[int] = []  # the keys of by_room, sorted
    for i in order:
        at = bisect.bisect_left(rooms, lengths[i])  # the tightest room it still fits in
        if at == len(rooms):
            rows.append([i])
            left, row = seq_len - lengths[i], len(rows) - 1
        else:
            left, heap = rooms[at], by_room[rooms[at]]
            row = heapq.heappop(heap)
            if not heap:
                del by_room[rooms.pop(at)]
            rows[row].append(i)
            left -= lengths[i]
        if left > 0:
            if left not in by_room:
                by_room[left] = []
                bisect.insort(rooms, left)
            heapq.heappush(by_room[left], row)
    rng.shuffle(rows)
    return rows


def row_tensors(records: list, seq_len: int, pad_id: int, packing: bool, left: bool = False) -> tuple:
    """One row's four tensors (input ids, real, labels, positions) from its records' (ids, labels).

    Packed: the records end to end, then filler; position ids restart at 0 for every record (and for
    the filler, a segment of its own); a record's first token is never predicted from the one before,
    and the filler never at all. Padded (the walkthrough): one record, padded on the tokenizer's side
    (`left`), positions as the model makes them (one per column), padding never trained.
    """
    import numpy as np
    import torch

    input_ids, real = np.full(seq_len, pad_id, dtype=np.int64), np.zeros(seq_len, dtype=np.int64)
    labels, positions = np.full(seq_len, IGNORE, dtype=np.int64), np.zeros(seq_len, dtype=np.int64)
    at = seq_len - sum(len(ids) for ids, _ in records) if left else 0
    for ids, doc_labels in records:
        end = at + len(ids)
        input_ids[at:end], real[at:end], labels[at:end] = ids, 1, doc_labels
        if at:
            labels[at] = IGNORE
        positions[at:end] = np.arange(len(ids))
        at = end
    if not packing:
        positions = np.arange(seq_len)
    elif at < seq_len:
        positions[at:] = np.arange(seq_len - at)
    return tuple(torch.from_numpy(a) for a in (input_ids, real, labels, positions))


def examples(docs, seq_len: int, packing: bool, pad_id: int, seed: int, padding_side: str = "right"):
    """Every row of records held in memory (`docs`: (ids, labels) each), packed best-fit by `seed` or
    one record each; the prepared data (jobs/data/prepared.py) makes the same rows from its files."""
    import torch

    layout = pack_rows([len(ids) for ids, _ in docs], seq_len, seed) if packing else [[i] for i in range(len(docs))]
    left = not packing and padding_side == "left"
    rows = [row_tensors([docs[i] for i in row], seq_len, pad_id, packing, left) for row in layout]
    if not rows:
        return torch.utils.data.TensorDataset(*(torch.zeros((0, seq_len), dtype=torch.long) for _ in range(4)))
    return torch.utils.data.TensorDataset(*(torch.stack(t) for t in zip(*rows, strict=True)))


def padded_examples(docs, seq_len: int, pad_id: int, padding_side: str = "right"):
    return examples(docs, seq_len, False, pad_id, 0, padding_side)


def packed_examples(docs, seq_len: int, pad_id: int, seed: int):
    return examples(docs, seq_len, True, pad_id, seed)


def model_inputs(batch, packing: bool, device) -> dict:
    """The model's inputs: packed rows' positions (no mask), or padded rows' mask; a media batch's towers' inputs."""
    input_ids, real, labels, positions = (t.to(device) for t in batch[:4])
    media = {k: v.to(device) for k, v in batch[4].items()} if len(batch) > 4 else {}
    if packing:
        return {"input_ids": input_ids, "position_ids": positions, "labels": labels} | media
    return {"input_ids": input_ids, "attention_mask": real, "labels": labels} | media


def real_token_share(docs: list[list[int]], seq_len: int) -> float:
    """Document tokens over padded positions: how much of a padded row is text."""
    return sum(len(d) for d in docs) / (len(docs) * seq_len)
