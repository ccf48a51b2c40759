"""Tiny offline stand-ins for the cloud assets: a Gemma 4 model, its tokenizer, a Dolly-like dataset and
preference pairs made from it.

Same classes and formats as the real ones, small enough for a CPU, made without a network:

    python jobs/tiny_assets.py --out .local/assets
    # -> .local/assets/{model,dolly.jsonl,pairs.jsonl}; the model directory holds the tokenizer too
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

from data.tiny_records import REWARD, make_pairs, make_prompts

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


def response_words(rng: random.Random, mix: str) -> int:
    """`tiny`: a few fixed lengths, a few words to ~300. `dolly`: dolly-15k's long-tailed shape.

    With the tiny tokenizer at --seq-len 512, `dolly` records fill about 37% of a padded row,
    as dolly-15k's do with the Gemma tokenizer (many short answers, a tail past 512).
    """
    if mix == "tiny":
        return rng.choice((4, 12, 30, 60, 120, 300))
    return max(1, min(1500, int(rng.lognormvariate(4.85, 1.0))))


def make_dataset(path: Path, rows: int = 96, seed: int = 0, mix: str = "tiny") -> Path:
    """Dolly's columns (instruction, context, response, category), lengths as `response_words` draws them."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(rows):
            subject = SUBJECTS[i % len(SUBJECTS)]
            n = response_words(rng, mix)
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


# Gemma 4's chat format, text turns only: `<bos><|turn>user\n{prompt}<turn|>\n<|turn>model\n{answer}<turn|>\n`;
# the assistant role renders as `model`, a system turn as `<|turn>system\n...<turn|>\n`, and the
# generation prompt is `<|turn>model\n`. Taken from the hub template's rendering as LLaMA-Factory's
# `template.py` and Google's gemma-skills restate it (../shared/FACTS.md); generation stops at `<turn|>`.
# A turn's content is a string or a list of text parts (OpenAI's and TRL's form), each part trimmed, as the hub
# template renders them (GEMMA4_MEDIA_CHAT_TEMPLATE below, less pictures and sound).
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% macro content(message) %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + content(message) + '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
TURN_MARKERS = ["<|turn>", "<turn|>"]


