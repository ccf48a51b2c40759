"""The lines a person reads in a run's log: each eval's samples and each epoch on one line, and the closing
summary a by-hand run prints before its JOB_RESULT_JSON line (`make local` and the stack print the same
figures as their outputs). The files (metrics.jsonl, samples.jsonl) keep every figure and every word."""

from __future__ import annotations

from runtime.tpu_generations import by_accelerator_type

# Ray Train 2.60 makes its PreemptionWatcher actor with max_restarts=-1 and the workers' handles as arguments
# (ray/train/v2/_internal/callbacks/preemption_callback.py), and Ray's core worker logs that at ERROR level.
HARMLESS_RAY_LINE = ("note: as the workers start, Ray logs one line 'E ... Actor with class name: 'PreemptionWatcher' "
                     "... max_restarts > 0': it is harmless (Ray Train's own preemption watcher, docs/limits.md)")  # fmt: skip


def scored(sample: dict) -> str:
    """A GRPO sample's reward after its answer (` (reward 1.00)`); nothing for other objectives' samples."""
    return f" (reward {sample['reward']:.2f})" if "reward" in sample else ""


def one_line(text: str, width: int) -> str:
    """`text` on one line of at most `width` characters: whitespace runs made one space, and what is cut marked
    with an ellipsis at the end."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def epoch_losses(epoch: dict) -> str:
    """`epoch 2: train 4.4490, eval 4.4782` from an epoch's metrics."""
    held_out = f", eval {epoch['eval_loss']:.4f}" if epoch.get("eval_loss") is not None else ""
    return f"epoch {epoch['epoch']}: train {epoch['loss']:.4f}{held_out}"


def epoch_line(m: dict) -> str:
    """An epoch's end, once, in words: its losses, time, throughput and memory (every figure: metrics.jsonl)."""
    mfu = f", MFU {m['mfu']:.1%}" if m.get("mfu") is not None else ""
    memory = f", peak memory {m['peak_memory_gib']:.1f} GiB" if m.get("peak_memory_gib") is not None else ""
    return (f"{epoch_losses(m)} ({m['steps']} steps in {m['epoch_time_s']:.1f} s, "
            f"{m['real_tokens_per_s']:,.0f} real tokens/s a device{mfu}{memory})")  # fmt: skip


def evaluation_table(evaluation: dict | None) -> list[str]:
    """evaluation.json as lines: `heldout  rouge_l  0.210 -> 0.480  (+0.270)` (the fine-tune alone where no base
    score was recorded)."""
    lines = []
    for task, entry in ((evaluation or {}).get("tasks") or {}).items():
        for metric, v in entry["metrics"].items():
            lines.append(f"{task}  {metric}  {v['base']:.3f} -> {v['fine_tuned']:.3f}  ({v['delta']:+.3f})"
                         if "base" in v else f"{task}  {metric}  {v['fine_tuned']:.3f}")  # fmt: skip
    return lines


def evaluation_block(evaluation: dict | None) -> list[str]:
    """The table under an `evaluation:` label, as the closing summary and make local's outputs show it."""
    return [f"  {'evaluation:' if i == 0 else '':<12} {line}" for i, line in enumerate(evaluation_table(evaluation))]


def duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {s:02d} s" if minutes else f"{s} s"


def rewards(history: list[dict]) -> str:
    """A GRPO run's mean reward over its first and last steps (five each, or fewer)."""
    curve = [r for h in history for r in h.get("reward_curve") or []]
    k = max(1, min(5, len(curve) // 2))
    return f"first {k} steps {sum(curve[:k]) / k:.3f}, last {k} {sum(curve[-k:]) / k:.3f} ({len(curve)} steps)"


def closing_summary(result: dict, seconds: float, devices: str, chips: int | None) -> str:
    """What a person looks for when a run ends, above the machine-readable result line. The cost is the slice's
    chip-hours while the run held it (the price per chip-hour: docs/cost.md; the stack's `cost` output prices it)."""
    history = result.get("history") or []
    copy = f"  (copy it out: gcloud storage cp -r {result['checkpoint']} .)" if str(
        result.get("checkpoint")).startswith("gs://") else ""  # fmt: skip
    lines = [
        f"done: run {result['run_name']}, {len(history)} epoch{'' if len(history) == 1 else 's'} in "
        f"{duration(seconds)} on {devices}",
        f"  checkpoint:  {result['checkpoint']}{copy}",
        f"  losses:      {'; '.join(epoch_losses(h) for h in history) or 'none (no epoch finished)'}",
        f"  loss curve:  {result.get('loss_curve')}  (metrics.jsonl beside it)",
        *([f"  reward:      {rewards(history)}; curve {result['reward_curve']}"] if result.get("reward_curve") else []),
        f"  samples:     {result.get('samples') or 'none'}",
        f"  tensorboard: tensorboard --logdir {result['tensorboard']}",
        *evaluation_block(result.get("evaluation")),
        f"  cost:        {chips * seconds / 3600:.2f} chip-hours ({devices} for {duration(seconds)}; price per "
        "chip-hour: docs/cost.md)"
        if chips is not None
        else f"  cost:        no TPU ({devices})",
    ]
    return "\n".join(lines)


def devices_used(settings, count: int) -> tuple[str, int | None]:
    """(the run's devices in words, its TPU chips: None off TPU) from checked settings and the worker count."""
    if settings.backend != "tpu":
        return f"{count} {settings.backend} workers", None
    generation = by_accelerator_type(settings.accelerator_type)
    slices = f"{settings.num_slices} x " if settings.num_slices > 1 else ""
    chips = count // generation.devices_per_chip
    return f"{slices}{generation.name} {settings.topology}, {chips} chips", chips


def quiet_ray_reports() -> None:
    """In a worker: Ray Train 2.60 logs every report's whole metrics dict at INFO on every rank
    (ray/train/v2/_internal/execution/context.py, `_wait_then_report`, on a logger named after that file); the
    epoch line says it once."""
    import logging

    from ray.train.v2._internal.execution import context

    context.logger.setLevel(logging.WARNING)
