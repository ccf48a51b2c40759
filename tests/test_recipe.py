"""The recipe a user would ship, in-process: one global batch per step, the schedule, the eval,
the walkthrough one switch away, and bad flags failing before any worker starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.inprocess import settings, train, train_ranks


def relative_distance(a: dict, b: dict) -> float:
    """|a - b| / |a| over every weight together (L2). Adam turns noise-level gradients into lr-sized
    steps, so a per-tensor maximum would measure that noise, not the recipe."""
    assert a.keys() == b.keys()
    return (sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) / sum(float((a[k] ** 2).sum()) for k in a)) ** 0.5


@pytest.mark.slow  # (three layouts of ranks)
def test_one_step_is_one_global_batch_however_the_batch_is_split(tiny_assets):
    """1 worker x 8 rows, 2 workers x 4 rows and 1 worker x 4 rows x --grad-accum 2 see the same 8
    padded records of mixed lengths per step and end the epoch with the same weights and loss."""
    flags = ("--no-packing", "--eval-split", "none", "--split", "train[:64]")
    one = train_ranks(settings(tiny_assets, *flags, "--batch-size", "8"), world=1)
    two = train_ranks(settings(tiny_assets, *flags, "--batch-size", "4", "--num-workers", "2"), world=2)
    accumulated = train_ranks(settings(tiny_assets, *flags, "--batch-size", "4", "--grad-accum", "2"), world=1)
    base = train_ranks(settings(tiny_assets, *flags, "--batch-size", "8", "--lr", "1e-9"), world=1)
    # training moved the weights 3.5e-2; a per-rank mean loss would put the splits 1.3e-2 and 1.9e-2 apart
    assert relative_distance(one["state"], base["state"]) > 1e-2
    assert relative_distance(one["state"], two["state"]) < 1e-3  # measured: 9.8e-5
    assert relative_distance(one["state"], accumulated["state"]) < 1e-3  # measured: 1.0e-6
    # the gradient itself, not only its direction: FSDP sums over ranks instead of averaging a second time
    norms = [r["history"][0]["grad_norm"] for r in (one, two, accumulated)]
    assert norms == pytest.approx([norms[0]] * 3, rel=1e-2)  # measured 1.9e-3 apart; averaged: half
    losses = [r["history"][0]["loss"] for r in (one, two, accumulated)]
    # fp32 sums in another order: measured 1.5e-5 apart on one machine; a per-rank mean puts them ~1e-2 apart
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-4)
    assert [r["history"][0]["steps"] for r in (one, two, accumulated)] == [8, 8, 8]


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    from training.recipe import Schedule, lr_at, warmup_steps

    schedule = Schedule(lr=1e-3, lr_schedule="cosine", warmup_ratio=0.1, total_steps=100)
    lrs = [schedule.at(s) for s in range(100)]
    assert warmup_steps(100, 0.1) == 10 and lrs[0] == pytest.approx(1e-4)  # no step at lr 0
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])  # linear warmup
    assert lrs[10] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)  # peak, then 10% at the end
    assert all(a > b for a, b in zip(lrs[10:], lrs[11:], strict=False))  # decays monotonically
    assert lrs[55] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 45 / 89)))  # cosine
    assert {lr_at(s, 100, 1e-3, "constant", 0.0) for s in range(100)} == {1e-3}
    assert warmup_steps(39, 0.03) == 2  # a few steps warm up even on a short run


def test_the_eval_loss_is_token_weighted_and_leaves_the_weights_untouched(tiny_assets, gloo_rank):
    """evaluate() against every predicted token's -log p from a plain copy of the model's own logits."""
    from transformers import AutoModelForCausalLM

    from tests.inprocess import full_state
    from training.step import TrainingData, evaluate

    config = settings(tiny_assets, "--eval-split", "train[80:96]", "--epochs", "1")
    trainee, history = train(config)
    rows = TrainingData(config, trainee.tokenizer, 0, 1).eval
    before = full_state(trainee.model)
    got = evaluate(trainee.loss, rows, 3, True, 0, 1, torch.device("cpu"))  # batches of 3: the last is not full
    after = full_state(trainee.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in trainee.model.parameters())

    plain = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32).eval()
    plain.load_state_dict(before)
    input_ids, _, labels, positions = (torch.stack(t) for t in zip(*(rows[i] for i in range(len(rows))), strict=True))
    with torch.no_grad():
        logits = plain(input_ids=input_ids, position_ids=positions).logits  # soft-capped, packed rows apart
    targets = labels[:, 1:]
    token_losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), targets, ignore_index=-100, reduction="none"
    )
    predicted = targets != -100
    assert got["eval_tokens"] == int(predicted.sum())
    assert got["eval_loss"] == pytest.approx(float(token_losses[predicted].mean()), rel=1e-5)
    assert history[0]["eval_loss"] == pytest.approx(got["eval_loss"], rel=1e-6)
    # token-weighted, not a mean of per-row means (rows hold different numbers of predicted tokens)
    per_row = (token_losses * predicted).sum(1) / predicted.sum(1)
    assert abs(float(per_row.mean()) - got["eval_loss"]) > 1e-4


def test_the_walkthrough_recipe_restores_every_default_and_single_flags_still_win():
    from config.command_line import from_args, parse_args
    from config.setting_checks import check

    walk = from_args(parse_args(["--recipe", "walkthrough"]))
    assert {k: getattr(walk, k) for k in ("packing", "sharded_checkpoints", "chat_template", "prompt_loss", "lr_schedule",
                                 "warmup_ratio", "max_grad_norm", "eval_split", "loss_chunk", "grad_accum",
                                 "save_every", "eval_every", "eval_samples", "max_steps")} == {
        "packing": False, "sharded_checkpoints": False, "chat_template": False, "prompt_loss": True,
        "lr_schedule": "constant", "warmup_ratio": 0.0, "max_grad_norm": 0.0, "eval_split": "none",
        "loss_chunk": 0, "grad_accum": 1, "save_every": 0, "eval_every": 0, "eval_samples": 0, "max_steps": 0,
    }  # fmt: skip
    from runtime.outcome import JobInputError

    full = from_args(parse_args(["--no-sharded-checkpoints", "--backend", "cpu", "--num-workers", "1"]))
    assert (full.save_every, full.eval_every) == (0, 500)  # the default recipe with full checkpoints
    check(full)
    with pytest.raises(JobInputError, match="--save-every 10 needs --sharded-checkpoints"):
        check(from_args(parse_args(["--recipe", "walkthrough", "--save-every", "10"])))
    with pytest.raises(JobInputError, match="--eval-samples -1 must be at least 0"):
        check(from_args(parse_args(["--eval-samples", "-1"])))
    default = from_args(parse_args([]))
    assert (default.packing, default.chat_template, default.prompt_loss, default.lr_schedule) == (
        True, True, False, "cosine",
    )  # fmt: skip
    assert (default.warmup_ratio, default.max_grad_norm, default.eval_split) == (0.03, 1.0, "auto")
    assert (default.save_every, default.eval_every, default.eval_samples, default.max_steps) == (500, 500, 4, 0)
    mixed = from_args(parse_args(["--recipe", "walkthrough", "--packing", "--eval-split", "auto"]))
    assert (mixed.packing, mixed.eval_split, mixed.chat_template) == (True, "auto", False)


BAD_FLAGS = {
    "grad accum": (["--grad-accum", "0"], "--grad-accum 0 must be at least 1"),
    "warmup": (["--warmup-ratio", "1"], "--warmup-ratio 1.0 must be below 1"),
    "negative warmup": (["--warmup-ratio", "-0.1"], "--warmup-ratio -0.1 must be at least 0"),
    "grad norm": (["--max-grad-norm", "-1"], "--max-grad-norm -1.0 must be at least 0"),
    "overlap": (["--eval-split", "train[70:90]"], "--eval-split 'train[70:90]' overlaps --split 'train[:80]'"),
    "overlap, resolved": (  # percentages: only the data's size tells
        ["--split", "train[:50%]", "--eval-split", "train[40%:60%]"],
        "the eval split train[38:58] overlaps the training split train[0:48]",  # of the 96 records
    ),
    "empty eval": (["--eval-split", "train[90:90]"], "the eval split holds no records (train[90:90])"),
    "several parts": (["--split", "train[:40]+train[40:80]"], "--eval-split 'auto' holds out records after the"),
    "too few to hold out": (
        ["--split", "train[95:]"],
        "--eval-split auto holds out some of the training records, "
        "but train[95:96] holds fewer than 2; add records, or pass --eval-split none",
    ),
    "columns": (["--columns", "prompt"], "--columns 'prompt' is not NEW=OLD pairs: each entry is NEW=OLD"),
}


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_bad_recipe_flags_fail_before_any_worker(case, tiny_assets, tmp_path, capsys):
    import ray_train_llm_finetune as ft

    argv, message = BAD_FLAGS[case]
    base = ["--backend", "cpu", "--num-workers", "1", "--model", tiny_assets["model"], "--dataset",
            tiny_assets["dataset"], "--split", "train[:80]", "--storage-path", str(tmp_path)]  # fmt: skip
    assert ft.main(base + argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_progress_puts_tensorboard_in_the_run_storage_and_keeps_no_local_copy(gloo_rank, tmp_path):
    import pyarrow.fs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from runtime.run_files import TensorBoard
    from training.training_run import Progress, Sums

    board = TensorBoard(pyarrow.fs.LocalFileSystem(), str(tmp_path / "run" / "tensorboard"))
    local = Path(board.writer.log_dir)
    progress = Progress(every=2, total_steps=3, rank=0, board=board)
    progress.line(2, Sums(loss=6.0 + 12.0, predicted=6.0, real=8.0, steps=2, seconds=1.0), lr=0.1, grad_norm=1.0)
    progress.line(3, Sums(loss=18.0, predicted=3.0, real=4.0, steps=1, seconds=1.0), lr=0.1, grad_norm=1.0)
    sample = {"prompt": "user\nName a river.\nmodel\n", "completion": "The Nile.", "reference": "The Amazon."}
    progress.evaluated(2, {"eval_loss": 5.5}, [sample])
    progress.epoch({"loss": 4.0, "eval_loss": 5.0, "step": 3})
    progress.close()
    scalars = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in scalars.Scalars("train/loss")] == [(2, 3.0), (3, 6.0)]  # (6 + 12) / (3 + 3)
    assert [(e.step, e.value) for e in scalars.Scalars("epoch/eval_loss")] == [(3, 5.0)]
    assert [(e.step, e.value) for e in scalars.Scalars("eval/loss")] == [(2, 5.5)]
    (text,) = scalars.Tensors("samples/0/text_summary")
    assert text.step == 2 and b"**model:** The Nile." in text.tensor_proto.string_val[0]
    assert local.exists() is False


def test_no_step_reads_the_device_between_progress_lines(tiny_assets, gloo_rank):
    """TorchTPU's fused eager mode runs what it recorded at each read: a step that reads nothing stays one program.
    Six steps, one progress line (at the last): the five steps before it read nothing, clipping included."""
    from bench.step import Reads
    from tests.inprocess import run

    marks = []
    config = settings(tiny_assets, "--max-steps", "6", "--eval-every", "0", "--save-every", "0", "--batch-size", "2")
    with Reads() as reads:
        run(config, on_step=lambda step, result: marks.append(reads.count))
    assert len(marks) == 6 and config.max_grad_norm > 0
    assert [b - a for a, b in zip(marks, marks[1:], strict=False)] == [0] * 5


def test_the_learning_rate_as_a_device_tensor_trains_as_the_float_did(tiny_assets, gloo_rank, monkeypatch):
    """Fused AdamW with a tensor rate written each step, against torch's default AdamW with the float rate."""
    import torch

    from tests.inprocess import StepRecorder, run
    from training import model

    config = settings(tiny_assets, "--max-steps", "6", "--eval-every", "0", "--save-every", "0", "--batch-size", "2")
    tensor = StepRecorder()
    run(config, on_step=tensor)
    assert isinstance(model.adamw(*_one_trainee(config)).param_groups[0]["lr"], torch.Tensor)
    monkeypatch.setattr(model, "adamw", lambda trainee, s: torch.optim.AdamW(
        [p for p in trainee.model.parameters() if p.requires_grad], lr=s.lr, weight_decay=s.weight_decay))  # fmt: skip
    floats = StepRecorder()
    run(config, on_step=floats)
    assert tensor.losses == pytest.approx(floats.losses, rel=1e-6, abs=0)
    # the first step's gradient comes before any update, the second's after one; later, the fused kernel's float32
    # arithmetic (the rate over the bias correction, in another order) has moved the weights by rounding alone
    assert tensor.grad_norms[:2] == pytest.approx(floats.grad_norms[:2], rel=1e-6, abs=0)
    assert tensor.grad_norms == pytest.approx(floats.grad_norms, rel=1e-4, abs=0)


