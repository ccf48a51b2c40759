"""Fine-tuning on pictures and sound (issue 46): records prepared with their soft tokens and the towers' inputs
(jobs/data/media_records.py), the towers frozen, and the same tokens, trained positions and losses as TRL's
SFTTrainer (trl 1.16.0) step for step on the tiny model with both towers, on one rank and on two."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from tests.inprocess import settings
from tests.tolerances import grad_norm_rel

STEPS = 3
LR = 1e-3


@pytest.fixture(scope="module")
def media_assets(tmp_path_factory) -> dict:
    from tiny_assets import make_media, make_media_model

    out = tmp_path_factory.mktemp("media-assets")
    return {"model": str(make_media_model(out / "model")), "dataset": str(make_media(out)), "dir": str(out)}


def job_settings(assets: dict, world: int, *flags: str):
    """The job's settings for the whole of the media records as one global batch, AdamW at a constant LR."""
    records = sum(1 for _ in open(assets["dataset"]))
    return settings(
        assets,
        "--split",
        "train",
        "--eval-split",
        "none",
        "--eval-tasks",
        "none",
        "--eval-samples",
        "0",
        "--batch-size",
        str(records // world),
        "--num-workers",
        str(world),
        "--lr",
        str(LR),
        "--lr-schedule",
        "constant",
        "--warmup-ratio",
        "0",
        "--max-grad-norm",
        "1.0",
        "--weight-decay",
        "0",
        "--max-steps",
        str(STEPS),
        "--seq-len",
        "256",
        "--modality",
        "image+audio",
        "--no-packing",
        *flags,
    )  # fmt: skip  (one record a row, as TRL's SFTTrainer batches them)


def trl_examples(assets: dict) -> list[dict]:
    """The records as TRL's vision format holds them (its docs: `"images": [Image.open(...)]`): an `images` column of
    the pictures as PIL opens the files, beside `{"type": "image"}` parts, so transformers' processor makes the
    pixels (convert_to_rgb: a transparent picture laid on white); each clip's samples in its part (the processor
    reads arrays; reading a WAV path would need soundfile); a turn in a string as TRL's prepare_multimodal_messages
    makes it, one text part (an Arrow column holds one type)."""
    from PIL import Image

    from data.media import clip_samples

    examples = []
    for line in open(assets["dataset"]):
        record, images = json.loads(line), []
        for turn in record["messages"]:
            if isinstance(turn["content"], str):
                turn["content"] = [{"type": "text", "text": turn["content"]}]
            for part in turn["content"]:
                if part["type"] in ("image", "audio"):
                    path = os.path.join(assets["dir"], part.pop(part["type"]))
                    if part["type"] == "image":
                        images.append(Image.open(path))
                    else:
                        part["audio"] = clip_samples(open(path, "rb").read())
        examples.append({"images": images, "messages": record["messages"]})
    return examples


def trl_trainer(assets: dict, out, batch: int, freeze: bool = True):
    """TRL's SFTTrainer on the tiny media model, the towers (unless not `freeze`) and the per-layer table frozen as
    the job freezes them; assistant_only_loss (the model turns and their end-of-turn markers: the tiny template's
    generation span)."""
    from trl import SFTConfig, SFTTrainer

    from data.media_processor import load_media_processor
    from training.model import freeze_per_layer_embeddings, freeze_towers, load_model

    model = load_model(assets["model"], "float32", towers=("image", "audio"))
    freeze_per_layer_embeddings(model)
    if freeze:
        freeze_towers(model)
    config = SFTConfig(output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                       learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
                       weight_decay=0.0, max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True,
                       assistant_only_loss=True, max_length=None, save_strategy="no", seed=0, bf16=False,
                       remove_unused_columns=False, dataloader_drop_last=True)  # fmt: skip
    return SFTTrainer(model=model, args=config, train_dataset=trl_dataset(assets),
                      processing_class=load_media_processor(assets["model"]))  # fmt: skip


def trl_dataset(assets: dict):
    """trl_examples as a datasets.Dataset (pictures as its Image feature), each clip's samples an array again when
    read (Arrow keeps them as a list, which transformers' load_audio refuses)."""
    import numpy as np
    from datasets import Dataset

    def arrays(batch: dict) -> dict:
        for messages in batch["messages"]:
            for turn in messages:
                for part in turn["content"]:
                    if part.get("audio") is not None:
                        part["audio"] = np.asarray(part["audio"], dtype=np.float32)
        return batch

    for example in (examples := trl_examples(assets)):
        for turn in example["messages"]:
            for part in turn["content"]:
                if part.get("audio") is not None:
                    part["audio"] = part["audio"].tolist()
    return Dataset.from_list(examples).with_transform(arrays)


def our_rows(config) -> list[tuple[list[int], list[int]]]:
    """The prepared training rows' (ids, labels), padding cut, record by record."""
    from data.prepare import prepare
    from data.prepared import PreparedRows, local_directory
    from data.render import load_tokenizer
    from training.step import scratch_prepared

    tokenizer = load_tokenizer(config.tokenizer_ref)
    rows = PreparedRows(local_directory(scratch_prepared(config, tokenizer, prepare)), "train", config.seq_len,
                        tokenizer.pad_token_id, False)  # fmt: skip
    out = []
    for i in range(len(rows)):
        ids, real, labels, _, _ = rows[i]
        n = int(real.sum())
        out.append((ids[:n].tolist(), labels[:n].tolist()))
    return out


def their_rows(trainer) -> list[tuple[list[int], list[int]]]:
    collate = trainer.data_collator
    out = []
    for example in trl_examples_of(trainer):
        batch = collate([example])
        n = int(batch["attention_mask"][0].sum())
        out.append((batch["input_ids"][0][:n].tolist(), batch["labels"][0][:n].tolist()))
    return out


def trl_examples_of(trainer) -> list[dict]:
    import copy

    return [copy.deepcopy(trainer.train_dataset[i]) for i in range(len(trainer.train_dataset))]


def loads_with_media(export: str, assets: dict) -> float:
    """The export loaded as transformers loads it for serving (the conditional-generation model and its processor):
    a record with a picture and a clip through it, its loss."""
    import torch
    from transformers import AutoModelForImageTextToText

    from data.media_processor import load_media_processor

    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    processor = load_media_processor(export)
    example = trl_examples(assets)[4]  # a picture and a clip
    messages = [{**turn, "content": [{**p, "image": example["images"][0]} if p["type"] == "image" else p
                                     for p in turn["content"]]} for turn in example["messages"]]  # fmt: skip
    batch = processor.apply_chat_template([messages], tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        return float(model(**batch, labels=batch["input_ids"]).loss)


def processor_of(export: str, assets: dict) -> dict:
    """What the export's processor is: its files against the base's, and what AutoProcessor makes of it (here, with
    no torchvision, Gemma4Processor's video processor stops it, loudly; a class it did not know would give the
    tokenizer alone, silently)."""
    from transformers import AutoProcessor

    from data.media_processor import PROCESSOR_CONFIG

    same = (
        open(os.path.join(export, PROCESSOR_CONFIG)).read()
        == open(os.path.join(assets["model"], PROCESSOR_CONFIG)).read()
    )
    try:
        auto = type(AutoProcessor.from_pretrained(export)).__name__
    except ImportError as err:
        auto = str(err).split(" requires ")[0].strip()
    return {
        "same_files": same,
        "auto": auto,
        "class": json.loads(open(os.path.join(export, PROCESSOR_CONFIG)).read())["processor_class"],
    }


def _media_rank_main(rank: int, world: int, rendezvous: str, assets: dict, out: str) -> None:
    """One rank of the job's loop over the media records (tests/inprocess.run): rank 0 saves each step's global loss
    sum, count and gradient norm, and whether any tower weight could train."""
    import torch
    import torch.distributed as dist

    from tests.inprocess import _join, run
    from training.checkpoints import save_pretrained
    from training.model import tower_modules

    _join(rank, world, rendezvous)
    try:
        steps = []

        def on_step(_step, result) -> None:
            loss_sum = result.loss_sum.clone()
            dist.all_reduce(loss_sum)
            steps.append({"loss": float(loss_sum) / result.counts[0], "grad_norm": float(result.grad_norm)})

        trainee, _ = run(job_settings(assets, world), rank, world, on_step=on_step)
        towers = tower_modules(trainee.model)
        trainable = any(p.requires_grad for m in towers for p in m.parameters())
        export = os.path.join(os.path.dirname(out), "export")
        save_pretrained(trainee.model, trainee.tokenizer, export)
        if rank == 0:
            torch.save({"steps": steps, "towers": len(towers), "tower_trainable": trainable,
                        "export": loads_with_media(export, assets), "processor": processor_of(export, assets)},
                       out)  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_media_records_train_as_trls_sft_trainer_trains_them(media_assets, tmp_path):
    """The six tiny records (a picture, a clip, a picture and a clip, two pictures) as one global batch, 3 steps, on
    one rank and on two: the same tokens, the same trained positions (the answers and their end-of-turn markers; no
    soft token), and each step's loss and gradient norm within 1e-4 of TRL's SFTTrainer's; the towers frozen."""
    from tests.inprocess import _spawn

    records = sum(1 for _ in open(media_assets["dataset"]))
    trainer = trl_trainer(media_assets, tmp_path / "trl", records)
    ours, theirs = our_rows(job_settings(media_assets, 1)), their_rows(trainer)
    assert [ids for ids, _ in ours] == [ids for ids, _ in theirs]
    assert [labels for _, labels in ours] == [labels for _, labels in theirs]
    assert all(any(label != -100 for label in labels) for _, labels in ours)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][:STEPS]
    for world in (1, 2):
        run = _spawn(_media_rank_main, world, media_assets)
        assert run["towers"] == 4 and not run["tower_trainable"]  # both towers and their embedders, frozen
        assert len(logged) == len(run["steps"]) == STEPS
        for step, (a, b) in enumerate(zip(run["steps"], logged, strict=True)):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-4), (world, step, a, b)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=grad_norm_rel(step)), (world, step, a, b)
        assert run["steps"][-1]["loss"] < run["steps"][0]["loss"]
        assert run["export"] > 0  # (a finite loss: the picture's and the clip's soft tokens matched their towers')
        assert run["processor"] == {"same_files": True, "auto": "Gemma4VideoProcessor", "class": "Gemma4Processor"}


