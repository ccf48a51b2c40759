"""The fine-tune's checkpoints: sharded, every --save-every steps and per epoch, and one loadable model
at the end.

At each save, by default, every rank writes its own shard of the model and AdamW state with
torch.distributed.checkpoint (DCP) straight into the run's storage, in the background; the
training loop waits only while its shard is copied into CPU memory. A run directory looks like:

    <storage>/<run name>/
        checkpoint_epoch_0003/    one Ray Train checkpoint per kept epoch end ...
        checkpoint_step_0001500/  ... or step (--save-every, a save on SIGTERM)
            __0_0.distcp ...      DCP shards, one file per rank (model, AdamW moments, RNG)
            .metadata             DCP's index, written last by rank 0
            train_state.json      epoch, step, the epoch's running sums, history, evals, attempt; written
                                  once the shards are in
        model/                    the from_pretrained export after the last epoch
        metrics.jsonl, loss.png

`--no-sharded-checkpoints` keeps the walkthrough's way instead: every epoch rank 0 gathers the
full model and writes a from_pretrained directory (`checkpoint_<timestamp>/`); a resume then
restores the weights only.
"""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import Future

from runtime.backend import worker_print
from runtime.storage import checkpoint_writer_options, fsspec_options

STATE_FILE = "train_state.json"
EXPORT_DIR = "model"
DCP_INDEX = ".metadata"


def epoch_dir_name(epoch: int) -> str:
    return f"checkpoint_epoch_{epoch:04d}"


def step_dir_name(step: int) -> str:
    """A checkpoint within an epoch (--save-every, a stop), or of a run's last, partial epoch (--max-steps)."""
    return f"checkpoint_step_{step:07d}"


def read_state(checkpoint) -> dict:
    """train_state.json of a Ray Train checkpoint, read in place (no download of the shards)."""
    with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{STATE_FILE}") as f:
        return json.loads(f.read())


def write_state(filesystem, directory: str, state: dict) -> None:
    with filesystem.open_output_stream(f"{directory}/{STATE_FILE}") as f:
        f.write(json.dumps(state).encode())


def is_sharded(checkpoint) -> bool:
    import pyarrow.fs

    return checkpoint.filesystem.get_file_info(f"{checkpoint.path}/{DCP_INDEX}").type == pyarrow.fs.FileType.File


def committer(written: Future, filesystem, state: dict | None):
    """Ray's upload function for a checkpoint DCP writes in place: wait for the write, then
    (rank 0) add train_state.json, so a directory with that file is a complete checkpoint."""

    def commit(checkpoint, _dir_name: str):
        written.result()
        if state is not None:
            write_state(filesystem, checkpoint.path, state)
        return checkpoint

    return commit


