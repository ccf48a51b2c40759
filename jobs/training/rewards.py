"""GRPO's rewards: the built-ins by name, a user's own function from a Python file, and the checks every reward
passes before it reaches a loss.

A reward function has TRL's signature (trl 1.16.0, trainer/grpo_trainer.py, `_calculate_rewards`):
`f(prompts, completions, completion_ids, trainer_state, **columns) -> list[float | None]`, one value a completion,
where `columns` are the prompt record's other columns (`answer`, ...), each a list aligned with `completions`, and
a completion is its text (a plain prompt) or `[{"role": "assistant", "content": text}]` (a chat prompt). None means
"this function does not apply here" (TRL's NaN: the completion's reward is the other functions', or, when none
applies, the completion is unscorable and its advantage 0). A file written for TRL's GRPOTrainer works unchanged.

Names (`--rewards`, comma-separated, each weighted by `--reward-weights`):
- answer_match: 1.0 when the completion's last number equals the record's `answer` (numbers normalised: commas,
  a trailing `.0`; a non-numeric answer compared as stripped, case-folded text), else 0.0;
- gsm8k: the same, the target being what follows GSM8K's `#### ` in `answer`, the completion's `#### n` if it has
  one, else its last number;
- format: 1.0 when the completion ends with GSM8K's answer line `#### <number>`, else 0.0;
- regex:PATTERN: 1.0 when PATTERN (Python's `re.search`) matches the completion, else 0.0;
- FILE.py:FUNCTION: the user's own (a local path, uploaded with the data as --dataset is, or gs://).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from config.reward_specs import BUILT_INS, FORMS, entries, file_and_function, weights
from runtime.outcome import JobInputError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
GSM8K_LINE = re.compile(GSM8K_ANSWER.pattern + r"\s*$")


class RewardError(JobInputError):
    """A reward function that cannot be used: not there, or it raised, returned the wrong count, a NaN or not a
    number (a bad input: before Ray, the job's exit status 2 and this message)."""


def text_of(completion) -> str:
    """A completion's text, plain or as TRL's chat completion (a list of one assistant message)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def normalised(value: str) -> str:
    """A number as one spelling (1,000 -> 1000, 3.50 -> 3.5, 2.0 -> 2), else the text stripped and case-folded."""
    text = str(value).strip().replace(",", "").rstrip(".")
    try:
        number = float(text)
    except ValueError:
        return str(value).strip().casefold()
    return str(int(number)) if number.is_integer() else repr(number)


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1] if found else None


def gsm8k_target(answer: str) -> str:
    """GSM8K's answer is a worked solution ending `#### 42`: the 42 (the whole answer where there is no `####`)."""
    return answer.rsplit("####", 1)[1] if "####" in answer else answer


def answer_match(prompts, completions, answer, **_) -> list[float]:
    out = []
    for completion, target in zip(completions, answer, strict=True):
        target = normalised(target)
        text = text_of(completion)
        said = last_number(text) if re.fullmatch(r"-?\d+(\.\d+)?", target) else text
        out.append(float(said is not None and normalised(said) == target))
    return out


def gsm8k(prompts, completions, answer, **_) -> list[float]:
    out = []
    for completion, target in zip(completions, answer, strict=True):
        text = text_of(completion).strip()
        marked = GSM8K_ANSWER.findall(text)
        said = marked[-1] if marked else last_number(text)
        out.append(float(said is not None and normalised(said) == normalised(gsm8k_target(str(target)))))
    return out


def answer_format(prompts, completions, **_) -> list[float]:
    return [float(GSM8K_LINE.search(text_of(c).strip()) is not None) for c in completions]


def regex_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern)

    def matches(prompts, completions, **_) -> list[float]:
        return [float(compiled.search(text_of(c)) is not None) for c in completions]

    return matches


@dataclass(frozen=True)
class Reward:
    name: str  # what the metrics and errors call it
    function: Callable


def load_reward(spec: str, local_path: Callable[[str], str] = lambda p: p) -> Reward:
    """One --rewards entry as a Reward; `local_path` turns a gs:// file into a local copy (runtime.storage)."""
    if spec in BUILT_INS:
        return Reward(spec, {"answer_match": answer_match, "gsm8k": gsm8k, "format": answer_format}[spec])
    if spec.startswith("regex:"):
        try:
            return Reward(spec, regex_reward(spec.removeprefix("regex:")))
        except re.error as err:
            raise RewardError(f"reward {spec!r}: not a regular expression ({err})") from None
    parts = file_and_function(spec)
    if parts is None:
        raise RewardError(f"reward {spec!r}: not one of {FORMS}")
    path, name = parts
    module_spec = importlib.util.spec_from_file_location(f"user_rewards_{abs(hash(path))}", local_path(path))
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except FileNotFoundError:
        raise RewardError(f"reward {spec!r}: {path} is not there") from None
    except Exception as err:
        raise RewardError(f"reward {spec!r}: importing {path} raised {type(err).__name__}: {err}") from err
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardError(f"reward {spec!r}: {path} defines no function {name!r} (it defines: "
                          f"{', '.join(defined) or 'none'})")  # fmt: skip
    return Reward(name, function)


def load_rewards(rewards: str, reward_weights: str | None, local_path=lambda p: p) -> tuple[list[Reward], list]:
    """--rewards' functions and --reward-weights' weights."""
    return [load_reward(e, local_path) for e in entries(rewards)], weights(rewards, reward_weights)


def score(rewards: Sequence[Reward], prompts: list, completions: list, completion_ids: list, columns: dict,
          step: int, where: Sequence[str]) -> list[list[float]]:  # fmt: skip
    """Each completion's reward from each function, [completion][function], None as NaN. `where` names each
    completion's record (its file and line) for an error. A function that raises, returns another count than the
    completions', a NaN or something not a number is a RewardError naming it and the first record it failed on."""
    state = SimpleNamespace(global_step=step)
    table = [[math.nan] * len(rewards) for _ in completions]
    for j, reward in enumerate(rewards):
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                     trainer_state=state, log_extra=lambda *a, **k: None,
                                     log_metric=lambda *a, **k: None, **columns)  # fmt: skip
        except Exception as err:
            raise RewardError(f"reward {reward.name!r} raised {type(err).__name__}: {err} (scoring the completions "
                              f"of {where[0]}{' and others' if len(set(where)) > 1 else ''})") from err  # fmt: skip
        values = list(values) if isinstance(values, list | tuple) else values
        if not isinstance(values, list) or len(values) != len(completions):
            count = len(values) if isinstance(values, list) else type(values).__name__
            raise RewardError(f"reward {reward.name!r} returned {count} values for {len(completions)} completions "
                              f"(of {where[0]}, ...): it must return one value a completion, in their order")  # fmt: skip
        for i, value in enumerate(values):
            if value is None:
                continue
            if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardError(f"reward {reward.name!r} returned {value!r} for a completion of {where[i]}: a "
                                  "reward is a finite number, or None where the function does not apply")  # fmt: skip
            table[i][j] = float(value)
    return table
