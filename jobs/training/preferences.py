"""A DPO run's data: the preference pairs checked and tokenized once and stored under
<storage>/prepared/<key>/ (as prepare.py stores SFT rows), each rank's loader over them, and the reference
log-probabilities: computed once, from the starting weights, before the first step, and stored beside the pairs
under the reference model's own key, so a resumed or restarted run reads them back and never recomputes them
from weights that have moved.

The pairs are few enough to be read by one process (the driver): no Ray Data here. Rows are never packed: a
pair's two rows are its prompt with each answer, right-padded to --seq-len.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable

from data.preference_data import Pair, pair_rows, read_pairs
from data.prepare import PREPARED_DIR, done, exists, found_prepared, ranges_text, split_report, write_object
from data.prepared import SPLITS, Prepared
from data.prepared_key import data_fingerprint, tokenizer_fingerprint
from runtime.storage import filesystem

FORMAT = 1  # bumped whenever what prepare_pairs writes changes
PAIRS_FILE = "pairs.npz"
REFERENCE_DIR = "reference"


def pairs_key(settings, tokenizer) -> str:
    """What shapes the pairs, hashed: change any of it and they are prepared again."""
    shaping = {"objective": "dpo", "format": FORMAT, "data": data_fingerprint(settings),
               "tokenizer": tokenizer_fingerprint(tokenizer), "chat_template": settings.chat_template,
               "columns": sorted(settings.column_renames.items()), "splits": [settings.split, settings.eval_split],
               "seq_len": settings.seq_len, "overlong": settings.overlong}  # fmt: skip
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:32]


def pairs_bytes(pairs: list[Pair]) -> bytes:
    """The pairs as one .npz: each part's ids end to end, and where each pair's start."""
    import numpy as np

    arrays = {}
    for part in ("prompt_ids", "chosen_ids", "rejected_ids"):
        lists = [getattr(p, part) for p in pairs]
        arrays[part] = np.fromiter((t for ids in lists for t in ids), dtype=np.int32)
        arrays[f"{part}_offsets"] = np.concatenate([[0], np.cumsum([len(ids) for ids in lists])]).astype(np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def pairs_from(path: str) -> list[Pair]:
    import numpy as np

    with np.load(path) as f:
        parts = [(f[part], f[f"{part}_offsets"]) for part in ("prompt_ids", "chosen_ids", "rejected_ids")]
    count = len(parts[0][1]) - 1
    return [Pair(*(tuple(int(t) for t in ids[o[i] : o[i + 1]]) for ids, o in parts)) for i in range(count)]


def prepare_pairs(settings, tokenizer, before_work: Callable[[], None] = lambda: None) -> Prepared:
    """The prepared pairs for `settings`: found under their key, or read, checked and written now, by this process
    (`before_work`, prepare.prepare's hook to join Ray for its parallel work, is not needed)."""
    target = f"{settings.storage_path.rstrip('/')}/{PREPARED_DIR}/{pairs_key(settings, tokenizer)}"
    if earlier := found_prepared(target):
        return earlier
    found, ranges, figures = read_pairs(settings, tokenizer)
    report = {"objective": "dpo"}
    for split, split_ranges in zip(SPLITS, ranges, strict=True):
        report[f"{split}_records"] = ranges_text(split_ranges)
        report[split] = split_report(figures[split]) if split_ranges else None
        report[f"{split}_rows"] = len(found[split])
        _put(f"{target}/{split}/{PAIRS_FILE}", pairs_bytes(found[split]))
    return done(target, report)


def _put(uri: str, payload: bytes) -> None:
    """prepare.write_object, its directory made first."""
    fs, path = filesystem(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    write_object(uri, payload)


def reference_key(settings, dtype: str) -> str:
    """The reference model's key: the starting weights (--model) and what changes their numbers."""
    return hashlib.sha256(json.dumps([settings.model, dtype, settings.attention]).encode()).hexdigest()[:16]


class PreferenceData:
    """This rank's loader over the training pairs (sharded, shuffled by seed and epoch, resumable as
    step.TrainingData's), the held-out pairs, the steps an epoch takes, and each pair's reference
    log-probabilities once `ready`. Without a prepared URI (a test in one process) the pairs are prepared here."""

    def __init__(self, settings, tokenizer, rank: int, world: int, prepared: str | None = None):
        import torch

        from data.prepared import local_directory
        from training.step import resumable_sampler, scratch_prepared, steps_per_epoch

        self.settings, self.rank, self.world, self.pad = settings, rank, world, tokenizer.pad_token_id
        self.prepared = prepared or scratch_prepared(settings, tokenizer, prepare_pairs)
        directory = local_directory(self.prepared)
        self.pairs = {s: pairs_from(os.path.join(directory, s, PAIRS_FILE)) for s in SPLITS}
        self.eval = self.pairs["eval"] or None
        indices = list(range(len(self.pairs["train"])))
        self.sampler = resumable_sampler()(indices, num_replicas=world, rank=rank, shuffle=True, seed=settings.seed,
                                           drop_last=True)  # fmt: skip
        self.loader = torch.utils.data.DataLoader(indices, batch_size=settings.batch_size, sampler=self.sampler,
                                                  drop_last=True, collate_fn=self.batch)  # fmt: skip
        self.rows_per_step = settings.batch_size * settings.grad_accum
        self.steps = steps_per_epoch(len(self.loader), settings.grad_accum)
        self.reference: dict | None = None  # split -> (2, pairs) array: chosen, rejected

    def start(self, epoch: int, step_in_epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.sampler.skip = step_in_epoch * self.rows_per_step

    def batch(self, indices: list[int], split: str = "train") -> dict:
        """Pairs by index as one micro-batch: their rows (pair_rows) and reference log-probabilities (float32)."""
        import numpy as np

        rows = pair_rows([self.pairs[split][i] for i in indices], self.settings.seq_len, self.pad)
        ref = self.reference[split][:, indices].astype(np.float32)
        return rows | {"ref_chosen": ref[0], "ref_rejected": ref[1]}

    def reference_uri(self, dtype: str) -> str:
        return f"{self.prepared.rstrip('/')}/{REFERENCE_DIR}/{reference_key(self.settings, dtype)}.npz"

    def ready(self, root, fresh: bool, dtype: str, device) -> None:
        """The reference log-probabilities: read back if stored; else, on a fresh run (the starting weights),
        computed by every rank together and stored by rank 0. A resumed run without them fails rather than
        compute them from trained weights."""
        import numpy as np
        import torch.distributed as dist

        from training.dpo import pair_log_probs

        uri = self.reference_uri(dtype)
        if not exists(uri):
            if not fresh:
                raise RuntimeError(f"the reference log-probabilities {uri} are missing: they come from the "
                                   "starting weights, which this resumed run no longer has; start a new run "
                                   "(--run-name)")  # fmt: skip
            computed = {s: np.stack(pair_log_probs(root, self.pairs[s], self.settings.seq_len, self.pad,
                                                        self.settings.batch_size, self.rank, self.world, device))
                        for s in SPLITS if self.pairs[s]}  # fmt: skip
            if self.rank == 0:
                buffer = io.BytesIO()
                np.savez(buffer, **computed)
                _put(uri, buffer.getvalue())
            dist.barrier()
        fs, path = filesystem(uri)
        with fs.open_input_stream(path) as f, np.load(io.BytesIO(f.read())) as arrays:
            self.reference = {s: arrays[s] for s in arrays.files}
