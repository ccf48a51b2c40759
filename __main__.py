"""gemma-tpu: from an empty Google Cloud project to a fine-tuned Gemma 4 on TPU slices.

Reads the stack's config once, then declares, in order: the APIs, the GKE cluster
(and a node pool per TPU slice in Standard mode), the checkpoint bucket (and a dataset file uploaded
into it), the image, the Kubernetes access, the RayCluster, the jobs that fine-tune on it, and with `serve` the
endpoint that serves the result (its own TPU pool and RayService).
The `local` stack declares only the jobs, against a Ray head on this machine.
"""

import pulumi

from infra.cloud.models import memory_plan_output
from infra.config import stack as config
from infra.prices import cost_estimate, run_cost
from infra.resources.apis import ProjectApis, ProjectApisArgs
from infra.resources.cluster import ClusterArgs, GkeCluster, GkeClusterArgs, TpuPoolArgs
from infra.resources.dataset import DatasetFile, DatasetFileArgs
from infra.resources.kube import KubernetesAccess, KubernetesAccessArgs, credentials_command
from infra.resources.raycluster import RayCluster, RayClusterArgs, RayClusterSpec, dashboard_command
from infra.resources.registry import ImageRegistry, ImageRegistryArgs
from infra.resources.serving import ServingEndpoint, ServingEndpointArgs, serving_pool_args, serving_spec
from infra.resources.storage import CheckpointBucket, CheckpointBucketArgs
from infra.served_evaluation import (
    ServedEvaluation,
    scored_through_endpoint,
    served_props,
    served_settings,
    with_served,
)
from infra.training import TrainingJobs, gke_target, identity, local_target, training_props

cfg, hf_token = config.load()

if cfg.local:
    training = TrainingJobs("training", training_props(cfg, local_target(cfg.ray_address), "local", "local"))
    evaluation, serving_seconds = training.evaluation, None