def _one_trainee(config):
    from tests.inprocess import build

    trainee, _ = build(config)
    return trainee, config


def test_sdpa_attention_trains_as_eager_does_on_packed_rows(tiny_assets, gloo_rank):
    """--attention sdpa: torch's kernel, the same document masks; the losses within 1e-3 of eager's (transformers'
    two paths differ by about 2.5e-4 on rows longer than a sliding window: docs/limits.md)."""
    from tests.inprocess import StepRecorder, run

    flags = ("--max-steps", "4", "--eval-every", "0", "--save-every", "0", "--batch-size", "2")
    losses = {}
    for attention in ("eager", "sdpa"):
        recorder = StepRecorder()
        trainee, _ = run(settings(tiny_assets, *flags, "--attention", attention), on_step=recorder)
        assert trainee.model.config.get_text_config()._attn_implementation == attention
        losses[attention] = recorder.losses
    assert losses["sdpa"] == pytest.approx(losses["eager"], rel=1e-3)
    assert losses["sdpa"] != losses["eager"]  # another kernel ran


def test_on_tpu_the_program_cache_misses_are_counted_where_torch_tpu_keeps_them(monkeypatch):
    """TorchTPU's fused eager mode compiles a program per new shape or constant: its cache misses (torch.tpu's
    _get_cache_misses in torch-tpu 0.2.0, _internal/device/_device_module.py; private, so looked up) join the
    counts; a torch-tpu without them adds nothing."""
    from types import SimpleNamespace

    import torch

    from config.command_line import from_args, parse_args
    from training.model import compile_counts
    from training.training_run import Progress, Sums

    tpu = from_args(parse_args([]))  # the default backend: tpu
    misses = iter([5, 7])
    monkeypatch.setattr(torch, "tpu", SimpleNamespace(_get_cache_misses=lambda: next(misses)), raising=False)
    assert [compile_counts(tpu), compile_counts(tpu)] == [{"program_cache_misses": 5}, {"program_cache_misses": 7}]
    assert compile_counts(from_args(parse_args(["--backend", "cpu", "--num-workers", "1"]))) == {}
    monkeypatch.setattr(torch, "tpu", SimpleNamespace(), raising=False)
    assert compile_counts(tpu) == {}
    printed = []
    monkeypatch.setattr("training.training_run.worker_print", printed.append)
    Progress(every=1, total_steps=2, rank=0).line(2, Sums(4.0, 2.0, 2.0, 1, 1.0), 0.1, 1.0, {"program_cache_misses": 2})
    assert printed[0].endswith("  program cache misses 2")
