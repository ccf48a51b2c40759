"""Your own data: the three record formats (and renamed columns) train with the right labels; every
bad input fails before any worker, naming the file, the row and the fix; gs:// end to end against a
local GCS emulator, with credentials from the metadata-server stand-in (the pods' Workload Identity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gcp_standins import ACCESS_TOKEN, ForbiddenStorage
from tests.inprocess import settings, train

CONVERSATION = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Describe bees."}, {"role": "model", "content": "Bees are warm."},
    {"role": "user", "content": "And tides?"}, {"role": "assistant", "content": "Tides are late and cold."},
]}  # fmt: skip
PAIR = {"prompt": "Explain comets.", "completion": "Comets are cold and often quickly light."}
DOLLY = {"instruction": "Describe rivers.", "context": "Rivers are water.", "response": "Rivers are cold water."}


def write(path: Path, records: list[dict]) -> str:
    """json/jsonl/csv/parquet, by the suffix."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        import pyarrow as pa
        import pyarrow.csv
        import pyarrow.parquet

        table = pa.Table.from_pylist(records)
        (pyarrow.csv.write_csv if path.suffix == ".csv" else pyarrow.parquet.write_table)(table, str(path))
    return str(path)


FORMATS = {  # name: (file, records, extra flags, the assistant answers of one record)
    "messages": ("chat.jsonl", [CONVERSATION], [], ["Bees are warm.", "Tides are late and cold."]),
    "prompt/completion": ("pairs.csv", [PAIR], [], [PAIR["completion"]]),
    "dolly": ("dolly.parquet", [DOLLY], [], [DOLLY["response"]]),
    "renamed columns": ("qa.json", [{"question": PAIR["prompt"], "answer": PAIR["completion"]}],
                        ["--columns", "prompt=question,completion=answer"], [PAIR["completion"]]),
}  # fmt: skip


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_trains_on_the_assistant_turns_and_their_end_of_turn(name, tiny_assets, tmp_path, gloo_rank):
    from data.labels import IGNORE
    from tests.records import prepare_docs

    file, records, flags, answers = FORMATS[name]
    data = write(tmp_path / file, records * 24)
    config = settings({"model": tiny_assets["model"], "dataset": data}, "--split", "train[:16]", "--epochs", "1",
                      "--batch-size", "2", *flags)  # fmt: skip
    trainee, history = train(config)
    tokenizer = trainee.tokenizer
    assert history[0]["steps"] > 0 and 0 < history[0]["loss"] < 10 and history[0]["eval_tokens"] > 0
    train_docs, _ = prepare_docs(config, tokenizer)
    expected = [t for a in answers for t in [*tokenizer.tokenize(a), "<turn|>"]]
    for ids, labels in train_docs.items:
        trained = tokenizer.convert_ids_to_tokens([i for i, label in zip(ids, labels, strict=True) if label != IGNORE])
        assert trained == expected  # every assistant turn with its end of turn; nothing of the prompts
    assert train_docs.report()["format"] == {"renamed columns": "prompt/completion", "dolly":
                                             "instruction/context/response"}.get(name, name)  # fmt: skip


def finetune_main(tiny_assets, tmp_path, dataset: str, *flags: str) -> tuple[int, str]:
    import ray

    import ray_train_llm_finetune as ft

    argv = ["--backend", "cpu", "--num-workers", "1", "--model", tiny_assets["model"], "--dataset", dataset,
            "--split", "train", "--eval-split", "none", "--storage-path", str(tmp_path / "runs"), *flags]  # fmt: skip
    code = ft.main(argv)
    assert not ray.is_initialized()  # it stopped before asking for any worker
    return code


