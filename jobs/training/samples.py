"""What the model says: at each eval, greedy answers to the first --eval-samples held-out prompts.

A prompt is a held-out record's tokens before its first trained one, as prepared (so rendered with
the chat template, up to the model's turn); its reference is the answer that follows (the first run of trained
tokens: a second exchange's answer is not this prompt's). A record's pictures and
clips go with it (the towers read them at the first step) and lead its prompt's text by name. The answer
is up to NEW_TOKENS tokens, stopping at the end of the turn (model.stop_at_end_of_turn).

Under FSDP every rank steps through generate() together (transformers' `synced_gpus=True`): each
forward all-gathers each layer's shards, so a rank that finished keeps doing forward passes until all
have. Every rank answers the same prompts, in one left-padded batch; rank 0 keeps the answers.
"""

from __future__ import annotations

NEW_TOKENS = 128


def held_out_prompts(rows, tokenizer, settings) -> list[dict]:
    """The first `settings.eval_samples` held-out records with a prompt: {"ids", "prompt", "reference"}.
    None when the prompt is trained too (--prompt-loss): there is no answer to tell apart."""
    import numpy as np

    if not settings.eval_samples or settings.prompt_loss:
        return []
    prompts = []
    for record in dict.fromkeys(int(i) for i in rows.rows):  # records in row order, once each
        ids, trained = rows.record(record)
        first = int(np.argmax(trained)) if trained.any() else 0
        if first == 0:
            continue
        answer = trained[first:].astype(bool)  # the first answer: a later exchange's is not this prompt's
        stop = first + (len(answer) if answer.all() else int(np.argmin(answer)))
        media = getattr(rows, "media", None)
        files = media.files(record) if media is not None else []
        prompts.append({
            "ids": np.asarray(ids[:first], dtype=np.int64),
            "prompt": (f"[{', '.join(files)}] " if files else "") + tokenizer.decode(ids[:first],
                                                                                      skip_special_tokens=True),
            "reference": tokenizer.decode(ids[first:stop], skip_special_tokens=True),
        } | ({"media": media.of([record])} if files else {}))  # fmt: skip
        if len(prompts) == settings.eval_samples:
            break
    return prompts


def answer(trainee, prompts: list[dict], device, world: int) -> list[dict]:
    """Greedy answers to `prompts` on every rank, in lockstep, in one batch (left-padded):
    [{"prompt", "completion", "reference"}]."""
    import torch

    root, model, tokenizer = trainee.loss, trainee.model, trainee.tokenizer
    longest = max(len(p["ids"]) for p in prompts)
    input_ids = torch.full((len(prompts), longest), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, p in enumerate(prompts):
        input_ids[row, longest - len(p["ids"]) :] = torch.as_tensor(p["ids"])
        attention_mask[row, longest - len(p["ids"]) :] = 1
    media = {}
    if any("media" in p for p in prompts):  # the prompts' pictures and clips, in row order, as a batch's
        from data.media_rows import join_media

        media = {k: v.to(device) for k, v in join_media([p.get("media", {}) for p in prompts]).items()}
        media["mm_token_type_ids"] = root.media_token_types(input_ids).to(device)
    was_training = root.training
    root.eval()
    # generate() calls the model inside the FSDP root (model.TokenLoss), whose own parameters (the
    # embeddings, the final norm, the tied head) are gathered by the root's forward; gather them here.
    root.unshard()
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=NEW_TOKENS,
                do_sample=False, synced_gpus=world > 1, pad_token_id=tokenizer.pad_token_id, **media,
            )  # fmt: skip
    finally:
        root.reshard()
        root.train(was_training)
    answers = [tokenizer.decode(row[longest:], skip_special_tokens=True).strip() for row in out]
    return [
        {"prompt": p["prompt"], "completion": a, "reference": p["reference"]}
        for p, a in zip(prompts, answers, strict=True)
    ]


def root_first(trainee) -> None:
    """A forward of the FSDP root on two padding tokens: FSDP2 picks its root at the first forward (not a layer's)."""
    import torch

    from data.labels import IGNORE

    with torch.no_grad():
        pad = torch.tensor([[trainee.tokenizer.pad_token_id] * 2], device=next(trainee.loss.parameters()).device)
        trainee.loss(input_ids=pad, labels=torch.full_like(pad, IGNORE))
