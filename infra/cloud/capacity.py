"""Where a TPU slice's capacity comes from, and what each kind implies: a typed row of the stack's
choice, and the public facts behind it.

Read by the config check, the node pool (infra/resources/cluster.py), the RayCluster's Autopilot selectors
(infra/resources/raycluster.py), the job resource's slice settings and the prices (infra/prices.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CAPACITIES = ("onDemand", "spot", "flexStart", "reservation")
# GKE "About flex-start" (cloud.google.com/kubernetes-engine/docs/concepts/dws, 2026): TPUs need
# 1.33.0-gke.1712000 or later; v6e is offered in asia-northeast1-b, us-east5-a and us-east5-b; a
# flex-start VM runs at most 7 days.
FLEX_START_MIN_GKE = "1.33.0-gke.1712000"
FLEX_START_MAX_RUN_MINUTES = 7 * 24 * 60
# NAME, or projects/PROJECT/reservations/NAME for a reservation shared from another project
RESERVATION = re.compile(
    r"^(?:projects/([a-z][-a-z0-9]{4,28}[a-z0-9])/reservations/)?([a-z]([-a-z0-9]{0,61}[a-z0-9])?)$"
)


# The Ray head pod beside the slice: the RayCluster's requests and limits (infra/resources/raycluster.py), and the
# bound of headCpus, the CPUs of it Ray may use (infra/config/stack.py).
HEAD_RESOURCES = {"cpu": "4", "memory": "16Gi"}

# How long a TPU pod has between the notice that it goes and SIGKILL (GKE's Spot VMs page,
# docs.cloud.google.com/kubernetes-engine/docs/concepts/spot-vms, "Termination and graceful shutdown of Spot
# VMs", and "Run fault-tolerant workloads at lower costs in Spot Pods", read 2026-12):
# - Spot, Standard: Compute Engine gives the VM 30 s, of which the kubelet gives pods 15 s and critical pods
#   15 s. A Standard pool on a control plane of SPOT_GRACE_MIN_GKE or later may raise the kubelet's
#   shutdown grace to 120 s (its node system config: shutdownGracePeriodSeconds, the total, and
#   shutdownGracePeriodCriticalPodsSeconds, Spot and preemptible pools only): pods then get 105 s.
# - Spot, Autopilot: a Spot Pod gets at most 25 s, whatever it asks for.
# - On demand, flex-start, a reservation: no preemption notice. A pod deleted through the API (a scale-down,
#   a node upgrade's drain, KubeRay) gets its terminationGracePeriodSeconds in full: POD_GRACE_S, the
#   stack's choice. A host error or auto-repair gives no grace at all (that is what saveEvery is for).
SPOT_GRACE_MIN_GKE = "1.35.0-gke.1171000"
SPOT_KUBELET_SHUTDOWN_S = 120
CRITICAL_PODS_SHUTDOWN_S = 15
AUTOPILOT_SPOT_GRACE_S = 25
POD_GRACE_S = 120
# Of a pod's grace, what its preStop hook keeps back after the drain's deadline: the hook's own start (a
# Python that imports Ray), then `ray start`'s shutdown once the hook returns (RAY_GRACEFUL_SHUTDOWN_DRAIN_
# TIMEOUT_S on the workers: infra/resources/raycluster.py).
STOP_MARGIN_S = 15
RAY_SHUTDOWN_DRAIN_S = 5


@dataclass(frozen=True)
class PodGrace:
    """A TPU pod's termination, sized to what its capacity kind grants."""

    seconds: int  # the pod's terminationGracePeriodSeconds: what it really gets
    drain_s: int  # the preStop hook's drain deadline, from when it starts: Ray Train restarts the run then
    kubelet_shutdown_s: int | None  # a Standard Spot pool's kubelet shutdown grace (all pods), if raised


def pod_grace(spot: bool, autopilot: bool) -> PodGrace:
    if spot and autopilot:
        seconds, kubelet = AUTOPILOT_SPOT_GRACE_S, None
    elif spot:
        seconds, kubelet = SPOT_KUBELET_SHUTDOWN_S - CRITICAL_PODS_SHUTDOWN_S, SPOT_KUBELET_SHUTDOWN_S
    else:
        seconds, kubelet = POD_GRACE_S, None
    return PodGrace(seconds, seconds - STOP_MARGIN_S, kubelet)


def flex_start_run_minutes(job_timeout: int, ready_timeout: int) -> int:
    """How long a flex-start slice may run: provisioning, then the collectives check and the fine-tune."""
    return ready_timeout + 2 * job_timeout


@dataclass(frozen=True)
class SliceCapacity:
    """The slice's capacity as the stack will ask for it."""

    kind: str  # one of CAPACITIES
    reservation: str  # NAME or projects/PROJECT/reservations/NAME; "" for none
    scale_to_zero: bool  # the TPU worker group (and node pool) at 0 except while jobs run
    run_minutes: int  # how long the slice may run once up (flex-start's max run duration)

    @property
    def spot(self) -> bool:
        return self.kind == "spot"

    @property
    def flex_start(self) -> bool:
        return self.kind == "flexStart"

    def grace(self, autopilot: bool) -> PodGrace:
        """How long the slice's pods get when they go, and the drain inside it."""
        return pod_grace(self.spot, autopilot)

    @property
    def reservation_project(self) -> str | None:
        return RESERVATION.fullmatch(self.reservation).group(1) if self.reservation else None

    @property
    def reservation_name(self) -> str | None:
        return RESERVATION.fullmatch(self.reservation).group(2) if self.reservation else None