BAD_RECORDS = {  # name: (file, its text, what the error says)
    "not json": ("bad.jsonl", '{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": "b"}\n{"prompt": oops}\n',
                 "bad.jsonl, line 3: not JSON"),
    "no known format": ("qa.jsonl", '{"question": "q", "answer": "a"}\n',
                        "no known record format in columns question, answer: expected messages; prompt + completion; "
                        "instruction + response (rename columns with --columns"),
    "unknown role": ("roles.jsonl", json.dumps(CONVERSATION) + "\n" + json.dumps({"messages": [
                        {"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}) + "\n",
                     "roles.jsonl, line 2: turn 2 has the unknown role 'bot'; use one of system, user, assistant, model"),
    "no assistant turn": ("lonely.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n",
                          "lonely.jsonl, line 1: the conversation has no assistant turn"),
    "empty content": ("empty.jsonl", json.dumps(PAIR) + "\n" + json.dumps({"prompt": "hi", "completion": "  "}) + "\n",
                      "empty.jsonl, line 2: completion is empty; it must be non-empty text"),
    "content not text": ("typed.jsonl", json.dumps(PAIR) + "\n" + json.dumps({"prompt": "hi", "completion": 42}) + "\n",
                         "typed.jsonl, line 2: completion is int; it must be non-empty text"),
    "missing key": ("keys.jsonl", json.dumps(PAIR) + "\n" + json.dumps({"prompt": "hi"}) + "\n",
                    "keys.jsonl, line 2: completion is missing; it must be non-empty text"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_RECORDS)
def test_a_bad_record_fails_before_any_worker_naming_file_row_and_what_is_wrong(case, tiny_assets, tmp_path, capsys):
    file, text, message = BAD_RECORDS[case]
    (tmp_path / file).write_text(text)
    assert finetune_main(tiny_assets, tmp_path, str(tmp_path / file)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_every_bad_record_and_line_is_named_in_one_run_by_the_line_it_is_on(tiny_assets, tmp_path, capsys):
    """A bad role, no assistant turn, a line that is not JSON and a record of other columns: all four at once, in
    file order, each by its line (the ones after the unreadable line too)."""
    lines = [json.dumps(CONVERSATION)] * 45
    lines[9] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]})
    lines[19] = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    lines[29] = '{"messages": [{"role": "user", "content": "hi"}'
    lines[39] = json.dumps(PAIR)
    lines.insert(34, "")  # a blank line moves the later records down, as an editor numbers them
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    assert finetune_main(tiny_assets, tmp_path, str(tmp_path / "mixed.jsonl")) == 2
    err = capsys.readouterr().err
    data = tmp_path / "mixed.jsonl"
    assert "4 bad records:" in err and "Traceback" not in err
    expected = [f"{data}, line 10: turn 2 has the unknown role 'bot'", f"{data}, line 20: the conversation has no "
                f"assistant turn", f"{data}, line 30: not JSON", f"{data}, line 41: messages is missing"]  # fmt: skip
    at = [err.index(message) for message in expected]
    assert at == sorted(at)


def test_a_file_line_counts_the_lines_that_hold_no_record():
    from data.sft_data import FileRecords

    lines = FileRecords("a.jsonl", 5, skipped=(1, 4, 5))  # records on lines 2, 3, 6, 7, 8
    assert [lines.line(i) for i in range(5)] == [2, 3, 6, 7, 8]
    assert [FileRecords("b.csv", 3).line(i) for i in range(3)] == [1, 2, 3]


def test_your_own_small_file_trains_with_the_default_splits(tiny_assets, tmp_path, gloo_rank):
    """No --split, no --eval-split: all 200 records of the file, its last 13 (1/16) held out and not trained on."""
    import ray_train_llm_finetune as ft
    from config.command_line import from_args, parse_args

    data = write(tmp_path / "own.jsonl", [PAIR, {"prompt": "Describe bees.", "completion": "Bees are warm."}] * 100)
    argv = ["--backend", "cpu", "--num-workers", "1", "--model", tiny_assets["model"], "--dataset", data,
            "--storage-path", str(tmp_path / "runs"), "--seq-len", "128", "--epochs", "1"]  # fmt: skip
    assert ft.main([*argv, "--preflight", "--run-name", "p"]) == 0
    report = json.loads((tmp_path / "runs" / "p" / "data_report.json").read_text())
    assert (report["split"], report["train_records"], report["eval_records"]) == ("train", "train[0:187]",
                                                                                   "train[187:200]")  # fmt: skip
    assert (report["train"]["records_used"], report["eval"]["records_used"]) == (187, 13)
    _, history = train(from_args(parse_args(argv)))
    assert history[0]["steps"] > 0 and 0 < history[0]["eval_loss"] < 10


def test_the_default_held_out_records_follow_the_training_slice_or_end_it():
    from data.sft_data import default_eval
    from runtime.outcome import JobInputError

    dolly = {"train": 15011}
    assert default_eval([("train", 0, 1024)], dolly) == ([("train", 0, 1024)], [("train", 1024, 1088)])
    assert default_eval([("train", 0, 15011)], dolly) == ([("train", 0, 14755)], [("train", 14755, 15011)])  # 256
    assert default_eval([("train", 0, 200)], {"train": 200}) == ([("train", 0, 187)], [("train", 187, 200)])
    assert default_eval([("train", 0, 1020)], {"train": 1030}) == ([("train", 0, 1020)], [("train", 1020, 1030)])
    with pytest.raises(JobInputError, match="holds fewer than 2"):
        default_eval([("train", 4, 5)], {"train": 5})


def test_missing_files_and_globs_that_match_nothing_say_so(tiny_assets, tmp_path, capsys):
    for ref in (tmp_path / "missing.jsonl", tmp_path / "none-*.jsonl", tmp_path / "empty-dir"):
        (tmp_path / "empty-dir").mkdir(exist_ok=True)
        assert finetune_main(tiny_assets, tmp_path, str(ref)) == 2
        assert f"--dataset '{ref}' does not exist" in capsys.readouterr().err


def test_overlong_records_are_truncated_or_dropped_and_counted(tiny_assets, tmp_path, capsys):
    long = {"prompt": "Describe bees.", "completion": " ".join(["warm"] * 200)}
    data = write(tmp_path / "long.jsonl", [PAIR] * 16 + [long] * 4)
    assert (
        finetune_main(
            tiny_assets, tmp_path, data, "--preflight", "--run-name", "t", "--seq-len", "128", "--batch-size", "1"
        )
        == 0
    )
    report = json.loads((tmp_path / "runs" / "t" / "data_report.json").read_text())["train"]
    assert (report["records_read"], report["records_used"], report["truncated"], report["dropped"]) == (20, 20, 4, 0)
    assert report["longest_record_tokens"] > 128 and report["longest_record"] == f"{data}, line 17"
    assert finetune_main(tiny_assets, tmp_path, data, "--preflight", "--run-name", "d", "--overlong", "drop", "--seq-len",
                         "128", "--batch-size", "1") == 0  # fmt: skip
    report = json.loads((tmp_path / "runs" / "d" / "data_report.json").read_text())["train"]
    assert (report["records_used"], report["truncated"], report["dropped"]) == (16, 0, 4)
    out = capsys.readouterr().out
    assert "data: 20 training records (prompt/completion)" in out and "16 used (0 truncated, 4 dropped" in out


def test_a_gs_dataset_is_read_end_to_end_with_the_pods_credentials(
    storage, metadata_server, tiny_assets, tmp_path, monkeypatch
):
    """gs:// files and a glob, through gcsfs with the metadata server's token; the run's report goes to
    gs:// too (pyarrow). Only 127.0.0.1 is ever reached, and the local copies are gone afterwards."""
    import tempfile

    import fsspec

    import ray_train_llm_finetune as ft
    from config.command_line import from_args, parse_args

    gs = fsspec.filesystem("gs")
    gs.pipe("gs://demo-data/chat/part-0.jsonl", (json.dumps(CONVERSATION) + "\n").encode() * 12)
    gs.pipe("gs://demo-data/chat/part-1.jsonl", (json.dumps(CONVERSATION) + "\n").encode() * 12)
    gs.pipe("gs://demo-data/chat/notes.txt", b"not data")
    asked = len(metadata_server.requests)
    argv = ["--backend", "cpu", "--num-workers", "1", "--model", tiny_assets["model"], "--dataset",
            "gs://demo-data/chat/*.jsonl", "--split", "train[:20]", "--storage-path", "gs://demo-data/runs",
            "--run-name", "gs-run", "--preflight", "--batch-size", "1"]  # fmt: skip
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert ft.main(argv) == 0
    assert not list(tmp_path.glob("dataset-*"))
    report = json.loads(gs.cat("gs://demo-data/runs/gs-run/data_report.json"))
    assert (report["train"]["records_used"], report["eval"]["records_used"], report["train"]["format"]) == (
        20, 2, "messages",
    )  # fmt: skip
    assert any(r.endswith("/token") for r in metadata_server.requests[asked:])  # Workload Identity's token
    with pytest.raises(Exception, match="does not exist"):
        ft.run(from_args(parse_args([*argv[:7], "gs://demo-data/chat/missing.jsonl", *argv[8:]])))
    assert ACCESS_TOKEN.startswith("ya29.")


def test_a_bucket_the_pods_may_not_read_names_the_role_to_grant(tiny_assets, tmp_path, capsys):
    with ForbiddenStorage():
        assert finetune_main(tiny_assets, tmp_path, "gs://someone-elses/data.jsonl") == 2
    err = capsys.readouterr().err
    assert "the pods may not read bucket someone-elses" in err and "roles/storage.objectViewer" in err
    assert "gcloud storage buckets add-iam-policy-binding gs://someone-elses" in err and "Traceback" not in err
