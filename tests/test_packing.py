"""Packed rows: boundaries, labels, positions, shapes, determinism; and no attention across records."""

from __future__ import annotations

import os

import pytest
import torch

from data.labels import IGNORE
from data.render import conversation, render_text, tokenize
from data.sft_data import model_inputs, pack_rows, packed_examples, padded_examples

SEQ = 32
IDS = [[2, 10 + i] + [20 + i] * n for i, n in enumerate([3, 28, 9, 14, 1, 30, 5, 11, 7, 18])]
DOCS = [(ids, ids) for ids in IDS]  # every token trained (the walkthrough's labels)


def walkthrough_docs(records, tokenizer):
    """`Instruction: ...\nResponse: ...` records, every token trained, untruncated."""
    return [tokenize(render_text(conversation(r, "instruction/context/response")), tokenizer, True) for r in records]


def test_rows_hold_every_record_once_and_never_overflow():
    rows = pack_rows([len(d) for d in IDS], SEQ, seed=42)
    assert sorted(i for row in rows for i in row) == list(range(len(IDS)))
    assert all(sum(len(IDS[i]) for i in row) <= SEQ for row in rows)
    # best fit: no two rows could have been one
    fills = sorted(sum(len(IDS[i]) for i in row) for row in rows)
    assert fills[0] + fills[1] > SEQ


def test_packing_is_deterministic_from_the_seed():
    lengths = [len(d) for d in IDS]
    assert pack_rows(lengths, SEQ, seed=42) == pack_rows(lengths, SEQ, seed=42)
    assert any(pack_rows(lengths, SEQ, seed=s) != pack_rows(lengths, SEQ, seed=42) for s in range(1, 6))


def test_positions_restart_and_labels_stop_at_boundaries():
    data = packed_examples(DOCS, SEQ, pad_id=0, seed=42)
    input_ids, real, labels, positions = data.tensors
    assert input_ids.shape == real.shape == labels.shape == positions.shape == (len(data), SEQ)
    rows = pack_rows([len(d) for d in IDS], SEQ, seed=42)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            doc, end = IDS[i], at + len(IDS[i])
            assert input_ids[r, at:end].tolist() == doc
            assert positions[r, at:end].tolist() == list(range(len(doc)))
            assert at == 0 or labels[r, at] == IGNORE  # never predicted from the previous record
            assert labels[r, at + 1 : end].tolist() == doc[1:]
            at = end
        assert real[r].sum() == at and (labels[r, at:] == IGNORE).all()  # filler: not text, not predicted
        assert positions[r, at:].tolist() == list(range(SEQ - at))
    assert int(real.sum()) == sum(len(d) for d in IDS)


def test_packed_batches_carry_positions_and_no_mask():
    batch = packed_examples(DOCS, SEQ, pad_id=0, seed=1).tensors
    assert set(model_inputs(batch, True, "cpu")) == {"input_ids", "position_ids", "labels"}
    assert set(model_inputs(batch, False, "cpu")) == {"input_ids", "attention_mask", "labels"}


