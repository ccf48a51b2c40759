"""Records in the model's chat template: the prompt masked, the end of turn trained, padded and packed;
and the exported model stopping at the end of its turn."""

from __future__ import annotations

import json

import pytest

from data.labels import IGNORE
from data.render import RecordError, conversation, end_of_turn_id, render, render_chat, tokenize
from data.sft_data import packed_examples, padded_examples

DOLLY = {"instruction": "Describe bees.", "context": "Bees live in hives.", "response": "Bees are warm."}


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets["model"])


def trained_tokens(tokenizer, ids, labels) -> list[str]:
    return tokenizer.convert_ids_to_tokens([i for i, label in zip(ids, labels, strict=True) if label != IGNORE])


def test_the_chat_template_trains_the_answer_and_its_end_of_turn_only(tokenizer):
    turns = conversation(DOLLY, "instruction/context/response")
    rendered = render_chat(turns, tokenizer)
    assert rendered.text == (
        "<bos><|turn>user\nDescribe bees.\n\nBees live in hives.<turn|>\n<|turn>model\nBees are warm.<turn|>\n"
    )  # Gemma 4's turns, the context after the instruction
    ids, labels = tokenize(rendered, tokenizer, prompt_loss=False)
    assert trained_tokens(tokenizer, ids, labels) == ["bees", "are", "warm", ".", "<turn|>"]
    assert labels[-1] == end_of_turn_id(tokenizer) == tokenizer.convert_tokens_to_ids("<turn|>")
    assert all(label == IGNORE for label in labels[: ids.index(tokenizer.convert_tokens_to_ids("model")) + 1])
    _, every = tokenize(rendered, tokenizer, prompt_loss=True)  # --prompt-loss
    assert every == ids


def test_every_assistant_turn_of_a_conversation_is_trained(tokenizer):
    turns = conversation({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe bees."},
        {"role": "model", "content": "Bees are warm."}, {"role": "user", "content": "And tides?"},
        {"role": "assistant", "content": "Tides are late."},
    ]}, "messages")  # fmt: skip
    ids, labels = tokenize(render(turns, tokenizer, chat_template=True), tokenizer, prompt_loss=False)
    assert trained_tokens(tokenizer, ids, labels) == [
        "bees", "are", "warm", ".", "<turn|>", "tides", "are", "late", ".", "<turn|>",
    ]  # fmt: skip
    assert tokenizer.decode(ids).startswith("<bos> <|turn> system be <unk> . <turn|> <|turn> user")  # the system turn


def test_a_turn_of_text_parts_trains_as_its_string_does_and_a_part_of_another_kind_is_named(tokenizer):
    """OpenAI's and TRL's form in a text file: each turn a list of text parts, rendered by the chat template (as
    transformers renders them at inference); the same tokens and trained ones as the turns in strings."""
    strings = {"messages": [{"role": "user", "content": "Describe bees."}, {"role": "assistant", "content": "Bees are warm."},
                            {"role": "user", "content": "And tides?"}, {"role": "assistant", "content": "Tides are late."}]}  # fmt: skip
    in_parts = {"messages": [t | {"content": [{"type": "text", "text": t["content"]}]} for t in strings["messages"]]}
    rendered = [render(conversation(r, "messages"), tokenizer, chat_template=True) for r in (strings, in_parts)]
    assert tokenize(rendered[0], tokenizer, False) == tokenize(rendered[1], tokenizer, False)
    walkthrough = render(conversation(in_parts, "messages"), tokenizer, chat_template=False)
    assert walkthrough.text.startswith("Instruction: Describe bees.\nResponse: Bees are warm.")
    with pytest.raises(RecordError, match=r"turn 1's content's part 2 is 'video'; a part is text"):
        conversation({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "video"}]},
                                   {"role": "assistant", "content": "ok"}]}, "messages")  # fmt: skip
    with pytest.raises(RecordError, match=r"turn 2's content holds no text"):
        conversation({"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": [{"type": "text", "text": " "}]}]}, "messages")  # fmt: skip


def test_masks_survive_padding_and_packing(tokenizer):
    records = [DOLLY, {"instruction": "Explain tides.", "response": "Tides are late and cold."}]
    docs = [tokenize(render(conversation(r, "instruction/context/response"), tokenizer, True), tokenizer, False)
            for r in records]  # fmt: skip
    expected = sorted(t for ids, labels in docs for t in trained_tokens(tokenizer, ids, labels))
    for rows in (padded_examples(docs, 48, tokenizer.pad_token_id), packed_examples(docs, 48, 0, seed=0)):
        input_ids, real, labels, positions = rows.tensors
        got = sorted(t for r in range(len(input_ids)) for t in trained_tokens(tokenizer, input_ids[r], labels[r]))
        assert got == expected  # the same tokens trained, nothing of the prompts, padding or filler
    input_ids, real, labels, positions = packed_examples(docs, 48, 0, seed=0).tensors
    assert len(input_ids) == 1 and (positions[0] == 0).sum() == 3  # two records and the filler restart
    second = int((positions[0, 1:] == 0).nonzero()[0]) + 1
    assert labels[0, second] == IGNORE  # the second record's first token is never predicted from the first


