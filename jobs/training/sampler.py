"""GRPO's sampler: the learner's own generation, on the learner's devices, with the learner's weights.

Why not a vLLM engine beside the learner (docs/grpo.md): on TPU the pinned tpu-inference gives no way to put a
PyTorch learner's new weights into its engine. Its worker's `update_weights` is a no-op ("weights are applied
out-of-band": Tunix writes into the engine's JAX arrays in-process) and `sleep`/`wake_up` raise
NotImplementedError (tpu-inference v0.27.0, tpu_inference/worker/tpu_worker.py: update_weights at line 757, sleep
at 782, wake_up at 791), and it has no `reload_weights` anywhere (git grep). So the sampler is the model being
trained: no weights to move (the sync is 0 s, and the old log-probabilities are the learner's own, with no
importance-sampling correction to make), at the price of generating with transformers' `generate()` under FSDP.

Every rank samples its own prompts, num_generations completions each, in one left-padded batch; under FSDP every
rank steps through generate() together (`synced_gpus=True`, as samples.answer does), since each forward
all-gathers each layer's shards. Sampling is TRL's (GRPOConfig's generation defaults): the temperature, no top-k
(transformers' own default is 50) and no top-p, up to max_completion_length new tokens, ending at the end of the
turn (model.stop_at_end_of_turn).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Samples:
    completions: list[list[int]]  # each completion's tokens, its stop token kept, no padding
    seconds: float
    tokens: int  # the completions' tokens on this rank

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def cut(row: list[int], stops: set[int], pad: int) -> list[int]:
    """A generated row's completion: up to and with its first stop token, else its tokens without padding."""
    for i, token in enumerate(row):
        if token in stops:
            return row[: i + 1]
    while row and row[-1] == pad:
        row = row[:-1]
    return row


def sampling(temperature: float) -> dict:
    """generate()'s sampling arguments: TRL's (the temperature, no top-k, no top-p), or greedy at temperature 0."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def sample(trainee, prompts: list[list[int]], num_generations: int, max_new: int, temperature: float, device,
           world: int, seed: int) -> Samples:  # fmt: skip
    """num_generations completions of each prompt (consecutive, in prompt order), sampled from the model as it is
    now (greedily at temperature 0); `seed` makes a step's samples the same after a restart."""
    import torch

    from data.render import stop_token_ids
    from training.samples import root_first

    root, model, tokenizer = trainee.loss, trainee.model, trainee.tokenizer
    rows = [p for p in prompts for _ in range(num_generations)]
    longest = max(len(p) for p in rows)
    input_ids = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(rows):
        input_ids[i, longest - len(p) :], attention_mask[i, longest - len(p) :] = torch.as_tensor(p), 1
    root_first(trainee)  # (FSDP2 takes its root at the first forward: the root's, not generate()'s first layer)
    was_training = root.training
    root.eval()
    root.unshard()  # (generate() calls inside the FSDP root: gather the root's own parameters, as samples.answer)
    started = time.perf_counter()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 max_new_tokens=max_new, synced_gpus=world > 1, pad_token_id=tokenizer.pad_token_id,
                                 **sampling(temperature))  # fmt: skip
    finally:
        root.reshard()
        root.train(was_training)
    seconds = time.perf_counter() - started
    stops = set(stop_token_ids(tokenizer))
    completions = [cut(row[longest:].tolist(), stops, tokenizer.pad_token_id) for row in out.cpu()]
    return Samples(completions, seconds, sum(len(c) for c in completions))
