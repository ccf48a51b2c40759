"""The Kubernetes provider for the new cluster, authenticated by gke-gcloud-auth-plugin."""

from __future__ import annotations

import json

import pulumi
import pulumi_kubernetes as k8s

from infra import PROJECT


def kubeconfig(name: str, endpoint: str, ca_certificate_b64: str) -> str:
    """A kubeconfig whose user is the exec credential plugin (the gcp auth-provider is gone)."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": name,
                    "cluster": {"server": f"https://{endpoint}", "certificate-authority-data": ca_certificate_b64},
                }
            ],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "current-context": name,
            "preferences": {},
            "users": [
                {
                    "name": name,
                    "user": {
                        "exec": {
                            "apiVersion": "client.authentication.k8s.io/v1beta1",
                            "command": "gke-gcloud-auth-plugin",
                            "installHint": "gcloud components install gke-gcloud-auth-plugin",
                            "provideClusterInfo": True,
                            "interactiveMode": "IfAvailable",
                        }
                    },
                }
            ],
        },
        indent=2,
    )


class KubernetesAccess(pulumi.ComponentResource):
    def __init__(
        self,
        name: str,
        cluster_name: pulumi.Input[str],
        endpoint: pulumi.Input[str],
        ca_certificate: pulumi.Input[str],
        opts: pulumi.ResourceOptions | None = None,
    ):
        super().__init__(f"{PROJECT}:infra:KubernetesAccess", name, None, opts)
        self.kubeconfig = pulumi.Output.secret(
            pulumi.Output.all(cluster_name, endpoint, ca_certificate).apply(lambda a: kubeconfig(*a))
        )
        self.provider = k8s.Provider(
            name,
            kubeconfig=self.kubeconfig,
            enable_server_side_apply=True,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.register_outputs({"kubeconfig": self.kubeconfig})
