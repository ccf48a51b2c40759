"""Every setting of the fine-tune, declared once, as a field of FinetuneSettings.

A field's type and default, and `setting(...)`'s metadata: its help text, its flag (`--name`, dashes for
underscores) and the walkthrough's alias, its bounds or choices, the stack config key that exposes it (none:
the job's alone), and, for the ones a --recipe decides, each recipe's value. From these declarations alone:

- the job's command line (command_line.py: every default in --help; `to_argv` gives settings back, which the
  stack's job resource sends);
- its checks, one function (`setting_checks.problems`), which the stack also runs at preview on the settings it
  will send, so a value the job would refuse is refused before any resource exists, in the stack's words;
- Pulumi.yaml's job keys (`python -m infra.config.pulumi_yaml` writes them; a test checks the file is current).

Adding a setting to the job and the stack is one field here and the regenerated Pulumi.yaml. Torch-free and
Ray-free: the stack imports it (infra/job_modules.py).
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass, fields

from config.data_formats import DEFAULT_DATASET, HUB_SPLIT, OVERLONG, default_split, parse_columns
from config.declared import declared, number, setting
from config.modality import MODALITIES
from config.splits import EXAMPLES
from runtime.backend import BACKENDS, DTYPES
from runtime.tpu_generations import ACCELERATOR_TYPES

RECIPES = ("default", "walkthrough")
OBJECTIVES = ("sft", "dpo", "grpo")
ATTENTION = ("eager", "sdpa")  # transformers' attn_implementation
SCHEDULES = ("cosine", "constant")  # training/recipe.py's learning-rate shapes
DPO_LOSSES = ("sigmoid", "ipo")  # training/dpo.py's losses, as TRL names them
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")  # training/grpo.py's, TRL's names
SCALE_REWARDS = ("group", "batch", "none")
DEFAULT_RUN_PREFIX = "torchtpu_gemma4_fsdp2_sft_"
DEFAULT_STORAGE = "$STORAGE_PATH, else ~/ray_results"


# upper bounds' reasons, said once
STEPS_WHY = "ten million optimizer steps; no fine-tune of this size runs that long"


@dataclass(frozen=True)
class FinetuneSettings:
    """Everything the run is asked to do: built once by the driver, handed to every worker."""

    # ---- the data
    recipe: str = setting("default", "the defaults of the settings marked (recipe): default, what a user would ship "
                          "(the chat template with the prompt masked, packed rows, a held-out eval, warmup + cosine, "
                          "clipping, a chunked loss, sharded checkpoints), or walkthrough, the walkthrough exactly",
                          key="recipe", choices=RECIPES)  # fmt: skip
    model: str = setting("google/gemma-4-E2B-it", "the model to fine-tune: a hub id, a local directory (on a "
                         "cluster: a path inside the image), or a gs:// directory such as an earlier run's export "
                         "(<run>/model: DPO after SFT)", key="model",
                         aliases=("--model-id",))  # fmt: skip
    tokenizer: str | None = setting(None, "hub id or local directory of the tokenizer (default: {model}'s)")
    dataset: str = setting(DEFAULT_DATASET, "the records: a hub id, or json/jsonl/csv/parquet files (a file, a "
                           "directory or a glob), local or gs://; messages, prompt/completion or Dolly's columns",
                           key="dataset", stack_default=False)  # fmt: skip
    dataset_config: str | None = setting(None, "the hub dataset's configuration name, if it has several",
                                         key="datasetConfig")  # fmt: skip
    columns: str | None = setting(None, "rename the data's columns onto a record format: NEW=OLD pairs, e.g. "
                                  "prompt=question,completion=answer", key="datasetColumns")  # fmt: skip
    split: str = setting(None, f"the training split ({EXAMPLES}; a file's one split is train; default: all of a "
                         f"file's records, {HUB_SPLIT} of a hub dataset)", key="datasetSplit",
                         aliases=("--dataset-split",), stack_default=False)  # fmt: skip
    eval_split: str = setting(None, "the held-out split, scored after every epoch and every {eval_every} steps: "
                              "auto (1/16 as many records as {split}, at most 256: the ones right after it, or, "
                              "where it reaches the data's end, its own last ones, not trained on then), none, or a "
                              "split that does not overlap {split}", key="evalSplit",
                              recipes={"default": "auto", "walkthrough": "none"})  # fmt: skip
    eval_tasks: str = setting("heldout", "scored on the base model before the first step and on the fine-tune after "
                              "the last (lm-evaluation-harness): heldout (the held-out records as tasks: exact match, "
                              "ROUGE-L, chrF, the answers' loss), lm-eval task names (heldout,gsm8k,hellaswag: their "
                              "data from the Hub), or none", key="evalTasks")  # fmt: skip
    eval_limit: int = setting(64, "documents of each task the before/after evaluation scores (0: every one)",
                              key="evalLimit", low=0, high=100_000, high_why="two generations each, on the slice")  # fmt: skip
    overlong: str = setting("truncate", "records longer than {seq_len}: truncate or drop (the data report counts "
                            "either)", key="overlong", choices=OVERLONG)  # fmt: skip
    # ---- the recipe
    objective: str = setting("sft", "what is trained: sft (supervised: the answers' tokens) or dpo (preference pairs: "
                             "prompt, chosen, rejected; Direct Preference Optimization against the starting "
                             "weights, whose log-probabilities are computed once; rows are not packed) or grpo "
                             "(online RL: prompts, completions sampled by the model and scored by {rewards}; "
                             "docs/grpo.md)", key="objective", choices=OBJECTIVES)  # fmt: skip
    dpo_beta: float = setting(0.1, "DPO's beta: how far from the starting model the preferences may pull (TRL's "
                              "default)", key="dpoBeta", low=0, low_open=True, high=100)  # fmt: skip
    dpo_loss: str = setting("sigmoid", "DPO's loss: sigmoid (the DPO paper's) or ipo (its log-ratios per answer "
                            "token, as TRL computes it)", key="dpoLoss", choices=DPO_LOSSES)  # fmt: skip
    num_generations: int = setting(8, "GRPO: completions sampled for each prompt and compared with each other "
                                   "(TRL's; {batch_size} counts completions and holds whole groups)",
                                   key="numGenerations", low=2, high=1024)  # fmt: skip
    max_completion_length: int = setting(512, "GRPO: the most tokens a sampled completion has (TRL's)",
                                         key="maxCompletionLength", low=1, high=131_072)  # fmt: skip
    temperature: float = setting(1.0, "GRPO: the sampling temperature, the log-probabilities' too (TRL's)",
                                 key="temperature", low=0, low_open=True, high=10)  # fmt: skip
    beta: float = setting(0.0, "GRPO: the KL penalty's weight, to the starting weights (TRL's beta; above 0 a copy "
                          "of them is kept in memory)", key="beta", low=0, high=100)  # fmt: skip
    epsilon: float = setting(0.2, "GRPO: the probability ratio's clip below 1 (and above unless {epsilon_high})",
                             key="epsilon", low=0, low_open=True, high=1, high_open=True)  # fmt: skip
    epsilon_high: float | None = setting(None, "GRPO: the ratio's clip above 1 (DAPO's clip-higher; default: "
                                         "{epsilon})", key="epsilonHigh", low=0, low_open=True, high=10)  # fmt: skip
    loss_type: str = setting("dapo", "GRPO's loss normalisation, TRL's: dapo, grpo, dr_grpo or bnpo (docs/grpo.md)",
                             key="lossType", choices=GRPO_LOSSES)  # fmt: skip
    scale_rewards: str = setting("group", "GRPO: advantages divided by each group's reward spread, the batch's, or "
                                 "none (TRL's)", key="scaleRewards", choices=SCALE_REWARDS)  # fmt: skip
    rewards: str = setting("answer_match", "GRPO's reward functions, comma-separated: answer_match, gsm8k, format, "
                           "regex:PATTERN or FILE.py:FUNCTION with TRL's signature (training/rewards.py)",
                           key="rewards")  # fmt: skip
    reward_weights: str | None = setting(None, "the rewards' weights, comma-separated (default: 1 each)",
                                         key="rewardWeights")  # fmt: skip
    epochs: int = setting(3, "epochs", key="epochs", aliases=("--num-epochs",), low=1, high=1000,
                          high_why="more epochs than any fine-tune of this size needs")  # fmt: skip
    batch_size: int = setting(4, "rows per device in each micro-batch", key="batchSize",
                              aliases=("--batch-size-per-device",), low=1, high=1024,
                              high_why="a TPU device's memory holds far fewer Gemma 4 sequences")  # fmt: skip
    grad_accum: int = setting(1, "micro-batches per optimizer step: the global batch is batch size x devices x "
                              "this, and its loss is divided by its count of predicted tokens", key="gradAccum",
                              low=1, high=1024, high_why="a global batch this large is rarely what a fine-tune "
                              "wants")  # fmt: skip
    seq_len: int = setting(512, "tokens per training row; each record is truncated to it", key="seqLen", low=1,
                           high=131072, high_why="Gemma 4's longest context")  # fmt: skip
    packing: bool = setting(None, "pack whole records into full rows (positions restart per record, no attention "
                            "across records), so no compute goes to padding; off: one record per padded row "
                            "(always off with {objective} dpo)",
                            key="packing", recipes={"default": True, "walkthrough": False})  # fmt: skip
    chat_template: bool = setting(None, "render each record with the tokenizer's chat template (the model turn "
                                  "alone is trained, with its end-of-turn marker); off: the walkthrough's "
                                  "'Instruction: ... Response: ...' text", key="chatTemplate",
                                  recipes={"default": True, "walkthrough": False})  # fmt: skip
    prompt_loss: bool = setting(None, "train on the prompt's tokens as well as the answer's", key="promptLoss",
                                recipes={"default": False, "walkthrough": True})  # fmt: skip
    lr: float = setting(2e-5, "the peak learning rate (AdamW); LoRA commonly uses 2e-4", key="learningRate",
                        low=0, low_open=True, high=1)  # fmt: skip
    lr_schedule: str = setting(None, "after the warmup: cosine decay to 10% of the peak, or constant",
                               key="lrSchedule", choices=SCHEDULES,
                               recipes={"default": "cosine", "walkthrough": "constant"})  # fmt: skip
    warmup_ratio: float = setting(None, "share of the optimizer steps over which the learning rate rises linearly",
                                  key="warmupRatio", low=0, high=1, high_open=True,
                                  recipes={"default": 0.03, "walkthrough": 0.0})  # fmt: skip
    max_grad_norm: float = setting(None, "clip the global gradient norm to this; 0: no clipping",
                                   key="maxGradNorm", low=0, recipes={"default": 1.0, "walkthrough": 0.0})  # fmt: skip
    weight_decay: float = setting(0.01, "AdamW's decoupled weight decay", key="weightDecay", low=0, high=1,
                                  high_why="a decay this strong erases the weights within a few steps")  # fmt: skip
    attention: str = setting("eager", "attention: eager (the scores made whole, as the walkthrough) or sdpa (torch's "
                             "scaled_dot_product_attention; on TPU under sdpa_kernel(OVERRIDEABLE), TorchTPU's flash "
                             "kernel, unproven for Gemma 4's 512-wide global heads)", key="attention",
                             choices=ATTENTION)  # fmt: skip
    loss_chunk: int = setting(None, "tokens per chunk of the cross-entropy: the [tokens x vocabulary] logits are "
                              "made and freed one chunk at a time; 0: the full logits at once", key="lossChunk",
                              low=0, high=1048576, high_why="more than a step holds is the full logits anyway",
                              recipes={"default": 256, "walkthrough": 0})  # fmt: skip
    max_steps: int = setting(0, "run this many optimizer steps, however many epochs that takes (it overrides "
                             "{epochs}; the schedule and the cost estimate are planned for them); 0: {epochs} "
                             "decides", key="maxSteps", low=0, high=10_000_000, high_why=STEPS_WHY)  # fmt: skip
    save_every: int = setting(None, "optimizer steps between sharded checkpoints, besides each epoch's end; 0: epoch "
                              "ends only (the default, and the only choice, with full checkpoints)", key="saveEvery",
                              low=0, high=10_000_000, high_why=STEPS_WHY,
                              recipes={"default": 500, "walkthrough": 0})  # fmt: skip
    eval_every: int = setting(None, "optimizer steps between held-out evals, besides each epoch's end; 0: epoch "
                              "ends only", key="evalEvery", low=0, high=10_000_000, high_why=STEPS_WHY,
                              recipes={"default": 500, "walkthrough": 0})  # fmt: skip
    eval_samples: int = setting(None, "held-out prompts the model answers greedily at each eval (up to 128 tokens: "
                                "samples.jsonl, TensorBoard, the log); 0: none", key="evalSamples", low=0, high=64,
                                high_why="prompts every rank answers in one batch at each eval",
                                recipes={"default": 4, "walkthrough": 0})  # fmt: skip
    activation_checkpointing: bool = setting(False, "recompute each decoder layer's activations in the backward "
                                             "pass instead of keeping them: far less memory for about a third "
                                             "more compute; the same losses", key="activationCheckpointing")  # fmt: skip
    compile: bool = setting(False, "torch.compile each decoder layer (dynamic=False: packed rows keep every step's "
                            "shapes; TorchTPU's compiler on TPU, inductor elsewhere); the first step compiles, and "
                            "the progress line counts any compile after it", key="compile")  # fmt: skip
    lora: bool = setting(False, "train LoRA adapters on the q/k/v/o and gate/up/down projections instead of every "
                         "weight: the base stays frozen; the export merges them and writes them alone to adapter/",
                         key="lora")  # fmt: skip
    lora_rank: int = setting(16, "LoRA rank", key="loraRank", low=1, high=1024,
                             high_why="far past what LoRA fine-tunes use (8 to 64)")  # fmt: skip
    lora_alpha: int = setting(32, "LoRA alpha: the adapters' update is scaled by alpha / rank", key="loraAlpha",
                              low=1, high=4096, high_why="the adapters' scale is alpha / rank")  # fmt: skip
    modality: str = setting("auto", "which of Gemma 4's towers load: auto (what the records hold), text, image, audio "
                            "or image+audio (records needing another are refused)", key="modality", choices=MODALITIES)  # fmt: skip
    train_towers: bool = setting(False, "train the vision and audio towers too (default: frozen)", key="trainTowers")
    seed: int = setting(42, "seed of the weights' init, the data's order and the packing")
    # ---- the run
    log_every: int | None = setting(None, "steps between progress lines (default: about 10 an epoch)", low=1)
    dtype: str | None = setting(None, "compute dtype (default: the backend's: bfloat16 on TPU and CUDA, float32 "
                                "on CPU)", choices=DTYPES)  # fmt: skip
    peak_tflops: float | None = setting(None, "peak TFLOP/s per device, for MFU off TPU", low=0, low_open=True)
    topology: str = setting("4x4", "the TPU slice's topology (one slice's, with {num_slices})")
    accelerator_type: str = setting("TPU-V6E", "Ray's TPU accelerator type", choices=ACCELERATOR_TYPES)
    backend: str = setting("tpu", "the device: tpu (torch_tpu, tpu_dist), cpu (gloo) or cuda (nccl)",
                           choices=tuple(BACKENDS))  # fmt: skip
    num_workers: int | None = setting(None, "workers off TPU (on TPU, one per device of the slices)", low=1)
    num_slices: int = setting(1, "TPU slices of {topology}, each a replica of the sharded model (HSDP); off TPU, "
                              "groups of {num_workers} standing in for them", key="numSlices", low=1)  # fmt: skip
    storage_path: str | None = setting(None, f"local path or gs://BUCKET/prefix (default: {DEFAULT_STORAGE})")
    run_name: str | None = setting(None, f"the run's directory under {{storage_path}} (default: "
                                   f"{DEFAULT_RUN_PREFIX}<unix time>); the same name resumes it")  # fmt: skip
    sharded_checkpoints: bool = setting(None, "every rank writes its own shard of the model and optimizer in the "
                                        "background, and the run ends with one from_pretrained export; resume is "
                                        "exact. Off: rank 0 gathers and writes the full model every epoch",
                                        key="shardedCheckpoints",
                                        recipes={"default": True, "walkthrough": False})  # fmt: skip
    async_checkpoint: bool = setting(True, "write shards while training goes on")
    max_failures: int = setting(3, "how often Ray Train restarts the workers from the latest checkpoint (a lost "
                                "host, a crashed process) before the job fails; 0 fails at once. Preemptions Ray "
                                "saw coming (a drained node) are counted apart, without limit", key="maxFailures",
                                low=0, high=100, high_why="each restart reloads the model; a run failing this often "
                                "has a cause to fix first")  # fmt: skip
    preflight: bool = setting(False, "check and prepare the data, write its report, and stop (no worker)")
    prepare_chunk: int = setting(2048, "records per task of the data's preparation (in parallel once there are "
                                 "more than this)", low=1)  # fmt: skip

    def __post_init__(self) -> None:
        if self.split is None:  # the defaults that depend on another setting
            object.__setattr__(self, "split", default_split(self.dataset))
        if self.objective in ("dpo", "grpo") and self.packing:  # a pair's rows are compared, a prompt sampled
            object.__setattr__(self, "packing", False)

    @property
    def tokenizer_ref(self) -> str:
        return self.tokenizer or self.model

    @property
    def column_renames(self) -> dict[str, str]:
        """--columns parsed: old column name -> record-format name."""
        return parse_columns(self.columns)


SETTINGS = {f.name: f for f in fields(FinetuneSettings)}
RECIPE_SETTINGS = tuple(n for n, f in SETTINGS.items() if declared(f).recipes)
HINTS = typing.get_type_hints(FinetuneSettings)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def value_type(name: str) -> type:
    """int, float, str or bool: a setting's type without its None."""
    hint = HINTS[name]
    if isinstance(hint, types.UnionType):
        return next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


