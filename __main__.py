"""gemma-tpu: from an empty Google Cloud project to a fine-tuned Gemma 4 on a TPU slice.

Reads the stack's config once, then declares, in order: the APIs, the GKE cluster
(and its TPU slice in Standard mode), the checkpoint bucket, the image, the
Kubernetes access, and the RayCluster.
"""

import pulumi

from infra import config
from infra.apis import ProjectApis
from infra.cluster import GkeCluster
from infra.kube import KubernetesAccess
from infra.raycluster import RayCluster, dashboard_command
from infra.registry import ImageRegistry
from infra.storage import CheckpointBucket

cfg, hf_token = config.load()
after_apis = pulumi.ResourceOptions(depends_on=ProjectApis("apis", cfg.project).services)

gke = GkeCluster(cfg.cluster_name, cfg, opts=after_apis)
bucket = CheckpointBucket("checkpoints", cfg, opts=pulumi.ResourceOptions(depends_on=[gke.cluster]))
registry = ImageRegistry("registry", cfg, opts=after_apis)
kube = KubernetesAccess("gke", gke.name, gke.endpoint, gke.ca_certificate)
ray = RayCluster(
    cfg.ray_cluster_name,
    cfg,
    image=registry.image,
    hf_token=hf_token,
    provider=kube.provider,
    endpoint=gke.endpoint,
    ca_certificate=gke.ca_certificate,
    depends_on=[bucket.member, *([gke.tpu_pool] if gke.tpu_pool else [])],
)

pulumi.export("clusterName", gke.name)
pulumi.export("kubeconfig", kube.kubeconfig)
pulumi.export("bucket", bucket.url)
pulumi.export("image", registry.image)
pulumi.export("rayClusterName", ray.name)
pulumi.export("dashboard", dashboard_command(cfg))
