"""The checkpoint bucket every host writes to, and the Ray pods' Workload Identity grant on it."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra import PROJECT

CHECKPOINT_ROLE = "roles/storage.objectAdmin"


def workload_identity_principal(project_number: str, project: str, namespace: str, service_account: str) -> str:
    """The IAM principal of a Kubernetes ServiceAccount under GKE Workload Identity Federation."""
    return (
        f"principal://iam.googleapis.com/projects/{project_number}/locations/global/"
        f"workloadIdentityPools/{project}.svc.id.goog/subject/ns/{namespace}/sa/{service_account}"
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointBucketArgs:
    bucket_name: str
    project: str
    region: str
    force_destroy: bool
    namespace: str  # with service_account: the Kubernetes ServiceAccount the Ray pods run as
    service_account: str


class CheckpointBucket(pulumi.ComponentResource):
    """`bucket_name` in `project`'s `region`, and objectAdmin on it for the Ray pods' Kubernetes
    ServiceAccount (`namespace`/`service_account`)."""

    def __init__(self, name: str, args: CheckpointBucketArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{PROJECT}:infra:CheckpointBucket", name, None, opts)
        project, namespace, service_account = args.project, args.namespace, args.service_account
        child = pulumi.ResourceOptions(parent=self)
        self.bucket = gcp.storage.Bucket(
            name,
            name=args.bucket_name,
            project=project,
            location=args.region.upper(),
            uniform_bucket_level_access=True,
            force_destroy=args.force_destroy,
            opts=child,
        )
        number = gcp.organizations.get_project_output(project_id=project).number
        self.member = gcp.storage.BucketIAMMember(
            f"{name}-ray-pods",
            bucket=self.bucket.name,
            role=CHECKPOINT_ROLE,
            member=number.apply(lambda n: workload_identity_principal(n, project, namespace, service_account)),
            opts=child,
        )
        self.name = self.bucket.name
        self.url = self.bucket.url
        self.register_outputs({"name": self.name, "url": self.url})
