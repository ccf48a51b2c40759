"""The records of a split rendered in this process and memory, as the preparation renders them (jobs/data/prepare.py
writes the same to files): for tests that look at a record's tokens and labels."""

from __future__ import annotations

from dataclasses import dataclass

from data.labels import IGNORE
from data.prepare import bad_records, chunk_row, plan_chunks, render_chunk, split_report
from data.render import require_chat_template
from data.sft_data import Source, load_splits


@dataclass
class Docs:
    """One split's records rendered in memory: (input_ids, labels) each, and its report."""

    items: list[tuple[list[int], list[int]]]
    stats: list[dict]

    def report(self) -> dict:
        return split_report(self.stats)


def prepare_docs(settings, tokenizer) -> tuple[Docs, Docs]:
    """The training and eval records, checked, rendered and tokenized, in this process and memory (for
    tests and small data: the run itself reads prepared files)."""
    if settings.chat_template:
        require_chat_template(tokenizer, settings.tokenizer_ref)
    train, held_out, loaded = load_splits(settings)
    out = []
    for split, ranges in (("train", train), ("eval", held_out)):
        items, stats = [], []
        for chunk in plan_chunks(split, ranges, settings.prepare_chunk):
            source = loaded[chunk.source]
            source = Source(source.ref, source.data.rename_columns(
                {o: n for o, n in settings.column_renames.items() if o in source.data.column_names}), source.files)  # fmt: skip
            ids, trained, chunk_stats, _ = render_chunk(chunk, source, tokenizer, settings)
            if error := bad_records([chunk_row(vars(chunk_stats) | {"formats": sorted(chunk_stats.formats)})]):
                raise error
            items += [
                (i, [t if k else IGNORE for t, k in zip(i, m, strict=True)]) for i, m in zip(ids, trained, strict=True)
            ]
            stats.append(chunk_row(vars(chunk_stats) | {"formats": sorted(chunk_stats.formats)}))
        out.append(Docs(items, stats))
    return out[0], out[1]
