"""Instruction data for the fine-tune: load, render, tokenize, then pad (the walkthrough) or pack.

Every example is four tensors of shape [seq_len]: input_ids, real (1 on document tokens,
0 on padding or filler), labels (-100 where nothing is predicted) and position_ids.

- Padded (the walkthrough): one record per row, padded to seq_len; the model gets an
  attention_mask (= real) and default positions.
- Packed: whole records laid end to end in rows of exactly seq_len, position_ids restarting
  at 0 for each record, and no attention_mask. From those restarts transformers builds a
  block-diagonal causal mask, in full and sliding-window layers alike
  (masking_utils.find_packed_sequence_indices), so no token sees another record;
  tests/test_packing.py checks a record's logits inside a packed row against its logits alone.
"""

from __future__ import annotations

import bisect
import os
import random
from pathlib import Path

from backend import JobInputError

COLUMNS = ("instruction", "response")
LOCAL_DATA = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
IGNORE = -100  # the label of a position whose next token is not trained on


def is_local(ref: str) -> bool:
    """A path, not a hub id (`org/name`): it exists, or it is spelt like a path."""
    return os.path.exists(ref) or ref.startswith(("/", "./", "../", "~")) or ref.count("/") > 1


def load_instructions(dataset: str, split: str):
    from datasets import load_dataset

    if is_local(dataset):
        path = Path(dataset).expanduser()
        if not path.exists():
            raise JobInputError(f"--dataset {dataset!r} does not exist")
        fmt = LOCAL_DATA.get(path.suffix)
        if fmt is None:
            raise JobInputError(f"--dataset {dataset!r}: use one of {', '.join(LOCAL_DATA)} or a hub id")
        data = load_dataset(fmt, data_files=str(path), split=split)
    else:
        data = load_dataset(dataset, split=split, token=os.environ.get("HF_TOKEN"))
    missing = [c for c in COLUMNS if c not in data.column_names]
    if missing:
        raise JobInputError(
            f"--dataset {dataset!r} lacks column(s) {', '.join(missing)}; it has {', '.join(data.column_names)}"
        )
    return data


def render(record: dict) -> str:
    return f"Instruction: {record['instruction']}\nResponse: {record['response']}"


def tokenize_records(data, tokenizer, seq_len: int) -> list[list[int]]:
    """Each record rendered and tokenized, truncated at seq_len, unpadded."""
    return tokenizer([render(r) for r in data], max_length=seq_len, truncation=True)["input_ids"]


def padded_examples(data, tokenizer, seq_len: int):
    """The walkthrough's rows: one record each, padded by the tokenizer; padding is masked out of the labels."""
    import torch

    enc = tokenizer(
        [render(r) for r in data], max_length=seq_len, truncation=True, padding="max_length", return_tensors="pt"
    )
    real = enc["attention_mask"]
    labels = enc["input_ids"].masked_fill(real == 0, IGNORE)
    positions = torch.arange(seq_len).expand_as(real).clone()
    return torch.utils.data.TensorDataset(enc["input_ids"], real, labels, positions)


def pack_rows(lengths: list[int], seq_len: int, seed: int) -> list[list[int]]:
    """Best-fit decreasing: record indices per row, every row holding at most seq_len tokens.

    Ties between equal lengths, and the order of the rows, come from `seed`, so a run is
    reproducible and different seeds mix differently.
    """
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order.sort(key=lambda i: -lengths[i])  # stable: the shuffle breaks ties
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, row index), sorted
    for i in order:
        at = bisect.bisect_left(free, (lengths[i], -1))  # the tightest row it still fits in
        if at == len(free):
            rows.append([i])
            left, row = seq_len - lengths[i], len(rows) - 1
        else:
            left, row = free.pop(at)
            rows[row].append(i)
            left -= lengths[i]
        if left > 0:
            bisect.insort(free, (left, row))
    rng.shuffle(rows)
    return rows


def packed_examples(docs: list[list[int]], seq_len: int, pad_id: int, seed: int):
    """Rows of exactly seq_len: whole records end to end, then filler.

    position_ids restart at 0 for every record (and for the filler, its own segment); the first
    token of each record is never predicted from the previous one, and filler is never
    predicted at all (labels -100 there).
    """
    import torch

    rows = pack_rows([len(d) for d in docs], seq_len, seed)
    n = len(rows)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    real = torch.zeros((n, seq_len), dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    positions = torch.zeros((n, seq_len), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            doc = torch.tensor(docs[i])
            end = at + len(doc)
            input_ids[r, at:end] = doc
            real[r, at:end] = 1
            labels[r, at + 1 : end] = doc[1:]
            positions[r, at:end] = torch.arange(len(doc))
            at = end
        positions[r, at:] = torch.arange(seq_len - at)
    return torch.utils.data.TensorDataset(input_ids, real, labels, positions)


def model_inputs(batch, packing: bool, device) -> dict:
    """What the model is called with: packed rows pass positions and no mask, padded ones a mask."""
    input_ids, real, labels, positions = (t.to(device) for t in batch)
    if packing:
        return {"input_ids": input_ids, "position_ids": positions, "labels": labels}
    return {"input_ids": input_ids, "attention_mask": real, "labels": labels}


def examples(data, tokenizer, seq_len: int, packing: bool, seed: int):
    if packing:
        return packed_examples(tokenize_records(data, tokenizer, seq_len), seq_len, tokenizer.pad_token_id, seed)
    return padded_examples(data, tokenizer, seq_len)


def real_token_share(docs: list[list[int]], seq_len: int) -> float:
    """Document tokens over padded positions: how much of a padded row is text."""
    return sum(len(d) for d in docs) / (len(docs) * seq_len)