class ShardedCheckpointer:
    """Model and optimizer state as DCP shards (each rank its own), plus each rank's RNG state.

    The writes run on a gloo group of their own: DCP's async save needs a CPU process group,
    and its background collectives must not interleave with the training group's.
    """

    def __init__(self, model, optimizer, rank: int, use_async: bool = True):
        import torch.distributed as dist

        self.model, self.optimizer, self.rank, self.use_async = model, optimizer, rank, use_async
        self.group = dist.new_group(backend="gloo")
        self.stager = None
        self.pending: Future | None = None

    def _state(self, with_rng: bool = True) -> dict:
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # Only what training changes: the frozen per-layer table, a frozen base under LoRA (the tied head
        # too, which ignore_frozen_params misses under its second name) and constant buffers come back
        # from the base model, not from here.
        model, optim = get_state_dict(self.model, self.optimizer, options=StateDictOptions(ignore_frozen_params=True))
        trained = {n for n, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
        state = {"model": {k: v for k, v in model.items() if k in trained}, "optimizer": optim}
        if with_rng:
            state[f"rng_rank{self.rank}"] = torch.get_rng_state()
        return state

    def save(self, target: str) -> Future:
        """Write this rank's shard under `target` (a path or URI); returns when the loop may go on.

        Async: once the shard is staged in CPU memory, with the write still running (the returned
        future ends with it). Sync: once written. A previous save is waited for first. A backend
        whose tensors DCP cannot stage falls back to synchronous saves, saying so once.
        """
        import torch.distributed.checkpoint as dcp

        # fsspec, so one code path serves local paths and gs:// (gcsfs, in the image); torch
        # ships these writers but does not re-export them from torch.distributed.checkpoint.
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.wait()
        state = self._state()
        writer_options = checkpoint_writer_options(target)
        if self.use_async:
            if self.stager is None:
                # Kept for the run: it allocates the CPU copy of this rank's shard once and refills
                # it each epoch. Pinned memory and background staging would need CUDA.
                self.stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                self.pending = dcp.async_save(state, storage_writer=FsspecWriter(target, **writer_options),
                                              async_stager=self.stager, process_group=self.group)  # fmt: skip
                return self.pending
            except (RuntimeError, NotImplementedError) as err:  # raised while staging, before any write
                worker_print(
                    f"[rank {self.rank}] async checkpointing is not available on this backend ({err}); "
                    "saving synchronously from now on"
                )
                self.close()
                self.use_async = False
        dcp.save(state, storage_writer=FsspecWriter(target, **writer_options), process_group=self.group)
        done: Future = Future()
        done.set_result(None)
        return done

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        """After the last save: wait for it, and free the staging copy."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def load(self, source: str, same_world: bool) -> None:
        """Restore model, optimizer and (when the world size is unchanged) RNG from `source`."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self._state(with_rng=same_world)
        dcp.load(state, storage_reader=FsspecReader(source, **fsspec_options(source)), process_group=self.group)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )
        if same_world:
            torch.set_rng_state(state[f"rng_rank{self.rank}"])


def save_pretrained(model, tokenizer, directory: str, lora=None) -> None:
    """Gather the full state (all ranks take part; frozen parameters too), then rank 0 writes a
    from_pretrained directory: weights, config, generation config, tokenizer with its chat template (and, with
    towers, the processor).
    With LoRA the adapters are merged into the weights (loading needs no peft), and also written
    alone to `adapter/`, loadable with peft (`lora`: the adapters' peft LoraConfig)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # full + cpu_offload: only rank 0 receives the tensors, in CPU memory
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return
    if lora is not None:
        from training.lora import ADAPTER_DIR, save_adapter, split_merged

        state_dict, adapters = split_merged(state_dict, lora.lora_alpha / lora.r)
        save_adapter(adapters, lora, model.config._name_or_path, f"{directory}/{ADAPTER_DIR}")
    model.save_pretrained(directory, state_dict=state_dict)
    tokenizer.save_pretrained(directory)
    if getattr(model.model, "vision_tower", None) is not None or getattr(model.model, "audio_tower", None) is not None:
        # the towers' processor beside them: a from_pretrained directory a server loads with its pictures and sound
        save_processor(model.config._name_or_path, directory)


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def save_processor(base: str, directory: str) -> None:
    """The base model's processor files into `directory`, as they are (training changes no processor; the job read
    its pictures and sound with them), so the export loads as its base does: AutoProcessor builds Gemma4Processor,
    its video processor included, from Gemma 4's own files."""
    import os
    import shutil

    for name in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(base, name)):
            shutil.copy(os.path.join(base, name), directory)


def export_pretrained(model, tokenizer, filesystem, target: str, lora=None) -> None:
    """A from_pretrained directory at `target` in the run's storage (pyarrow `filesystem`): written
    locally by rank 0 after the gather, then copied. A sharded run does this once, at the end."""
    import pyarrow.fs
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as local:
        save_pretrained(model, tokenizer, local, lora)
        if dist.get_rank() == 0:
            filesystem.create_dir(target, recursive=True)
            pyarrow.fs.copy_files(local, target, destination_filesystem=filesystem)
    dist.barrier()
