import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "jobs")]


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """One real Ray head on 127.0.0.1 shared by every test that runs jobs."""
    from infra.local_ray import LocalRayHead

    with LocalRayHead(log_dir=tmp_path_factory.mktemp("ray")) as head:
        yield head


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    from tiny_assets import make_all

    return make_all(tmp_path_factory.mktemp("assets"))
