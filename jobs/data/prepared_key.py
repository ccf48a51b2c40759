"""The prepared data's key: everything that shapes the rows, hashed (jobs/data/prepare.py stores the rows under it,
training/preferences.py the pairs): the data's content, the tokenizer and chat template, the recipe's keys; for
records with pictures or sound, every such file's content and the model whose processor read them."""

from __future__ import annotations

import hashlib
import json
import os

from data.sft_data import load_splits
from runtime.storage import gcs

FORMAT = 2  # bumped whenever what a preparation writes changes


def _file_digest(name: str) -> str:
    """A file's content: sha256 of its bytes here; a gs:// object's checksum and generation (no download)."""
    if name.startswith("gs://"):
        info = gcs().info(name)
        return json.dumps([info.get(k) for k in ("md5Hash", "crc32c", "generation", "size")])
    digest = hashlib.sha256()
    with open(name, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_fingerprint(settings) -> list:
    from config.data_formats import is_file_source
    from data.sft_data import data_files

    if is_file_source(settings.dataset):
        files = data_files(settings.dataset)
        return [(os.path.basename(f), _file_digest(f)) for f in files] + media_fingerprint(files, settings.model)
    _, _, loaded = load_splits(settings)  # the hub's copy, from datasets' cache after the first time
    return [(settings.dataset, settings.dataset_config, n, s.data._fingerprint) for n, s in sorted(loaded.items())]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [backend.to_str() if backend is not None else repr(tokenizer.get_vocab()), tokenizer.chat_template or "",
             tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id]  # fmt: skip
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def data_key(settings, tokenizer) -> str:
    """What shapes the rows, hashed: change any of it and the data is prepared again."""
    shaping = {
        "format": FORMAT,
        "data": data_fingerprint(settings),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "recipe": [
            settings.chat_template,
            settings.prompt_loss,
            settings.packing,
            sorted(settings.column_renames.items()),
        ],
        "splits": [settings.split, settings.eval_split],
        "rows": [settings.seq_len, settings.overlong, settings.seed, getattr(tokenizer, "padding_side", "right")],
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:32]


def media_fingerprint(files: list[str], model: str) -> list:
    """Every picture and clip a JSON or JSON Lines file's records name, by content (a file replaced under the same
    name is prepared again), and the model whose processor read them; [] for data without any. A line that is not
    JSON, or a record the preflight will refuse, adds nothing: the preparation names it."""
    import fsspec

    from data.media import located, media_refs
    from data.render import RecordError
    from runtime.storage import fsspec_options

    found = []
    for name in (f for f in files if f.endswith((".jsonl", ".json"))):
        with fsspec.open(name, "r", **fsspec_options(name)) as f:
            lines = f if name.endswith(".jsonl") else [f.read()]
            for line in lines:
                try:
                    records = json.loads(line) if line.strip() else []
                    for record in records if isinstance(records, list) else [records]:
                        found += [(r.kind, located(r.ref, name)) for r in media_refs(record)]
                except (json.JSONDecodeError, RecordError, AttributeError, TypeError):
                    continue
    digests = {path: _media_digest(path) for _, path in sorted(set(found))}
    return [("media", model, sorted(digests.items()))] if digests else []


def _media_digest(path: str) -> str:
    try:
        if path.startswith(("http://", "https://")):  # what the address gives now (read once more, by the check)
            from data.media import _read

            return hashlib.sha256(_read(path)).hexdigest()
        if path.startswith("data:"):
            return hashlib.sha256(path.encode()).hexdigest()
        return _file_digest(path)
    except OSError:
        return "missing"  # (the preparation names it)
