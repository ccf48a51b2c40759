"""GRPO (jobs/training/grpo.py, jobs/training/rewards.py): the advantages, the loss and its gradient as TRL's
GRPOTrainer (trl 1.16.0) computes them on the tiny model, for every loss type, beta 0 and > 0, on one rank and on
two; the built-in rewards; bad reward functions named with the record they failed on."""

from __future__ import annotations

import math

import pytest

from tests.inprocess import build, settings
from tests.tolerances import grad_norm_rel

STEPS, GENERATIONS, MAX_COMPLETION, TEMPERATURE, LR = 3, 4, 12, 0.7, 1e-3
# Each prompt's four completions, fixed (TRL is given them through its rollout_func), in the tiny tokenizer's words:
# some right, some naming water (the second reward), one group all wrong (zero spread: advantage 0), one cut at
# MAX_COMPLETION tokens.
PROBLEMS = [
    ("What is cold?", "glaciers", ["glaciers", "rivers", "Glaciers", "the water is cold"]),
    (
        "What is warm?",
        "deserts",
        ["deserts", "the deserts are warm and the water is warm and the light is warm", "water", "deserts"],
    ),
    ("Name a small thing.", "bees", ["bees", "comets", "bees .", "chess"]),
    ("What is large?", "volcanoes", ["rivers", "tides", "light", "time"]),
]


def records() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a, _ in PROBLEMS]


def token_ids(tokenizer) -> dict[str, tuple[list[int], list[list[int]]]]:
    """Each prompt's ids (the chat template with its generation prompt) and its completions' (the end of turn
    after each, cut at MAX_COMPLETION), by the prompt's text."""
    from data.render import stop_token_ids

    end = stop_token_ids(tokenizer)[0]
    out = {}
    for question, _, answers in PROBLEMS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        completions = [(tokenizer.encode(a, add_special_tokens=False) + [end])[:MAX_COMPLETION] for a in answers]
        out[question] = (tokenizer.encode(text, add_special_tokens=False), completions)
    return out


def reward_specs():
    from training.rewards import load_reward

    return [load_reward("answer_match"), load_reward(r"regex:\bwater\b")], [1.0, 0.5]


def trl_run(model_dir: str, out, loss: str, beta: float) -> tuple[list[dict], list[list[str]]]:
    """TRL's GRPOTrainer for STEPS steps of 2 prompts x GENERATIONS completions: each step's exact loss (TRL logs
    it rounded), its logged gradient norm, reward and KL, and the prompts it drew."""
    import os

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from data.render import load_tokenizer
    from training.model import freeze_per_layer_embeddings, load_model

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # (rollout_func is experimental in 1.16)
    tokenizer = load_tokenizer(model_dir)
    ids, drawn, losses = token_ids(tokenizer), [], []

    def rollout(prompts: list, trainer) -> dict:
        """The fixed completions of the prompts TRL drew (each repeated GENERATIONS times, in order)."""
        questions = [p[0]["content"] for p in prompts]
        drawn.append(questions[::GENERATIONS])
        rows = [(ids[q][0], ids[q][1][i % GENERATIONS]) for i, q in enumerate(questions)]
        return {"prompt_ids": [p for p, _ in rows], "completion_ids": [c for _, c in rows],
                "logprobs": [[0.0] * len(c) for _, c in rows]}  # fmt: skip

    model = load_model(model_dir, "float32")
    freeze_per_layer_embeddings(model)
    rewards, weights = reward_specs()
    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=2 * GENERATIONS,
                        num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
                        beta=beta, loss_type=loss, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                        max_grad_norm=1.0, weight_decay=0.0, max_steps=STEPS, logging_steps=1, report_to=[],
                        use_cpu=True, save_strategy="no", seed=0, bf16=False, reward_weights=weights)  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[r.function for r in rewards], args=config,
                          train_dataset=Dataset.from_list(records()), processing_class=tokenizer,
                          rollout_func=rollout)  # fmt: skip
    compute_loss = trainer.compute_loss

    def recorded(*args, **kwargs):
        value = compute_loss(*args, **kwargs)
        losses.append(float(value.detach()))
        return value

    trainer.compute_loss = recorded
    trainer.train()
    logged = [h for h in trainer.state.log_history if "grad_norm" in h][:STEPS]
    return [{"loss": v} | {k: h[k] for k in ("grad_norm", "reward", "kl") if k in h}
            for v, h in zip(losses, logged, strict=True)], drawn  # fmt: skip


