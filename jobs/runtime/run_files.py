"""What a run leaves in its directory, <storage>/<run>: data_report.json, metrics.jsonl, loss.png and
TensorBoard's event files. Local paths and gs:// alike, through pyarrow's filesystems."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.storage import filesystem, uri

METRICS_FILE, LOSS_PLOT, DATA_REPORT, TENSORBOARD_DIR = "metrics.jsonl", "loss.png", "data_report.json", "tensorboard"
REWARD_PLOT = "reward.png"  # a GRPO run's: each step's mean reward (its epochs' reward_curve)
SAMPLES_FILE = "samples.jsonl"
# A bad input the workers met mid-run on every rank together (a reward that raised: grpo_iteration.agreed), which
# rank 0 writes here and the driver raises once: raised in the workers, it would be a worker error, and Ray Train
# retries each of those up to max_failures times (ray/train/v2/_internal/execution/failure_handling/default.py
# `_is_retryable_error`), each retry failing at the same step the same way. (A metrics-only report would not do:
# the run's Result carries the latest checkpoint's metrics, controller.py `_build_result`.)
INPUT_ERROR_FILE = "input_error.txt"


def run_dir(storage_path: str, run_name: str) -> str:
    """The run's directory as a URI (what a user opens)."""
    return f"{storage_path.rstrip('/')}/{run_name}"


def write_run_files(storage_path: str, run_name: str, files: dict[str, bytes]) -> dict[str, str]:
    fs, base = filesystem(storage_path)
    directory = f"{base.rstrip('/')}/{run_name}"
    fs.create_dir(directory, recursive=True)
    for name, payload in files.items():
        with fs.open_output_stream(f"{directory}/{name}") as f:
            f.write(payload)
    return {name: uri(storage_path, f"{directory}/{name}") for name in files}


def write_data_report(storage_path: str, run_name: str, report: dict) -> str:
    return write_run_files(storage_path, run_name, {DATA_REPORT: json.dumps(report, indent=1).encode()})[DATA_REPORT]


def loss_plot(run_name: str, history: list[dict]) -> bytes:
    """Training and eval loss, and real tokens/s, per epoch."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, loss_ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    loss_ax.plot(epochs, [h["loss"] for h in history], "o-", color="tab:blue", label="train")
    if any(h.get("eval_loss") is not None for h in history):
        loss_ax.plot(epochs, [h.get("eval_loss") for h in history], "^-", color="tab:green", label="eval")
    loss_ax.set(xlabel="epoch", ylabel="loss per predicted token", title=run_name)
    loss_ax.legend(loc="upper left")
    speed_ax = loss_ax.twinx()
    speed_ax.plot(epochs, [h["real_tokens_per_s"] for h in history], "s--", color="tab:orange")
    speed_ax.set_ylabel("real tokens/s", color="tab:orange")
    loss_ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return png.getvalue()


def reward_curve(history: list[dict]) -> list[float]:
    """A GRPO run's mean reward at each step, from its epochs' metrics."""
    return [r for h in history for r in h.get("reward_curve") or []]


def reward_plot(run_name: str, curve: list[float]) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(range(1, len(curve) + 1), curve, ".-", color="tab:purple")
    ax.set(xlabel="step", ylabel="mean reward (training samples)", title=run_name)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return png.getvalue()


def write_run_report(storage_path: str, run_name: str, history: list[dict]) -> dict[str, str]:
    """metrics.jsonl and loss.png in the run's directory (and a GRPO run's reward.png)."""
    curve = reward_curve(history)
    return write_run_files(storage_path, run_name, {
        METRICS_FILE: "".join(json.dumps(h, sort_keys=True) + "\n" for h in history).encode(),
        LOSS_PLOT: loss_plot(run_name, history),
    } | ({REWARD_PLOT: reward_plot(run_name, curve)} if curve else {}))  # fmt: skip


class TensorBoard:
    """Rank 0's TensorBoard event files: written to a local directory, copied to <run>/tensorboard in the
    run's storage (a pyarrow filesystem and directory) at each `publish`."""

    def __init__(self, filesystem, target: str):
        import hashlib
        import shutil
        import tempfile

        from torch.utils.tensorboard import SummaryWriter

        self.filesystem, self.target = filesystem, target
        # One local directory per run: a restart after a lost worker clears the one its killed attempt left.
        local = Path(tempfile.gettempdir()) / f"tensorboard-{hashlib.sha256(target.encode()).hexdigest()[:16]}"
        shutil.rmtree(local, ignore_errors=True)
        self.writer = SummaryWriter(log_dir=str(local))

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.writer.add_scalar(name, value, step)

    def add_text(self, name: str, text: str, step: int) -> None:
        self.writer.add_text(name, text, step)

    def publish(self) -> None:
        import pyarrow.fs

        self.writer.flush()
        self.filesystem.create_dir(self.target, recursive=True)
        pyarrow.fs.copy_files(self.writer.log_dir, self.target, destination_filesystem=self.filesystem)

    def close(self) -> None:
        import shutil

        self.writer.close()
        self.publish()
        shutil.rmtree(self.writer.log_dir, ignore_errors=True)  # the local copy; storage has the files


