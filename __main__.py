"""gemma-tpu: from an empty Google Cloud project to a fine-tuned Gemma 4 on a TPU slice.

Reads the stack's config once, then declares, in order: the APIs, the GKE cluster
(and its TPU slice in Standard mode), the checkpoint bucket (and a dataset file uploaded
into it), the image, the Kubernetes access, the RayCluster, and last the jobs that
fine-tune on it.
The `local` stack declares only the jobs, against a Ray head on this machine.
"""

import pulumi

from infra import config
from infra.apis import ProjectApis
from infra.cluster import GkeCluster
from infra.dataset import DatasetFile
from infra.kube import KubernetesAccess
from infra.models import memory_plan_output
from infra.prices import cost_estimate, run_cost
from infra.raycluster import RayCluster, dashboard_command
from infra.registry import ImageRegistry
from infra.storage import CheckpointBucket
from infra.training import TrainingJobs, gke_target, local_target

cfg, hf_token = config.load()

if cfg.local:
    training = TrainingJobs("training", cfg, local_target(cfg.ray_address), cluster="local", image="local")
else:
    after_apis = pulumi.ResourceOptions(depends_on=ProjectApis("apis", cfg.project).services)
    gke = GkeCluster(cfg.cluster_name, cfg, opts=after_apis)
    bucket = CheckpointBucket("checkpoints", cfg, opts=pulumi.ResourceOptions(depends_on=[gke.cluster]))
    uploads = [DatasetFile("dataset", cfg, bucket.name).object] if cfg.job.dataset_file else []
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
    training = TrainingJobs(
        "training",
        cfg,
        gke_target(cfg, gke.endpoint, gke.ca_certificate),
        cluster=gke.name,
        image=registry.image,
        opts=pulumi.ResourceOptions(depends_on=[ray, *uploads]),
    )
    pulumi.export("clusterName", gke.name)
    pulumi.export("kubeconfig", kube.kubeconfig)
    pulumi.export("bucket", bucket.url)
    pulumi.export("image", registry.image)
    pulumi.export("rayClusterName", ray.name)
    pulumi.export("dashboard", dashboard_command(cfg))

pulumi.export("memoryPlan", memory_plan_output(cfg.job, None if cfg.local else cfg.slice))
pulumi.export("costEstimate", cost_estimate(cfg))
pulumi.export("cost", pulumi.Output.all(training.slice_hours, training.run_hours).apply(
    lambda hours: run_cost(hours[0] or 0.0, hours[1] or 0.0, cfg)))  # fmt: skip
pulumi.export("checkpoint", training.checkpoint)
pulumi.export("checkpoints", training.checkpoints)
pulumi.export("metrics", training.metrics)
pulumi.export("lossCurve", training.loss_curve)
pulumi.export("dataReport", training.data_report)
pulumi.export("sliceHours", training.slice_hours)
pulumi.export("collectives", training.collectives)
pulumi.export("jobIds", training.job_ids)