def our_steps(assets: dict, loss: str, beta: float, drawn: list[list[str]], rank: int = 0, world: int = 1):
    """The job's GRPO step on the same completions: this rank's share of each step's groups."""
    import torch
    import torch.distributed as dist

    from training.grpo import GrpoLoss, advantages, completion_log_probs, grpo_rows, grpo_step
    from training.rewards import score

    config = settings(assets, "--lr", str(LR), "--lr-schedule", "constant", "--warmup-ratio", "0",
                      "--max-grad-norm", "1.0", "--weight-decay", "0", "--num-workers", str(world))  # fmt: skip
    trainee, optimizer = build(config, world)
    reference = build(config, world)[0].loss  # the starting weights, frozen
    tokenizer, ids = trainee.tokenizer, token_ids(trainee.tokenizer)
    answers = {q: a for q, a, _ in PROBLEMS}
    knobs = GrpoLoss(loss_type=loss, beta=beta, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE)
    rewards, weights = reward_specs()
    out = []
    for questions in drawn:
        rows = [(q, ids[q][0], c) for q in questions for c in ids[q][1]]
        completions = [[{"role": "assistant", "content": tokenizer.decode(c, skip_special_tokens=True)}]
                       for _, _, c in rows]  # fmt: skip
        table = score(rewards, [[{"role": "user", "content": q}] for q, _, _ in rows], completions,
                      [c for _, _, c in rows], {"answer": [answers[q] for q, _, _ in rows]}, len(out),
                      [q for q, _, _ in rows])  # fmt: skip
        advantage, reward, _ = advantages(table, weights, GENERATIONS)
        share = slice(rank * len(rows) // world, (rank + 1) * len(rows) // world)
        batch = grpo_rows([p for _, p, _ in rows[share]], [c for _, _, c in rows[share]], tokenizer.pad_token_id)
        batch["advantages"] = advantage[share].numpy()
        if reference is not None:
            with torch.no_grad():
                tensors = {k: torch.as_tensor(v) for k, v in batch.items()}
                batch["ref_logps"] = completion_log_probs(reference, tensors, TEMPERATURE).numpy()
        result = grpo_step(trainee.loss, optimizer, [batch], LR, 1.0, knobs, torch.device("cpu"))
        values = torch.cat([result.loss_sum.reshape(1), result.metric_sums]).double()
        if world > 1:
            dist.all_reduce(values)
        out.append({"loss": float(values[0]), "grad_norm": float(result.grad_norm),
                    "reward": float(torch.nanmean(reward))}
                   | ({"kl": float(values[1]) / result.counts[1]} if beta else {}))  # fmt: skip
    return out


def _grpo_rank_main(rank: int, world: int, rendezvous: str, assets: dict, cases: list, out: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.inprocess import _join

    _join(rank, world, rendezvous)
    try:
        steps = [our_steps(assets, loss, beta, drawn, rank, world) for loss, beta, drawn in cases]
        if rank == 0:
            torch.save(steps, out)
    finally:
        dist.destroy_process_group()


CASES = [(loss, beta) for loss in ("dapo", "grpo", "dr_grpo", "bnpo") for beta in (0.0, 0.2)]


@pytest.fixture(scope="module")
def trl_steps(tiny_assets, tmp_path_factory) -> dict:
    """TRL's runs, one for each loss type and beta."""
    return {case: trl_run(tiny_assets["model"], tmp_path_factory.mktemp("trl"), *case) for case in CASES}


def assert_equal(ours: list[dict], theirs: list[dict], case) -> None:
    assert len(ours) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert set(a) == set(b), (case, step, a, b)
        for name in a:  # (the gradient norm's tolerance grows with the step: tests/tolerances.py)
            rel = grad_norm_rel(step) if name == "grad_norm" else 1e-4
            assert a[name] == pytest.approx(b[name], abs=1e-4, rel=rel), (case, step, name, a[name], b[name])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{loss}-beta{beta}" for loss, beta in CASES])
def test_grpo_equals_trls_grpo_trainer_on_one_rank(tiny_assets, trl_steps, gloo_rank, case):
    """The same prompts, completions and rewards for 3 steps (AdamW at a constant 1e-3, clipping at 1.0,
    temperature 0.7, two reward functions weighted 1 and 0.5): TRL's loss, gradient norm, mean reward and KL."""
    theirs, drawn = trl_steps[case]
    ours = our_steps(tiny_assets, *case, drawn)
    assert_equal(ours, theirs, case)
    assert all(s["grad_norm"] > 1 for s in theirs)  # a gradient to compare (grpo's loss is 0 on-policy: mean A)


@pytest.mark.slow
def test_grpo_on_two_ranks_equals_trls_grpo_trainer(tiny_assets, trl_steps):
    """Each step's two groups split over two gloo ranks (FSDP2): the same losses and gradient norms as TRL's on
    one process, for every case."""
    from tests.inprocess import _spawn

    cases = [(*case, trl_steps[case][1]) for case in CASES]
    for case, ours in zip(CASES, _spawn(_grpo_rank_main, 2, tiny_assets, cases), strict=True):
        assert_equal(ours, trl_steps[case][0], case)


def test_advantages_are_trls_for_each_scaling_and_unscorable_completions_get_none():
    """Group means and standard deviations (Bessel's), the batch's, none; a completion every function skipped
    (None) is out of its group's statistics and its advantage is 0; a group of equal rewards has zero spread."""
    import torch

    from training.grpo import advantages

    nan = math.nan
    table = [[1.0, nan], [0.0, 1.0], [1.0, 0.0], [nan, nan], [2.0, nan], [2.0, nan], [2.0, nan], [2.0, nan]]
    a, rewards, zero = advantages(table, [1.0, 0.5], 4, "group")
    first = torch.tensor([1.0, 0.5, 1.0])
    assert a[:3].tolist() == pytest.approx(((first - first.mean()) / (first.std() + 1e-4)).tolist(), rel=1e-6)
    assert a[3] == 0 and math.isnan(rewards[3]) and a[4:].tolist() == [0.0] * 4
    assert zero.tolist() == [False] * 4 + [True] * 4
    batch, _, _ = advantages(table, [1.0, 0.5], 4, "batch")
    everything = torch.tensor([1.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0])
    assert batch[0] == pytest.approx(float((1.0 - first.mean()) / (everything.std() + 1e-4)), rel=1e-6)
    unscaled, _, _ = advantages(table, [1.0, 0.5], 4, "none")
    assert unscaled[:3].tolist() == pytest.approx((first - first.mean()).tolist(), rel=1e-6)


def test_the_built_in_rewards_read_numbers_gsm8ks_answer_line_and_patterns():
    from training.rewards import load_reward

    def run(name, completions, answer):
        return load_reward(name).function(prompts=[""] * len(completions), completions=completions,
                                          answer=[answer] * len(completions))  # fmt: skip

    assert run("answer_match", ["it is 1,000", "1000.0", "999", [{"role": "assistant", "content": "so 1000"}],
                                "none"], "1000") == [1.0, 1.0, 0.0, 1.0, 0.0]  # fmt: skip
    assert run("answer_match", ["Red", " red ", "a red"], "red") == [1.0, 1.0, 0.0]
    assert run("gsm8k", ["3 + 4 = 7\n#### 7", "7 apples", "#### 8 (7)"], "4 and 3 make 7.\n#### 7") == [1, 1, 0]
    assert run("format", ["x\n#### 7", "#### 7 apples", "7"], "7") == [1.0, 0.0, 0.0]
    assert run("regex:^<think>.*</think>", ["<think>a</think> 3", "3"], "3") == [1.0, 0.0]


def test_a_bad_reward_function_is_named_with_the_record_it_failed_on(tmp_path):
    """Raising, the wrong count, a NaN, a string; a file without the function named, a missing file, a spec that
    is none of the forms: each one RewardError naming the function (and the record where there is one)."""
    from training.rewards import RewardError, load_reward, score

    path = tmp_path / "mine.py"
    path.write_text("def raises(completions, **kw):\n    return [1 / 0 for _ in completions]\n"
                    "def short(completions, **kw):\n    return [1.0]\n"
                    "def nan(completions, **kw):\n    return [float('nan')] * len(completions)\n"
                    "def text(completions, **kw):\n    return ['1'] * len(completions)\n"
                    "def fine(completions, answer, **kw):\n    return [float(c == a) for c, a in zip(completions, answer)]\n")  # fmt: skip
    where = ["data.jsonl, line 3", "data.jsonl, line 3", "data.jsonl, line 4", "data.jsonl, line 4"]

    def run(name):
        return score([load_reward(f"{path}:{name}")], ["q"] * 4, ["a", "b", "a", "c"], [[1]] * 4,
                     {"answer": ["a"] * 4}, 0, where)  # fmt: skip

    assert run("fine") == [[1.0], [0.0], [1.0], [0.0]]
    expected = {"raises": "reward 'raises' raised ZeroDivisionError: division by zero (scoring the completions of "
                          "data.jsonl, line 3 and others)",
                "short": "reward 'short' returned 1 values for 4 completions",
                "nan": "reward 'nan' returned nan for a completion of data.jsonl, line 3",
                "text": "reward 'text' returned '1' for a completion of data.jsonl, line 3"}  # fmt: skip
    for name, message in expected.items():
        with pytest.raises(RewardError) as err:
            run(name)
        assert message in str(err.value), str(err.value)
    for spec, message in ((f"{path}:missing", "defines no function 'missing' (it defines: fine, nan, raises, short, "
                           "text)"), (f"{tmp_path}/gone.py:f", "is not there"),
                          ("exact", "not one of answer_match, gsm8k, format")):  # fmt: skip
        with pytest.raises(RewardError, match=".*") as err:
            load_reward(spec)
        assert message in str(err.value), str(err.value)


def _sampler_rank_main(rank: int, world: int, rendezvous: str, assets: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.inprocess import _join

    _join(rank, world, rendezvous)
    try:
        samples = sampled(assets, world, rank)
        gathered = [None] * world
        dist.all_gather_object(gathered, samples)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def sampled(assets: dict, world: int = 1, rank: int = 0) -> dict:
    """Each rank's samples of its own prompts (rank 0: two, rank 1: one), twice with one seed, once with another."""
    import torch

    from data.render import stop_token_ids
    from training.sampler import sample

    trainee, _ = build(settings(assets, "--num-workers", str(world)), world)
    ids = token_ids(trainee.tokenizer)
    prompts = [ids[q][0] for q, _, _ in PROBLEMS][rank * 2 : rank * 2 + 2 - rank]
    device = torch.device("cpu")
    runs = [sample(trainee, prompts, 3, 8, 1.0, device, world, seed) for seed in (7, 7, 8)]
    return {"completions": [r.completions for r in runs], "tokens": runs[0].tokens,
            "stops": stop_token_ids(trainee.tokenizer)}  # fmt: skip


@pytest.mark.slow
def test_the_sampler_samples_each_prompts_group_to_its_end_of_turn_on_one_rank_and_two(tiny_assets):
    """num_generations completions a prompt, up to max_completion_length, ending at the first end of turn; the same
    seed the same samples, another seed others; on two ranks with two prompts and one (FSDP2 and synced_gpus: a
    rank that has finished keeps stepping with the other), every rank's own."""
    from tests.inprocess import _spawn

    one = _spawn(_sampler_rank_main, 1, tiny_assets)[0]
    two = _spawn(_sampler_rank_main, 2, tiny_assets)
    for run, prompts in ((one, 2), (two[0], 2), (two[1], 1)):
        first, again, other = run["completions"]
        assert len(first) == 3 * prompts and first == again and first != other
        for completion in first:
            assert 1 <= len(completion) <= 8
            assert all(t not in run["stops"] for t in completion[:-1])
        assert run["tokens"] == sum(len(c) for c in first)


def test_a_generated_row_is_cut_after_its_first_end_of_turn_or_its_padding():
    from training.sampler import cut

    assert cut([5, 6, 9, 7, 9, 0], {9}, 0) == [5, 6, 9]
    assert cut([5, 6, 7, 0, 0], {9}, 0) == [5, 6, 7]
    assert cut([5, 6, 7], {9}, 0) == [5, 6, 7]


def grpo_settings(assets: dict, *flags: str):
    """make local's GRPO stage on one rank: the tiny prompts, the reward file tiny_assets wrote (brief answers)."""
    return settings({"model": assets["model"], "dataset": assets["prompts"]}, "--objective", "grpo", "--rewards",
                    assets["rewards"], "--num-generations", "8", "--batch-size", "8", "--max-completion-length",
                    str(MAX_COMPLETION), "--lr", "5e-3", "--lr-schedule", "constant", "--warmup-ratio", "0",
                    "--split", "train", "--eval-tasks", "none", *flags)  # fmt: skip


@pytest.mark.slow
def test_the_run_loop_raises_a_reward_of_the_users_own_from_rare_to_nearly_always(tiny_assets, gloo_rank):
    """--objective grpo through the job's run loop (training_run.TrainingRun, as train_loop_per_worker runs it):
    30 steps of one prompt x 8 completions; TRL's metrics each epoch, the reward at every step (reward_curve),
    the held-out prompts' greedy reward at each eval, and their answers as samples with their rewards. Measured:
    0.06 over the first 5 steps, 1.0 over the last 5."""
    from tests.inprocess import train

    class Samples(list):
        def add(self, step: int, samples: list[dict]) -> None:
            self.append((step, samples))

    answered = Samples()
    _, history = train(grpo_settings(tiny_assets, "--max-steps", "30", "--eval-samples", "2"), samples=answered)
    curve = [r for h in history for r in h["reward_curve"]]
    assert len(curve) == 30 and sum(curve[:5]) / 5 < 0.3 and sum(curve[-5:]) / 5 > 0.8, curve
    last = history[-1]
    assert {
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "clip_ratio/region_mean",
        "generation_s",
        "sync_s",
        "step_s",
        "sampler_tokens_per_s",
    } <= set(last)
    assert "kl" not in last and last["sync_s"] == 0 and last["sampler_tokens_per_s"] > 0
    assert last["eval_rewards/brief"] == last["eval_reward"] and 0 <= last["eval_reward"] <= 1
    assert last["step"] == 30 and 1 <= last["completions/mean_length"] <= MAX_COMPLETION
    # each eval's first two held-out prompts, their greedy answers and rewards (the reward file's one function)
    assert [step for step, _ in answered] == [h["step"] for h in history if "eval_reward" in h] and answered
    for _, shown in answered:
        assert len(shown) == 2 and all(s["prompt"] and s["reference"] for s in shown)
        assert all(set(s["rewards"]) == {"brief"} and s["reward"] == s["rewards"]["brief"] for s in shown)


@pytest.mark.slow
def test_with_beta_the_reference_is_the_starting_weights_and_the_kl_grows_from_zero(tiny_assets, gloo_rank):
    from tests.inprocess import train

    _, history = train(grpo_settings(tiny_assets, "--max-steps", "6", "--beta", "0.2", "--eval-split", "none"))
    assert history[-1]["kl"] > 0  # step 1's is 0 (the learner is the reference), later steps' not


def _raising_rank_main(rank: int, world: int, rendezvous: str, assets: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.inprocess import _join
    from training.grpo import GrpoLoss
    from training.grpo_iteration import Group, iteration
    from training.rewards import Reward, RewardError

    def raises_on_large(prompts, completions, **kwargs):
        if any("large" in p[0]["content"] for p in prompts):
            raise ValueError("cannot score this one")
        return [1.0] * len(completions)

    _join(rank, world, rendezvous)
    try:
        trainee, optimizer = build(settings(assets, "--num-workers", str(world)), world)
        before = [p.detach().clone() for p in trainee.loss.parameters()]
        ids = token_ids(trainee.tokenizer)
        question = PROBLEMS[rank * 3][0]  # rank 0: "What is cold?", rank 1: "What is large?"
        prompts = [{"ids": ids[question][0], "prompt": [{"role": "user", "content": question}], "columns": {},
                    "where": f"prompts.jsonl, line {rank * 3 + 1}"}]  # fmt: skip
        try:
            iteration(trainee, optimizer, None, prompts, Group(4, 8, 1.0), [Reward("raises_on_large", raises_on_large)],
                      [1.0], GrpoLoss(max_completion_length=8), 1e-3, 1.0, 0, torch.device("cpu"), rank, world, 0)  # fmt: skip
            message = None
        except RewardError as err:
            message = str(err)
        unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, trainee.loss.parameters(), strict=True))
        seen = [None] * world
        dist.all_gather_object(seen, (message, unchanged))
        if rank == 0:
            torch.save(seen, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_reward_that_raises_on_one_rank_stops_every_rank_before_the_step(tiny_assets):
    """Rank 1's prompt makes the reward raise: both ranks raise its RewardError, naming the function and rank 1's
    record (none waits in the rewards' gather), and no weight moved."""
    from tests.inprocess import _spawn

    seen = _spawn(_raising_rank_main, 2, tiny_assets)
    expected = ("reward 'raises_on_large' raised ValueError: cannot score this one (scoring the completions of "
                "prompts.jsonl, line 4)")  # fmt: skip
    assert seen == [(expected, True), (expected, True)]


def test_a_reward_error_mid_run_reaches_the_driver_once_through_the_runs_directory(tmp_path):
    """The workers' RewardError is written to the run's directory (rank 0's), not raised (Ray Train would retry the
    group max_failures times, failing the same way), and the driver takes it: once, the file gone after."""
    from types import SimpleNamespace

    import pyarrow.fs

    from runtime.run_files import INPUT_ERROR_FILE, take_input_error, write_input_error

    (tmp_path / "run").mkdir()
    storage = SimpleNamespace(storage_filesystem=pyarrow.fs.LocalFileSystem(), experiment_fs_path=str(tmp_path / "run"))
    ctx = SimpleNamespace(get_storage=lambda: storage)
    write_input_error(ctx, 1, "rank 1's")  # (every rank has it; rank 0 writes it)
    assert take_input_error(str(tmp_path), "run") is None
    write_input_error(ctx, 0, "reward 'brief' raised KeyError: 'score'")
    assert (tmp_path / "run" / INPUT_ERROR_FILE).exists()
    assert take_input_error(str(tmp_path), "run") == "reward 'brief' raised KeyError: 'score'"
    assert take_input_error(str(tmp_path), "run") is None and take_input_error(str(tmp_path), "other") is None


def test_grpo_settings_are_refused_before_anything_is_loaded_naming_the_fix(tiny_assets):
    from config.setting_checks import check
    from runtime.outcome import JobInputError

    cases = {("--num-generations", "3"): "--batch-size 8 does not hold whole groups of --num-generations 3 "
             "completions (a group is one prompt's, compared with each other on one rank): give 6 or another multiple "
             "of 3, or a --num-generations that divides 8",
             ("--rewards", "exact"): "--rewards 'exact' names 'exact', which is not one of answer_match, gsm8k, "
             "format, regex:PATTERN or FILE.py:FUNCTION",
             ("--rewards", "regex:(["): "--rewards 'regex:([' names 'regex:([', which is not a regular expression",
             ("--reward-weights", "1,2"): "--reward-weights '1,2' gives 2 weights for 1 rewards (--rewards): one each",
             ("--reward-weights", "x"): "--reward-weights 'x' is not comma-separated numbers such as 1,0.5",
             ("--epsilon-high", "0.1"): "--epsilon-high 0.1 is below --epsilon 0.2",
             ("--num-generations", "1"): "--num-generations 1 must be at least 2"}  # fmt: skip
    for flags, message in cases.items():
        with pytest.raises(JobInputError) as err:
            check(grpo_settings(tiny_assets, *flags))
        assert message in str(err.value), str(err.value)
    with pytest.raises(JobInputError, match="holds instructions, not prompts with checkable answers"):
        check(settings(tiny_assets, "--objective", "grpo", "--dataset", "databricks/databricks-dolly-15k"))
    assert check(grpo_settings(tiny_assets)).packing is False  # a prompt is sampled, never packed
    from config.reward_specs import entries

    assert entries("gsm8k, format,regex:a,b") == ["gsm8k", "format", "regex:a,b"]


def test_prompt_records_are_read_in_both_forms_and_bad_ones_named_by_line(tiny_assets, tmp_path):
    """Text and turns, every other column kept for the rewards; the prompt's ids the chat template's with the
    model's turn opened; a missing, empty or ill-formed prompt and a line that is not JSON, named in file order in
    one message; a file without a prompt column refused naming --columns."""
    import json

    from data.prompt_data import read_prompts
    from data.render import load_tokenizer
    from runtime.outcome import JobInputError

    tokenizer = load_tokenizer(tiny_assets["model"])
    path = tmp_path / "prompts.jsonl"
    good = [{"prompt": "describe the bees", "answer": "bees", "id": 1},
            {"prompt": [{"role": "user", "content": "describe the tides"}], "answer": "tides", "id": 2}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in good))
    config = grpo_settings({"model": tiny_assets["model"], "prompts": str(path), "rewards": "answer_match"},
                           "--eval-split", "none")  # fmt: skip
    found, _, figures = read_prompts(config, tokenizer)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "describe the bees"}], tokenize=True,
                                         return_dict=True, add_generation_prompt=True)["input_ids"]  # fmt: skip
    assert [p["ids"] for p in found["train"]][0] == list(chat)
    assert [(p["prompt"], p["columns"]) for p in found["train"]] == [
        (r["prompt"], {"answer": r["answer"], "id": r["id"]}) for r in good]  # fmt: skip
    assert figures["train"][0]["formats"] == ["prompt (conversational)", "prompt (text)"]
    bad = [{"prompt": " ", "answer": "x"}, {"prompt": [{"role": "user", "content": "q"},
                                                        {"role": "assistant", "content": "a"}]},
           {"prompt": 3}, {"answer": "no prompt"}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in good + bad) + '{"prompt": \n')
    with pytest.raises(JobInputError) as err:
        read_prompts(config, tokenizer)
    assert str(err.value).splitlines() == [
        "5 bad records:",
        f"  {path}, line 3: prompt is empty",
        f"  {path}, line 4: prompt ends with an assistant turn; the model's turn is the completion's",
        f"  {path}, line 5: prompt is int; it must be non-empty text or a list of {{role, content}} turns",
        f"  {path}, line 6: prompt is missing",
        f"  {path}, line 7: not JSON (Expecting value): '{{\"prompt\":'",
    ]
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(JobInputError, match=r"needs a prompt column .* its columns: question, answer \(rename with "
                       r"--columns, e.g. --columns prompt=question\)"):  # fmt: skip
        read_prompts(config, tokenizer)


def test_a_reward_file_on_this_machine_reaches_the_workers_by_its_absolute_path(tiny_assets, tmp_path, monkeypatch):
    """The workers run in Ray's working directory, not the user's: a relative FILE.py (as docs/grpo.md's command
    gives it) is made absolute as --dataset is; built-ins, regex: and gs:// entries stay as they are."""
    from pathlib import Path

    from config.command_line import for_this_machine

    monkeypatch.chdir(Path(tiny_assets["model"]).parent)
    spec = "gsm8k,rewards.py:brief,gs://b/r.py:f,regex:a,b"
    assert for_this_machine(grpo_settings(tiny_assets, "--rewards", spec)).rewards == (
        f"gsm8k,{Path(tiny_assets['model']).parent / 'rewards.py'}:brief,gs://b/r.py:f,regex:a,b"
    )