def tensorboard(ctx, rank: int) -> TensorBoard | None:
    """Rank 0's TensorBoard, published to <run>/tensorboard in the run's storage."""
    if rank != 0:
        return None
    storage = ctx.get_storage()
    return TensorBoard(storage.storage_filesystem, f"{storage.experiment_fs_path}/{TENSORBOARD_DIR}")


class SampleLog:
    """Rank 0's <run>/samples.jsonl: one line per prompt and eval, {"step", "prompt", "completion",
    "reference"}, rewritten whole at each eval (object stores do not append). A restart keeps the lines
    up to the step it goes on from: a step done again is not answered twice."""

    def __init__(self, filesystem, path: str, resumed_step: int):
        import pyarrow.fs

        self.filesystem, self.path = filesystem, path
        self.lines: list[str] = []
        if filesystem.get_file_info(path).type == pyarrow.fs.FileType.File:
            with filesystem.open_input_stream(path) as f:
                kept = [line for line in f.read().decode().splitlines() if line.strip()]
            self.lines = [line for line in kept if json.loads(line)["step"] <= resumed_step]

    def add(self, step: int, samples: list[dict]) -> None:
        self.lines += [json.dumps({"step": step, **sample}) for sample in samples]
        with self.filesystem.open_output_stream(self.path) as f:
            f.write("".join(line + "\n" for line in self.lines).encode())


def sample_log(ctx, rank: int, resumed_step: int) -> SampleLog | None:
    """Rank 0's samples.jsonl in the run's storage."""
    if rank != 0:
        return None
    storage = ctx.get_storage()
    storage.storage_filesystem.create_dir(storage.experiment_fs_path, recursive=True)
    return SampleLog(storage.storage_filesystem, f"{storage.experiment_fs_path}/{SAMPLES_FILE}", resumed_step)


def last_samples(samples_uri: str | None) -> list[dict]:
    """The last eval's answers in a samples.jsonl (a path or URI; none if there is no such file)."""
    import pyarrow.fs

    if not samples_uri:
        return []
    fs, path = filesystem(samples_uri)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return []
    with fs.open_input_stream(path) as f:
        rows = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    return [r for r in rows if r["step"] == rows[-1]["step"]] if rows else []


def write_input_error(ctx, rank: int, message: str) -> None:
    """Rank 0's INPUT_ERROR_FILE in the run's storage."""
    if rank == 0:
        storage = ctx.get_storage()
        with storage.storage_filesystem.open_output_stream(f"{storage.experiment_fs_path}/{INPUT_ERROR_FILE}") as f:
            f.write(message.encode())


def take_input_error(storage_path: str, run_name: str) -> str | None:
    """The run's INPUT_ERROR_FILE's message, the file removed (a later run of that name, resumed, starts without
    it); None if there is none."""
    import pyarrow.fs

    fs, base = filesystem(storage_path)
    path = f"{base.rstrip('/')}/{run_name}/{INPUT_ERROR_FILE}"
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        message = f.read().decode()
    fs.delete_file(path)
    return message
