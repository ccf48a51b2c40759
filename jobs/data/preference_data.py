"""Preference records for DPO: {prompt, chosen, rejected}, checked, and tokenized as TRL's DPOTrainer tokenizes them.

Two formats, TRL's (trl 1.16.0, data_utils.is_conversational):

- **standard**: three strings. With the chat template (the default) the prompt becomes one user turn and each
  answer one assistant turn, so the pair is the conversational one below; without it (--no-chat-template) the
  text is raw, as TRL treats strings: each answer gets the tokenizer's end-of-sequence text appended unless it
  ends with it, and `tokenizer(prompt + answer)` (with its BOS) is tokenized.
- **conversational**: `prompt` a list of {role, content} turns, `chosen` and `rejected` each a list of
  assistant turns (usually one). The prompt is `apply_chat_template(prompt, add_generation_prompt=True)`, each
  answer `apply_chat_template(prompt + answer)`: what follows the end of turn (Gemma 4's newline) is trained
  too, as TRL trains it.
- **implicit prompt**: no prompt column, chosen and rejected each the whole conversation: the prompt is the turns
  they share from the start (TRL's extract_prompt).

The answer starts where the prompt's tokens and the prompt+answer's tokens first differ, for both answers
(trl/trainer/dpo_trainer.py, _prepare_dataset, `common_prefix_length`). A row is prompt + answer, cut to
--seq-len from the start (TRL's `truncation_mode="keep_start"`, `max_length`); a pair whose prompt alone fills
--seq-len is dropped (TRL drops it too: no answer token would be left), and with --overlong drop, a pair either
of whose rows passes --seq-len.
"""

from __future__ import annotations

from dataclasses import dataclass

from data.render import RecordError, checked_turn

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One tokenized preference pair: the prompt's ids (the shared prefix) and each answer's."""

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


def is_preference(columns: list[str]) -> bool:
    """The preference columns: prompt, chosen and rejected, or chosen and rejected alone (the prompt implicit)."""
    return all(c in columns for c in PREFERENCE_COLUMNS[1:])


def extract_prompt(record: dict) -> dict:
    """An implicit prompt (no prompt column) made explicit as TRL's extract_prompt makes it: the turns (or
    characters) chosen and rejected share from the start."""
    chosen, rejected = record["chosen"], record["rejected"]
    if chosen is None or rejected is None or type(chosen) is not type(rejected):
        return {"prompt": None, "chosen": chosen, "rejected": rejected}
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # (TRL's: a space before the answer stays with it)
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def _turns(value, what: str, assistant_only: bool) -> list[dict]:
    if not value:
        raise RecordError(f"{what} is empty; it must be non-empty text or a list of {{role, content}} turns")
    turns = [checked_turn(turn, f"{what}'s turn {i}") for i, turn in enumerate(value, 1)]
    for i, turn in enumerate(turns, 1):
        if assistant_only and turn["role"] != "assistant":
            raise RecordError(f"{what}'s turn {i} is a {turn['role']} turn; an answer is the assistant's")
    return turns


def preference_record(record: dict) -> dict:
    """The record's prompt, chosen and rejected, checked: all strings, or all turns (raises RecordError). Without a
    prompt column, the prompt is what chosen and rejected share (extract_prompt)."""
    if "prompt" not in record:
        record = extract_prompt(record)
    missing = [c for c in PREFERENCE_COLUMNS if record.get(c) is None]
    if missing:
        raise RecordError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing")
    values = [record[c] for c in PREFERENCE_COLUMNS]
    if all(isinstance(v, str) for v in values):
        empty = [c for c, v in zip(PREFERENCE_COLUMNS, values, strict=True) if not v.strip()]
        if empty:
            raise RecordError(f"{' and '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty")
        out = dict(zip(PREFERENCE_COLUMNS, values, strict=True))
    elif all(isinstance(v, list) for v in values):
        out = {"prompt": _turns(values[0], "prompt", False), "chosen": _turns(values[1], "chosen", True),
               "rejected": _turns(values[2], "rejected", True)}  # fmt: skip
    else:
        kinds = ", ".join(f"{c} {type(v).__name__}" for c, v in zip(PREFERENCE_COLUMNS, values, strict=True))
        raise RecordError(f"mixes text and turns ({kinds}): give all three as text, or all three as turns")
    if out["chosen"] == out["rejected"]:
        raise RecordError("chosen and rejected are the same; a pair must prefer one answer to another")
    return out


def conversational(record: dict) -> dict:
    """A checked standard record as the conversation the chat template renders (TRL's conversational format)."""
    if isinstance(record["prompt"], list):
        return record
    return {"prompt": [{"role": "user", "content": record["prompt"]}],
            "chosen": [{"role": "assistant", "content": record["chosen"]}],
            "rejected": [{"role": "assistant", "content": record["rejected"]}]}  # fmt: skip


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        length += 1
    return length


def tokenize_pair(record: dict, tokenizer, chat_template: bool) -> Pair:
    """A checked record's ids, as TRL 1.16's DPOTrainer makes them (its tokenize_fn)."""
    if chat_template or isinstance(record["prompt"], list):
        record = conversational(record)

        def ids(messages: list[dict], generation_prompt: bool = False) -> list[int]:
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                add_generation_prompt=generation_prompt)  # fmt: skip
            return list(out["input_ids"])

        prompt = ids(record["prompt"], generation_prompt=True)
        chosen, rejected = (ids(record["prompt"] + record[k]) for k in ("chosen", "rejected"))
    else:
        eos = tokenizer.eos_token

        def ids(text: str) -> list[int]:
            return list(tokenizer(text)["input_ids"])

        prompt = ids(record["prompt"])
        chosen, rejected = (ids(record["prompt"] + (a if a.endswith(eos) else a + eos))
                            for a in (record["chosen"], record["rejected"]))  # fmt: skip
    start = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
    return Pair(tuple(prompt[:start]), tuple(chosen[start:]), tuple(rejected[start:]))


