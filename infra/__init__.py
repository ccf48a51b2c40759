"""Components of the stack: one module per thing it builds, over pure functions."""

from pathlib import Path

import yaml

PULUMI_YAML = Path(__file__).resolve().parent.parent / "Pulumi.yaml"
# The project name types the components (`<project>:infra:<Class>`) and namespaces the config.
PROJECT: str = yaml.safe_load(PULUMI_YAML.read_text())["name"]
