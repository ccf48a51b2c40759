"""`make bench`'s checkpoint-write table: one rank's DCP shard written to gs:// through gcsfs, with gcsfs and
torch's defaults (one file, 5 MiB blocks) against the jobs' settings (jobs/runtime/storage.py: CHECKPOINT_THREADS
files at once, CHECKPOINT_BLOCK_BYTES blocks), on the GCS emulator on 127.0.0.1 (fake-gcs-server) with the
metadata-server stand-in for the token. Each setting is written `--repeats` times in turn; the table gives the
median seconds and MB/s, and the ratio.

The emulator is a local process, not Google Cloud: what the ratio shows is the client side's parallelism and
its request count, not GCS's own throughput (docs/benchmark.md).

    python -m bench.checkpoint_writes                # 512 MB, 3 repeats
    python -m bench.checkpoint_writes --mb 16 --repeats 1
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=512, help="the shard's size, in MB of fp32 tensors of 4 MB each")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def write_seconds(state: dict, target: str, options: dict) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    started = time.perf_counter()
    dcp.save(state, storage_writer=FsspecWriter(target, **options))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    import torch
    import torch.distributed as dist

    from infra.job_modules import storage
    from tests.gcp_standins import MetadataStandin, StorageEmulator, isolate_google_clients

    args = parse_args(argv)
    # fake-gcs-server has no moveTo (GCS's objects.move), which gcsfs tries first for DCP's rename of .metadata and
    # then logs, traceback and all, before it copies instead: the emulator's gap, not the write's
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    saved_env = dict(os.environ)
    metadata = MetadataStandin().start()
    isolate_google_clients(metadata.host, "http://127.0.0.1:9", Path(tempfile.mkdtemp(prefix="gcloud-")))
    emulator = StorageEmulator().start()
    emulator.create_bucket("bench-ckpt")
    settings = {"defaults (1 file, 5 MiB blocks)": storage.fsspec_options("gs://bench-ckpt"),
                "the jobs' (jobs/runtime/storage.py)": storage.checkpoint_writer_options("gs://bench-ckpt")}  # fmt: skip
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(args.mb // 4)}
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
    try:
        times = {name: [] for name in settings}
        for repeat in range(args.repeats):
            for i, (name, options) in enumerate(settings.items()):
                times[name].append(write_seconds(state, f"gs://bench-ckpt/r{repeat}-{i}", options))
    finally:
        dist.destroy_process_group()
        emulator.stop()
        metadata.stop()
        os.environ.clear()
        os.environ.update(saved_env)  # (a test process goes on with its own stand-ins)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"\ncheckpoint writes: one rank's {args.mb} MB shard to the GCS emulator, median of {args.repeats}\n")
    for name, seconds in median.items():
        print(f"  {name:34} {seconds:6.2f} s  {args.mb / seconds:7.1f} MB/s")
    default, ours = median.values()
    print(f"  the jobs' / defaults: {default / ours:.2f}x the throughput")
    return {"seconds": median, "ratio": default / ours}


if __name__ == "__main__":
    main()
