"""DPO (jobs/training/dpo.py, jobs/data/preference_data.py): pairs tokenized as TRL's DPOTrainer tokenizes them, bad records named
by file and line, the loss invariant to how a global batch of pairs is split, and the same losses and reward
accuracies as TRL's DPOTrainer (trl 1.16.0) step for step on the tiny model."""

from __future__ import annotations

import json

import pytest

from tests.inprocess import build, settings

STEPS = 3


def preference_records(dataset: str, n: int, conversational: bool) -> list[dict]:
    """Pairs from the tiny Dolly data: a record's response chosen over the next record's."""
    records = [json.loads(line) for line in open(dataset)][: n + 1]
    pairs = []
    for a, b in zip(records, records[1:], strict=False):
        prompt, chosen, rejected = a["instruction"], a["response"], b["response"]
        if conversational:
            prompt = [{"role": "user", "content": prompt}]
            chosen, rejected = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs


def test_bad_preference_records_are_named_by_file_and_line(tiny_assets, tmp_path):
    """Every bad pair and every line that is not a record, in one message, by the line an editor shows."""
    from data.preference_data import read_pairs
    from data.render import load_tokenizer
    from runtime.outcome import JobInputError

    good = preference_records(tiny_assets["dataset"], 4, conversational=False)
    bad = [{"prompt": "q", "chosen": "same", "rejected": "same"}, {"prompt": "q", "chosen": "a"},
           {"prompt": "q", "chosen": " ", "rejected": "b"},
           {"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}]  # fmt: skip
    path = tmp_path / "pairs.jsonl"
    lines = (
        [json.dumps(r) for r in good[:2] + bad[:3]] + ['{"prompt": "q", "chosen": '] + [json.dumps(r) for r in good[2:]]
    )
    path.write_text("\n".join(lines) + "\n")
    config = settings({"model": tiny_assets["model"], "dataset": str(path)}, "--split", "train", "--eval-split",
                      "none")  # fmt: skip
    with pytest.raises(JobInputError) as err:
        read_pairs(config, load_tokenizer(config.tokenizer_ref))
    assert str(err.value).splitlines() == [  # in file order, a line that is not JSON among them, as SFT's
        "4 bad records:",
        f"  {path}, line 3: chosen and rejected are the same; a pair must prefer one answer to another",
        f"  {path}, line 4: rejected is missing",
        f"  {path}, line 5: chosen is empty",
        f'  {path}, line 6: not JSON (Expecting value): \'{{"prompt": "q", "chosen":\'',
    ]
    from data.preference_data import preference_record
    from data.render import RecordError

    with pytest.raises(RecordError, match="mixes text and turns"):
        preference_record(bad[3])


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_each_rows_log_probability_chunked_equals_the_whole_logits(softcap):
    """chunked_loss.row_log_probs: N positions at a time, recomputed in the backward pass, against autograd through
    the whole logits (a soft-cap small enough to bend them), values and gradients."""
    import torch

    from training.chunked_loss import row_log_probs

    torch.manual_seed(0)
    hidden = torch.randn(4, 9, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (4, 9))
    labels[:, :3], labels[3, 6:] = -100, -100  # a prompt, and a padded row
    weights = torch.randn(4, dtype=torch.float64)
    results = []
    for chunk in (0, 5):
        values = row_log_probs(hidden, weight, labels, softcap, chunk)
        (values * weights).sum().backward()
        results.append((values.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    (whole, *whole_grads), (chunked, *chunked_grads) = results
    assert torch.allclose(whole, chunked, atol=1e-5) and whole.abs().min() > 1
    for a, b in zip(whole_grads, chunked_grads, strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)


def trl_trainer(model_dir: str, records: list[dict], out, seq_len: int, lr: float, beta: float, loss: str,
                batch: int):  # fmt: skip
    """TRL's DPOTrainer on the tiny model, its per-layer table frozen as the job freezes it."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from data.render import load_tokenizer
    from training.model import freeze_per_layer_embeddings, load_model

    model = load_model(model_dir, "float32")
    freeze_per_layer_embeddings(model)
    config = DPOConfig(output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                       learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
                       weight_decay=0.0, beta=beta, loss_type=[loss], max_steps=STEPS, logging_steps=1,
                       report_to=[], use_cpu=True, precompute_ref_log_probs=True, max_length=seq_len,
                       save_strategy="no", seed=0, bf16=False, dataloader_drop_last=True)  # fmt: skip
    return DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(records),
                      processing_class=load_tokenizer(model_dir))  # fmt: skip


@pytest.mark.slow
def test_standard_and_implicit_prompt_pairs_are_tokenized_as_trl_tokenizes_them(tiny_assets, tmp_path):
    """Strings without the chat template (TRL's standard format: raw text, EOS appended) and whole conversations
    with no prompt column (TRL's extract_prompt): the same prompt, chosen and rejected ids as TRL's DPOTrainer."""
    from data.preference_data import Pair, preference_record, tokenize_pair
    from data.render import load_tokenizer

    tokenizer = load_tokenizer(tiny_assets["model"])
    standard = preference_records(tiny_assets["dataset"], 4, conversational=False)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                for r in preference_records(tiny_assets["dataset"], 4, conversational=True)]  # fmt: skip
    for records, chat_template in ((standard, False), (implicit, True)):
        trainer = trl_trainer(tiny_assets["model"], records, tmp_path / "trl", 512, 1e-3, 0.1, "sigmoid", batch=4)
        theirs = [Pair(tuple(r["prompt_ids"]), tuple(r["chosen_ids"]), tuple(r["rejected_ids"]))
                  for r in trainer.train_dataset]  # fmt: skip
        ours = [tokenize_pair(preference_record(r), tokenizer, chat_template) for r in records]
        assert ours == theirs and all(p.prompt_ids and p.chosen_ids and p.rejected_ids for p in ours)


def our_steps(trainee, optimizer, pairs, seq_len: int, lr: float, beta: float, loss: str, splits: int = 1,
              rank: int = 0, world: int = 1) -> list[dict]:  # fmt: skip
    """STEPS optimizer steps of dpo.dpo_step over the whole of `pairs` as one global batch (this rank's share in
    `splits` micro-batches): the loss and TRL's metrics of each."""
    import numpy as np

    from data.preference_data import pair_rows
    from training.dpo import METRICS, dpo_step, pair_log_probs

    pad = trainee.tokenizer.pad_token_id
    ref_chosen, ref_rejected = pair_log_probs(trainee.loss, pairs, seq_len, pad, 4, rank, world, "cpu")
    mine = np.array_split(np.arange(rank, len(pairs), world), splits)
    micro = [pair_rows([pairs[i] for i in m], seq_len, pad) | {"ref_chosen": ref_chosen[m].astype(np.float32),
             "ref_rejected": ref_rejected[m].astype(np.float32)} for m in mine]  # fmt: skip
    out = []
    for _ in range(STEPS):
        result = dpo_step(trainee.loss, optimizer, micro, lr, 1.0, beta, loss, "cpu")
        sums = result.metric_sums.clone()
        import torch.distributed as dist

        loss_sum = result.loss_sum.clone()
        dist.all_reduce(sums)
        dist.all_reduce(loss_sum)
        pairs = result.counts[0]
        out.append({"loss": float(loss_sum) / pairs, "grad_norm": float(result.grad_norm)}
                   | {m: float(v) / pairs for m, v in zip(METRICS, sums, strict=True)})  # fmt: skip
    return out


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_equals_trls_dpo_trainer_step_for_step(tiny_assets, tmp_path, gloo_rank, loss):
    """8 pairs as one global batch, 3 steps, AdamW at a constant 1e-3, clipping at 1.0: the same tokens (prompt
    masked, the same trained positions), reference log-probabilities, losses, reward accuracies and gradient norms
    as TRL's DPOTrainer (which computes its reference log-probabilities once too: precompute_ref_log_probs)."""
    from data.preference_data import Pair, preference_record, tokenize_pair

    records = preference_records(tiny_assets["dataset"], 8, conversational=True)
    seq_len, lr, beta = 96, 1e-3, 0.1
    trainer = trl_trainer(tiny_assets["model"], records, tmp_path / "trl", seq_len, lr, beta, loss, batch=8)
    config = settings(tiny_assets, "--lr", str(lr), "--lr-schedule", "constant", "--warmup-ratio", "0",
                      "--max-grad-norm", "1.0", "--weight-decay", "0", "--seq-len", str(seq_len))  # fmt: skip
    trainee, optimizer = build(config)
    pairs = [tokenize_pair(preference_record(r), trainee.tokenizer, True) for r in records]
    theirs_tokens = [Pair(tuple(r["prompt_ids"]), tuple(r["chosen_ids"]), tuple(r["rejected_ids"]))
                     for r in trainer.train_dataset]  # fmt: skip
    assert pairs == theirs_tokens
    ours = our_steps(trainee, optimizer, pairs, seq_len, lr, beta, loss)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h][:STEPS]
    assert len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for name in ("loss", "rewards/accuracies", "rewards/chosen", "rewards/margins", "logps/chosen",
                     "logps/rejected", "grad_norm"):  # fmt: skip
            assert a[name] == pytest.approx(b[name], abs=1e-4, rel=1e-4), (step, name, a[name], b[name])
    assert ours[-1]["loss"] < ours[0]["loss"]  # it learns


def _dpo_rank_main(rank: int, world: int, rendezvous: str, assets: dict, splits: int, flags: tuple, out: str) -> None:
    import torch
    import torch.distributed as dist

    from data.preference_data import preference_record, tokenize_pair
    from tests.inprocess import _join

    _join(rank, world, rendezvous)
    try:
        config = settings(assets, "--lr", "1e-3", "--lr-schedule", "constant", "--warmup-ratio", "0",
                          "--seq-len", "96", "--num-workers", str(world), *flags)  # fmt: skip
        trainee, optimizer = build(config, world)
        records = preference_records(assets["dataset"], 8, conversational=False)
        pairs = [tokenize_pair(preference_record(r), trainee.tokenizer, True) for r in records]
        steps = our_steps(trainee, optimizer, pairs, 96, 1e-3, 0.1, "sigmoid", splits, rank, world)
        if rank == 0:
            torch.save(steps, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_dpo_loss_is_the_mean_over_the_global_batch_however_it_is_split(tiny_assets):
    """8 pairs as 1 rank x 1 micro-batch, 1 rank x 3 micro-batches (3, 3, 2 pairs), 2 ranks x 4 pairs, 2 slices of
    2 ranks (HSDP) and 1 rank with activation checkpointing: the same losses, gradient norms and metrics each step
    (a per-micro-batch or per-rank mean would weight the pairs unequally, and FSDP's sum over ranks would double
    the gradient)."""
    from tests.inprocess import _spawn

    cases = ((1, 1, ()), (1, 3, ()), (2, 1, ()), (4, 1, ("--num-slices", "2")), (1, 1, ("--activation-checkpointing",)))
    one, *others = (_spawn(_dpo_rank_main, world, tiny_assets, splits, flags) for world, splits, flags in cases)
    for other in others:
        for a, b in zip(one, other, strict=True):
            assert a == {k: pytest.approx(v, abs=1e-5, rel=1e-4) for k, v in b.items()}
    assert one[0]["rewards/accuracies"] == 0 and one[-1]["rewards/accuracies"] > 0.5


def dpo_settings(assets: dict, *flags: str):
    return settings({"model": assets["model"], "dataset": assets["pairs"]}, "--objective", "dpo", "--split",
                    "train[:24]", "--batch-size", "4", "--eval-samples", "0", "--epochs", "2", *flags)  # fmt: skip


@pytest.mark.slow  # (the SFT run's resume and SIGTERM tests hold the loop in make test-fast)
def test_a_dpo_run_resumes_exactly_and_reads_its_reference_back(tiny_assets, tmp_path, gloo_rank):
    """The run loop with --objective dpo: each epoch's loss, reward accuracy and the held-out pairs' (auto: the 2
    after the 24 trained); a run stopped after epoch 1 and resumed ends with the uninterrupted run's weights, its
    reference log-probabilities read back, never recomputed: with them gone, the resume refuses to go on."""
    import shutil

    from tests.inprocess import full_state, run
    from tests.test_recipe import relative_distance

    config = dpo_settings(tiny_assets)
    whole, state = run(config, root=str(tmp_path / "whole"))
    history = list(state.history)
    assert len(history) == 2 and history[-1]["loss"] < history[0]["loss"]
    assert all({"rewards/accuracies", "rewards/margins", "eval_loss", "eval_rewards/accuracies"} <= set(h)
               for h in history)  # fmt: skip
    assert history[-1]["rewards/accuracies"] > 0.5
    run(config, epochs=1, root=str(tmp_path / "parts"))
    from training.objectives import training_data

    data = training_data(config, whole.tokenizer, 0, 1)
    reference = data.reference_uri("float32")
    shutil.move(reference, tmp_path / "kept.npz")
    with pytest.raises(RuntimeError, match="reference log-probabilities .* are missing"):
        run(config, root=str(tmp_path / "parts"), resume_from=str(tmp_path / "parts" / "checkpoint_epoch_0001"))
    shutil.move(tmp_path / "kept.npz", reference)
    resumed, resumed_state = run(config, root=str(tmp_path / "parts"),
                                 resume_from=str(tmp_path / "parts" / "checkpoint_epoch_0001"))  # fmt: skip
    assert relative_distance(full_state(whole.model), full_state(resumed.model)) < 1e-6
    assert resumed_state.history[-1]["loss"] == pytest.approx(history[-1]["loss"], rel=1e-6)


def test_the_driver_checks_and_prepares_pairs_before_any_worker(tiny_assets, tmp_path, capsys):
    """--objective dpo --preflight: the pairs read, checked, tokenized and stored once (reused the second time),
    the data report in pairs; the walkthrough's Dolly refused as DPO data before anything is read."""
    import ray_train_llm_finetune as ft

    base = ["--backend", "cpu", "--num-workers", "2", "--model", tiny_assets["model"], "--objective", "dpo",
            "--storage-path", str(tmp_path), "--split", "train[:40]", "--preflight"]  # fmt: skip
    for made in ("made now", "reused"):
        assert ft.main([*base, "--dataset", tiny_assets["pairs"]]) == 0
        out = capsys.readouterr().out
        assert "40 used (0 truncated, 0 dropped at --seq-len)" in out and "40 pairs (not packed), 5 steps" in out
        assert "eval: 3 held-out records (auto: train[40:43]" in out and f"({made})" in out
    assert ft.main(base) == 2
    assert (
        "--dataset 'databricks/databricks-dolly-15k' holds instructions, not preference pairs"
        in capsys.readouterr().err
    )


@pytest.mark.slow
def test_with_lora_the_reference_is_the_base_with_the_adapters_off(tiny_assets, gloo_rank):
    """LoRA's adapters start at zero (peft: B = 0), so the reference computed before the first step is the base
    model's: the first step's rewards are exactly 0 and its loss log 2; the adapters then learn the preferences."""
    import math

    from tests.inprocess import run
    from training.dpo import METRICS

    steps = []
    _, state = run(dpo_settings(tiny_assets, "--lora", "--lr", "1e-2", "--eval-split", "none"),
                   on_step=lambda step, result: steps.append(result))  # fmt: skip
    first = dict(zip(METRICS, steps[0].metric_sums.tolist(), strict=True))
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert float(steps[0].loss_sum) / steps[0].counts[0] == pytest.approx(math.log(2), abs=1e-6)
    assert state.history[1]["loss"] < min(state.history[0]["loss"], math.log(2))  # the pairs seen again


@pytest.mark.slow
def test_the_held_out_pairs_are_scored_before_and_after(tiny_assets, tmp_path, gloo_rank):
    """With the before/after evaluation, a DPO run's held-out pairs are a task of evaluation.json: the base's loss
    is log 2 (it is its own reference), and how often each model finds the chosen answer the likelier."""
    import json
    import math

    import pyarrow.fs

    from evaluation.before_after import BeforeAfter, Plan
    from tests.inprocess import run

    config = dpo_settings(tiny_assets, "--split", "train[:48]")
    plan = Plan.of(config, None)
    assert plan is not None and plan.pairs and not plan.named
    (tmp_path / "run").mkdir()
    hook = BeforeAfter(plan, pyarrow.fs.LocalFileSystem(), str(tmp_path / "run"), 0, config.batch_size)
    run(config, evaluation=hook)
    pairs = json.loads((tmp_path / "run" / "evaluation.json").read_text())["tasks"]["heldout_pairs"]
    assert pairs["samples"] == 3 and set(pairs["metrics"]) == {"preferred", "loss", "rewards/margins"}
    assert pairs["metrics"]["loss"]["base"] == pytest.approx(math.log(2), abs=1e-6)
    assert pairs["metrics"]["rewards/margins"]["base"] == 0 and pairs["metrics"]["loss"]["delta"] != 0
    assert 0 <= pairs["metrics"]["preferred"]["base"] <= 1
    assert Plan.of(dpo_settings(tiny_assets, "--eval-tasks", "none"), None) is None


@pytest.mark.slow  # (the SFT run's resume and SIGTERM tests hold the loop in make test-fast)
def test_sigterm_mid_epoch_saves_the_next_step_and_a_dpo_run_goes_on_to_the_same_weights(tiny_assets, tmp_path):
    """Two ranks, 9 steps with saves every 4: rank 1 sent SIGTERM after step 2, both save step 3 and stop (the
    request rides on DPO's count all-reduce as on SFT's); the next attempt goes on from step 3 and ends where an
    uninterrupted run does: weights, epoch metrics with TRL's names, held-out evals."""
    from tests.inprocess import attempts
    from tests.test_step_checkpoints import same_run

    config = dpo_settings(tiny_assets, "--max-steps", "9", "--save-every", "4", "--eval-every", "5", "--num-workers",
                          "2", "--batch-size", "2", "--split", "train[:48]")  # fmt: skip
    straight, stopped, after = attempts(config, 2, [
        {"root": str(tmp_path / "straight")}, {"root": str(tmp_path / "stopped"), "stop": {1: (2, "sigterm")}},
        {"root": str(tmp_path / "stopped"), "resume": True}])  # fmt: skip
    assert stopped["ended"] == "StopRequested" and stopped["seen"] == [1, 2, 3]
    assert after["from"] == "checkpoint_step_0000003" and after["seen"] == [4, 5, 6, 7, 8, 9]
    same_run(after, straight)
    assert "rewards/accuracies" in straight["state"]["history"][-1] and straight["state"]["evals"]


def test_a_pairs_epoch_counts_two_rows_a_pair():
    """The epoch's throughput figures: a DPO global batch of 8 pairs is 16 padded rows (chosen and rejected)."""
    from training.worker_hooks import epoch_metrics

    trained = {
        "loss": 0.6,
        "real_tokens": 8_000.0,
        "predicted_tokens": 80.0,
        "steps": 10,
        "lr": 1e-4,
        "grad_norm": 1.0,
    }
    sft, dpo = (epoch_metrics(settings({"model": "m", "dataset": "d.jsonl"}, *flags, "--batch-size", "4",
                                       "--num-workers", "2", "--seq-len", "64"), 1, trained, {}, 2.0, 2)
                for flags in ((), ("--objective", "dpo")))  # fmt: skip
    assert (sft["global_batch_rows"], dpo["global_batch_rows"]) == (8, 16)
    assert dpo["real_token_share"] == pytest.approx(8_000 / (10 * 16 * 64)) and dpo["real_token_share"] < 1
    assert dpo["tokens_per_s"] == 2 * sft["tokens_per_s"] and dpo["packing"] is False