@pytest.mark.slow
def test_activation_checkpointing_and_lora_hold_for_media_records(media_assets, gloo_rank):
    """The same media records with every decoder layer recomputed: the same losses; with LoRA, only the adapters
    train (none in a tower: the targets are the language model's layers), and the loss falls."""
    from tests.inprocess import StepRecorder, run
    from training.model import tower_modules

    def losses(*flags: str) -> tuple[list[float], object]:
        recorder = StepRecorder()
        trainee, _ = run(job_settings(media_assets, 1, *flags), on_step=recorder)
        return recorder.losses, trainee

    plain, _ = losses()
    recomputed, _ = losses("--activation-checkpointing")
    assert recomputed == pytest.approx(plain, abs=1e-5)
    adapted, trainee = losses("--lora", "--lr", "1e-2")
    trainable = [n for n, p in trainee.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and "language_model" in n for n in trainable)
    assert not any(p.requires_grad for m in tower_modules(trainee.model) for p in m.parameters())
    assert adapted[-1] < adapted[0]


@pytest.mark.slow
def test_trained_towers_train_as_trls_and_a_micro_batch_without_a_clip_still_gives_the_audio_tower_a_gradient(
    media_assets, tmp_path, gloo_rank
):  # fmt: skip
    """--train-towers: the same losses and gradient norms as TRL's SFTTrainer with the towers unfrozen; and a
    micro-batch of one picture gives the audio tower zero gradients, not none (its blank clip, masked: on two ranks
    whose rows differ, each sends the same parameters' gradients to FSDP's reduce-scatter), its loss unchanged."""
    from data.media_rows import collate_media
    from data.prepare import prepare
    from data.prepared import PreparedRows, local_directory
    from data.sft_data import model_inputs
    from tests.inprocess import StepRecorder, build, run
    from training.model import tower_modules
    from training.step import scratch_prepared

    records = sum(1 for _ in open(media_assets["dataset"]))
    trainer = trl_trainer(media_assets, tmp_path / "trl", records, freeze=False)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][:STEPS]
    recorder = StepRecorder()
    config = job_settings(media_assets, 1, "--train-towers")
    run(config, on_step=recorder)
    assert recorder.losses == pytest.approx([h["loss"] for h in logged], abs=1e-4)
    for step, (a, b) in enumerate(zip(recorder.grad_norms, [h["grad_norm"] for h in logged], strict=True)):
        assert a == pytest.approx(b, rel=grad_norm_rel(step)), (step, a, b)

    trainee, _ = build(config)
    rows = PreparedRows(local_directory(scratch_prepared(config, trainee.tokenizer, prepare)), "train", config.seq_len,
                        trainee.tokenizer.pad_token_id, False)  # fmt: skip
    one_picture = collate_media([rows[0]])  # the first record: red.png alone, and blanks to the split's most
    assert set(one_picture[4]) == {"pixel_values", "image_position_ids", "input_features", "input_features_mask"}
    assert len(one_picture[4]["pixel_values"]) == 2 and not one_picture[4]["input_features_mask"].any()
    loss = trainee.loss(**model_inputs(one_picture, False, "cpu"))
    loss.backward()
    towers = trainee.model.model
    audio = [*towers.audio_tower.parameters(), *towers.embed_audio.parameters()]
    assert all(p.grad is not None and float(p.grad.full_tensor().abs().sum()) == 0 for p in audio)
    assert float(towers.vision_tower.patch_embedder.input_proj.weight.grad.full_tensor().abs().sum()) > 0
    # a split without clips has no blank clips to give: idle_towers' 0 x a silent clip's output does it
    no_clips = (*one_picture[:4], {k: v for k, v in one_picture[4].items() if not k.startswith("input_features")})
    trainee.model.zero_grad(set_to_none=True)
    trainee.loss(**model_inputs(no_clips, False, "cpu")).backward()
    assert all(p.grad is not None and float(p.grad.full_tensor().abs().sum()) == 0 for p in audio)
    for tower in tower_modules(trainee.model):  # nothing in the towers trains: no idle pass
        tower.requires_grad_(False)
    assert float(trainee.loss(**model_inputs(one_picture, False, "cpu"))) == pytest.approx(float(loss), abs=1e-6)


