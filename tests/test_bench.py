"""A smoke run of `make bench` with tiny settings, and the Dolly-shaped data it measures on."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import checkpoint_writes, media_packing
from bench import data as data_bench
from bench import finetune as bench


def test_the_dolly_mix_pads_like_dolly_with_gemma(tmp_path):
    """dolly-15k's records fill 30-45% of a 512-token row with the Gemma tokenizer; the bench data must too."""
    assets = bench.make_assets(tmp_path, "tiny", rows=256)
    assert 0.30 <= bench.real_share(assets, 512) <= 0.45


@pytest.mark.slow  # two fine-tunes, tens of seconds
def test_bench_smoke_prints_the_side_by_side_table(tmp_path, capsys):
    # In this process (--in-process: the job's settings, TrainingRun, metrics and checkpoint writes on one gloo
    # rank). The job on Ray is the README run's, the resumed and the drained runs' (issue 47: two Ray Train runs of
    # the same path fewer).
    smoke = "--size tiny --stall-size tiny --memory-size tiny --rows 48 --epochs 1 --seq-len 512 --in-process".split()
    out = bench.main(["--out", str(tmp_path), *smoke])
    printed = capsys.readouterr().out
    assert "tiny Gemma 4, one gloo rank in this process (fp32)" in printed
    walk, pack = out["results"].values()
    assert walk["metrics"]["packing"] is False and pack["metrics"]["packing"] is True
    # the walkthrough's recipe: one record per padded row, so every record is a row
    assert walk["metrics"]["steps"] == 48 // 4 and walk["metrics"]["real_token_share"] < 0.5
    assert pack["metrics"]["steps"] < walk["metrics"]["steps"]  # the same records in fewer, fuller rows
    assert pack["metrics"]["real_token_share"] > 0.9
    assert out["ratio"] == pack["metrics"]["real_tokens_per_s"] / walk["metrics"]["real_tokens_per_s"]
    # the walkthrough's checkpoints: every epoch a full from_pretrained directory from rank 0
    walk_checkpoint = Path(walk["checkpoint"])
    assert walk_checkpoint.name.startswith("checkpoint_") and (walk_checkpoint / "model.safetensors").exists()
    assert not list(walk_checkpoint.glob("*.distcp")) and walk["checkpoints"] == [walk["checkpoint"]]
    # the default's: per-rank shards each epoch, one from_pretrained export at the end
    assert Path(pack["checkpoint"]).name == "model" and (Path(pack["checkpoint"]) / "model.safetensors").exists()
    assert len(list(Path(pack["checkpoints"][0]).glob("*.distcp"))) == 1  # (one rank)
    assert out["stall_ratio"] == pack["metrics"]["checkpoint_stall_s"] / walk["metrics"]["checkpoint_stall_s"]
    for row in ("epoch 1: real_tokens_per_s", "epoch 1: steps", "epoch 1: loss", "epoch 1: checkpoint_stall_s"):
        assert row in printed
    assert "default / walkthrough" in printed and "x the walkthrough's" in printed
    assert "sharded, async / full gather" in printed and "the sharded save stalls the loop" in printed
    assert (
        "chunked / full logits" in printed
        and "epoch 1: peak_memory_gib" in printed
        and "epoch 1: step_time_s" in printed
    )
    assert out["memory_ratio"] == pack["metrics"]["peak_memory_gib"] / walk["metrics"]["peak_memory_gib"]


def test_data_bench_smoke_prepares_in_parallel_then_reuses(ray_head, tmp_path, capsys):
    # 300 records (and 19 held out) in 3 tasks; the fine-tune's start is the e2e tests' (budget)
    smoke = ["--sizes", "300", "--scaling-rows", "0", "--prepare-chunk", "150", "--no-first-step"]
    out = data_bench.main(["--out", str(tmp_path), *smoke], head=ray_head)
    printed = capsys.readouterr().out
    (row,) = out["rows"]
    assert row["records"] == 300 and 0 < row["again_share"] < 1  # the second preflight found the first's data
    assert row["on_ray_data"]  # prepared in parallel, on the head's CPUs
    assert row["prepare_s"] > 0 and row["prepare_peak_gib"] > 0 and row["first_step_s"] is None
    assert "to first step" in printed and "again / first" in printed and "    300" in printed


def test_checkpoint_write_bench_smoke_prints_the_ratio(capsys):
    out = checkpoint_writes.main(["--mb", "8", "--repeats", "1"])
    printed = capsys.readouterr().out
    assert set(out["seconds"]) == {"defaults (1 file, 5 MiB blocks)", "the jobs' (jobs/runtime/storage.py)"}
    assert out["ratio"] > 0 and "the jobs' / defaults" in printed and "MB/s" in printed


def test_media_packing_bench_smoke_prints_the_ratio(capsys):
    out = media_packing.main(["--copies", "4", "--steps", "2", "--seq-len", "256"])
    printed = capsys.readouterr().out
    one, packed = (out["runs"][name]["history"][-1] for name in media_packing.RUNS)
    assert packed["real_token_share"] > 2 * one["real_token_share"] and out["ratio"] > 0
    assert "packed / one a row" in printed and "real_tokens_per_s" in printed
