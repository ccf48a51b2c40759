"""Records to conversations, conversations to text, text to token ids and labels.

Three record formats, told apart by their columns (`--columns new=old` renames columns first):

- `messages`: a list of {role, content} turns; roles system, user, assistant (`model` is read
  as assistant). Every assistant turn is trained on.
- `prompt` / `completion`: one user turn, one assistant turn.
- `instruction` / `context` / `response` (Dolly): the user turn is the instruction, then the
  context when there is one; the assistant turn is the response.

With the chat template (the default), a conversation is rendered by the tokenizer's own
`apply_chat_template`, and the trained characters are each assistant turn's content and its
end-of-turn marker (so the model learns to stop), found by rendering the conversation up to
that turn with and without the generation prompt. Without it, the walkthrough's text:
`Instruction: {instruction}\\nResponse: {response}` (Dolly's context left out, as there).
Tokens whose first character is trained get their own id as label; the rest get IGNORE,
unless --prompt-loss trains on every token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from config.data_formats import FORMATS
from data.labels import IGNORE
from runtime.outcome import JobInputError

ROLES = {"system": "system", "user": "user", "assistant": "assistant", "model": "assistant"}


class RecordError(ValueError):
    """What is wrong with one record; the caller adds where it is."""


def detect_format(columns: list[str]) -> str:
    for name, needed in FORMATS.items():
        if all(c in columns for c in needed):
            return name
    expected = "; ".join(" + ".join(cols) for cols in FORMATS.values())
    raise JobInputError(
        f"no known record format in columns {', '.join(columns)}: expected {expected} "
        "(rename columns with --columns, e.g. --columns prompt=question,completion=answer)"
    )


def _text(value, what: str) -> str:
    """Arrow gives a key a record lacks (or holds null) as None: "missing"."""
    if value is None:
        raise RecordError(f"{what} is missing; it must be non-empty text")
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"{what} is {'empty' if isinstance(value, str) else type(value).__name__}; it must be "
                          "non-empty text")  # fmt: skip
    return value


def checked_turn(turn, name: str) -> dict:
    """One {role, content} turn, its role made one of ROLES' values (raises RecordError naming it `name`)."""
    if not isinstance(turn, dict):
        raise RecordError(f"{name} is not a {{role, content}} object")
    if turn.get("role") is None:
        raise RecordError(f"{name}'s role is missing; use one of {', '.join(ROLES)}")
    if turn["role"] not in ROLES:
        raise RecordError(f"{name} has the unknown role {turn['role']!r}; use one of {', '.join(ROLES)}")
    content = turn.get("content")
    if isinstance(content, list):
        return {"role": ROLES[turn["role"]], "content": text_parts(content, f"{name}'s content")}
    return {"role": ROLES[turn["role"]], "content": _text(content, f"{name}'s content")}


def text_parts(parts: list, what: str) -> list[dict]:
    """A turn's content as a list of text parts (OpenAI's and TRL's form), kept as parts: the chat template renders
    them as it renders them at inference. Raises RecordError for a part that is not text, or no text at all."""
    out = []
    for i, part in enumerate(parts, 1):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise RecordError(f"{what}'s part {i} is {kind!r}; a part is text ({{'type': 'text', 'text': ...}}), "
                              "an image or an audio clip")  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise RecordError(f"{what}'s part {i} has no text; give it a 'text' string")
        out.append({"type": "text", "text": part["text"]})
    if not any(p["text"].strip() for p in out):
        raise RecordError(f"{what} holds no text; it must be non-empty text")
    return out


def content_text(content) -> str:
    """A turn's content as one string (its text parts joined by newlines): for the walkthrough's text format, which
    has no parts."""
    return content if isinstance(content, str) else "\n".join(p["text"].strip() for p in content)


def conversation(record: dict, fmt: str) -> list[dict]:
    """The record as turns [{role, content}] (a Dolly user turn also keeps its `context`); raises RecordError."""
    if fmt == "prompt/completion":
        return [
            {"role": "user", "content": _text(record["prompt"], "prompt")},
            {"role": "assistant", "content": _text(record["completion"], "completion")},
        ]
    if fmt == "instruction/context/response":
        context = record.get("context") or ""
        if not isinstance(context, str):
            raise RecordError(f"context is {type(context).__name__}; it must be text")
        return [
            {"role": "user", "content": _text(record["instruction"], "instruction"), "context": context.strip()},
            {"role": "assistant", "content": _text(record["response"], "response")},
        ]
    turns = record["messages"]
    if turns is None:
        raise RecordError("messages is missing; it must be a non-empty list of {role, content} turns")
    if not isinstance(turns, list) or not turns:
        raise RecordError("messages must be a non-empty list of {role, content} turns")
    out = [checked_turn(turn, f"turn {i}") for i, turn in enumerate(turns, 1)]  # numbered as people count
    if not any(t["role"] == "assistant" for t in out):
        raise RecordError("the conversation has no assistant turn, so nothing to train on")
    return out