@pytest.mark.slow  # (make test-fast keeps test_media.py's checks; these train)
def test_the_sample_answers_read_their_pictures_and_sound_and_name_them(media_assets, gloo_rank):
    """The held-out media records' prompts carry their pictures and clips into generate(), where the towers read all
    three pictures and the clip at the first step, and lead with the files they name."""
    from data.prepare import prepare
    from data.prepared import PreparedRows, local_directory
    from tests.inprocess import build
    from training.samples import answer, held_out_prompts
    from training.step import scratch_prepared

    config = job_settings(media_assets, 1, "--eval-split", "train[4:6]", "--split", "train[:4]", "--eval-samples", "2")
    trainee, _ = build(config)
    prepared = local_directory(scratch_prepared(config, trainee.tokenizer, prepare))
    rows = PreparedRows(prepared, "eval", config.seq_len, trainee.tokenizer.pad_token_id, True)
    prompts = held_out_prompts(rows, trainee.tokenizer, config)
    assert [p["prompt"].split("]")[0] for p in prompts] == ["[media/blue.jpg, media/tone-440.wav",
                                                           "[media/red.png, media/grey.png"]  # fmt: skip
    assert set(prompts[0]["media"]) == {"pixel_values", "image_position_ids", "input_features", "input_features_mask"}
    towers, seen = trainee.model.model, {"image": 0, "audio": 0}
    for kind, tower in (("image", towers.vision_tower), ("audio", towers.audio_tower)):

        def count(_module, args, kwargs, _output, _kind=kind) -> None:
            seen[_kind] += len(args[0] if args else next(iter(kwargs.values())))  # the pictures or clips read

        tower.register_forward_hook(count, with_kwargs=True)
    answers = answer(trainee, prompts, "cpu", 1)
    assert seen == {"image": 3, "audio": 1}
    assert [a["reference"] for a in answers] == ["a cold water and an early time", "a warm light and a cold water"]
    assert all(isinstance(a["completion"], str) for a in answers)


