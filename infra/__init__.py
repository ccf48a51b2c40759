"""Components of the stack: one module per thing it builds, over pure functions."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PULUMI_YAML = ROOT / "Pulumi.yaml"
# The project name types the components (`<project>:infra:<Class>`) and namespaces the config.
PROJECT: str = yaml.safe_load(PULUMI_YAML.read_text())["name"]
# What runs on the Ray cluster (uploaded as the jobs' working directory); the stack reads the torch-free
# modules of it through infra/job_modules.py.
JOBS_DIR = ROOT / "jobs"