@dataclass(frozen=True)
class Rendered:
    text: str
    spans: tuple[tuple[int, int], ...]  # [start, end) of the trained characters
    special_tokens: bool  # whether the tokenizer adds its own (the chat template writes them itself)


def user_text(turn: dict):
    """A turn's content for the chat template (a Dolly user turn's context after its instruction; parts as they are)."""
    return f"{turn['content']}\n\n{turn['context']}" if turn.get("context") else turn["content"]


def render_chat(turns: list[dict], tokenizer) -> Rendered:
    """The tokenizer's chat template; each assistant turn's content and end-of-turn marker are trained."""
    messages = [{"role": t["role"], "content": user_text(t)} for t in turns]

    def apply(part, prompt=False):
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    text, spans = apply(messages), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # (the conversation through its last turn is the whole text: one rendering fewer per record)
        before = apply(messages[:i], prompt=True)
        through = text if i == len(messages) - 1 else apply(messages[: i + 1])
        if not text.startswith(through):
            raise RecordError(
                "the chat template renders earlier turns differently once later ones follow, so the "
                "assistant turns cannot be located; split the conversation or pass --no-chat-template"
            )
        # the turn's own text starts where the generation prompt ends; the newline after the
        # end-of-turn marker is not part of what the model should say
        spans.append((len(os.path.commonprefix([before, through])), len(through.rstrip())))
    return Rendered(text, tuple(spans), special_tokens=False)


def render_text(turns: list[dict]) -> Rendered:
    """The walkthrough's `Instruction: ...\\nResponse: ...` (one pair per exchange); responses are trained."""
    parts, spans, at = [], [], 0
    for turn in turns:
        label = {"system": "System: ", "user": "Instruction: ", "assistant": "Response: "}[turn["role"]]
        text = content_text(turn["content"])
        start = at + (1 if parts else 0) + len(label)
        parts.append(label + text)
        at = start + len(text)
        if turn["role"] == "assistant":
            spans.append((start, at))
    return Rendered("\n".join(parts), tuple(spans), special_tokens=True)


def render(turns: list[dict], tokenizer, chat_template: bool) -> Rendered:
    return render_chat(turns, tokenizer) if chat_template else render_text(turns)


def require_chat_template(tokenizer, source: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise JobInputError(
            f"the tokenizer of {source} has no chat template; pass --no-chat-template to train on the "
            "walkthrough's `Instruction: ... Response: ...` text, or a --tokenizer that has one"
        )


def tokenize(rendered: Rendered, tokenizer, prompt_loss: bool) -> tuple[list[int], list[int]]:
    """(input_ids, labels), untruncated. A token is trained when its first character is."""
    import numpy as np

    enc = tokenizer(rendered.text, add_special_tokens=rendered.special_tokens, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if prompt_loss:
        return ids, list(ids)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    trained = np.zeros(len(ids), dtype=bool)
    for a, b in rendered.spans:
        trained |= (a <= starts) & (starts < b)
    trained &= ends > starts
    return ids, np.where(trained, np.asarray(ids, dtype=np.int64), IGNORE).tolist()


def end_of_turn_id(tokenizer) -> int | None:
    """The token that ends an assistant turn in the tokenizer's chat template (Gemma 4: `<turn|>`):
    the last token of a rendered one-exchange conversation's assistant span."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    probe = render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], tokenizer)
    ids, labels = tokenize(probe, tokenizer, prompt_loss=False)
    trained = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE]
    added = tokenizer.added_tokens_decoder.get(trained[-1]) if trained else None
    return trained[-1] if added is not None and added.special else None  # a marker, not a word


def stop_token_ids(tokenizer, eos: int | list[int] | None = None) -> list[int]:
    """The tokens a generated answer ends at: EOS (the model's generation config's, else the tokenizer's) and the
    chat template's end of turn. One rule for the samples at each eval, the export's generation config and the
    held-out task, whose YAML carries the ids: lm-eval decodes answers without special tokens, so an `until`
    of `<turn|>` never cuts them, and a directory whose generation config lacks the end of turn (a base, a hub
    id) would answer on past it."""
    eos = tokenizer.eos_token_id if eos is None else eos
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    end = end_of_turn_id(tokenizer)
    return ids + [end] if end is not None and end not in ids else ids


def load_tokenizer(ref: str):
    """The tokenizer of a hub id or directory, local or gs:// (--tokenizer, else the model's), with a pad token."""
    from transformers import AutoTokenizer

    from runtime.storage import model_directory

    tokenizer = AutoTokenizer.from_pretrained(model_directory(ref), token=os.environ.get("HF_TOKEN"))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