@pytest.mark.slow
def test_a_media_run_stopped_after_an_epoch_resumes_to_the_unbroken_runs_weights(media_assets, tmp_path, gloo_rank):
    """Sharded checkpoints hold a media run (towers frozen in the root unit) as they hold a text one: stopped after
    its first epoch and resumed, it ends with the weights of the run that never stopped."""
    from tests.inprocess import full_state, run
    from tests.test_recipe import relative_distance

    config = settings(media_assets, "--split", "train", "--eval-split", "none", "--eval-tasks", "none", "--epochs",
                      "2", "--batch-size", "2", "--seq-len", "256", "--lr", "1e-3")  # fmt: skip
    with pytest.raises(RuntimeError, match="the workers' --modality is auto, which loads no tower"):
        run(config)  # (auto is the driver's to resolve: a worker is told what to load)
    config = replace(config, modality="image+audio")
    whole, _ = run(config, root=str(tmp_path / "whole"))
    run(config, epochs=1, root=str(tmp_path / "parts"))
    resumed, state = run(config, root=str(tmp_path / "parts"),
                         resume_from=str(tmp_path / "parts" / "checkpoint_epoch_0001"))  # fmt: skip
    assert len(state.history) == 2
    assert relative_distance(full_state(whole.model), full_state(resumed.model)) < 1e-6