else:
    after_apis = pulumi.ResourceOptions(depends_on=ProjectApis("apis", ProjectApisArgs(project=cfg.project)).services)
    pool = None
    if not cfg.autopilot:  # Autopilot makes the TPU nodes for the RayCluster's pods itself
        pool = TpuPoolArgs(
            project=cfg.project,
            zone=cfg.zone,
            region=cfg.region,
            tpu=cfg.slice,
            capacity=cfg.capacity,
            num_slices=cfg.num_slices,
        )
    gke = GkeCluster(
        cfg.cluster_name,
        GkeClusterArgs(
            cluster=ClusterArgs(
                name=cfg.cluster_name,
                project=cfg.project,
                location=cfg.location,
                version=cfg.cluster_version,
                deletion_protection=cfg.deletion_protection,
                autopilot=cfg.autopilot,
                head_machine_type=cfg.head_machine_type,
                scale_to_zero=cfg.capacity.scale_to_zero,
            ),
            pool=pool,
        ),
        opts=after_apis,
    )
    bucket = CheckpointBucket(
        "checkpoints",
        CheckpointBucketArgs(
            bucket_name=cfg.bucket_name,
            project=cfg.project,
            region=cfg.region,
            force_destroy=cfg.bucket_force_destroy,
            namespace=cfg.namespace,
            service_account=cfg.service_account,
        ),
        opts=pulumi.ResourceOptions(depends_on=[gke.cluster]),
    )
    uploads = [DatasetFile("dataset", DatasetFileArgs(path=cfg.dataset_file, bucket=bucket.name)).object
               ] if cfg.dataset_file else []  # fmt: skip
    registry = ImageRegistry(
        "registry",
        ImageRegistryArgs(
            project=cfg.project,
            region=cfg.region,
            repository=cfg.repository,
            image_name=cfg.image_name,
            serving=cfg.serve is not None,
        ),
        opts=after_apis,
    )
    kube = KubernetesAccess(
        "gke", KubernetesAccessArgs(cluster_name=gke.name, endpoint=gke.endpoint, ca_certificate=gke.ca_certificate)
    )
    ray = RayCluster(
        cfg.ray_cluster_name,
        RayClusterArgs(
            spec=RayClusterSpec(
                name=cfg.ray_cluster_name,
                namespace=cfg.namespace,
                tpu=cfg.slice,
                capacity=cfg.capacity,
                autopilot=cfg.autopilot,
                head_cpus=cfg.head_cpus,
                num_slices=cfg.num_slices,
                defer_and_fuse=cfg.defer_and_fuse,
                compile_cache=cfg.compile_cache_root,
                service_account=cfg.service_account,
            ),
            image=registry.image,
            hf_token=hf_token,
            endpoint=gke.endpoint,
            ca_certificate=gke.ca_certificate,
        ),
        opts=pulumi.ResourceOptions(providers=[kube.provider], depends_on=[bucket.member, *gke.tpu_pools]),
    )
    target = gke_target(cfg.namespace, cfg.ray_cluster_name, gke.endpoint, gke.ca_certificate)
    training = TrainingJobs(
        "training",
        training_props(cfg, target, gke.name, registry.image, identity=identity(cfg, bucket.member.member)),
        opts=pulumi.ResourceOptions(depends_on=[ray, *uploads]),
    )
    evaluation = training.evaluation  # the job's before/after scores (and, with serve, the endpoint's beside them)
    serving_seconds = None  # how long the endpoint's host ran for up's served evaluation
    if cfg.serve is not None:  # the run's export (or its starting model) behind an endpoint, once the run is done
        spec = serving_spec(cfg, cfg.serve_name)
        serving = ServingEndpoint(
            "serving",
            ServingEndpointArgs(
                spec=spec,
                image=registry.serve_image,
                model_source=cfg.serve.model
                or (training.checkpoint if cfg.serve.what == "finetuned" else cfg.job.model),
                pool=None if cfg.autopilot else serving_pool_args(cfg.serve, cfg.project, cfg.zone, gke.name),
                modality_read=training.data_report.apply(lambda report: report.get("modality") or "text")
                if cfg.job.modality == "auto" and cfg.serve.what == "finetuned" and not cfg.serve.model
                else None,
            ),
            # after the run whose export it serves (an export named by serveModel exists already)
            opts=pulumi.ResourceOptions(
                providers=[kube.provider], depends_on=[ray] + ([] if cfg.serve.model else [training])
            ),
        )
        pulumi.export("endpoint", serving.endpoint)
        pulumi.export("servedModel", spec.model_name)
        if scored_through_endpoint(cfg):  # the run's tasks through the endpoint, from the training head
            run_dir = training.checkpoint.apply(lambda export: export.rsplit("/", 1)[0])
            settings = served_settings(cfg, run_dir, serving.endpoint["url"], spec.model_name)
            props = served_props(cfg, target, gke.name, registry.image, settings, serving.serve_config)
            served = ServedEvaluation("served-evaluation", props, opts=pulumi.ResourceOptions(depends_on=[serving]))
            evaluation = pulumi.Output.all(evaluation, served.scores).apply(
                lambda found: with_served(found[0], found[1], base=cfg.serve.what == "base")
            )
            serving_seconds = served.seconds
    pulumi.export("clusterName", gke.name)
    pulumi.export("kubeconfig", kube.kubeconfig)
    pulumi.export("credentials", credentials_command(cfg.cluster_name, cfg.location, cfg.project))
    pulumi.export("bucket", bucket.url)
    pulumi.export("image", registry.image)
    pulumi.export("rayClusterName", ray.name)
    pulumi.export("dashboard", dashboard_command(cfg.namespace, cfg.ray_cluster_name))

pulumi.export("memoryPlan", memory_plan_output(cfg.job, None if cfg.local else cfg.slice, cfg.num_slices))
pulumi.export("costEstimate", cost_estimate(cfg))
pulumi.export("cost", pulumi.Output.all(training.slice_hours, training.run_hours, serving_seconds).apply(
    lambda hours: run_cost(hours[0] or 0.0, hours[1] or 0.0, cfg, hours[2])))  # fmt: skip
pulumi.export("checkpoint", training.checkpoint)
pulumi.export("checkpoints", training.checkpoints)
pulumi.export("metrics", training.metrics)
pulumi.export("lossCurve", training.loss_curve)
pulumi.export("rewardCurve", training.reward_curve)  # objective grpo: each step's mean reward (reward.png)
pulumi.export("samples", training.samples)
pulumi.export("dataReport", training.data_report)
pulumi.export("evaluation", evaluation)
pulumi.export("sliceHours", training.slice_hours)
pulumi.export("collectives", training.collectives)
pulumi.export("jobIds", training.job_ids)
