"""The Artifact Registry repository and the images built into it: Ray + TorchTPU for training, and with serving\nvLLM TPU + Ray Serve LLM."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_docker as docker
import pulumi_gcp as gcp

from infra import PROJECT

IMAGE_DIR = Path(__file__).resolve().parent.parent / "image"


def registry_host(region: str) -> str:
    return f"{region}-docker.pkg.dev"


def image_ref(region: str, project: str, repository: str, image_name: str, tag: str = "latest") -> str:
    return f"{registry_host(region)}/{project}/{repository}/{image_name}:{tag}"


SERVE_IMAGE_DIR = IMAGE_DIR / "serve"


@dataclass(frozen=True, kw_only=True)
class ImageRegistryArgs:
    project: str
    region: str
    repository: str
    image_name: str
    serving: bool = False  # also the serving image (vLLM TPU + Ray Serve LLM, image/serve/), as IMAGE_NAME-serve


class ImageRegistry(pulumi.ComponentResource):
    """`image` is the pushed image by digest (repo@sha256:...), so a rebuild rolls the pods."""

    def __init__(self, name: str, args: ImageRegistryArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{PROJECT}:infra:ImageRegistry", name, None, opts)
        project, region, repository, image_name = args.project, args.region, args.repository, args.image_name
        child = pulumi.ResourceOptions(parent=self)
        self.repository = gcp.artifactregistry.Repository(
            name,
            repository_id=repository,
            project=project,
            location=region,
            format="DOCKER",
            description="Ray + TorchTPU images for the Gemma 4 fine-tune",
            opts=child,
        )
        token = gcp.organizations.get_client_config_output().access_token

        def image(resource_name: str, ref: str, context: Path) -> docker.Image:
            return docker.Image(
                resource_name,
                image_name=ref,
                build={"context": str(context), "dockerfile": str(context / "Dockerfile"), "platform": "linux/amd64"},
                # Previews (and CI) never need a Docker daemon; `up` builds and pushes.
                build_on_preview=False,
                registry={
                    "server": registry_host(region),
                    "username": "oauth2accesstoken",
                    "password": pulumi.Output.secret(token),
                },
                opts=child.merge(pulumi.ResourceOptions(depends_on=[self.repository])),
            )

        self.built = image(f"{name}-image", image_ref(region, project, repository, image_name), IMAGE_DIR)
        self.image = self.built.repo_digest
        self.serve_image = None
        if args.serving:
            serve_ref = image_ref(region, project, repository, f"{image_name}-serve")
            self.serve_image = image(f"{name}-serve-image", serve_ref, SERVE_IMAGE_DIR).repo_digest
        self.register_outputs({"image": self.image, "serveImage": self.serve_image})
