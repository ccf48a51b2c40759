"""Components of the stack: one module per thing it builds, over pure functions."""

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PULUMI_YAML = ROOT / "Pulumi.yaml"
# The project name types the components (`<project>:infra:<Class>`) and namespaces the config.
PROJECT: str = yaml.safe_load(PULUMI_YAML.read_text())["name"]

# The jobs run with jobs/ as their working directory (Ray's working_dir) and import one another as
# top-level modules (`import recipe`). The stack reads a few of their facts under those same names,
# so each is loaded once, as one module, in any process.
JOBS_DIR = ROOT / "jobs"
if str(JOBS_DIR) not in sys.path:
    sys.path.insert(0, str(JOBS_DIR))