def recipe_values(recipe: str) -> dict:
    """The recipe's value of each setting it decides. Full checkpoints cannot go on from the middle of an epoch:
    with them, saves default to epoch ends only."""
    return {n: declared(SETTINGS[n]).recipes[recipe] for n in RECIPE_SETTINGS}


def named(text: str, name_of) -> str:
    """`text` with each {setting} written as `name_of` gives it (a flag or a stack key); any other brace, such as
    one in a value the user gave, left as it is."""
    return re.sub(r"\{(\w+)\}", lambda m: name_of(m[1]) if m[1] in SETTINGS else m[0], text)


def help_text(name: str, name_of) -> str:
    """A setting's help, the settings it names ({name}) written as `name_of` gives them: flags or stack keys."""
    return named(declared(SETTINGS[name]).help, name_of)


def shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def bounds_text(name: str) -> str:
    """The values a number setting allows, as an interval ("in [0, 1)"), or "" where it declares none."""
    d = declared(SETTINGS[name])
    if d.low is None:
        return ""
    if d.high is None:
        return f"{'more than' if d.low_open else 'at least'} {number(d.low)}"
    return f"in {'(' if d.low_open else '['}{number(d.low)}, {number(d.high)}{')' if d.high_open else ']'}"


PLACEMENT = ("backend", "topology", "accelerator_type", "num_workers", "num_slices")  # what the collectives take


def with_recipe(values: dict, recipe: str) -> dict:
    """`values` with every recipe setting that is None taken from the named recipe."""
    filled = values | {n: v for n, v in recipe_values(recipe).items() if values.get(n) is None}
    if values.get("save_every") is None and not filled["sharded_checkpoints"]:
        filled["save_every"] = 0
    return filled


def from_dict(values: dict) -> FinetuneSettings:
    """Settings from their dict (asdict), each value made its declared type again: a dynamic provider's inputs come
    back from Pulumi's wire format with every number a float (pulumi/pulumi#13830)."""
    typed = {n: v if v is None else value_type(n)(v) for n, v in values.items() if n in SETTINGS}
    return FinetuneSettings(**typed)


def stack_keys() -> dict[str, str]:
    """Setting name -> the stack config key that exposes it."""
    return {n: declared(f).key for n, f in SETTINGS.items() if declared(f).key}
