"""A save before a worker goes: SIGTERM becomes a request to stop after the current step.

The request rides on the step's count all-reduce (loop.train_step): one more element, so every rank
learns of it in the same step with no extra synchronisation. Every rank then finishes that step,
writes a checkpoint of it, waits until Ray Train's controller has taken the report, and raises
StopRequested; Ray Train restarts the worker group from that checkpoint, so no step is done twice.

Without this, SIGTERM ends a Ray worker at once: Ray's own handler raises SystemExit in the worker's
main thread (ray/_private/worker.py, `main_loop`).
"""

from __future__ import annotations

import signal
import threading

from backend import worker_print

_REQUESTED = threading.Event()
_LISTENING = threading.Event()
_PREVIOUS: list = []  # the handler this one replaced (Ray's, which ends the worker)


class StopRequested(RuntimeError):
    """Raised by every rank once the checkpoint of the step in which a stop was requested is in."""


def requested() -> bool:
    return _REQUESTED.is_set()


def _on_sigterm(signum, frame) -> None:
    if not _LISTENING.is_set():  # training is over: SIGTERM is Ray ending the worker (Ray >= 2.60 sends it)
        previous = _PREVIOUS[-1] if _PREVIOUS else signal.SIG_DFL
        if callable(previous):
            previous(signum, frame)
            return
        raise SystemExit(128 + signum)
    if not _REQUESTED.is_set():
        _REQUESTED.set()
        worker_print("SIGTERM: this worker stops after the current step, once its checkpoint is written")


def _install() -> bool:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    if previous is not _on_sigterm:
        _PREVIOUS.append(previous)
    return True


def listen() -> None:
    """From now on SIGTERM asks for a stop instead of ending the process.

    Only a process's main thread may install a signal handler (and Python runs handlers there).
    Ray Train runs the training function on a thread of its own, while the worker actor's main thread
    executes the actor's tasks: so the handler is installed by a task sent to this very actor.
    """
    _REQUESTED.clear()
    _LISTENING.set()
    if threading.current_thread() is threading.main_thread():
        _install()
        return
    import ray

    try:
        ray.get(ray.get_runtime_context().current_actor.execute.remote(_install), timeout=60)
    except Exception as err:  # noqa: BLE001  (a Ray without RayTrainWorker.execute: no save on SIGTERM, say so)
        worker_print(f"SIGTERM will end this worker without a save: the handler could not be installed ({err})")


def stop_listening() -> None:
    """Training is over (done, or failed): SIGTERM goes back to ending the process, quietly."""
    _LISTENING.clear()


def wait_until_taken(timeout_s: float = 120.0) -> None:
    """Until Ray Train's controller has taken this worker's reports, so the checkpoint just reported is
    registered before the worker group fails. (Ray Train V2 queues a worker's reports until its
    controller's next poll, which marks them done: an internal queue, hence the fallback.)"""
    import time

    try:
        from ray.train.v2._internal.execution.context import get_train_context

        queue = get_train_context().get_result_queue()
    except Exception:  # noqa: BLE001
        time.sleep(10)  # a few of the controller's polls
        return
    deadline = time.monotonic() + timeout_s
    while queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.1)
