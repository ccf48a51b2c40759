"""Where a run's files go (a local path or gs://), and the two clients that write them, set up in one place.

- **pyarrow** (Ray Train's storage, the run's files, the prepared data): its GcsFileSystem retries a
  failing request for `retry_time_limit`, 15 minutes unless told (pyarrow/_gcsfs.pyx), which looks like a
  hang when the pod has no credentials; here it gives up after RETRY_S.
- **gcsfs** (DCP's shards through fsspec, gs:// data): given no token it tries google_default, its cache,
  `cloud`, then *anonymous* (gcsfs/credentials.py, `connect`), so a pod whose Workload Identity is not
  ready, or wrong, would write anonymously and learn of it from a 401 at the first checkpoint. Every
  gcsfs client here is made with token google_default (ADC: on GKE the metadata server's Workload
  Identity token; on a laptop `gcloud auth application-default login`), which fails loudly instead.
- gcsfs 2026.8's experimental adaptive prefetcher, on by default for reads, stops answering when a reader
  seeks backwards in a file (a hard seek restarts its producer, and the fetch it spawns never completes),
  which torch.load does in every DCP shard: a resume from gs:// hung (tests/test_storage.py). Importing this
  module turns it off for the process (USE_EXPERIMENTAL_ADAPTIVE_PREFETCHING, read at each open:
  gcsfs/core.py, _get_prefetcher_and_cache_config); reads use gcsfs's readahead cache instead.
- **probe**: before any work, the credentials are fetched (bounded), then one small object is written,
  read and deleted under the storage path through both clients. A failure stops the run there, naming
  the bucket, who this process is, and the client's error.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from pathlib import Path

from runtime.outcome import JobInputError

os.environ.setdefault("USE_EXPERIMENTAL_ADAPTIVE_PREFETCHING", "false")
GCS_TOKEN = "google_default"
RETRY_S = 60  # pyarrow's retry_time_limit for gs://: an auth failure or an outage ends in a minute
CREDENTIALS_TIMEOUT_S = 45.0  # google-auth's own metadata timeouts stay under it (3 s a try, bounded retries)
STORAGE_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
# What the job resource looks for in a failed job's log to add the stack's view of the identity.
PROBE_FAILED = "storage check failed"
# A Kubernetes pod's own ServiceAccount token: its `sub` claim names the account the pod runs as.
POD_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
# DCP's writer on gs://: each rank's shard in CHECKPOINT_THREADS files written at once (torch's FsspecWriter
# splits a rank's items by size over its threads), each uploaded in CHECKPOINT_BLOCK_BYTES requests (gcsfs's
# default is 5 MiB: a 1 GiB shard is 200 sequential round trips). At most threads x block bytes in flight a
# rank: 64 MiB, 512 MiB on an Ironwood host's 8 ranks, beside 250 GiB. make bench measures the ratio.
CHECKPOINT_THREADS = 4
CHECKPOINT_BLOCK_BYTES = 16 << 20


def is_gcs(uri: str) -> bool:
    return uri.startswith("gs://")


def bucket_of(uri: str) -> str:
    return uri.removeprefix("gs://").split("/", 1)[0]


def filesystem(uri: str):
    """(pyarrow filesystem, path) for a local path or URI; gs:// with its retries bounded to RETRY_S."""
    import pyarrow.fs

    if is_gcs(uri):
        return pyarrow.fs.FileSystem.from_uri(f"{uri}?retry_limit_seconds={RETRY_S}")
    return pyarrow.fs.FileSystem.from_uri(uri if "://" in uri else str(Path(uri).expanduser().resolve()))


def ray_storage(storage_path: str) -> dict:
    """RunConfig's storage arguments: gs:// through filesystem()'s bounded client (Ray would make its own
    with the 15-minute default: ray/train/v2/_internal/execution/storage.py, get_fs_and_path)."""
    if not is_gcs(storage_path):
        return {"storage_path": storage_path}
    fs, path = filesystem(storage_path)
    return {"storage_path": path, "storage_filesystem": fs}


def fsspec_options(uri: str) -> dict:
    """Keyword arguments for an fsspec filesystem of `uri`: gs:// pinned to google_default."""
    return {"token": GCS_TOKEN} if is_gcs(uri) else {}


def gcs():
    import fsspec

    return fsspec.filesystem("gs", token=GCS_TOKEN)


def checkpoint_writer_options(uri: str) -> dict:
    """torch's FsspecWriter arguments for a checkpoint at `uri` (its extra kwargs reach fsspec's url_to_fs)."""
    if not is_gcs(uri):
        return {}
    return {"thread_count": CHECKPOINT_THREADS, "block_size": CHECKPOINT_BLOCK_BYTES, **fsspec_options(uri)}


def pod_service_account() -> str | None:
    """NAMESPACE/NAME of the Kubernetes ServiceAccount this pod runs as (its token's `sub` claim), if in a pod."""
    try:
        payload = POD_TOKEN.read_text().split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (OSError, IndexError, ValueError):
        return None
    parts = str(claims.get("sub", "")).split(":")
    return f"{parts[2]}/{parts[3]}" if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"] else None


def who() -> str:
    account = pod_service_account()
    return f"this pod's Kubernetes ServiceAccount {account}" if account else "this process's Google credentials"