def test_the_walkthroughs_text_is_one_flag_away(tokenizer):
    rendered = render(conversation(DOLLY, "instruction/context/response"), tokenizer, chat_template=False)
    assert rendered.text == "Instruction: Describe bees.\nResponse: Bees are warm."  # context left out, as there
    ids, labels = tokenize(rendered, tokenizer, prompt_loss=True)
    assert ids == labels == tokenizer(rendered.text)["input_ids"]  # the prompt in the loss, as there
    _, masked = tokenize(rendered, tokenizer, prompt_loss=False)
    assert trained_tokens(tokenizer, ids, masked) == ["bees", "are", "warm", "."]


def test_a_tokenizer_without_a_chat_template_says_what_to_pass(tiny_assets, tmp_path, capsys):
    import shutil

    import ray_train_llm_finetune as ft

    plain = tmp_path / "tokenizer"
    shutil.copytree(tiny_assets["model"], plain, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    base = ["--backend", "cpu", "--num-workers", "1", "--model", tiny_assets["model"], "--tokenizer", str(plain),
            "--dataset", tiny_assets["dataset"], "--split", "train[:80]", "--storage-path", str(tmp_path)]  # fmt: skip
    assert ft.main(base) == 2
    assert "has no chat template; pass --no-chat-template" in capsys.readouterr().err
    assert ft.main([*base, "--no-chat-template", "--preflight"]) == 0


def test_the_exported_model_stops_generating_at_the_end_of_its_turn(tiny_assets, tmp_path, gloo_rank):
    """Trained on one short answer in the chat template, exported, reloaded without any of this code:
    given the prompt through its chat template, it says the answer and stops at `<turn|>`."""
    import pyarrow.fs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.inprocess import settings, train
    from training.checkpoints import export_pretrained

    data = tmp_path / "qa.jsonl"
    data.write_text((json.dumps({"prompt": "Describe bees.", "completion": "Bees are warm and early."}) + "\n") * 8)
    config = settings({"model": tiny_assets["model"], "dataset": str(data)}, "--split", "train", "--eval-split",
                      "none", "--no-packing", "--batch-size", "4", "--epochs", "40", "--lr", "3e-3")  # fmt: skip
    trainee, _ = train(config)
    export_pretrained(trainee.model, trainee.tokenizer, pyarrow.fs.LocalFileSystem(), str(tmp_path / "model"))

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    exported_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    end = exported_tokenizer.convert_tokens_to_ids("<turn|>")
    eos = exported.generation_config.eos_token_id
    assert end in ([eos] if isinstance(eos, int) else eos)  # generate() stops there, as well as at <eos>
    prompt = exported_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe bees."}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )  # fmt: skip
    out = exported.generate(**prompt, max_new_tokens=20, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert exported_tokenizer.convert_ids_to_tokens(out) == ["bees", "are", "warm", "and", "early", ".", "<turn|>"]


def test_the_closing_summary_says_where_the_model_is_how_it_learned_and_what_the_slice_held():
    from config.command_line import from_args, parse_args
    from runtime.log_lines import closing_summary, devices_used

    history = [{"epoch": 1, "loss": 2.5, "eval_loss": 2.25}, {"epoch": 2, "loss": 2.0, "eval_loss": None}]
    result = {"run_name": "r", "checkpoint": "gs://b/r/model", "history": history, "loss_curve": "gs://b/r/loss.png",
              "samples": None, "tensorboard": "gs://b/r/tensorboard"}  # fmt: skip
    tpu7x = from_args(parse_args(["--accelerator-type", "TPU-V7X", "--topology", "2x2x2", "--num-slices", "2"]))
    devices, chips = devices_used(tpu7x, 32)  # 2 devices a chip
    assert (devices, chips) == ("2 x tpu7x 2x2x2, 16 chips", 16)
    text = closing_summary(result, 5400, devices, chips)
    assert text.splitlines()[0] == "done: run r, 2 epochs in 1 h 30 min on 2 x tpu7x 2x2x2, 16 chips"
    assert "  checkpoint:  gs://b/r/model  (copy it out: gcloud storage cp -r gs://b/r/model .)" in text
    assert "  losses:      epoch 1: train 2.5000, eval 2.2500; epoch 2: train 2.0000" in text
    assert "  cost:        24.00 chip-hours (2 x tpu7x 2x2x2, 16 chips for 1 h 30 min" in text


def test_ray_trains_line_for_every_report_is_quieted_in_the_workers():
    """Each report's whole metrics dict, on every rank, several times an epoch: the epoch line says it once."""
    import inspect
    import logging

    from ray.train.v2._internal.execution import context

    from runtime.log_lines import quiet_ray_reports

    assert "Reporting training result" in inspect.getsource(context.TrainContext._wait_then_report)
    assert "logger.info(" in inspect.getsource(context.TrainContext._wait_then_report)
    level = context.logger.level
    try:
        context.logger.setLevel(logging.INFO)  # as a Ray worker's logging config leaves it
        quiet_ray_reports()
        assert not context.logger.isEnabledFor(logging.INFO) and context.logger.isEnabledFor(logging.WARNING)
    finally:
        context.logger.setLevel(level)


def test_a_log_line_holds_one_line_and_marks_what_it_cut():
    from runtime.log_lines import one_line

    assert one_line("short\nanswer", 20) == "short answer"
    assert one_line("word " * 50, 20) == "word word word word…" and len(one_line("word " * 50, 20)) == 20
    assert one_line("Describe the tides.\n\nTides are the sea rising and falling.", 24) == "Describe the tides. Tid…"
