"""Everything that compiles with inductor, in one file so that one xdist worker runs it in order: the second test
finds the first's kernels in inductor's on-disk cache (the same tiny model, rows of [2, 128], one thread), and a
clean checkout compiles them once instead of twice at the same time on two workers (issue 47)."""

from __future__ import annotations

import pytest

from bench import step as step_bench
from tests.inprocess import settings


@pytest.mark.slow
def test_compiled_layers_train_as_eager_ones_and_compile_once(tiny_assets, gloo_rank):
    """--compile (inductor on CPU): ten steps' losses within 1e-4 of eager's; after the first step nothing compiles
    again (the evals and sample answers run eager), and the count is in the progress line's figures and the
    epoch's metrics."""
    from tests.inprocess import StepRecorder, run

    flags = ("--max-steps", "10", "--eval-every", "5", "--eval-samples", "1", "--save-every", "0", "--batch-size", "2")
    losses, states = {}, {}
    for compiled in ("--no-compile", "--compile"):
        recorder = StepRecorder()
        _, states[compiled] = run(settings(tiny_assets, *flags, compiled), on_step=recorder)
        losses[compiled] = recorder.losses
    assert losses["--compile"] == pytest.approx(losses["--no-compile"], rel=1e-4)
    assert [h["recompiles"] for h in states["--compile"].history] == [0]
    assert ["recompiles" in h for h in states["--no-compile"].history] == [False]


@pytest.mark.slow  # inductor compiling, tens of seconds
def test_step_bench_smoke_prints_the_compile_ratio_and_the_reads_per_step(tmp_path, capsys):
    # In this process (--in-process: the job's TrainingRun on one gloo rank), at the rows' shape of the compile test
    # above ([2, 128], the tiny model): it finds that test's kernels in inductor's cache (~25 s of CPU, cold).
    smoke = ["--size", "tiny", "--rows", "32", "--epochs", "1", "--seq-len", "128", "--batch-size", "2", "--steps",
             "3", "--in-process"]  # fmt: skip
    out = step_bench.main(["--out", str(tmp_path), *smoke])
    printed = capsys.readouterr().out
    eager, compiled = out["runs"].values()
    assert "recompiles" not in eager["metrics"] and compiled["metrics"]["recompiles"] == 0
    assert eager["metrics"]["loss"] == pytest.approx(compiled["metrics"]["loss"], rel=1e-4)  # the same training
    assert "one gloo rank in this process" in printed
    assert out["compile_ratio"] == compiled["metrics"]["step_time_s"] / eager["metrics"]["step_time_s"]
    assert out["reads"]["now"] == 0 and out["reads"]["before"] >= 3  # the norm, the counts, transformers' check
    assert "compile / eager" in printed and "device reads per step" in printed and "x an eager one's" in printed
