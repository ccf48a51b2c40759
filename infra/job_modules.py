"""The stack's one door into jobs/: the jobs' torch-free modules, under the names the jobs import each other by.

jobs/ travels alone, as Ray's working directory (`ray job submit --working-dir jobs -- python
ray_train_llm_finetune.py`), its packages importing one another from the top (`from training import recipe`). The
stack reads some of the same facts and functions (the settings table, the TPU generations, the split grammar,
the memory plan, the storage clients' names); jobs/ is put on sys.path here, once, and everything in infra/
that reads a job module imports it from here, so a reader sees where it comes from:

    from infra.job_modules import settings

Each module is loaded once, under its one name, in any process (tests/test_layout.py).
"""

import sys

from infra import JOBS_DIR

if str(JOBS_DIR) not in sys.path:
    sys.path.insert(0, str(JOBS_DIR))

import tiny_assets  # noqa: E402
from config import command_line, data_formats, eval_tasks, modality, reward_specs, setting_checks, settings, splits  # noqa: E402,E501
from evaluation import endpoint  # noqa: E402
from runtime import backend, log_lines, memory_plan, outcome, run_files, storage, tpu_generations  # noqa: E402
from training import samples  # noqa: E402

__all__ = [
    "backend",
    "command_line",
    "data_formats",
    "endpoint",
    "eval_tasks",
    "log_lines",
    "memory_plan",
    "modality",
    "outcome",
    "reward_specs",
    "run_files",
    "samples",
    "setting_checks",
    "settings",
    "splits",
    "storage",
    "tiny_assets",
    "tpu_generations",
]
