"""A save before a worker goes: a preemption Ray saw coming, or SIGTERM, becomes a stop after the current step.

Two ways a stop is asked for, both carried by the step's count all-reduce (step.train_step: one more
element each), so every rank learns of it in the same step with no extra synchronisation:

- **A preemption notice** (the GKE path). The TPU pods' preStop hook drains its Ray node (infra/resources/stop_hook.py);
  Ray Train's PreemptionWatcher sees the drain and writes a PreemptionInfo into every worker's context
  (ray/train/v2/_internal/execution/preemption.py, worker_group/worker.py `mark_preempt`). Every rank then
  saves the step and waits: at the drain's deadline Ray Train's controller restarts the group from that
  checkpoint, off the draining nodes, and charges FailureConfig.max_preemption_failures, not max_failures
  (controller.py `_handle_preempting_state`, failure_handling/default.py). Raising here instead would be a
  worker error, charged to max_failures. The notice is read from the worker's context, which is what
  ray.train.get_preemption_info() returns for this rank, without that call's barrier through Ray's
  synchronisation actor on every step: the step's own all-reduce agrees on it.
- **SIGTERM** to a training process (a job run by hand, a cluster without the hook): every rank finishes the
  step, writes its checkpoint, waits until Ray Train's controller has taken the report, and raises
  StopRequested; Ray Train restarts the worker group from that checkpoint, so no step is done twice.
  Without this, SIGTERM ends a Ray worker at once: Ray's own handler raises SystemExit in the worker's main
  thread (ray/_private/worker.py, `main_loop`).
"""

from __future__ import annotations

import signal
import threading
import time

from runtime.backend import worker_print

_REQUESTED = threading.Event()
_LISTENING = threading.Event()
_PREVIOUS: list = []  # the handler this one replaced (Ray's, which ends the worker)
# Ray Train's wait when a drain gives no deadline (ray/train/v2/_internal/constants.py,
# DEFAULT_PREEMPTION_DEADLINE_S); a worker still alive this long past its deadline gives up waiting.
UNKNOWN_DEADLINE_S = 120.0
RESTART_MARGIN_S = 30.0


class StopRequested(RuntimeError):
    """Raised by every rank once the checkpoint of the step in which a stop was requested is in."""


def requested() -> bool:
    return _REQUESTED.is_set()


def preemption_notice():
    """This worker's PreemptionInfo from Ray Train (deadline_ms: when its node goes), or None."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except Exception:  # noqa: BLE001  (no Ray Train here, or a Ray without the watcher: no notice)
        return None


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


def await_restart(step: int, rank: int, notice, clock=time.time) -> None:
    """After the save of `step` on a preemption notice: wait for Ray Train to end this group at the drain's
    deadline and restart it from that save; SIGTERM now ends the process, as Ray sends it. A group Ray has
    not ended RESTART_MARGIN_S past the deadline stops itself (StopRequested), so nothing waits forever."""
    stop_listening()
    deadline_ms = getattr(notice, "deadline_ms", None)
    deadline = deadline_ms / 1000 if deadline_ms else clock() + UNKNOWN_DEADLINE_S
    if rank == 0:
        worker_print(f"preemption notice: step {step} saved; Ray Train restarts the run from it off the draining "
                     f"node(s) at the drain's deadline ({max(0.0, deadline - clock()):.0f} s)")  # fmt: skip
    while clock() < deadline + RESTART_MARGIN_S:
        time.sleep(0.5)
    raise StopRequested(f"preempted after step {step} (its checkpoint is saved), and not restarted by Ray Train")


def wait_until_taken(timeout_s: float = 120.0) -> None:
    """Until Ray Train's controller has taken this worker's reports, so the checkpoint just reported is
    registered before the worker group fails. (Ray Train V2 queues a worker's reports until its
    controller's next poll, which marks them done: an internal queue, hence the fallback.)"""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        queue = get_train_context().get_result_queue()
    except Exception:  # noqa: BLE001
        time.sleep(10)  # a few of the controller's polls
        return
    deadline = time.monotonic() + timeout_s
    while queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.1)