def _bounded(call, timeout_s: float, what: str):
    """`call()` on a daemon thread: its result, its error, or a TimeoutError after timeout_s (a stuck thread
    must not hold the process at exit, as a pool's would)."""
    box: dict = {}

    def target():
        try:
            box["result"] = call()
        except BaseException as err:  # noqa: BLE001  (handed to the caller)
            box["error"] = err

    thread = threading.Thread(target=target, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not answer within {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def google_credentials(timeout_s: float = CREDENTIALS_TIMEOUT_S):
    """ADC, refreshed once: a token in hand, or the reason there is none, within timeout_s."""

    def fetch():
        import google.auth
        import google.auth.transport.requests

        credentials, _ = google.auth.default(scopes=[STORAGE_SCOPE])
        credentials.refresh(google.auth.transport.requests.Request())
        return credentials

    return _bounded(fetch, timeout_s, "Google credentials (the metadata server, on GKE)")


def _failed(storage_path: str, step: str, err: BaseException) -> JobInputError:
    reason = " ".join(str(err).split())[:400] or type(err).__name__
    if not is_gcs(storage_path):
        return JobInputError(f"{PROBE_FAILED}: --storage-path {storage_path!r} cannot be written ({step}): {reason}")
    bucket = bucket_of(storage_path)
    return JobInputError(
        f"{PROBE_FAILED}: --storage-path {storage_path!r}: {step} failed as {who()}: {reason}. The pods need "
        f"roles/storage.objectAdmin on gs://{bucket} for their Workload Identity principal (the stack grants it "
        "to its serviceAccount); on a laptop, run `gcloud auth application-default login`. Nothing was written."
    )


def probe(storage_path: str) -> None:
    """Credentials, then write, read and delete one small object under `storage_path` through pyarrow and
    (for gs://) gcsfs, the clients training uses: the run stops here, before any work, if one cannot."""
    payload = f"probe {os.getpid()} {time.time()}".encode()
    name = f".storage_probe_{os.getpid()}"
    if is_gcs(storage_path):
        try:
            google_credentials()
        except Exception as err:  # noqa: BLE001  (any reason means the same to the user)
            raise _failed(storage_path, "getting Google credentials", err) from None
    try:
        fs, base = filesystem(storage_path)
        fs.create_dir(base, recursive=True)
        path = f"{base.rstrip('/')}/{name}"
        with fs.open_output_stream(path) as f:
            f.write(payload)
        with fs.open_input_stream(path) as f:
            assert f.read() == payload, "the object read back differs from the one written"
        fs.delete_file(path)
    except Exception as err:  # noqa: BLE001
        raise _failed(storage_path, "writing, reading and deleting an object with pyarrow", err) from None
    if is_gcs(storage_path):
        uri = f"{storage_path.rstrip('/')}/{name}"
        try:
            client = gcs()
            client.pipe(uri, payload)
            assert client.cat(uri) == payload, "the object read back differs from the one written"
            client.rm(uri)
        except Exception as err:  # noqa: BLE001
            raise _failed(storage_path, "writing, reading and deleting an object with gcsfs", err) from None


def model_directory(ref: str) -> str:
    """A model (or tokenizer) reference as from_pretrained takes it: a hub id or local directory as it is; a
    gs:// directory (an earlier run's export, `<run>/model`) copied once per machine into the temp dir (every
    rank of a host shares the copy). The copy is named by the URI and its objects' names, sizes and checksums:
    an export written again at the same URI (a run name used twice) is copied again, never read from an older
    copy."""
    import hashlib

    if not is_gcs(ref):
        return ref
    fs, source = gcs(), ref.rstrip("/")
    root = fs._strip_protocol(source)
    listing = {name[len(root) + 1 :]: (d.get("size"), d.get("md5Hash") or d.get("crc32c") or d.get("generation"))
               for name, d in fs.find(source, detail=True).items()}  # fmt: skip
    if "config.json" not in listing and "tokenizer_config.json" not in listing:
        raise JobInputError(f"{ref!r} holds no model (no config.json or tokenizer_config.json there): give "
                            "the directory an earlier run exported, <run>/model")  # fmt: skip
    key = hashlib.sha256(json.dumps([ref, sorted(listing.items())]).encode()).hexdigest()[:16]
    return once_per_machine(f"model-{key}", lambda partial: fs.get(f"{source}/", f"{partial}/", recursive=True))


def once_per_machine(name: str, fill) -> str:
    """The temp dir's `name`, made once on this machine: the first process fills a partial directory
    (`fill(partial)`) and renames it into place; every other (each rank of a host) waits on the lock, then
    finds it."""
    import fcntl
    import shutil
    import tempfile

    local = os.path.join(tempfile.gettempdir(), name)
    with open(f"{local}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(local):
            partial = f"{local}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            fill(partial)
            os.rename(partial, local)
    return local


def uri(storage_path: str, fs_path: str) -> str:
    """pyarrow paths drop the scheme (gs://bucket/x is bucket/x); fsspec and users need it back."""
    scheme = storage_path.split("://", 1)[0] + "://" if "://" in storage_path else ""
    return fs_path if fs_path.startswith(scheme) else scheme + fs_path
