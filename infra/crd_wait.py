"""Waits until a CustomResourceDefinition is established on a new cluster.

The Ray Operator add-on installs the RayCluster CRD a while after GKE reports the
cluster ready, longer than the Kubernetes provider retries a missing kind; this
resource sits between the cluster and the RayCluster so the first `up` does not fail.
"""

from __future__ import annotations

import time

import pulumi
import pulumi.dynamic as dynamic

from infra.runner import kube_api

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"


def is_established(crd: dict) -> bool:
    conditions = crd.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def wait_for_crd(api, name: str, timeout_s: float, poll_s: float = 10, log=print) -> dict:
    """Poll until the CRD exists and is Established; raise TimeoutError naming it otherwise."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        status, body = api.get(CRD_PATH + name)
        if status == 200 and is_established(body):
            return body
        state = "not installed yet" if status == 404 else f"HTTP {status}" if status != 200 else "not established yet"
        if state != last:
            log(f"CRD {name}: {state}; waiting", flush=True)
            last = state
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"CRD {name} was not established within {timeout_s:.0f}s ({state}); "
                "check that the cluster's Ray Operator add-on is enabled"
            )
        time.sleep(poll_s)


class _CrdEstablishedProvider(dynamic.ResourceProvider):
    # Pulumi pickles this class by reference: its host imports `infra` from the project directory.

    def _wait(self, props: dict) -> dict:
        wait_for_crd(
            kube_api.for_gke(props["endpoint"], props["ca_certificate"]), props["crd"], float(props["timeout_s"])
        )
        return props

    def create(self, props):
        return dynamic.CreateResult(id_=props["crd"], outs=self._wait(props))

    def update(self, _id, _olds, news):
        return dynamic.UpdateResult(outs=self._wait(news))


class CrdEstablished(dynamic.Resource):
    def __init__(
        self,
        name: str,
        endpoint: pulumi.Input[str],
        ca_certificate: pulumi.Input[str],
        crd: str,
        timeout_s: int = 1800,
        opts: pulumi.ResourceOptions | None = None,
    ):
        super().__init__(
            _CrdEstablishedProvider(),
            name,
            {"endpoint": endpoint, "ca_certificate": ca_certificate, "crd": crd, "timeout_s": timeout_s},
            opts,
        )
