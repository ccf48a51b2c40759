"""The data prepared once (jobs/data/prepared.py): the same rows the in-memory path made, found again under
the same key and made again when anything that shapes them changes, every bad record named."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.inprocess import settings

DOLLY = {"instruction": "Describe bees.", "context": "", "response": "Bees are warm and early."}


def tokenizer_of(assets: dict):
    from data.render import load_tokenizer

    return load_tokenizer(settings(assets).tokenizer_ref)


@pytest.mark.parametrize(
    "flags",
    [(), ("--prompt-loss",), ("--no-packing",), ("--recipe", "walkthrough")],
    ids=["packed", "packed, prompt trained", "padded", "walkthrough"],
)
def test_the_prepared_rows_are_the_rows_the_records_make_in_memory(tiny_assets, tmp_path, flags):
    """Row for row, the four tensors sft_data.examples makes from every record rendered in memory: the
    sampler's order is a function of (seed, epoch) over the same rows, so a run trains the same weights."""
    from data.prepare import prepare
    from data.prepared import PreparedRows, local_directory
    from data.sft_data import examples
    from tests.records import prepare_docs

    config = replace(settings(tiny_assets, "--eval-split", "train[80:96]", *flags), storage_path=str(tmp_path))
    tokenizer = tokenizer_of(tiny_assets)
    made = prepare(config, tokenizer)
    train, held_out = prepare_docs(config, tokenizer)
    for split, docs in (("train", train), ("eval", held_out)):
        want = examples(docs.items, config.seq_len, config.packing, tokenizer.pad_token_id, config.seed).tensors
        got = PreparedRows(local_directory(made.uri), split, config.seq_len, tokenizer.pad_token_id, config.packing)
        assert len(got) == len(want[0]) > 0
        for row in range(len(got)):
            for a, b in zip(got[row], (t[row] for t in want), strict=True):
                assert torch.equal(a, b), (split, row)
        assert made.report[split] == docs.report()


def test_a_second_preparation_reuses_the_first_and_any_change_makes_a_new_one(tiny_assets, tmp_path, monkeypatch):
    from data import prepare as prepared

    config = replace(settings(tiny_assets), storage_path=str(tmp_path))
    tokenizer = tokenizer_of(tiny_assets)
    first = prepared.prepare(config, tokenizer)
    assert not first.reused and (tmp_path / "prepared" / first.uri.rsplit("/", 1)[1] / "DONE").exists()
    monkeypatch.setattr(prepared, "run_chunks", lambda *a: pytest.fail("rendered again"))
    again = prepared.prepare(config, tokenizer)
    assert (again.uri, again.report, again.reused) == (first.uri, first.report, True)
    changed = {
        "seq_len": replace(config, seq_len=64),
        "seed": replace(config, seed=7),
        "overlong": replace(config, overlong="drop"),
        "prompt_loss": replace(config, prompt_loss=True),
        "packing": replace(config, packing=False),
        "split": replace(config, split="train[:40]"),
    }
    keys = {name: prepared.data_key(c, tokenizer) for name, c in changed.items()}
    template = tokenizer_of(tiny_assets)
    template.chat_template = template.chat_template.replace("model", "assistant")
    keys["chat template"] = prepared.data_key(config, template)
    data = tmp_path / "edited.jsonl"
    data.write_text(open(tiny_assets["dataset"]).read().replace("bees", "wasps", 1))
    keys["data"] = prepared.data_key(replace(config, dataset=str(data)), tokenizer)
    base = prepared.data_key(config, tokenizer)
    assert base not in keys.values() and len(set(keys.values())) == len(keys)


def test_bad_records_are_named_together_in_file_order(tiny_assets, tmp_path, monkeypatch, capsys):
    """Twelve bad records across several chunks: the first ten, by file and line, in one message."""
    import ray_train_llm_finetune as ft

    lines = [json.dumps(DOLLY)] * 120
    bad = [3, 10, 11, 25, 40, 41, 55, 60, 70, 81, 99, 110]  # 0-based; the file's lines are these + 1
    for i in bad:
        lines[i] = json.dumps(DOLLY | {"response": ""})
    data = tmp_path / "records.jsonl"
    data.write_text("\n".join(lines) + "\n")
    argv = ["--backend", "cpu", "--num-workers", "1", "--model", tiny_assets["model"], "--dataset", str(data),
            "--split", "train[:112]", "--eval-split", "none", "--storage-path", str(tmp_path / "runs"), "--preflight",
            "--prepare-chunk", "7"]  # fmt: skip
    assert ft.main(argv) == 2
    err = capsys.readouterr().err
    named = [f"records.jsonl, line {i + 1}: response is empty" for i in bad if i < 112]
    assert "10 bad records (the first 10, in file order)" in err and "Traceback" not in err
    shown = [line.strip() for line in err.splitlines() if "records.jsonl, line" in line]
    assert [s.split(str(tmp_path) + "/")[-1].split("; it must")[0] for s in shown] == named[:10]


def test_prepared_in_gs_is_copied_once_to_the_machine_and_read_the_same(storage, metadata_server, tiny_assets, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    """On the cluster the prepared files live in gs://: a rank's machine copies them once (through the
    emulator, with the pods' credentials) and reads the same rows as from a local preparation."""
    import tempfile

    from data.prepare import prepare
    from data.prepared import PreparedRows, local_directory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "machine"))
    (tmp_path / "machine").mkdir()
    config = settings(tiny_assets)
    tokenizer = tokenizer_of(tiny_assets)
    remote = prepare(replace(config, storage_path="gs://demo-data/ray_train_torchtpu"), tokenizer)
    local = prepare(replace(config, storage_path=str(tmp_path / "local")), tokenizer)
    assert remote.uri.startswith("gs://demo-data/ray_train_torchtpu/prepared/") and remote.report == local.report
    copied = local_directory(remote.uri)
    assert copied.startswith(str(tmp_path / "machine")) and local_directory(remote.uri) == copied  # once
    shape = (config.seq_len, tokenizer.pad_token_id, config.packing)
    a, b = PreparedRows(copied, "train", *shape), PreparedRows(local_directory(local.uri), "train", *shape)
    assert len(a) == len(b) > 0 and all(
        torch.equal(x, y) for r in range(len(a)) for x, y in zip(a[r], b[r], strict=True)
    )
