"""Where a TPU slice's capacity comes from, and what each kind implies: a typed row of the stack's
choice, and the public facts behind it.

Read by the config check, the node pool (infra/cluster.py), the RayCluster's Autopilot selectors
(infra/raycluster.py), the job resource's slice settings and the prices (infra/prices.py).
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


# The Ray head pod beside the slice: the RayCluster's requests and limits (infra/raycluster.py), and the
# bound of headCpus, the CPUs of it Ray may use (infra/config.py).
HEAD_RESOURCES = {"cpu": "4", "memory": "16Gi"}


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

    @property
    def reservation_project(self) -> str | None:
        return RESERVATION.fullmatch(self.reservation).group(1) if self.reservation else None

    @property
    def reservation_name(self) -> str | None:
        return RESERVATION.fullmatch(self.reservation).group(2) if self.reservation else None
