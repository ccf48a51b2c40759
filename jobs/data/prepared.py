"""The prepared data, read back (jobs/data/prepare.py makes it): where it is (Prepared), its files on this machine's
disk, a split's rows memory-mapped and read by index (PreparedRows: a rank reads only the rows its sampler gives
it), and the data report of what the run will train on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from config.modality import towers_of
from data.labels import IGNORE
from data.media_rows import RecordMedia, collate_media
from data.sft_data import row_tensors
from runtime.outcome import JobInputError
from runtime.storage import filesystem, once_per_machine

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Prepared:
    uri: str  # <storage>/prepared/<key>
    report: dict  # the data report: what was read, used, truncated, dropped; rows per split
    reused: bool


def local_directory(uri: str) -> str:
    """The prepared files on this machine's disk: in place for a local path, else copied once per machine
    (every rank of a host shares the copy: storage.once_per_machine)."""
    import pyarrow.fs

    fs, path = filesystem(uri)
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        return path

    def fill(partial: str) -> None:
        for split in SPLITS:
            os.makedirs(os.path.join(partial, split))
        pyarrow.fs.copy_files(path, partial, source_filesystem=fs)

    return once_per_machine(f"prepared-{os.path.basename(path)}", fill)


class PreparedRows:
    """One split's rows, read by index from memory-mapped files: each row's four tensors made when asked
    for, by sft_data.row_tensors."""

    def __init__(self, directory: str, split: str, seq_len: int, pad_id: int, packing: bool, left: bool = False):
        import numpy as np

        folder = os.path.join(directory, split)
        counts = json.loads(open(os.path.join(folder, "chunks.json")).read())
        self.tokens = [np.load(os.path.join(folder, f"{i:05d}.tokens.npy"), mmap_mode="r") for i in range(len(counts))]
        self.trained = [
            np.load(os.path.join(folder, f"{i:05d}.trained.npy"), mmap_mode="r") for i in range(len(counts))
        ]
        lengths = [np.load(os.path.join(folder, f"{i:05d}.lengths.npy")) for i in range(len(counts))]
        self.chunk_of = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        self.start = np.concatenate([np.concatenate([[0], np.cumsum(n)[:-1]]) for n in lengths]).astype(np.int64)
        self.length = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int32)
        self.rows = np.load(os.path.join(folder, "rows.npy"), mmap_mode="r")
        self.offsets = np.load(os.path.join(folder, "row_offsets.npy"))
        self.seq_len, self.pad_id, self.packing, self.left = seq_len, pad_id, packing, left
        has_media = os.path.exists(os.path.join(folder, "media.json"))
        in_chunk = np.arange(len(self.chunk_of)) - np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        self.media = RecordMedia(folder, len(counts), self.chunk_of, in_chunk) if has_media else None
        # a training row's towers' inputs, blanks included: the most pictures and clips any of the split's rows holds
        self.media_row = self.media.most_a_row(self.rows, self.offsets) if has_media else None
        self.collate = collate_media if has_media else None  # (the DataLoader's: a batch's pictures vary in number)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def record(self, i: int):
        chunk, start = self.chunk_of[i], self.start[i]
        end = start + self.length[i]
        return self.tokens[chunk][start:end], self.trained[chunk][start:end]

    def __getitem__(self, row: int):
        import numpy as np

        records = []
        indices = self.rows[self.offsets[row] : self.offsets[row + 1]]
        for i in indices:
            ids, trained = self.record(i)
            records.append((ids, np.where(trained, ids, IGNORE)))
        tensors = row_tensors(records, self.seq_len, self.pad_id, self.packing, self.left)
        return tensors if self.media is None else (*tensors, self.media.of([int(i) for i in indices], self.media_row))


def data_report(settings, prepared: Prepared, workers: int) -> dict:
    """What the run will train on (prepared.report) and its steps; fails if the data does not fill one
    global batch."""
    rows, needed = prepared.report["train_rows"], workers * settings.batch_size * settings.grad_accum
    per_row = settings.num_generations if settings.objective == "grpo" else 1  # (GRPO: a prompt, its group's rows)
    if rows * per_row < needed:
        kind = {"dpo": "pairs", "grpo": "prompts"}.get(settings.objective, "packed rows" if settings.packing else
                                                                           "records")  # fmt: skip
        each = f" / {per_row} completions a prompt" if per_row > 1 else ""
        raise JobInputError(f"{rows} {kind} are fewer than one global batch ({workers} workers x "
                            f"{settings.batch_size} rows x {settings.grad_accum} accumulation{each} = "
                            f"{needed // per_row})")  # fmt: skip
    return {
        "objective": settings.objective,
        "dataset": settings.dataset,
        "split": settings.split,
        "eval_split": settings.eval_split,
        "chat_template": settings.chat_template,
        "overlong": settings.overlong,
        "train_records": prepared.report["train_records"],
        "eval_records": prepared.report["eval_records"],
        "train": prepared.report["train"],
        "eval": prepared.report["eval"],
        "train_rows": rows,
        "steps_per_epoch": rows * per_row // needed,
        "modality": prepared.report.get("modality", "text"),
        "prepared": prepared.uri,
        "prepared_reused": prepared.reused,
    }


def print_data_report(report: dict) -> None:
    t = report["train"]
    print(
        f"data: {t['records_read']} training records ({t['format']}) from {report['dataset']} "
        f"({report['split']}: {report['train_records']}), "
        f"{t['records_used']} used ({t['truncated']} truncated, {t['dropped']} dropped at --seq-len); "
        f"{t['tokens']:,} tokens, {t['predicted_share']:.1%} of them trained on; longest "
        f"{t['longest_record_tokens']} tokens ({t['longest_record']}); {report['train_rows']} "
        f"{ {'dpo': 'pairs (not packed)', 'grpo': 'prompts'}.get(report.get('objective'), 'rows') }, "
        f"{report['steps_per_epoch']} steps an epoch",
        flush=True,
    )
    if media := t.get("media"):
        print(f"media: {media['records']} records hold {media['images']} pictures ({media['image_tokens']:,} soft "
              f"tokens) and {media['clips']} clips ({media['audio_tokens']:,} soft tokens; the longest "
              f"{media['longest_clip_frames']} frames); modality {report['modality']}",
              flush=True)  # fmt: skip
    e = report["eval"]
    print(f"eval: {e['records_used']} held-out records ({report['eval_split']}: {report['eval_records']}, not "
          f"trained on), {e['predicted_tokens']:,} tokens scored" if e else "eval: none", flush=True)  # fmt: skip
    print(f"prepared data: {report['prepared']} ({'reused' if report['prepared_reused'] else 'made now'})",
          flush=True)  # fmt: skip


def with_modality(settings, report: dict):
    """The settings the workers get: --modality auto made what the data holds (report["modality"]); a named one that
    lacks a tower the data needs is refused. With pictures or sound, lm-eval's named tasks (text) are dropped, said
    in the log; the held-out records are scored in the job (evaluation/media_scores.py)."""
    from dataclasses import replace

    found, asked = report.get("modality", "text"), settings.modality
    missing = [k for k in towers_of(found) if asked != "auto" and k not in towers_of(asked)]
    if missing:
        raise JobInputError(f"the records hold {' and '.join(missing)} but --modality is {asked}: pass --modality "
                            f"{found} (or auto)")  # fmt: skip
    resolved = replace(settings, modality=found if asked == "auto" else asked)
    if towers_of(resolved.modality):
        from transformers import AutoConfig

        from config.modality import require_towers
        from runtime.storage import model_directory

        ref = model_directory(settings.model)
        require_towers(AutoConfig.from_pretrained(ref, token=os.environ.get("HF_TOKEN")), towers_of(resolved.modality),
                       settings.model)  # fmt: skip
    from config.eval_tasks import HELDOUT, parse

    asked_tasks = parse(settings.eval_tasks)
    if found == "text" or asked_tasks in ((), (HELDOUT,)):
        return resolved
    print(f"media records: lm-eval's named tasks ({', '.join(t for t in asked_tasks if t != HELDOUT)}) are text and "
          "not scored on this run; the held-out records are, with their pictures and sound", flush=True)  # fmt: skip
    return replace(resolved, eval_tasks=HELDOUT if HELDOUT in asked_tasks else "none")
