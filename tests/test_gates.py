"""The quality gates of `make test` bite: a broken Dockerfile, workflow or Python file fails them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

BROKEN_WORKFLOW = """\
name: broken
on: pull_request
jobs:
  preview:
    runs-on: ubuntu-latest
    permissions: write-everything
    steps:
      - uses: actions/checkout@v4
        with: checkout-everything
"""
BROKEN_DOCKERFILE = """\
FROM ubuntu
RUN apt-get update && apt-get install wget
RUN cd /tmp && pip install ray
"""


def gate(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / tool), *args], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("workflow", sorted((ROOT / ".github" / "workflows").glob("*.yml")), ids=lambda p: p.name)
def test_workflows_validate(workflow):
    done = gate("check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(workflow))
    assert done.returncode == 0, done.stdout + done.stderr


def test_broken_workflow_fails_the_gate(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(BROKEN_WORKFLOW)
    done = gate("check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(broken))
    assert done.returncode != 0 and "permissions" in done.stdout + done.stderr


def test_dockerfile_passes_and_broken_one_fails(tmp_path):
    assert gate("hadolint", "image/Dockerfile").returncode == 0
    broken = tmp_path / "Dockerfile"
    broken.write_text(BROKEN_DOCKERFILE)
    done = gate("hadolint", str(broken))
    assert done.returncode != 0
    for rule in ("DL3006", "DL3014", "DL3003"):  # untagged base, apt without -y, cd instead of WORKDIR
        assert rule in done.stdout


def test_ruff_fails_on_a_broken_file(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import os\n\ndef f( x ):\n    return undefined_name\n")
    assert gate("ruff", "check", "--no-cache", str(broken)).returncode != 0
    assert gate("ruff", "format", "--check", "--no-cache", str(broken)).returncode != 0
