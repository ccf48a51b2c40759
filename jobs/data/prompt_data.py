"""Prompt records for GRPO: {prompt, ...the columns the rewards read}, checked and tokenized.

A prompt is text or a list of {role, content} turns (TRL's standard and conversational prompts). With the chat
template (the default) text becomes one user turn; either way the prompt's ids are
`apply_chat_template(turns, add_generation_prompt=True)`, the model's turn opened. Without it (--no-chat-template)
the text is tokenized raw, with the tokenizer's BOS. Every other column goes to the reward functions as it is
(TRL's keyword arguments), each completion given in its prompt's form: text for text, a list of one assistant turn
for turns. A prompt longer than --seq-len minus --max-completion-length is dropped and counted.
"""

from __future__ import annotations

from data.render import RecordError, checked_turn


def prompt_record(record: dict) -> dict:
    """The record's prompt checked (raises RecordError) and its other columns: {"prompt", "columns"}."""
    prompt = record.get("prompt")
    if prompt is None:
        raise RecordError("prompt is missing")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RecordError("prompt is empty")
    elif isinstance(prompt, list) and prompt:
        prompt = [checked_turn(turn, f"prompt's turn {i}") for i, turn in enumerate(prompt, 1)]
        if prompt[-1]["role"] == "assistant":
            raise RecordError("prompt ends with an assistant turn; the model's turn is the completion's")
    else:
        raise RecordError(f"prompt is {type(prompt).__name__}; it must be non-empty text or a list of {{role, "
                          "content} turns")  # fmt: skip
    return {"prompt": prompt, "columns": {k: v for k, v in record.items() if k != "prompt"}}


def prompt_ids(prompt, tokenizer, chat_template: bool) -> list[int]:
    if isinstance(prompt, list) or chat_template:
        turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        out = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True, add_generation_prompt=True)
        return list(out["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def prompts_of(source, start: int, stop: int, renames: dict, tokenizer, settings):
    """(prompts as {"ids", "prompt", "columns", "where"}, bad records as ((file, line), message), figures as
    prepare.split_report sums them) of rows [start, stop) of a loaded split (sft_data.Source)."""
    data = source.data.rename_columns({o: n for o, n in renames.items() if o in source.data.column_names})
    if "prompt" not in data.column_names:
        from runtime.outcome import JobInputError

        raise JobInputError(f"{source.ref}: --objective grpo needs a prompt column (text or turns) beside the "
                            f"columns its rewards read; its columns: {', '.join(data.column_names)} (rename with "
                            "--columns, e.g. --columns prompt=question)")  # fmt: skip
    budget = settings.seq_len - settings.max_completion_length
    prompts, errors, formats = [], [], set()
    figures = dict.fromkeys(("read", "used", "truncated", "dropped", "tokens", "predicted", "longest_tokens"), 0)
    figures["longest_where"] = ""
    for row, record in enumerate(data.select(range(start, stop)), start):
        try:
            checked = prompt_record(record)
        except RecordError as err:
            errors.append((source.position(row), f"{source.where(row)}: {err}"))
            continue
        ids = prompt_ids(checked["prompt"], tokenizer, settings.chat_template)
        figures["read"] += 1
        formats.add("prompt (conversational)" if isinstance(checked["prompt"], list) else "prompt (text)")
        if len(ids) > figures["longest_tokens"]:
            figures["longest_tokens"], figures["longest_where"] = len(ids), source.where(row)
        if len(ids) > budget:
            figures["dropped"] += 1
            continue
        figures["used"] += 1
        figures["tokens"] += len(ids)
        prompts.append(checked | {"ids": ids, "where": source.where(row)})
    return prompts, errors, figures | {"formats": sorted(formats)}


def read_prompts(settings, tokenizer) -> tuple[dict, list, dict]:
    """({"train": prompts, "eval": prompts}, the record ranges of each, each split's figures) from --dataset, --split
    and --eval-split; every bad record named in one JobInputError (as read_pairs does)."""
    from data.sft_data import bad_lines_message, load_splits
    from runtime.outcome import JobInputError

    train, held_out, loaded = load_splits(settings)
    found, errors, figures = {}, [u for s in loaded.values() for u in s.unreadable], {}
    for part, ranges in (("train", train), ("eval", held_out)):
        found[part], figures[part] = [], []
        for name, start, stop in ranges:
            prompts, bad, counted = prompts_of(loaded[name], start, stop, settings.column_renames, tokenizer,
                                               settings)  # fmt: skip
            found[part] += prompts
            errors += bad
            figures[part].append(counted)
    if errors:
        raise JobInputError(bad_lines_message([message for _, message in sorted(errors)]))
    return found, [train, held_out], figures
