"""`make bench`'s data table: Dolly-shaped records prepared once (jobs/data/prepared.py), then the fine-tune's
start on them, at 10k, 100k and 1M records.

For each size, on one local Ray head with this machine's cores, the real job:
- prepare: `--preflight`, as the job resource runs it on the head; its time, records/s, and the peak
  of the summed resident memory of every process of the run (the driver, Ray's daemons, the Ray Data
  workers), sampled ten times a second;
- again: the same preflight once more, which finds the prepared data and renders nothing;
- first step: the fine-tune (2 CPU workers) on the prepared data, from its start to its first
  optimizer step (`step 1/` in its log), and the same summed memory's peak up to then.
Then 100k records prepared on a head of 1 CPU and of 2: the speed-up.

    python -m bench.data                          # 10k, 100k, 1M (about half an hour on 2 cores)
    python -m bench.data --sizes 2000,8000 --scaling-rows 0   # quicker
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.finetune import JOB, ROOT, make_assets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / ".local" / "bench")
    p.add_argument("--sizes", default="10000,100000,1000000", help="records, comma-separated")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prepare-chunk", type=int, default=None, help="records per preparation task (default: the job's)")
    p.add_argument("--first-step", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the fine-tune's start to its first step")  # fmt: skip
    p.add_argument("--scaling-rows", type=int, default=100_000,
                   help="records prepared on a head of 1 CPU and of 2, for the speed-up; 0: skip")  # fmt: skip
    return p.parse_args(argv)


class PeakMemory:
    """The peak, over time, of the summed resident memory of some process trees (sampled every 0.1 s)."""

    def __init__(self, *pids: int):
        self.pids, self.peak, self._stop = pids, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def total(self) -> int:
        import psutil

        seen = 0
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    try:
                        seen += proc.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                pass
        return seen

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.total())
            self._stop.wait(0.1)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()


def job_argv(assets: dict, rows: int, storage: Path, args: argparse.Namespace, *flags: str) -> list[str]:
    return [sys.executable, str(JOB), "--backend", "cpu", "--num-workers", "2", "--model", assets["model"],
            "--dataset", assets["dataset"], "--split", f"train[:{rows}]", "--seq-len", str(args.seq_len),
            "--epochs", "1", "--log-every", "1", "--storage-path", str(storage),
            *(["--prepare-chunk", str(args.prepare_chunk)] if args.prepare_chunk else []), *flags]  # fmt: skip


def timed_run(head, argv: list[str], until: str | None = None) -> tuple[float, int, int, str]:
    """(seconds, peak bytes of the driver and the head's processes, the idle head's bytes, output) of a job
    run as the job resource runs it (RAY_ADDRESS: the head); with `until`, stopped once a line contains it."""
    heads = [head.process.pid] if head.process else []  # (a head another process started: not counted)
    idle = PeakMemory(*heads).total()
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=head.client_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    lines = []
    with PeakMemory(proc.pid, *heads) as memory:
        for line in proc.stdout:
            lines.append(line)
            if until and until in line:
                break
        took = time.monotonic() - started
    if until:
        os.killpg(proc.pid, signal.SIGTERM)
    code = proc.wait(60)
    output = "".join(lines)
    if (until and until not in output) or (not until and code != 0):
        raise RuntimeError(f"{' '.join(argv[2:])} failed ({code}):\n{output[-3000:]}")
    if until:
        time.sleep(2)  # the stopped run's workers go (their memory must not count in the next run)
    return took, memory.peak, idle, output


def measure(head, args: argparse.Namespace, rows: int) -> dict:
    assets = make_assets(args.out, "tiny", rows)
    storage = args.out / f"data-runs-{time.time_ns()}"
    prepare_s, prepare_peak, idle, prepared = timed_run(head, job_argv(assets, rows, storage, args, "--preflight"))
    again_s, _, _, output = timed_run(head, job_argv(assets, rows, storage, args, "--preflight"))
    assert "(reused)" in output, output[-2000:]
    first_s = first_peak = None
    if args.first_step:
        first_s, first_peak, _, _ = timed_run(head, job_argv(assets, rows, storage, args), until="step 1/")
    return {"records": rows, "prepare_s": prepare_s, "records_per_s": rows / prepare_s,
            "prepare_peak_gib": prepare_peak / 2**30, "prepare_own_gib": (prepare_peak - idle) / 2**30,
            "again_share": again_s / prepare_s, "first_step_s": first_s,
            "first_step_peak_gib": first_peak / 2**30 if first_peak else None,
            "idle_head_gib": idle / 2**30, "on_ray_data": "chunks on Ray Data" in prepared}  # fmt: skip


def prepare_seconds(args: argparse.Namespace, rows: int, cpus: int) -> float:
    from infra.runner.local_ray import LocalRayHead

    assets = make_assets(args.out, "tiny", rows)
    with LocalRayHead(num_cpus=cpus, log_dir=args.out) as head:
        storage = args.out / f"data-runs-{time.time_ns()}"
        return timed_run(head, job_argv(assets, rows, storage, args, "--preflight"))[0]


def table(rows: list[dict]) -> str:
    header = ("records", "prepare", "records/s", "prepare peak", "(above the idle head)", "again / first",
              "to first step", "first-step peak")  # fmt: skip
    cells = [header] + [
        (f"{r['records']:,}", f"{r['prepare_s']:.1f} s", f"{r['records_per_s']:,.0f}", f"{r['prepare_peak_gib']:.2f} GiB",
         f"{r['prepare_own_gib']:.2f} GiB", f"{r['again_share']:.2f}x",
         f"{r['first_step_s']:.1f} s" if r["first_step_s"] else "-",
         f"{r['first_step_peak_gib']:.2f} GiB" if r["first_step_peak_gib"] else "-")
        for r in rows
    ]  # fmt: skip
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells)


def main(argv: list[str] | None = None, head=None) -> dict:
    """Runs the data bench and prints its table; `head` is a running LocalRayHead to use instead of a new one."""
    from contextlib import nullcontext

    from infra.runner.local_ray import LocalRayHead

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    with nullcontext(head) if head else LocalRayHead(num_cpus=os.cpu_count() or 2, log_dir=args.out) as head:
        results = [measure(head, args, rows) for rows in sizes]
    print(f"\ndata: Dolly-shaped records, tiny Gemma 4 tokenizer, seq {args.seq_len}, packed; a Ray head of "
          f"{head.num_cpus} CPUs ({results[0]['idle_head_gib']:.2f} GiB idle); peaks: every process of the run "
          "(the driver, Ray's daemons, its workers), summed\n")  # fmt: skip
    print(table(results))
    out = {"rows": results}
    if args.scaling_rows:
        one, two = (prepare_seconds(args, args.scaling_rows, cpus) for cpus in (1, 2))
        out["speedup"] = one / two
        print(f"\npreparing {args.scaling_rows:,} records: {one:.1f} s on a head of 1 CPU, {two:.1f} s on 2 "
              f"({one / two:.2f}x)")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