def pairs_of(source, start: int, stop: int, renames: dict, tokenizer, settings):
    """(pairs, bad records as ((file, line), message), figures as prepare.split_report sums them) of rows
    [start, stop) of a loaded
    split (sft_data.Source); a pair whose prompt alone fills --seq-len is dropped, and with --overlong drop one
    whose longer row passes it."""
    chat_template, seq_len = settings.chat_template, settings.seq_len
    data = source.data.rename_columns({o: n for o, n in renames.items() if o in source.data.column_names})
    if not is_preference(data.column_names):
        from runtime.outcome import JobInputError

        raise JobInputError(f"{source.ref}: --objective dpo needs the columns {', '.join(PREFERENCE_COLUMNS)} (or "
                            f"chosen and rejected alone, sharing their prompt); its "
                            f"columns: {', '.join(data.column_names)} (rename with --columns, e.g. "
                            "--columns chosen=better,rejected=worse)")  # fmt: skip
    pairs, errors, formats = [], [], set()
    figures = dict.fromkeys(("read", "used", "truncated", "dropped", "tokens", "predicted", "longest_tokens"), 0)
    figures["longest_where"] = ""
    for row, record in enumerate(data.select(range(start, stop)), start):
        try:
            checked = preference_record(record)
            pair = tokenize_pair(checked, tokenizer, chat_template)
        except RecordError as err:
            errors.append((source.position(row), f"{source.where(row)}: {err}"))
            continue
        figures["read"] += 1
        formats.add("preference (conversational)" if isinstance(checked["prompt"], list) else "preference (text)")
        lengths = [len(pair.prompt_ids) + len(a) for a in (pair.chosen_ids, pair.rejected_ids)]
        if len(pair.prompt_ids) >= seq_len or (settings.overlong == "drop" and max(lengths) > seq_len):
            figures["dropped"] += 1
            continue
        kept = [min(n, seq_len) for n in lengths]
        figures["used"] += 1
        figures["truncated"] += max(lengths) > seq_len
        figures["tokens"] += sum(kept)
        figures["predicted"] += sum(kept) - 2 * len(pair.prompt_ids)
        if max(lengths) > figures["longest_tokens"]:
            figures["longest_tokens"], figures["longest_where"] = max(lengths), source.where(row)
        pairs.append(pair)
    return pairs, errors, figures | {"formats": sorted(formats)}


def read_pairs(settings, tokenizer) -> tuple[dict, list[tuple], dict]:
    """({"train": pairs, "eval": pairs}, the record ranges of each, each split's figures) from --dataset, --split
    and --eval-split; every bad record and line that is not a record named (up to sft_data.MAX_ERRORS) in one
    JobInputError."""
    from data.sft_data import bad_lines_message, load_splits
    from runtime.outcome import JobInputError

    train, held_out, loaded = load_splits(settings)
    found, errors, figures = {}, [u for s in loaded.values() for u in s.unreadable], {}
    for part, ranges in (("train", train), ("eval", held_out)):
        found[part], figures[part] = [], []
        for name, start, stop in ranges:
            pairs, bad, counted = pairs_of(loaded[name], start, stop, settings.column_renames, tokenizer, settings)
            found[part] += pairs
            errors += bad
            figures[part].append(counted)
    if errors:  # every bad record and unreadable line, in file order, as the SFT preflight names them
        raise JobInputError(bad_lines_message([message for _, message in sorted(errors)]))
    return found, [train, held_out], figures


def pair_rows(pairs: list[Pair], seq_len: int, pad_id: int) -> dict:
    """A batch of pairs as TRL's collator lays it out: the chosen rows, then the rejected rows, each prompt +
    answer cut to seq_len and right-padded to it (one shape every step: the TPU compiles once); `labels` the
    answer's tokens (IGNORE elsewhere), `tokens` each row's answer tokens left after the cut. numpy arrays."""
    import numpy as np

    from data.labels import IGNORE

    rows = [(p.prompt_ids, p.chosen_ids) for p in pairs] + [(p.prompt_ids, p.rejected_ids) for p in pairs]
    ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
    mask = np.zeros((len(rows), seq_len), dtype=np.int64)
    for i, (prompt, answer) in enumerate(rows):
        whole = (list(prompt) + list(answer))[:seq_len]
        ids[i, : len(whole)] = whole
        mask[i, : len(whole)] = 1
        labels[i, len(prompt) : len(whole)] = whole[len(prompt) :]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "tokens": (labels != IGNORE).sum(axis=1)}
