"""A GRPO run's data: the prompt records checked and tokenized once and stored under <storage>/prepared/<key>/ (as
preferences.py stores DPO's pairs), and each rank's loader over them: a micro-batch is --batch-size completions,
so --batch-size / --num-generations prompts. Read by the driver alone (no Ray Data): prompts are few."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

from data.prepare import PREPARED_DIR, done, found_prepared, ranges_text, split_report
from data.prepared import SPLITS, Prepared
from data.prepared_key import data_fingerprint, tokenizer_fingerprint
from data.prompt_data import read_prompts
from training.preferences import _put

FORMAT = 1  # bumped whenever what prepare_prompts writes changes
PROMPTS_FILE = "prompts.jsonl"


def prompts_key(settings, tokenizer) -> str:
    """What shapes the prompts, hashed: change any of it and they are prepared again."""
    shaping = {"objective": "grpo", "format": FORMAT, "data": data_fingerprint(settings),
               "tokenizer": tokenizer_fingerprint(tokenizer), "chat_template": settings.chat_template,
               "columns": sorted(settings.column_renames.items()), "splits": [settings.split, settings.eval_split],
               "budget": settings.seq_len - settings.max_completion_length}  # fmt: skip
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:32]


def prepare_prompts(settings, tokenizer, before_work: Callable[[], None] = lambda: None) -> Prepared:
    """The prepared prompts for `settings`: found under their key, or read, checked and written now."""
    target = f"{settings.storage_path.rstrip('/')}/{PREPARED_DIR}/{prompts_key(settings, tokenizer)}"
    if earlier := found_prepared(target):
        return earlier
    found, ranges, figures = read_prompts(settings, tokenizer)
    report = {"objective": "grpo"}
    for split, split_ranges in zip(SPLITS, ranges, strict=True):
        report[f"{split}_records"] = ranges_text(split_ranges)
        report[split] = split_report(figures[split]) if split_ranges else None
        report[f"{split}_rows"] = len(found[split])
        lines = "".join(json.dumps(p, default=str) + "\n" for p in found[split])
        _put(f"{target}/{split}/{PROMPTS_FILE}", lines.encode())
    return done(target, report)


class PromptData:
    """This rank's loader over the training prompts (sharded, shuffled by seed and epoch, resumable as
    step.TrainingData's), the held-out prompts and the steps an epoch takes. Without a prepared URI (a test in one
    process) the prompts are prepared here."""

    def __init__(self, settings, tokenizer, rank: int, world: int, prepared: str | None = None):
        import torch

        from data.prepared import local_directory
        from training.step import resumable_sampler, scratch_prepared, steps_per_epoch

        self.settings, self.rank, self.world = settings, rank, world
        self.prepared = prepared or scratch_prepared(settings, tokenizer, prepare_prompts)
        directory = local_directory(self.prepared)
        self.prompts = {s: [json.loads(line) for line in open(os.path.join(directory, s, PROMPTS_FILE))]
                        for s in SPLITS}  # fmt: skip
        self.eval = self.prompts["eval"] or None
        per_batch = settings.batch_size // settings.num_generations
        self.sampler = resumable_sampler()(list(range(len(self.prompts["train"]))), num_replicas=world, rank=rank,
                                           shuffle=True, seed=settings.seed, drop_last=True)  # fmt: skip
        self.loader = torch.utils.data.DataLoader(self.prompts["train"], batch_size=per_batch, sampler=self.sampler,
                                                  drop_last=True, collate_fn=list)  # fmt: skip
        self.rows_per_step = per_batch * settings.grad_accum
        self.steps = steps_per_epoch(len(self.loader), settings.grad_accum)

    def start(self, epoch: int, step_in_epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.sampler.skip = step_in_epoch * self.rows_per_step
