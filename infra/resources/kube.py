"""The Kubernetes provider for the new cluster, authenticated by gke-gcloud-auth-plugin."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra import PROJECT


def credentials_command(cluster_name: str, location: str, project: str) -> str:
    """What gives kubectl a context for the cluster (the `credentials` output: the stack's port-forwards need it)."""
    return f"gcloud container clusters get-credentials {cluster_name} --location {location} --project {project}"


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


@dataclass(frozen=True, kw_only=True)
class KubernetesAccessArgs:
    cluster_name: pulumi.Input[str]
    endpoint: pulumi.Input[str]
    ca_certificate: pulumi.Input[str]


class KubernetesAccess(pulumi.ComponentResource):
    """A kubeconfig (secret) and a Kubernetes provider for the new cluster."""

    def __init__(self, name: str, args: KubernetesAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{PROJECT}:infra:KubernetesAccess", name, None, opts)
        self.kubeconfig = pulumi.Output.secret(
            pulumi.Output.all(args.cluster_name, args.endpoint, args.ca_certificate).apply(lambda a: kubeconfig(*a))
        )
        self.provider = k8s.Provider(
            name,
            kubeconfig=self.kubeconfig,
            enable_server_side_apply=True,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.register_outputs({"kubeconfig": self.kubeconfig})