def make_tokenizer(out: Path):
    """A word-level tokenizer over the dataset's vocabulary, with Gemma 4's turn markers and chat
    template, saved in the fast-tokenizer format."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab_words = sorted(set(WORDS) | set(SUBJECTS) | {w for v in VERBS for w in v.split()})
    vocab_words += ["instruction", "response", "user", "model", "system", ".", ",", ":", "?", "!"]
    vocab = {tok: i for i, tok in enumerate(specials + vocab_words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    core.normalizer = normalizers.Lowercase()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TURN_MARKERS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tokenizer.chat_template = GEMMA4_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


# Model sizes: `tiny` for tests and `make local`; `bench` (about 4M matmul parameters) for
# `make bench`, big enough that compute, not per-step overhead, dominates on a CPU.
SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "head_dim": 32, "sliding_window": 64},
    "bench": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
              "head_dim": 64, "sliding_window": 128},
    # ~120M parameters: big enough that writing a checkpoint takes real time, for the bench's stall table
    "ckpt": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 8,
             "head_dim": 128, "sliding_window": 128},
    # E2B's structure: 4 of its 7 layers reuse an earlier layer's keys and values (E2B: 20 of 35), with double-wide
    # MLPs there; sliding layers beside full ones, the last full
    "e2b": {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 7, "num_attention_heads": 2,
            "head_dim": 32, "sliding_window": 64, "num_kv_shared_layers": 4, "use_double_wide_mlp": True,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                            "sliding_attention", "sliding_attention", "full_attention"]},
    # a mixture of experts shaped like 26B-A4B's layers: a dense MLP beside 4 experts, top 2, K = V on full layers
    "moe": {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "head_dim": 32, "sliding_window": 64, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
            "moe_intermediate_size": 32, "attention_k_eq_v": True, "num_global_key_value_heads": 1},
}  # fmt: skip


def make_model(out: Path, vocab_size: int, seed: int = 0, size: str = "tiny") -> Path:
    """A random-weight Gemma 4 (text only) that AutoModelForCausalLM loads like the real one, beside the tokenizer
    already saved in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma4Config

    torch.manual_seed(seed)
    shape = SIZES[size]
    layers = shape["num_hidden_layers"]
    config = Gemma4Config(
        text_config={
            "vocab_size": vocab_size,
            "vocab_size_per_layer_input": vocab_size,
            "hidden_size_per_layer_input": 16,
            "num_key_value_heads": 1,
            "global_head_dim": shape["head_dim"],
            "max_position_embeddings": 1024,
            # every other layer sliding, the last one full, as in Gemma 4 (a size may say otherwise)
            "layer_types": [
                "sliding_attention" if i % 2 == 0 and i < layers - 1 else "full_attention" for i in range(layers)
            ],
            "num_kv_shared_layers": 0,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
            **shape,
        },
        vision_config=None,
        audio_config=None,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # as Gemma 4's generation_config.json ([1, 106]): generation ends at EOS or at the end of turn, `<turn|>`
    # (the tokenizer saved in `out` before the model, by every caller)
    end_of_turn = AutoTokenizer.from_pretrained(out).convert_tokens_to_ids(TURN_MARKERS[1])
    model.generation_config.eos_token_id = [config.text_config.eos_token_id, end_of_turn]
    model.save_pretrained(out)
    return out


def make_tone(path: Path, hz: float, seconds: float = 0.5, rate: int = 16_000, channels: int = 1,
              loudness: float = 0.5) -> Path:  # fmt: skip
    """A sine tone as a 16-bit PCM WAV file (the standard library's `wave`: no audio package needed)."""
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    samples = (loudness * 32767 * np.sin(2 * np.pi * hz * t)).astype("<i2")
    with wave.open(str(path), "wb") as clip:
        clip.setnchannels(channels)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes(np.repeat(samples, channels).tobytes())
    return path


def make_picture(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (48, 32), mode: str = "RGB") -> Path:
    """A small picture, its format from the name (PNG, JPEG): a field of `colour` with a white square in it; in
    mode "RGBA", the square is transparent over green and its border half so (the colours under it are not white: a
    picture read without laying it on white is another picture); in mode "L", greyscale."""
    from PIL import Image, ImageDraw

    box = (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2)
    if mode == "RGBA":
        image = Image.new("RGBA", size, (*colour, 255))
        draw = ImageDraw.Draw(image)
        draw.rectangle(box, fill=(0, 255, 0, 128))
        draw.rectangle((box[0] + 2, box[1] + 2, box[2] - 2, box[3] - 2), fill=(0, 255, 0, 0))
    else:
        image = Image.new("RGB", size, colour)
        ImageDraw.Draw(image).rectangle(box, fill=(255, 255, 255))
        image = image.convert(mode)
    image.save(path)
    return path


# (the user turn's files, the caption: the tiny vocabulary's words; content parts unless said). Issue 46's records
# and issue 57's forms: a transparent PNG (red.png), a JPEG, a greyscale PNG, a second exchange, text alone.
MEDIA = (
    (("red.png",), "a warm small light"),
    (("blue.jpg",), "a cold large water"),
    (("tone-440.wav",), "a slowly early time"),
    (("tone-880.wav",), "a quickly late time"),
    (("blue.jpg", "tone-440.wav"), "a cold water and an early time"),
    (("red.png", "grey.png"), "a warm light and a cold water", "a warm light"),  # then a second exchange, in strings
    ((), "a small water"),  # text alone, in parts
    ((), "a large light", "strings"),  # text alone, in strings
)
PICTURES = {"red.png": ((200, 30, 30), "RGBA"), "blue.jpg": ((30, 30, 200), "RGB"), "grey.png": ((90, 90, 90), "L")}


def media_record(files: tuple[str, ...], caption: str, then: str | None = None) -> dict:
    """One of MEDIA's records: the files' parts (relative to the data file) before the question."""
    if then == "strings":
        return {"messages": [{"role": "user", "content": "describe it ."}, {"role": "assistant", "content": caption}]}
    parts = [{"type": (k := "audio" if name.endswith(".wav") else "image"), k: f"media/{name}"} for name in files]
    turns = [{"role": "user", "content": [*parts, {"type": "text", "text": "describe it ."}]},
             {"role": "assistant", "content": [{"type": "text", "text": caption}]}]  # fmt: skip
    if then:
        turns += [{"role": "user", "content": "describe it ."}, {"role": "assistant", "content": then}]
    return {"messages": turns}


def make_media(out: Path, copies: int = 1) -> Path:
    """Pictures and tones under `out`/media, and `out`/media.jsonl: `copies` chat records for each of MEDIA."""
    (out / "media").mkdir(parents=True, exist_ok=True)
    for name, (colour, mode) in PICTURES.items():
        make_picture(out / "media" / name, colour, mode=mode)
    for name, hz, seconds in (("tone-440.wav", 440, 0.5), ("tone-880.wav", 880, 1.0)):  # clips of two lengths
        make_tone(out / "media" / name, hz, seconds)
    with open(out / "media.jsonl", "w") as f:
        for record in MEDIA * copies:
            f.write(json.dumps(media_record(*record)) + "\n")
    return out / "media.jsonl"


# Gemma 4's chat template's content parts, as its hub template renders them: a text part trimmed, a picture as
# "\n\n<|image|>\n\n", a clip as "<|audio|>", each then expanded by the processor into its soft tokens. The model
# turn's content and end-of-turn marker inside {% generation %} (rendering nothing): the span this project trains,
# which TRL's SFTTrainer trains too with assistant_only_loss (processor.apply_chat_template's assistant mask).
GEMMA4_MEDIA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% macro content(message) %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% elif item['type'] == 'image' %}{{ '\n\n<|image|>\n\n' }}"
    "{% elif item['type'] == 'audio' %}{{ '<|audio|>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|turn>model\n' }}{% generation %}{{ content(message) }}{{ '<turn|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|turn>' + message['role'] + '\n' + content(message) + '<turn|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
