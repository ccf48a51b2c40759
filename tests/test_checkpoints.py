"""The checkpoint helpers without a Ray run: the commit order, URIs, and the gs:// dependency."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from pathlib import Path

import pyarrow.fs

from runtime.storage import uri
from training.checkpoints import STATE_FILE, committer

ROOT = Path(__file__).resolve().parent.parent


def test_a_checkpoint_gets_its_state_file_only_once_its_shards_are_written(tmp_path):
    """Ray registers what the upload function returns: it must not return before the write ends."""
    written: Future = Future()
    commit = committer(written, pyarrow.fs.LocalFileSystem(), {"epoch": 2})
    checkpoint = type("Checkpoint", (), {"path": str(tmp_path)})()
    returned = []
    thread = threading.Thread(target=lambda: returned.append(commit(checkpoint, "checkpoint_epoch_0002")))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and not (tmp_path / STATE_FILE).exists()
    written.set_result(None)
    thread.join(5)
    assert returned == [checkpoint] and json.loads((tmp_path / STATE_FILE).read_text()) == {"epoch": 2}


def test_a_failed_write_is_never_committed(tmp_path):
    written: Future = Future()
    written.set_exception(OSError("bucket gone"))
    commit = committer(written, pyarrow.fs.LocalFileSystem(), {"epoch": 2})
    try:
        commit(type("Checkpoint", (), {"path": str(tmp_path)})(), "x")
    except OSError as err:
        assert "bucket gone" in str(err)
    else:
        raise AssertionError("a failed write was committed")
    assert not (tmp_path / STATE_FILE).exists()


def test_uris_get_their_scheme_back():
    assert uri("gs://bucket/prefix", "bucket/prefix/run/model") == "gs://bucket/prefix/run/model"
    assert uri("gs://bucket/prefix", "gs://bucket/prefix/run") == "gs://bucket/prefix/run"
    assert uri("/local/runs", "/local/runs/run/model") == "/local/runs/run/model"


def pins(path: Path) -> dict[str, str]:
    """Each pinned distribution's version, by name without its extras (the images take fewer of Ray's)."""
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {name.split("[")[0]: version for name, version in (line.split("==") for line in lines if "==" in line)}


def test_gs_checkpoints_go_through_the_gcsfs_the_image_installs():
    """DCP writes gs:// through fsspec, which needs gcsfs; the image pins what the tests run with (peft for
    LoRA and tensorboard for the event files too)."""
    import fsspec
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    image, local = pins(ROOT / "image" / "requirements.txt"), pins(ROOT / "requirements.txt")
    assert {"gcsfs", "peft", "tensorboard"} <= set(image)
    assert image == {name: local.get(name) for name in image}
    assert fsspec.get_filesystem_class("gs").__module__.startswith("gcsfs")
    assert FsspecWriter.validate_checkpoint_id("gs://bucket/ray_train_torchtpu/run/checkpoint_epoch_0001")


def whole(tensor):
    """A DTensor's full value (one rank here, so its only shard); a plain tensor as is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def test_a_backend_that_cannot_stage_falls_back_to_a_synchronous_save(tiny_assets, tmp_path, monkeypatch, capfd):
    """One gloo rank: the async save's staging fails, the shard is written synchronously instead,
    and it loads back into a fresh model and optimizer exactly."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.device_mesh import init_device_mesh

    from training.checkpoints import ShardedCheckpointer
    from training.model import TokenLoss, apply_fsdp, freeze_per_layer_embeddings, load_model

    def cannot_stage(self, state_dict, **kwargs):
        raise RuntimeError("cannot copy these tensors to the CPU")

    def trained(steps: int):
        torch.manual_seed(0)
        model = load_model(tiny_assets["model"], "float32")
        table = freeze_per_layer_embeddings(model)
        root = apply_fsdp(TokenLoss(model, 0), init_device_mesh("cpu", (1,)), ignored={table}, dtype="float32")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(steps):
            ids = torch.randint(0, 8, (2, 16))
            root(input_ids=ids, labels=ids).backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model, optimizer = trained(steps=2)
        saver = ShardedCheckpointer(model, optimizer, rank=0, use_async=True)
        monkeypatch.setattr(DefaultStager, "stage", cannot_stage)
        saver.save(str(tmp_path / "checkpoint")).result()
        assert "saving synchronously from now on" in capfd.readouterr().out and saver.use_async is False
        assert (tmp_path / "checkpoint" / ".metadata").exists()

        fresh_model, fresh_optimizer = trained(steps=0)
        ShardedCheckpointer(fresh_model, fresh_optimizer, rank=0).load(str(tmp_path / "checkpoint"), same_world=True)
        for (name, saved), restored in zip(model.state_dict().items(), fresh_model.state_dict().values(), strict=True):
            assert torch.equal(whole(saved), whole(restored)), name
        saved_moments = optimizer.state_dict()["state"]
        restored_moments = fresh_optimizer.state_dict()["state"]
        assert saved_moments.keys() == restored_moments.keys() and saved_moments
        for key, moments in saved_moments.items():
            for name in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(whole(moments[name]), whole(restored_moments[key][name])), (key, name)
    finally:
        dist.destroy_process_group()


def test_a_walkthrough_checkpoint_restores_its_weights_and_epoch(tiny_assets, tmp_path, gloo_rank):
    """--no-sharded-checkpoints: rank 0's full from_pretrained directory plus train_state.json; a run
    restarted from it builds its model from those weights and goes on after its epoch."""
    import pyarrow.fs
    import ray.train
    import torch

    from tests.inprocess import build, settings
    from training.checkpoints import ShardedCheckpointer, export_pretrained, write_state
    from training.worker_hooks import resume

    config = settings(tiny_assets, "--recipe", "walkthrough", "--lr", "1e-2")
    trainee, optimizer = build(config)
    model = trainee.model
    ids = torch.randint(0, 8, (2, 16))
    trainee.loss(input_ids=ids, labels=ids).backward()  # (the training forward returns the summed token loss)
    optimizer.step()
    directory, local = str(tmp_path / "checkpoint_2026-12-03_10-00-00.000000"), pyarrow.fs.LocalFileSystem()
    export_pretrained(model, trainee.tokenizer, local, directory)
    write_state(local, directory, {"epoch": 1, "step": 6, "history": [{"epoch": 1}], "attempt": 1, "world_size": 1})

    restored = ray.train.Checkpoint(directory)
    resumed, again_optimizer = build(config, restored=restored)
    again = resumed.model
    state = resume(restored, ShardedCheckpointer(again, again_optimizer, 0), str(tmp_path), 0, 1)
    assert (state.epoch, state.step, state.attempt, state.history) == (1, 6, 2, ({"epoch": 1},))
    for (name, trained), restarted in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(whole(trained), whole(restarted)), name
