"""One shape a step for pictures and sound (issue 57): every training batch padded with blank pictures and clips up to
the split's most a record holds (data/media_rows.RecordMedia), whose outputs change no loss and no gradient, so that
an epoch of mixed records (0, 1 and 2 pictures, clips of two lengths, text alone) feeds the model one shape set, and
--compile compiles nothing after the first step."""

from __future__ import annotations

import pytest

from tests.test_media_training import job_settings, media_assets  # noqa: F401  (the module's fixture)


def rows_of(config, tokenizer):
    from data.prepare import prepare
    from data.prepared import PreparedRows, local_directory
    from training.step import scratch_prepared

    return PreparedRows(local_directory(scratch_prepared(config, tokenizer, prepare)), "train", config.seq_len,
                        tokenizer.pad_token_id, False)  # fmt: skip


def test_blank_pictures_and_clips_change_no_loss_and_no_gradient(media_assets, gloo_rank):  # noqa: F811
    """The towers trained, so every weight's gradient counts: a batch of the first four records (two pictures,
    one JPEG, two clips of different lengths) with its blanks (two pictures, four clips) against the same batch
    without them: the loss within 1e-6, every gradient within 1e-5 of its largest entry (at least 1)."""

    from data.media_rows import collate_media
    from data.sft_data import model_inputs
    from tests.inprocess import build

    config = job_settings(media_assets, 1, "--train-towers")
    trainee, _ = build(config)
    rows = rows_of(config, trainee.tokenizer)
    fixed = collate_media([rows[i] for i in range(4)])
    bare = collate_media([(*rows[i][:4], rows.media.of([int(r) for r in rows.rows[rows.offsets[i]:rows.offsets[i + 1]]]))
                          for i in range(4)])  # fmt: skip
    assert (len(fixed[4]["pixel_values"]), len(bare[4]["pixel_values"])) == (4 * 2, 2)  # the most a record: 2, 1
    assert (len(fixed[4]["input_features"]), len(bare[4]["input_features"])) == (4 * 1, 2)

    def loss_and_grads(batch) -> tuple[float, dict]:
        trainee.model.zero_grad(set_to_none=True)
        loss = trainee.loss(**model_inputs(batch, False, "cpu"))
        loss.backward()
        return float(loss), {n: p.grad.full_tensor().clone() for n, p in trainee.model.named_parameters()
                             if p.grad is not None}  # fmt: skip

    (with_blanks, grads), (without, reference) = loss_and_grads(fixed), loss_and_grads(bare)
    assert with_blanks == pytest.approx(without, abs=1e-6) and grads.keys() == reference.keys()
    towers = [n for n in grads if "vision_tower" in n or "audio_tower" in n]
    assert towers and any(float(reference[n].abs().sum()) > 0 for n in towers)
    for name, grad in grads.items():
        err, scale = float((grad - reference[name]).abs().max()), float(reference[name].abs().max())
        # float32's sums over more rows: 1e-6 of the largest entry here; in float64 the same comparison gives 4e-16
        assert err <= 1e-5 * max(1.0, scale), (name, err, scale)


@pytest.mark.slow  # inductor compiling the tiny layers (tens of seconds, cold)
def test_an_epoch_of_mixed_records_feeds_one_shape_set_and_compiles_once(media_assets, gloo_rank):  # noqa: F811
    """Micro-batches of two rows over the eight records: their pictures (0 to 3) and clips (0 to 2) differ from step to
    step, yet every step feeds one shape set (the epoch's metrics say how many), and under --compile nothing compiles
    after the first step; the losses are eager's."""
    from data.media_rows import collate_media
    from tests.inprocess import StepRecorder, run
    from training.training_run import input_shapes

    flags = ("--batch-size", "2", "--max-steps", "4", "--eval-samples", "0")
    config = job_settings(media_assets, 1, *flags)
    losses, states = {}, {}
    for compiled in ("--no-compile", "--compile"):
        recorder = StepRecorder()
        trainee, states[compiled] = run(job_settings(media_assets, 1, *flags, compiled), on_step=recorder)
        losses[compiled] = recorder.losses
    rows = rows_of(config, trainee.tokenizer)
    counts = {(len(b.get("pixel_values", [])), len(b.get("input_features", [])))
              for b in (rows.media.of([2 * i, 2 * i + 1]) for i in range(4))}  # fmt: skip
    assert len(counts) > 1  # without the blanks, the steps' shapes would differ
    assert len({input_shapes(collate_media([rows[2 * i], rows[2 * i + 1]])) for i in range(4)}) == 1
    (eager,), (compiled,) = states["--no-compile"].history, states["--compile"].history
    assert eager["input_shape_sets"] == compiled["input_shape_sets"] == 1
    assert compiled["recompiles"] == 0
    assert losses["--compile"] == pytest.approx(losses["--no-compile"], rel=1e-4)


@pytest.mark.slow
def test_packed_media_records_train_as_one_a_row(media_assets, gloo_rank):  # noqa: F811
    """--packing with pictures and sound: the eight records in two rows (a picture in a row's later record among
    them), one global batch, trained as the same records one a row are: each step's loss and gradient norm within
    1e-5 (transformers' own packed masks would move a later record's picture: training/model.packed_media_masks)."""
    from data.render import load_tokenizer
    from tests.inprocess import StepRecorder, run

    runs = {}
    for packing in ("--no-packing", "--packing"):
        config = job_settings(media_assets, 1, packing)
        rows = rows_of(config, load_tokenizer(config.tokenizer_ref))
        recorder = StepRecorder()
        run(job_settings(media_assets, 1, packing, "--batch-size", str(len(rows))), on_step=recorder)
        runs[packing] = (len(rows), recorder)
    (records, one_a_row), (packed_rows, packed) = runs["--no-packing"], runs["--packing"]
    assert records == 8 and packed_rows < records
    assert packed.losses == pytest.approx(one_a_row.losses, abs=1e-5)
    assert packed.grad_norms[0] == pytest.approx(one_a_row.grad_norms[0], rel=1e-5)
    # (later steps: AdamW's division by the root of tiny second moments magnifies float32's order of sums, 1e-4)
    assert packed.grad_norms == pytest.approx(one_a_row.grad_norms, rel=1e-3)
