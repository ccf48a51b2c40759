import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "jobs")]

from tests.gcp_standins import MetadataStandin, isolate_google_clients  # noqa: E402

# Before any test (or google-auth, which reads the metadata host at import) runs: Google's
# endpoints are stand-ins on 127.0.0.1, and storage is a closed port until a test starts the emulator.
METADATA = MetadataStandin().start()
isolate_google_clients(METADATA.host, "http://127.0.0.1:9", Path(tempfile.mkdtemp(prefix="gcloud-config-")))


def pytest_collection_modifyitems(items):
    """`e2e`: every test that needs the Ray head (directly or through a fixture); `make test-fast`
    leaves them out."""
    for item in items:
        if "ray_head" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def metadata_server() -> MetadataStandin:
    return METADATA


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """One real Ray head on 127.0.0.1 shared by every test that runs jobs."""
    from infra.local_ray import LocalRayHead

    with LocalRayHead(log_dir=tmp_path_factory.mktemp("ray")) as head:
        yield head


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The tiny model, tokenizer and dataset, made once per session."""
    from tiny_assets import make_all

    return make_all(tmp_path_factory.mktemp("assets"))


@pytest.fixture
def gloo_rank(tmp_path):
    """A one-rank gloo process group in this process: the training code without Ray."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