# the tokens of media_processor.MEDIA_TOKENS, in its order
MEDIA_SPECIAL_TOKENS = ("<|image|>", "<|image>", "<image|>", "<|audio|>", "<|audio>", "<audio|>")
# Towers of Gemma 4's shapes, tiny (transformers' own tests' Gemma4Vision2TextModelTester and
# Gemma4Audio2TextModelTester): the vision tower's patch and pooling are the image processor's; the audio tower's
# first subsampling channels are the feature extractor's 128 mel bins (modeling_gemma4's input_proj_linear).
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 3,
          "position_embedding_size": 128}  # fmt: skip
AUDIO = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "subsampling_conv_channels": [128, 8],
         "conv_kernel_size": 3, "attention_chunk_size": 4, "attention_context_left": 5, "attention_context_right": 0,
         "output_proj_dims": 32, "use_clipped_linears": False}  # fmt: skip


def make_media_model(out: Path, seed: int = 0) -> Path:
    """A random-weight Gemma 4 with both towers (Gemma4ForConditionalGeneration) under `out`, with its tokenizer
    (the media tokens, the content parts' chat template) and processor: pictures at 70 soft tokens (the image
    processor's smallest budget), clips at 16 kHz."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from data.media_processor import MEDIA_TOKENS, PROCESSOR_CONFIG, MediaProcessor

    make_tokenizer(out)
    specials = dict(zip(MEDIA_TOKENS, MEDIA_SPECIAL_TOKENS, strict=True))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out, extra_special_tokens=specials)
    tokenizer.chat_template = GEMMA4_MEDIA_CHAT_TEMPLATE
    images = Gemma4ImageProcessorPil(patch_size=VISION["patch_size"], pooling_kernel_size=VISION["pooling_kernel_size"],
                                     max_soft_tokens=70)  # fmt: skip
    processor = MediaProcessor(Gemma4AudioFeatureExtractor(), images, tokenizer, GEMMA4_MEDIA_CHAT_TEMPLATE,
                               image_seq_length=70)  # fmt: skip
    processor.save_pretrained(out)
    # Gemma 4's files name a video processor too (Gemma4Processor's fourth part): the tiny one's, as its pictures'
    saved = json.loads((out / PROCESSOR_CONFIG).read_text())
    saved["video_processor"] = {"video_processor_type": "Gemma4VideoProcessor", "patch_size": VISION["patch_size"],
                                "pooling_kernel_size": VISION["pooling_kernel_size"], "max_soft_tokens": 70}  # fmt: skip
    (out / PROCESSOR_CONFIG).write_text(json.dumps(saved, indent=2))
    vocab, shape, ids = len(tokenizer), SIZES["tiny"], {k: tokenizer.convert_tokens_to_ids(v)
                                                       for k, v in specials.items()}  # fmt: skip
    config = Gemma4Config(
        text_config={"vocab_size": vocab, "vocab_size_per_layer_input": vocab, "hidden_size_per_layer_input": 16,
                     "num_key_value_heads": 1, "global_head_dim": shape["head_dim"], "max_position_embeddings": 1024,
                     "layer_types": ["sliding_attention", "full_attention"], "num_kv_shared_layers": 0,
                     "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "use_bidirectional_attention": "vision",
                     **shape},
        vision_config=VISION, audio_config=AUDIO, image_token_id=ids["image_token"], boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"], audio_token_id=ids["audio_token"], boa_token_id=ids["boa_token"],
        eoa_token_index=ids["eoa_token"], video_token_id=tokenizer.unk_token_id, pad_token_id=0, eos_token_id=1,
        bos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = [1, tokenizer.convert_tokens_to_ids(TURN_MARKERS[1])]
    model.save_pretrained(out)
    return out


# Bumped whenever what make_all writes changes: older assets are then made again (2: the chat template; 3: pairs;
# 4: the generation config stops at the end of turn, as Gemma 4's does; 5: the media model and records; 6: the
# text template renders text parts, and the media records issue 57's forms).
ASSETS_VERSION = "6"
MEDIA_COPIES = 12  # make local's media stage: 96 records, packed into 23 rows (2 steps of 2 workers x 4 rows)


def make_all(out: Path) -> dict[str, str]:
    """Write the model (with tokenizer), the dataset, the preference pairs, GRPO's prompts and reward file, and the
    model with both towers with its media records, under `out`; returns their paths. Assets an older version of this file made are replaced."""
    model_dir, data_file, stamp = out / "model", out / "dolly.jsonl", out / ".assets_version"
    pairs_file, media_model, media_file = out / "pairs.jsonl", out / "media-model", out / "media.jsonl"
    prompts_file, rewards_file = out / "prompts.jsonl", out / "rewards.py"
    if not stamp.exists() or stamp.read_text() != ASSETS_VERSION:
        for directory in (model_dir, media_model, out / "media"):
            shutil.rmtree(directory, ignore_errors=True)
        for file in (data_file, pairs_file, media_file, prompts_file, rewards_file):
            file.unlink(missing_ok=True)
    if not (model_dir / "config.json").exists():
        tokenizer = make_tokenizer(model_dir)
        make_model(model_dir, vocab_size=len(tokenizer))
    if not data_file.exists():
        make_dataset(data_file)
    if not pairs_file.exists():
        make_pairs(pairs_file, data_file)
    if not prompts_file.exists():
        make_prompts(prompts_file, rewards_file)
    if not (media_model / "config.json").exists():
        make_media_model(media_model)
    if not media_file.exists():
        make_media(out, copies=MEDIA_COPIES)
    stamp.write_text(ASSETS_VERSION)
    return {"model": str(model_dir), "dataset": str(data_file), "pairs": str(pairs_file),
            "media_model": str(media_model), "media": str(media_file), "prompts": str(prompts_file),
            "rewards": f"{rewards_file}:{REWARD}"}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".local/assets"))
    print(json.dumps(make_all(parser.parse_args(argv).out)))


if __name__ == "__main__":
    main()