def tiny_model(tiny_assets, attention: str):
    """The tiny Gemma 4 in fp32 with a sliding window (4) shorter than every record."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_assets["model"])
    config.text_config.sliding_window = 4
    model = AutoModelForCausalLM.from_pretrained(
        tiny_assets["model"], config=config, dtype=torch.float32, attn_implementation=attention
    ).eval()
    return model, AutoTokenizer.from_pretrained(tiny_assets["model"])


@pytest.fixture(scope="module")
def tiny(tiny_assets):
    return tiny_model(tiny_assets, "eager")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_record_in_a_packed_row_sees_only_itself(attention, tiny, tiny_assets):
    model, tokenizer = tiny if attention == "eager" else tiny_model(tiny_assets, attention)
    assert model.config.get_text_config()._attn_implementation == attention
    records = [{"instruction": f"Describe {s}.", "response": f"The {s} is warm and {s} often {w}."}
               for s, w in [("bees", "early"), ("tides", "late"), ("comets", "slowly"), ("chess", "small")]]  # fmt: skip
    docs = walkthrough_docs(records, tokenizer)
    assert all(len(ids) > 4 for ids, _ in docs)
    data = packed_examples(docs, 64, tokenizer.pad_token_id, seed=0)
    assert len(data) == 1  # all four in one row, so three of them follow another record
    row, rows = data.tensors, pack_rows([len(ids) for ids, _ in docs], 64, seed=0)
    with torch.no_grad():
        packed = model(**{k: v for k, v in model_inputs(row, True, "cpu").items() if k != "labels"}).logits[0]
        at = 0
        for i in rows[0]:
            ids = docs[i][0]
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            torch.testing.assert_close(packed[at : at + len(ids)], alone, rtol=1e-4, atol=1e-4)
            at += len(ids)


def test_packed_rows_keep_their_masks_without_asking_the_device_whether_they_are_packed(tiny, monkeypatch):
    """model.packed_masks_without_host_reads: one document or several, a row's logits are transformers' own."""
    from transformers import masking_utils

    from training.model import packed_masks_without_host_reads

    model, tokenizer = tiny
    docs = walkthrough_docs([{"instruction": "Explain bees.", "response": "Bees are warm and early."}] * 3, tokenizer)
    packed = packed_examples(docs, 64, tokenizer.pad_token_id, seed=0).tensors
    single = packed_examples(docs[:1], len(docs[0][0]), tokenizer.pad_token_id, seed=0).tensors
    rows = [{k: v for k, v in model_inputs(r, True, "cpu").items() if k != "labels"} for r in (packed, single)]
    found = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", getattr(found, "original", found))
    with torch.no_grad():
        assert masking_utils.find_packed_sequence_indices(rows[1]["position_ids"]) is None  # transformers' own
        before = [model(**r).logits for r in rows]
        packed_masks_without_host_reads()
        assert masking_utils.find_packed_sequence_indices(rows[1]["position_ids"]).eq(0).all()  # not None
        after = [model(**r).logits for r in rows]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_equivalence_check_bites_without_the_packed_positions(tiny):
    model, tokenizer = tiny
    docs = walkthrough_docs([{"instruction": "Explain bees.", "response": "Bees are warm."}] * 2, tokenizer)
    row = packed_examples(docs, 64, tokenizer.pad_token_id, seed=0).tensors
    (first, _), (second_ids, _) = docs
    with torch.no_grad():
        unmasked = model(input_ids=row[0]).logits[0]  # one causal row: the second record sees the first
        alone = model(input_ids=torch.tensor([second_ids])).logits[0]
    second = unmasked[len(first) : len(first) + len(second_ids)]
    assert (second - alone).abs().max() > 1e-2


def test_padded_rows_are_the_walkthroughs(tiny):
    _, tokenizer = tiny
    records = [{"instruction": "Explain bees.", "context": "Bees.", "response": "Bees are warm."}]
    input_ids, real, labels, _ = padded_examples(
        walkthrough_docs(records, tokenizer), 16, tokenizer.pad_token_id
    ).tensors
    expected = tokenizer(["Instruction: Explain bees.\nResponse: Bees are warm."], max_length=16,
                         truncation=True, padding="max_length", return_tensors="pt")  # fmt: skip
    assert torch.equal(input_ids, expected["input_ids"]) and torch.equal(real, expected["attention_mask"])
    assert torch.equal(labels, expected["input_ids"].masked_fill(real == 0, IGNORE))


# ---- utilisation --------------------------------------------------------------------------------


def test_flops_formula_on_a_known_config():
    from runtime.utilisation import AttentionLayer, causal_context, model_flops_per_token

    assert causal_context(8, None) == 4.5  # (1 + ... + 8) / 8
    assert causal_context(8, 2) == (1 + 2 * 7) / 8  # the first query sees 1 key, the rest 2
    assert causal_context(8, 100) == 4.5
    layers = [AttentionLayer(2, 4, None), AttentionLayer(2, 4, 2)]
    flops = model_flops_per_token(1000, 100, layers, 8)
    assert flops == 6 * 1000 + 4 * 100 + 12 * 2 * 4 * 4.5 + 12 * 2 * 4 * (15 / 8)


def test_describe_counts_the_matmuls_of_gemma4(tiny):
    from runtime.utilisation import AttentionLayer, describe

    model, tokenizer = tiny
    text = model.config.get_text_config()
    h, f, p, hd = text.hidden_size, text.intermediate_size, text.hidden_size_per_layer_input, text.head_dim
    per_layer = (
        h * text.num_attention_heads * hd * 2  # q, o
        + h * text.num_key_value_heads * hd * 2  # k, v
        + 3 * h * f  # gate, up, down
        + 2 * h * p  # per-layer input gate and projection
    )
    expected = text.num_hidden_layers * per_layer + p * text.num_hidden_layers * h + len(tokenizer) * h
    model.model.language_model.embed_tokens_per_layer.weight.requires_grad_(False)  # a lookup: never counted
    assert describe(model) == (
        expected,
        0,
        [AttentionLayer(2, 32, 4), AttentionLayer(2, 32, None)],
    )


# ---- the walkthrough's command line ---------------------------------------------------------------


def test_walkthrough_flags_are_accepted(monkeypatch, capsys):
    from config.command_line import from_args, parse_args
    from config.setting_checks import check, worker_count

    monkeypatch.setenv("STORAGE_PATH", "gs://b/ray_train_torchtpu")
    args = parse_args(
        ["--model-id", "google/gemma-4-E2B-it", "--num-epochs", "3", "--batch-size-per-device", "4",
         "--dataset-split", "train[:1024]", "--num-workers", "16"]
    )  # fmt: skip
    assert (args.model, args.epochs, args.batch_size, args.split) == ("google/gemma-4-E2B-it", 3, 4, "train[:1024]")
    walkthrough = from_args(args)
    assert walkthrough.storage_path == "gs://b/ray_train_torchtpu" and walkthrough.packing is True
    assert worker_count(check(walkthrough)) == 16
    assert from_args(parse_args(["--no-packing"])).packing is False
    monkeypatch.delenv("STORAGE_PATH")
    assert from_args(parse_args([])).storage_path == os.path.expanduser("~/ray_results")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = capsys.readouterr().out
    for pair in ("--model TEXT, --model-id TEXT", "--epochs N, --num-epochs N", "--no-packing"):
        assert pair in shown


def test_peak_flops_per_device_and_mfu():
    from dataclasses import replace

    from config.command_line import from_args, parse_args
    from training.worker_hooks import peak_flops_per_device

    base = from_args(parse_args(["--backend", "tpu", "--accelerator-type", "TPU-V6E"]))
    assert peak_flops_per_device(base) == 918e12
    assert peak_flops_per_device(replace(base, accelerator_type="TPU-V7X")) == 2307e12 / 2
    assert peak_flops_per_device(replace(base, backend="cpu")) is None
    assert peak_flops_per_device(replace(base, backend="cpu", peak_tflops=2.0)) == 2e12
