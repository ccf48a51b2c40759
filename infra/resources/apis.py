"""The Google APIs the stack calls, enabled once and left on when the stack goes."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra import PROJECT

SERVICES = (
    "compute.googleapis.com",
    "container.googleapis.com",
    "artifactregistry.googleapis.com",
    "storage.googleapis.com",
)


@dataclass(frozen=True, kw_only=True)
class ProjectApisArgs:
    project: str


class ProjectApis(pulumi.ComponentResource):
    def __init__(self, name: str, args: ProjectApisArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{PROJECT}:infra:ProjectApis", name, None, opts)
        self.services = [
            gcp.projects.Service(
                service.split(".")[0],
                project=args.project,
                service=service,
                # Other things in the project may use these APIs; destroy must not cut them off.
                disable_on_destroy=False,
                disable_dependent_services=False,
                opts=pulumi.ResourceOptions(parent=self),
            )
            for service in SERVICES
        ]
        self.register_outputs({"services": [s.service for s in self.services]})
