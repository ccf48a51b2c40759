"""The tiny assets' records for the other objectives (tiny_assets.py makes them): DPO's preference pairs from the
tiny Dolly records, GRPO's prompts and a reward file of the user's kind that the tiny model can learn."""

from __future__ import annotations

import json
import random
from pathlib import Path

REWARD = "brief"
REWARD_FILE = '''"""make local's GRPO reward: a user's own, with TRL's signature (jobs/training/rewards.py)."""


def brief(prompts, completions, completion_ids, **kwargs):
    """1.0 for an answer of at most two tokens and its end of turn, else 0.0: the tiny model must learn to stop."""
    return [1.0 if len(ids) <= 3 else 0.0 for ids in completion_ids]
'''
SUBJECTS = ("rivers", "glaciers", "deserts", "bees", "comets", "tides", "volcanoes", "orchards", "violins", "chess")


def make_pairs(path: Path, dataset: Path, seed: int = 0) -> Path:
    """Preference pairs (TRL's conversational format) from the tiny Dolly records: each instruction's own response
    chosen over another record's, for --objective dpo."""
    rng = random.Random(seed)
    records = [json.loads(line) for line in dataset.read_text().splitlines()]
    with open(path, "w") as f:
        for i, r in enumerate(records):
            other = records[(i + rng.randrange(1, len(records))) % len(records)]
            f.write(json.dumps({"prompt": [{"role": "user", "content": r["instruction"]}],
                                "chosen": [{"role": "assistant", "content": r["response"]}],
                                "rejected": [{"role": "assistant", "content": other["response"]}]}) + "\n")  # fmt: skip
    return path


def make_prompts(path: Path, rewards: Path, count: int = 48) -> Path:
    """GRPO's prompts (chat turns, an answer column for the rewards that read one) and the reward file."""
    with open(path, "w") as f:
        for i in range(count):
            subject = SUBJECTS[i % len(SUBJECTS)]
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"describe the {subject} in a short answer"}],
                                "answer": subject}) + "\n")  # fmt: skip
    rewards.write_text(REWARD_FILE)
    return path
