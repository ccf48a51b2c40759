"""Tiny offline stand-ins for the cloud assets: a Gemma 4 model, its tokenizer, a Dolly-like dataset.

Same classes and formats as the real ones, small enough for a CPU, made without a network:

    python jobs/tiny_assets.py --out .local/assets
    # -> .local/assets/{model,dolly.jsonl}; the model directory holds the tokenizer too
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CATEGORIES = (
    "open_qa",
    "general_qa",
    "classification",
    "closed_qa",
    "brainstorming",
    "information_extraction",
    "summarization",
    "creative_writing",
)
SUBJECTS = (
    "rivers",
    "volcanoes",
    "bread",
    "chess",
    "tides",
    "bees",
    "glaciers",
    "lighthouses",
    "comets",
    "orchards",
    "violins",
    "deserts",
)
VERBS = ("explain", "describe", "summarise", "compare", "list facts about", "write a short note on")
WORDS = (
    "the a of and to in is it that for on with as by from at this be are was which or an can water light "
    "time small large warm cold early late people often usually because when while each many some more "
    "most first after before during under over between through around across slowly quickly carefully"
).split()


def make_dataset(path: Path, rows: int = 96, seed: int = 0) -> Path:
    """Dolly's columns (instruction, context, response, category), lengths from a few words to ~300."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(rows):
            subject = SUBJECTS[i % len(SUBJECTS)]
            n = rng.choice((4, 12, 30, 60, 120, 300))
            response = " ".join(rng.choice(WORDS + [subject]) for _ in range(n)).capitalize() + "."
            context = " ".join(rng.choice(WORDS) for _ in range(rng.choice((0, 0, 10, 40))))
            record = {
                "instruction": f"{rng.choice(VERBS).capitalize()} {subject}.",
                "context": context,
                "response": response,
                "category": CATEGORIES[i % len(CATEGORIES)],
            }
            f.write(json.dumps(record) + "\n")
    return path


def make_tokenizer(out: Path):
    """A word-level tokenizer over the dataset's vocabulary, saved in the fast-tokenizer format."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab_words = sorted(set(WORDS) | set(SUBJECTS) | {w for v in VERBS for w in v.split()})
    vocab_words += ["instruction", "response", ".", ",", ":", "?", "!"]
    vocab = {tok: i for i, tok in enumerate(specials + vocab_words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    core.normalizer = normalizers.Lowercase()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(out)
    return tokenizer


def make_model(out: Path, vocab_size: int, seed: int = 0) -> Path:
    """A random-weight Gemma 4 (text only, two layers) that AutoModelForCausalLM loads like the real one."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma4Config

    torch.manual_seed(seed)
    config = Gemma4Config(
        text_config={
            "vocab_size": vocab_size,
            "vocab_size_per_layer_input": vocab_size,
            "hidden_size": 64,
            "hidden_size_per_layer_input": 16,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "global_head_dim": 32,
            "max_position_embeddings": 1024,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_kv_shared_layers": 0,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
        },
        vision_config=None,
        audio_config=None,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def make_all(out: Path) -> dict[str, str]:
    """Write the model (with tokenizer) and the dataset under `out`; returns their paths."""
    model_dir, data_file = out / "model", out / "dolly.jsonl"
    if not (model_dir / "config.json").exists():
        tokenizer = make_tokenizer(model_dir)
        make_model(model_dir, vocab_size=len(tokenizer))
    if not data_file.exists():
        make_dataset(data_file)
    return {"model": str(model_dir), "dataset": str(data_file)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".local/assets"))
    print(json.dumps(make_all(parser.parse_args(argv).out)))


if __name__ == "__main__":
    main()
