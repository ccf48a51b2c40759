import atexit
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest

import infra.job_modules  # noqa: E402, F401  (the one door to jobs/: the tests import job modules by their names)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: one compute thread each (as Ray's workers), or their OpenMP pools
    # oversubscribe the machine and every in-process training step runs several times slower.
    os.environ["OMP_NUM_THREADS"] = "1"

from tests.gcp_standins import MetadataStandin, isolate_google_clients  # noqa: E402

# Before any test (or google-auth, which reads the metadata host at import) runs: Google's
# endpoints are stand-ins on 127.0.0.1, and storage is a closed port until a test starts the emulator.
METADATA = MetadataStandin().start()
GCLOUD_CONFIG = Path(tempfile.mkdtemp(prefix="gcloud-config-"))
atexit.register(shutil.rmtree, GCLOUD_CONFIG, True)
isolate_google_clients(METADATA.host, "http://127.0.0.1:9", GCLOUD_CONFIG)
# google-auth keeps the host it found at import (google/auth/compute_engine/_metadata.py: _GCE_METADATA_HOST) for
# the process's life: imported now, it is this session's stand-in, and not the short-lived one of whichever test
# imported it first (bench/checkpoint_writes.py starts its own), which later tests would wait on for minutes.
import google.auth.compute_engine._metadata  # noqa: E402, F401, I001

# datasets (at import) and transformers (at first use) give their loggers a handler on the sys.stderr
# of that moment, once. Done here it is the session's stream, not the stream of whichever `capsys` test
# came first, which is closed after it: later log lines would end in "--- Logging error ---" tracebacks.
import datasets  # noqa: E402, F401, I001
from transformers.utils import logging as transformers_logging  # noqa: E402

transformers_logging.get_logger("transformers")


# The files that take longest, longest first (pytest's own per-test times from fresh clones, docs/tests.md): `-n 2
# --dist loadfile --no-loadscope-reorder` hands out whole files in this order, so the long ones start early on both
# workers and the many short files fill in around them. (xdist's default reorder, by test count, started the
# bench and preemption files last: one worker ran them alone for the last minute.)
SLOWEST_FIRST = ("test_jobs.py", "test_training.py", "test_preemption.py", "test_resume.py", "test_ctrl_c.py",
                 "test_compile.py", "test_bench.py", "test_dpo.py", "test_evaluation.py", "test_step_checkpoints.py",
                 "test_recipe.py", "test_storage.py", "test_slices.py", "test_local_serving.py", "test_serving.py")  # fmt: skip


def pytest_collection_modifyitems(items):
    """`e2e`: every test that needs the Ray head (directly or through a fixture); `make test-fast` leaves them
    out. Then the files in SLOWEST_FIRST's order, the others after them as collected."""
    for item in items:
        if "ray_head" in getattr(item, "fixturenames", ()) or item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: within a file as collected)


PICKLER_AS_PYTHON_MADE_IT = {name: pickle._Pickler.__dict__[name] for name in ("_batch_setitems", "save_dict")}


@pytest.fixture(autouse=True)
def pickler_as_found():
    """Pulumi's serialize_provider (pulumi 3.272.0, pulumi/dynamic/dynamic.py) replaces pickle._Pickler's
    _batch_setitems with a sorting wrapper around the one it finds and never puts it back: one layer per dynamic
    resource a program declares. A `pulumi up` declares two and exits; this session runs the program hundreds of
    times, and a later `datasets` fingerprint (dill, a pickle._Pickler) then exceeds the recursion limit. Each
    test gets the pickler as Python made it."""
    yield
    for name, method in PICKLER_AS_PYTHON_MADE_IT.items():
        setattr(pickle._Pickler, name, method)


@pytest.fixture(scope="session")
def metadata_server() -> MetadataStandin:
    return METADATA


# With `-n N` (make test), the xdist controller starts the one Ray head and writes the one tiny-asset
# set before its workers start, and every worker uses them: the e2e tests mostly wait (on Ray's
# scheduling, polling and process start-up), so two run side by side on one head.
SHARED = "GEMMA_TPU_TEST_SHARED"
HEAD_CPUS = 8  # logical: two workers' fine-tunes (2 each) and a collectives check (4) at once


def pytest_configure(config):
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return  # a worker, or no workers: the session fixtures below make what is needed when it is needed
    from infra.runner.local_ray import LocalRayHead
    from tiny_assets import make_all

    config.shared_dir = shared = Path(tempfile.mkdtemp(prefix="gemma-tpu-tests-"))
    found = {"assets": make_all(shared / "assets")}
    if "not e2e" not in (config.option.markexpr or ""):  # (`make test-fast` runs no test that needs the head)
        config.shared_head = LocalRayHead(num_cpus=HEAD_CPUS, log_dir=shared).start()
        found |= {"port": config.shared_head.port, "dashboard_port": config.shared_head.dashboard_port}
    os.environ[SHARED] = json.dumps(found)


def pytest_unconfigure(config):
    if getattr(config, "shared_head", None) is not None:
        config.shared_head.stop()
    if getattr(config, "shared_dir", None) is not None:
        shutil.rmtree(config.shared_dir, ignore_errors=True)
    if not hasattr(config, "workerinput"):  # the controller, or a run without workers: nothing left in /tmp
        shutil.rmtree(Path(tempfile.gettempdir()) / "gemma-tpu-scratch", ignore_errors=True)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """One real Ray head on 127.0.0.1 shared by every test that runs jobs (and every xdist worker)."""
    from infra.runner.local_ray import LocalRayHead

    if SHARED in os.environ:
        shared = json.loads(os.environ[SHARED])
        yield LocalRayHead.running_at(shared["port"], shared["dashboard_port"], num_cpus=HEAD_CPUS)
        return
    with LocalRayHead(num_cpus=HEAD_CPUS, log_dir=tmp_path_factory.mktemp("ray")) as head:
        yield head


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The tiny model, tokenizer and dataset, made once per session."""
    from tiny_assets import make_all

    if SHARED in os.environ:
        return json.loads(os.environ[SHARED])["assets"]
    return make_all(tmp_path_factory.mktemp("assets"))


@pytest.fixture
def storage():
    """A GCS emulator on 127.0.0.1 (fake-gcs-server) holding the bucket demo-data, for gs:// through gcsfs."""
    from tests.gcp_standins import StorageEmulator

    emulator = StorageEmulator().start()
    emulator.create_bucket("demo-data")
    yield emulator
    emulator.stop()


@pytest.fixture
def gloo_rank(tmp_path):
    """A one-rank gloo process group in this process: the training code without Ray."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