@pytest.mark.slow  # (make test-fast keeps test_media.py's checks; these train)
def test_the_held_out_media_records_are_scored_before_and_after_in_the_job(media_assets, tmp_path, gloo_rank):
    """heldout_media: every held-out media record answered with its pictures and clips by the base and by the
    fine-tune, exact match, ROUGE-L and chrF in evaluation.json beside their deltas; the text heldout task is not
    written for media records, and lm-eval's named tasks are dropped for them, said in the log."""
    import pyarrow.fs

    from data.prepared import with_modality
    from evaluation.before_after import BeforeAfter, Plan
    from evaluation.heldout_task import write_task
    from tests.inprocess import run

    config = settings(media_assets, "--split", "train[:4]", "--eval-split", "train[4:6]", "--eval-samples", "0",
                      "--batch-size", "2", "--seq-len", "256", "--epochs", "2", "--lr", "1e-2", "--modality",
                      "image+audio", "--storage-path", str(tmp_path / "store"), "--no-packing")  # fmt: skip
    plan = Plan.of(config, None)
    assert plan is not None and plan.media and not plan.named
    assert write_task(config, None, str(tmp_path / "run")) is None
    (tmp_path / "run").mkdir()
    hook = BeforeAfter(plan, pyarrow.fs.LocalFileSystem(), str(tmp_path / "run"), 0, config.batch_size)
    run(config, evaluation=hook)
    scored = json.loads((tmp_path / "run" / "evaluation.json").read_text())["tasks"]["heldout_media"]
    assert scored["samples"] == 2 and set(scored["metrics"]) == {"exact_match", "rouge_l", "chrf"}
    assert all({"base", "fine_tuned", "delta"} <= set(m) for m in scored["metrics"].values())
    assert scored["metrics"]["chrf"]["delta"] != 0  # (the fine-tune answers otherwise than the base)
    named = replace(config, eval_tasks="heldout,gsm8k", modality="auto")
    assert with_modality(named, {"modality": "image+audio"}).eval_tasks == "heldout"
